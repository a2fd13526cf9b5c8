"""EAGLE-3 draft model, layer for layer as SGLang's `LlamaForCausalLMEagle3` serves it.

Owns the draft's forward pass for both uses:
- decoding (`decoder_step`, KV cache, boolean mask) for `eagle3/serving/decoding.py`;
- training-time test (`ttt_step`), whose attention (`ttt_attention`) computes the EAGLE-3
  TTT mask as causal flash attention over the step-0 keys plus the k diagonal scores of
  the earlier steps, merged analytically through the log-sum-exp, with a hand-written
  backward. `eagle3/draft/masks.py` holds the dense mask it is tested against.

Layer math (sgl-project/sglang `python/sglang/srt/models/llama_eagle3.py`, `LlamaDecoderLayer`):
    x = cat([input_layernorm(embed(ids)), hidden_norm(h)])   # [B, T, 2H]
    r = h + o_proj(attn(q/k/v_proj(x)))                       # residual is the un-normed h
    out = r + mlp(post_attention_layernorm(r))                # pre-norm output -> next step
    logits = lm_head(norm(out))                               # [B, T, Vd]

Two architectures share this layer: `llama` (GQA, `LlamaForCausalLMEagle3`) and `deepseek_mla`
(DeepSeek-V2 multi-latent attention, `Eagle3DeepseekV2ForCausalLM` in sglang `srt/models/
kimi_k25_eagle3.py`; the attention is in `eagle3/draft/mla.py`); everything around the attention is
the same module. Both take the EAGLE-3.1 options of SGLang's classes: `fc_norm` (an RMSNorm per aux
state before `fc`) and `norm_output` (the next draft step gets norm(out) instead of out).

Risk: SGLang loads weights by name and silently skips unknown ones, so module and buffer
names here ARE the checkpoint format (`embed_tokens`, `fc`, `midlayer.*`, `norm`,
`lm_head`, `d2t`, `t2d`); `eagle3/export.py` checks them against SGLang's list.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle3.draft.masks import build_causal_mask, build_ttt_attention_mask
from eagle3.draft.mla import MLAAttention, yarn_factors, yarn_inv_freq
from eagle3.draft.fused_layer import FusedLayerWeights, compile_upcast, fuse_layer_weights, uncompile_upcast
from eagle3.draft.silu_mul import compile_silu_mul, silu_mul, uncompile_silu_mul

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "deepseek_yarn")
ARCHITECTURES = ("llama", "deepseek_mla")
MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def target_rope_settings(target_config: dict[str, Any]) -> tuple[float, dict | None]:
    """RoPE base and scaling of an HF config, in either transformers-4 or -5 layout.

    transformers 5 writes `rope_parameters: {rope_type, rope_theta, ...}`; older configs
    have top-level `rope_theta` and `rope_scaling`. Returns (theta, scaling or None).
    """
    params = target_config.get("rope_parameters") or {}
    theta = target_config.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = target_config.get("rope_scaling")
    if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return float(theta), (dict(scaling) if scaling else None)


@dataclass
class DraftModelConfig:
    """Shape of the one-layer EAGLE-3 draft (SGLang `LlamaForCausalLMEagle3`, or with architecture
    `deepseek_mla` its `Eagle3DeepseekV2ForCausalLM`: then heads are MLA heads, num_key_value_heads =
    num_attention_heads and head_dim = qk_nope_head_dim + qk_rope_head_dim)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # TARGET vocab (embed_tokens rows, t2d length)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int] = field(default_factory=list)  # SGLang convention: id k = output of layer k
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    architecture: str = "llama"
    fc_norm: bool = False  # EAGLE-3.1: RMSNorm of each aux state before fc
    norm_output: bool = False  # EAGLE-3.1: the next draft step gets norm(out), not out
    q_lora_rank: int | None = None  # MLA dims (deepseek_mla only), as the target's config names them
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        self._check_architecture()
        if not self.aux_layer_ids:
            raise ValueError("DraftModelConfig.aux_layer_ids: expected at least one layer id, found none")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}], found {self.draft_vocab_size}")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act: expected one of {sorted(_ACTIVATIONS)}, found {self.hidden_act!r}")
        rope_type = _rope_type(self.rope_scaling)
        if rope_type not in _ROPE_TYPES:
            raise ValueError(f"rope_scaling type: expected one of {_ROPE_TYPES}, found {rope_type!r}")
        if rope_type in ("yarn", "deepseek_yarn") and self.architecture != "deepseek_mla":
            raise ValueError(f"rope_scaling type {rope_type!r}: only the deepseek_mla draft implements (DeepSeek) YaRN")

    def _check_architecture(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture: expected one of {ARCHITECTURES}, found {self.architecture!r}")
        if self.architecture != "deepseek_mla":
            return
        missing = [name for name in MLA_DIMS if not getattr(self, name)]
        if missing:
            raise ValueError(f"architecture deepseek_mla: {missing} must be set (from the target's config or "
                             "train.draft); SGLang's Eagle3DeepseekV2ForCausalLM requires q_lora_rank")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (rotated in pairs), found {self.qk_rope_head_dim}")
        if self.num_key_value_heads != self.num_attention_heads or self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise ValueError("architecture deepseek_mla: num_key_value_heads must equal num_attention_heads and head_dim "
                             "must be qk_nope_head_dim + qk_rope_head_dim")

    @property
    def is_mla(self) -> bool:
        return self.architecture == "deepseek_mla"

    @property
    def rope_dim(self) -> int:
        """Width RoPE rotates: the whole head (llama) or the MLA rope part."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def num_aux_hidden_states(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def shares_target_embedding(self) -> bool:
        """SGLang replaces the draft embedding by the target's only when the widths match."""
        return self.hidden_size == self.target_hidden_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DraftModelConfig:
        return cls(**data)

    @classmethod
    def from_target_config(
        cls, target_config: dict, draft_vocab_size: int, aux_layer_ids: list[int], **overrides: Any
    ) -> DraftModelConfig:
        """Draft shape copied from the target's HF config (a multimodal wrapper's `text_config`); `overrides`
        (None values ignored) win.

        Overriding the width or the head count without `head_dim` recomputes head_dim.
        """
        overrides = {k: v for k, v in overrides.items() if v is not None}
        if "hidden_size" not in target_config and isinstance(target_config.get("text_config"), dict):
            target_config = target_config["text_config"]  # a multimodal wrapper (Kimi-K2.5): its language model
        theta, scaling = target_rope_settings(target_config)
        heads = target_config["num_attention_heads"]
        if overrides.get("architecture") == "deepseek_mla":
            return cls._mla_from_target_config(target_config, draft_vocab_size, aux_layer_ids, overrides)
        overrides = {k: v for k, v in overrides.items() if k not in MLA_DIMS}
        values: dict[str, Any] = {
            "hidden_size": target_config["hidden_size"],
            "intermediate_size": target_config["intermediate_size"],
            "num_attention_heads": heads,
            "num_key_value_heads": target_config.get("num_key_value_heads") or heads,
            "head_dim": target_config.get("head_dim") or target_config["hidden_size"] // heads,
            "vocab_size": target_config["vocab_size"],
            "draft_vocab_size": draft_vocab_size,
            "target_hidden_size": target_config["hidden_size"],
            "aux_layer_ids": list(aux_layer_ids),
            "rms_norm_eps": target_config.get("rms_norm_eps", 1e-6),
            "rope_theta": theta,
            "rope_scaling": scaling,
            "max_position_embeddings": target_config.get("max_position_embeddings", 2048),
            "hidden_act": target_config.get("hidden_act", "silu"),
        }
        if ("hidden_size" in overrides or "num_attention_heads" in overrides) and "head_dim" not in overrides:
            values["head_dim"] = overrides.get("hidden_size", values["hidden_size"]) // overrides.get(
                "num_attention_heads", heads
            )
        unknown = set(overrides) - set(values) - {"architecture", "fc_norm", "norm_output"}
        if unknown:
            raise ValueError(f"from_target_config: unknown override(s) {sorted(unknown)}")
        values.update(overrides)
        return cls(**values)

    @classmethod
    def _mla_from_target_config(cls, target_config: dict, draft_vocab_size: int, aux_layer_ids: list[int],
                                overrides: dict[str, Any]) -> DraftModelConfig:
        """The MLA draft: width, heads and MLA dims from the target (Kimi-K2.x / DeepSeek-V3 name them as SGLang
        reads them), `overrides` win; the MLP is the dense one (the target's `intermediate_size`)."""
        if "num_key_value_heads" in overrides or "head_dim" in overrides:
            raise ValueError("architecture deepseek_mla: set the MLA dims (qk_nope_head_dim, qk_rope_head_dim, ...), "
                             "not num_key_value_heads or head_dim")
        mla = {name: overrides.pop(name, target_config.get(name)) for name in MLA_DIMS}
        theta, scaling = target_rope_settings(target_config)
        heads = overrides.pop("num_attention_heads", target_config["num_attention_heads"])
        values: dict[str, Any] = {
            "hidden_size": target_config["hidden_size"], "intermediate_size": target_config["intermediate_size"],
            "vocab_size": target_config["vocab_size"], "draft_vocab_size": draft_vocab_size,
            "target_hidden_size": target_config["hidden_size"], "aux_layer_ids": list(aux_layer_ids),
            "rms_norm_eps": target_config.get("rms_norm_eps", 1e-6), "rope_theta": theta, "rope_scaling": scaling,
            "max_position_embeddings": target_config.get("max_position_embeddings", 2048),
            "hidden_act": target_config.get("hidden_act", "silu"),
        }
        unknown = set(overrides) - set(values) - {"architecture", "fc_norm", "norm_output"}
        if unknown:
            raise ValueError(f"from_target_config: unknown override(s) {sorted(unknown)}")
        values.update(overrides)
        head_dim = (mla["qk_nope_head_dim"] or 0) + (mla["qk_rope_head_dim"] or 0)
        return cls(**values, **mla, num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim)


def _rope_type(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


def compute_rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> Tensor:
    """RoPE inverse frequencies [head_dim/2] (fp32), with HF's `linear` and `llama3` scaling."""
    rope_type = _rope_type(scaling)
    if rope_type in ("yarn", "deepseek_yarn"):
        return yarn_inv_freq(head_dim, theta, scaling).float()
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq.float()


def _weight(weights: dict[str, Tensor] | None, name: str, default: Tensor) -> Tensor:
    """`weights[name]` when the caller passed pre-cast weights (see `cast_layer_weights`), else the parameter."""
    return default if weights is None else weights.get(name, default)


class RMSNorm(nn.Module):
    """Llama RMSNorm; statistics and scale in fp32, output in the input dtype (as SGLang)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for arbitrary position ids; `inv_freq` stays fp32 under `.to(bf16)`. Over the MLA rope
    part for the MLA draft, whose DeepSeek YaRN also scales cos/sin (`magnitude`, 1 otherwise)."""

    def __init__(self, config: DraftModelConfig) -> None:
        super().__init__()
        self._args = (config.rope_dim, config.rope_theta, config.rope_scaling)
        self.magnitude = yarn_factors(config.rope_scaling)[0] if config.is_mla else 1.0
        self.register_buffer("inv_freq", compute_rope_inv_freq(*self._args), persistent=False)

    def _apply(self, fn, recurse=True):  # keep RoPE frequencies exact when the model is cast
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = compute_rope_inv_freq(*self._args).to(self.inv_freq.device)
        return self

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq  # [B, T, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, d]
        if self.magnitude != 1.0:
            return (emb.cos() * self.magnitude).to(dtype), (emb.sin() * self.magnitude).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, h, T, d]; cos/sin [B, T, d] (HF rotate-half convention)."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def repeat_kv(x: Tensor, groups: int) -> Tensor:
    """[B, n_kv, S, d] -> [B, n_kv * groups, S, d] (GQA head sharing)."""
    if groups == 1:
        return x
    b, n_kv, s, d = x.shape
    return x[:, :, None].expand(b, n_kv, groups, s, d).reshape(b, n_kv * groups, s, d)


class Eagle3Attention(nn.Module):
    """GQA attention whose q/k/v projections read the 2H-wide [embeds, hidden] input."""

    def __init__(self, config: DraftModelConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(2 * h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.value_dim = d

    def output(self, attn: Tensor) -> Tensor:
        """attn [B, nh, T, d] -> [B, T, nh d], o_proj's input."""
        b, _, t, _ = attn.shape
        return attn.transpose(1, 2).reshape(b, t, -1)

    def weight_groups(self) -> dict[str, list[Tensor]]:
        """The weights as the fused unroll groups them (eagle3.draft.fused_layer): q/k/v read the same x."""
        return {"qkv": [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight], "o": [self.o_proj.weight]}

    def project(self, x: Tensor, cos: Tensor, sin: Tensor, weights: dict | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, 2H] -> q [B, nh, T, d], k/v [B, n_kv, T, d], RoPE applied to q and k."""
        b, t, _ = x.shape
        q = F.linear(x, _weight(weights, "midlayer.self_attn.q_proj.weight", self.q_proj.weight))
        k = F.linear(x, _weight(weights, "midlayer.self_attn.k_proj.weight", self.k_proj.weight))
        v = F.linear(x, _weight(weights, "midlayer.self_attn.v_proj.weight", self.v_proj.weight))
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


class Eagle3MLP(nn.Module):
    def __init__(self, config: DraftModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: Tensor, weights: dict | None = None) -> Tensor:
        gate = F.linear(x, _weight(weights, "midlayer.mlp.gate_proj.weight", self.gate_proj.weight))
        up = F.linear(x, _weight(weights, "midlayer.mlp.up_proj.weight", self.up_proj.weight))
        return F.linear(self.act(gate) * up, _weight(weights, "midlayer.mlp.down_proj.weight", self.down_proj.weight))


class Eagle3DecoderLayer(nn.Module):
    """SGLang's `midlayer`: attention over [input_layernorm(embeds), hidden_norm(h)], then MLP."""

    def __init__(self, config: DraftModelConfig) -> None:
        super().__init__()
        self.self_attn = MLAAttention(config) if config.is_mla else Eagle3Attention(config)
        self.mlp = Eagle3MLP(config)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def qkv(
        self, embeds: Tensor, hidden_states: Tensor, cos: Tensor, sin: Tensor, weights: dict | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden_states)], dim=-1)  # [B, T, 2H]
        return self.self_attn.project(x, cos, sin, weights)

    def finish(self, attn: Tensor, hidden_states: Tensor, weights: dict | None = None) -> Tensor:
        """attn [B, nh, T, d]; hidden_states [B, T, H] (un-normed residual) -> pre-norm output [B, T, H]."""
        o_proj = _weight(weights, "midlayer.self_attn.o_proj.weight", self.self_attn.o_proj.weight)
        residual = hidden_states + F.linear(self.self_attn.output(attn), o_proj)
        return residual + self.mlp(self.post_attention_layernorm(residual), weights)


class TTTCache:
    """Keys/values of every TTT step so far: index 0 = the causal context, 1.. = diagonal terms."""

    def __init__(self) -> None:
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []

    def append(self, key: Tensor, value: Tensor) -> None:
        self.keys.append(key)
        self.values.append(value)


class Eagle3DraftModel(nn.Module):
    """The draft: `fc` fuses the target's aux hidden states, one `midlayer`, `norm`, `lm_head`."""

    def __init__(self, config: DraftModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(not config.shares_target_embedding)
        self.fc = nn.Linear(config.num_aux_hidden_states * config.target_hidden_size, config.hidden_size, bias=False)
        # EAGLE-3.1: one RMSNorm per aux state (SGLang's `fc_norm.{i}`), before fc
        self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden_size, config.rms_norm_eps)
                                     for _ in range(config.num_aux_hidden_states)) if config.fc_norm else None
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary_emb = RotaryEmbedding(config)
        # Identity mapping until set_vocab_mapping: draft id i = target id i.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self._qkv_fn: Callable = self._ttt_qkv
        self._finish_fn: Callable = self._ttt_finish
        self._pieces: dict[str, Callable] = self._fused_pieces()
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """HF Llama init: normal(0, std) linears and embedding, unit norms."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    # ------------------------------------------------------------------ shared pieces

    def project(self, aux_hidden_states: Tensor, weights: FusedLayerWeights | None = None) -> Tensor:
        """[B, T, k*H_t] -> [B, T, H] (fc; with the unroll's `fused_layer_weights`, its fc copy)."""
        expected = self.fc.in_features
        if aux_hidden_states.shape[-1] != expected:
            raise ValueError(
                f"aux_hidden_states: expected last dim {expected} "
                f"({self.config.num_aux_hidden_states} x {self.config.target_hidden_size}), "
                f"found {aux_hidden_states.shape[-1]}"
            )
        if self.fc_norm is not None:  # [B, T, k*H_t] -> k chunks [B, T, H_t], each normed by its own RMSNorm
            chunks = aux_hidden_states.chunk(self.config.num_aux_hidden_states, dim=-1)
            aux_hidden_states = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        if isinstance(weights, FusedLayerWeights) and "fc" in weights.slots:
            return weights.linear("fc", aux_hidden_states.to(weights.weight("fc").dtype))
        return self.fc(aux_hidden_states)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        """What `decoder_step` returns [B, T, H] (pre-norm; with norm_output already normed) -> logits [B, T, Vd]."""
        return self.lm_head(hidden_states if self.config.norm_output else self.norm(hidden_states))

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocab ids -> target-vocab ids (d2t holds offsets, as SGLang's `hot_token_id`)."""
        return draft_ids + self.d2t[draft_ids]

    def draft_vocab_columns(self) -> Tensor:
        """int64 [Vd]: the ascending target ids of the draft vocab (where t2d is True; see
        set_vocab_mapping), computed without waiting for the device as t2d.nonzero() would."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def set_vocab_mapping(self, d2t: Tensor, t2d: Tensor) -> None:
        """Install the reduced-vocab maps: d2t int64 [Vd] offsets, t2d bool [V].

        Draft id i must be the i-th target id of t2d (ascending), because training reads
        the teacher's draft-vocab columns as `logits[..., t2d]`.
        """
        vd, v = self.config.draft_vocab_size, self.config.vocab_size
        if d2t.shape != (vd,) or t2d.shape != (v,):
            raise ValueError(f"vocab mapping: expected d2t [{vd}] and t2d [{v}], found {list(d2t.shape)} and {list(t2d.shape)}")
        target_ids = torch.arange(vd, device=d2t.device) + d2t.long()
        if not torch.equal(target_ids.cpu(), t2d.bool().nonzero().squeeze(-1).cpu()):
            raise ValueError("vocab mapping: arange(Vd) + d2t must equal the ascending ids where t2d is True")
        self.d2t.copy_(d2t.long())
        self.t2d.copy_(t2d.bool())

    @torch.no_grad()
    def load_target_embedding(self, weight: Tensor) -> None:
        """Copy the target's input embedding [V, H] and freeze it."""
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(
                f"target embedding: expected {list(self.embed_tokens.weight.shape)}, found {list(weight.shape)}"
            )
        self.embed_tokens.weight.data = weight.detach().to(self.embed_tokens.weight.device).clone()
        self.embed_tokens.weight.requires_grad_(False)

    def _embed(self, input_ids: Tensor, dtype: torch.dtype) -> Tensor:
        return self.embed_tokens(input_ids).to(dtype)

    # ------------------------------------------------------------------ decoding

    def decoder_step(
        self,
        input_ids: Tensor,
        hidden_states: Tensor,
        position_ids: Tensor,
        attention_mask: Tensor | None = None,
        past_key_value: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """One draft forward with a KV cache.

        Args:
            input_ids: [B, T]; hidden_states: [B, T, H] (fc output or previous pre-norm output);
            position_ids: [B, T]; attention_mask: bool [B, 1, T, S_past+T], True = attend
            (None = causal over past + new); past_key_value: (k, v) [B, n_kv, S_past, d] or None.
        Returns:
            the next step's hidden [B, T, H] (pre-norm output; norm(output) with norm_output) and
            (k_all, v_all) [B, n_kv, S_past+T, d], RoPE applied to k (MLA: expanded heads, v zero-padded to d).
        """
        cos, sin = self.rotary_emb(position_ids, hidden_states.dtype)
        q, k, v = self.midlayer.qkv(self._embed(input_ids, hidden_states.dtype), hidden_states, cos, sin)
        if past_key_value is not None:
            k = torch.cat([past_key_value[0].to(k.dtype), k], dim=2)
            v = torch.cat([past_key_value[1].to(v.dtype), v], dim=2)
        groups = self.config.num_attention_heads // self.config.num_key_value_heads
        past_len = k.shape[2] - q.shape[2]
        if attention_mask is None and past_len == 0:
            attn = F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), is_causal=True)
        else:
            mask = attention_mask if attention_mask is not None else build_causal_mask(q.shape[2], past_len, q.device)
            attn = F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask)
        out = self.midlayer.finish(attn, hidden_states)
        return (self.norm(out) if self.config.norm_output else out), (k, v)

    # ------------------------------------------------------------------ training-time test

    def cast_layer_weights(self, dtype: torch.dtype) -> dict[str, Tensor]:
        """Compute-dtype copies of the layer's projection weights, made once per TTT unroll.

        Every step then reuses the same copies: autocast would recast per compiled call,
        and the steps' weight gradients would each be cast and summed into the fp32 .grad;
        with shared copies they sum in the compute dtype and are cast back once (as eager
        autocast, whose cast cache does the same).
        """
        return {f"midlayer.{n}": p.to(dtype) for n, p in self.midlayer.named_parameters() if p.dim() == 2}

    def _ttt_qkv(self, input_ids: Tensor, hidden_states: Tensor, position_ids: Tensor, weights: dict | None = None):
        cos, sin = self.rotary_emb(position_ids, hidden_states.dtype)
        return self.midlayer.qkv(self._embed(input_ids, hidden_states.dtype), hidden_states, cos, sin, weights)

    def _ttt_finish(self, attn: Tensor, hidden_states: Tensor, weights: dict | None = None) -> tuple[Tensor, Tensor]:
        out = self.midlayer.finish(attn, hidden_states, weights)
        return out, self.norm(out)

    def fused_layer_weights(self, dtype: torch.dtype | None) -> FusedLayerWeights:
        """The layer's weights and fc's for one TTT unroll, fused and cast once (see eagle3/draft/fused_layer.py)."""
        return fuse_layer_weights(self.midlayer, dtype, fc=self.fc)

    def ttt_step(
        self,
        input_ids: Tensor,
        hidden_states: Tensor,
        position_ids: Tensor,
        cache: TTTCache,
        attn_impl: str = "fast",
        weights: dict[str, Tensor] | FusedLayerWeights | None = None,
        return_normed: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """One TTT unroll step; appends this step's keys to `cache`.

        Args:
            input_ids: [B, T] token inputs of this step (already shifted by the caller);
            hidden_states: [B, T, H] fc output (step 0) or the previous step's output;
            position_ids: [B, T] RoPE positions (t + step); attn_impl: "fast" | "dense";
            weights: optional `cast_layer_weights` copies to use instead of the parameters, or
                `fused_layer_weights` (the training path: fused GEMMs, weight gradients summed in them).
        Returns:
            the next step's hidden [B, T, H]: the pre-norm output, or with norm_output norm(output) (SGLang's
            EAGLE-3.1 aux); with return_normed also norm(output) (the lm_head input).
        """
        if isinstance(weights, FusedLayerWeights):
            out, normed = self._fused_ttt_step(input_ids, hidden_states, position_ids, cache, attn_impl, weights)
        else:
            q, k, v = self._qkv_fn(input_ids, hidden_states, position_ids, weights)
            cache.append(k, v)
            attn = ttt_attention(q, cache.keys, cache.values, impl=attn_impl)
            out, normed = self._finish_fn(attn, hidden_states, weights)
        if self.config.norm_output:
            out = normed
        return (out, normed) if return_normed else out

    def _fused_ttt_step(self, input_ids: Tensor, hidden_states: Tensor, position_ids: Tensor, cache: TTTCache,
                        attn_impl: str, weights: FusedLayerWeights) -> tuple[Tensor, Tensor]:
        """`ttt_step` as GEMMs (eager, `FusedLayerWeights.linear`) between compiled elementwise pieces.

        The GEMMs stay outside the compiled graphs so that each weight's gradient over the unroll
        is summed inside its backward GEMMs instead of by autograd's adds. A SiLU MLP's activation is
        `silu_mul` (its backward stores d gate and d up in one pass)."""
        pieces = self._pieces
        x = pieces["input"](input_ids, hidden_states)  # [B, T, 2H]
        if self.config.is_mla:
            q_lat, kv_lat, k_pe = pieces["mla_latents"](weights.linear("qkv_a", x))  # [B, T, r_q | r_kv | d_r]
            q, k, v = pieces["mla_heads"](weights.linear("q_b", q_lat), weights.linear("kv_b", kv_lat), k_pe,
                                          position_ids)  # [B, nh, T, d_n + d_r] (v padded)
        else:
            q, k, v = pieces["rope"](weights.linear("qkv", x), position_ids)  # [B, nh | n_kv, T, d]
        cache.append(k, v)
        attn = ttt_attention(q, cache.keys, cache.values, impl=attn_impl)  # [B, nh, T, d]
        attn_out = weights.linear("o", self.midlayer.self_attn.output(attn))  # [B, T, H]
        residual, normed_r = pieces["post_attention"](hidden_states, attn_out)
        gate_up = weights.linear("gate_up", normed_r)  # [B, T, 2F]
        mlp_in = silu_mul(gate_up) if self.midlayer.mlp.act is F.silu else pieces["act"](gate_up)  # [B, T, F]
        return pieces["final"](residual, weights.linear("down", mlp_in))

    # the fused step's elementwise pieces (compiled by compile_layer)
    def _fused_input(self, input_ids: Tensor, hidden_states: Tensor) -> Tensor:
        layer = self.midlayer
        embeds = self._embed(input_ids, hidden_states.dtype)
        return torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden_states)], dim=-1)

    def _fused_rope(self, qkv: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """qkv [B, T, (nh + 2 n_kv) d] -> q [B, nh, T, d], k/v [B, n_kv, T, d], RoPE on q and k."""
        b, t, _ = qkv.shape
        nh, n_kv, d = self.config.num_attention_heads, self.config.num_key_value_heads, self.config.head_dim
        q, k, v = qkv.split([nh * d, n_kv * d, n_kv * d], dim=-1)
        cos, sin = self.rotary_emb(position_ids, qkv.dtype)
        q = apply_rotary(q.view(b, t, nh, d).transpose(1, 2), cos, sin)
        k = apply_rotary(k.view(b, t, n_kv, d).transpose(1, 2), cos, sin)
        return q, k, v.view(b, t, n_kv, d).transpose(1, 2)

    def _fused_mla_heads(self, q: Tensor, kv: Tensor, k_pe: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        cos, sin = self.rotary_emb(position_ids, q.dtype)
        return self.midlayer.self_attn.heads(q, kv, k_pe, cos, sin)

    def _fused_post_attention(self, hidden_states: Tensor, attn_out: Tensor) -> tuple[Tensor, Tensor]:
        residual = hidden_states + attn_out
        return residual, self.midlayer.post_attention_layernorm(residual)

    def _fused_act(self, gate_up: Tensor) -> Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.midlayer.mlp.act(gate) * up

    def _fused_final(self, residual: Tensor, mlp_out: Tensor) -> tuple[Tensor, Tensor]:
        out = residual + mlp_out
        return out, self.norm(out)

    def _fused_pieces(self) -> dict[str, Callable]:
        pieces = {"input": self._fused_input, "rope": self._fused_rope, "post_attention": self._fused_post_attention,
                  "act": self._fused_act, "final": self._fused_final}
        if self.config.is_mla:
            pieces.update(mla_latents=self.midlayer.self_attn.latents, mla_heads=self._fused_mla_heads)
        return pieces

    def compile_layer(self, **compile_kwargs: Any) -> None:
        """torch.compile the layer's elementwise pieces (both step forms) and the TTT attention's merge math."""
        self._qkv_fn = torch.compile(self._ttt_qkv, **compile_kwargs)
        self._finish_fn = torch.compile(self._ttt_finish, **compile_kwargs)
        self._pieces = {name: torch.compile(fn, **compile_kwargs) for name, fn in self._fused_pieces().items()}
        compile_upcast(**compile_kwargs)
        compile_silu_mul(**compile_kwargs)
        compile_ttt_attention(**compile_kwargs)

    def uncompile_layer(self) -> None:
        """Back to the eager layer and attention merge (benchmarks compare both)."""
        self._qkv_fn, self._finish_fn, self._pieces = self._ttt_qkv, self._ttt_finish, self._fused_pieces()
        uncompile_upcast()
        uncompile_silu_mul()
        uncompile_ttt_attention()


# ====================================================================== TTT attention


def ttt_attention(q: Tensor, keys: list[Tensor], values: list[Tensor], impl: str = "fast") -> Tensor:
    """Attention of TTT step k = len(keys) - 1 under the EAGLE-3 mask.

    Query i sees keys[0][j] for j <= i (causal context) and keys[s][i] for s = 1..k.

    Args:
        q: [B, nh, T, d] (RoPE applied); keys/values: k+1 tensors [B, n_kv, T, d].
        impl: "fast" (flash causal + analytic diagonal merge) or "dense" (reference:
            SDPA over the concatenated keys with the dense boolean mask of masks.py).
    Returns:
        [B, nh, T, d].
    """
    if impl == "dense":
        return _ttt_attention_dense(q, keys, values)
    if impl != "fast":
        raise ValueError(f"ttt attention impl: expected 'fast' or 'dense', found {impl!r}")
    if _flash_backend(q) is None:
        return _ttt_attention_math(q, keys, values)
    return _FastTTTAttention.apply(q, keys[0], values[0], *keys[1:], *values[1:])


def _ttt_attention_dense(q: Tensor, keys: list[Tensor], values: list[Tensor]) -> Tensor:
    groups = q.shape[1] // keys[0].shape[1]
    k = repeat_kv(torch.cat(keys, dim=2), groups)  # [B, nh, (k+1)T, d]
    v = repeat_kv(torch.cat(values, dim=2), groups)
    mask = build_ttt_attention_mask(q.shape[2], len(keys) - 1, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _ttt_attention_math(q: Tensor, keys: list[Tensor], values: list[Tensor]) -> Tensor:
    """Plain-autograd version of the fast path (no flash kernel for this device/dtype)."""
    b, nh, t, d = q.shape
    groups = nh // keys[0].shape[1]
    scale = d**-0.5
    qf = q.float()
    causal = qf @ repeat_kv(keys[0], groups).float().transpose(-1, -2) * scale  # [B, nh, T, T]
    causal = causal.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    diag = [(qf * repeat_kv(k, groups).float()).sum(-1, keepdim=True) * scale for k in keys[1:]]  # [B, nh, T, 1]
    probs = torch.softmax(torch.cat([causal, *diag], dim=-1), dim=-1)
    out = probs[..., :t] @ repeat_kv(values[0], groups).float()
    for s, v in enumerate(values[1:]):
        out = out + probs[..., t + s : t + s + 1] * repeat_kv(v, groups).float()
    return out.to(q.dtype)


def _flash_backend(q: Tensor) -> str | None:
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16):
        return "cpu"
    if q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256:
        return "cuda"
    return None


# Kernel of the causal block on CUDA: "cudnn" (cuDNN's fused attention, Hopper-native: ~2x
# PyTorch's FA2 kernels on an H200), "flash" (FA2), or "auto" = cudnn where it runs, else flash.
# Both return the natural-log LSE and accept the merged (out, lse) in backward.
CAUSAL_BACKENDS = ("auto", "cudnn", "flash")
_causal_backend = "auto"
_cudnn_refused: set[tuple] = set()  # (dtype, head_dim, gqa) cuDNN raised for: flash from then on


def set_causal_attention_backend(name: str) -> None:
    """Pick the CUDA kernel of the TTT attention's causal block (see CAUSAL_BACKENDS)."""
    global _causal_backend
    if name not in CAUSAL_BACKENDS:
        raise ValueError(f"causal attention backend: expected one of {CAUSAL_BACKENDS}, found {name!r}")
    _causal_backend = name


def _flash_forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, tuple]:
    """Causal attention returning (out [B,nh,T,d], lse fp32 [B,nh,T], state for backward)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        return out, lse, ("cpu",)
    key = (q.dtype, q.shape[-1], q.shape[1] != k.shape[1])
    if _causal_backend != "flash" and key not in _cudnn_refused:
        try:
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
                torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale))
            return out, lse.view(lse.shape[:3]), ("cudnn", cum_q, cum_k, max_q, max_k, seed, offset)
        except RuntimeError:  # this cuDNN/shape combination is not supported
            if _causal_backend == "cudnn":
                raise
            _cudnn_refused.add(key)
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True, False, scale=scale
    )
    return out, lse, ("flash", cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, state: tuple, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    kind, *rest = state
    if kind == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, True, scale=scale
        )
    cum_q, cum_k, max_q, max_k, seed, offset = rest
    if kind == "cudnn":
        # cuDNN reads dO in out's layout; its LSE is [B, nh, T, 1]
        dout = dout if dout.stride() == out.stride() else _like(dout, out)
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.unsqueeze(-1), seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, True,
            scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale
    )


def _like(x: Tensor, ref: Tensor) -> Tensor:
    """A copy of `x` with `ref`'s memory layout (same shape)."""
    return torch.empty_strided(ref.shape, ref.stride(), dtype=x.dtype, device=x.device).copy_(x)


def _merge_forward(q: Tensor, o_c: Tensor, lse_c: Tensor, keys: list[Tensor], values: list[Tensor], scale: float):
    """Merge causal (o_c, lse_c) with the diagonal terms -> (out [B,nh,T,d] in q.dtype, lse fp32 [B,nh,T])."""
    b, nh, t, d = q.shape
    n_kv = keys[0].shape[1]
    qg = q.float().view(b, n_kv, nh // n_kv, t, d)
    scores = [(qg * k.float()[:, :, None]).sum(-1).view(b, nh, t) * scale for k in keys]
    lse = torch.logsumexp(torch.stack([lse_c, *scores]), dim=0)
    merged = o_c.float() * torch.exp(lse_c - lse)[..., None]
    for score, v in zip(scores, values):
        merged = merged + torch.exp(score - lse)[..., None] * repeat_kv(v, nh // n_kv).float()
    # [B, T, nh, d]-contiguous: the layout flash uses and o_proj reads without a copy
    return merged.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2), lse


def _diag_backward(q: Tensor, dout: Tensor, out: Tensor, lse: Tensor, keys: list[Tensor], values: list[Tensor],
                   scale: float, dq_causal: Tensor):
    """Gradients of the diagonal terms: dd_s = p_s (dO.V_s - D), D = rowsum(dO * out).

    Returns (dq [B, nh, T, d] in q's dtype = dq_causal + the diagonal terms' share, [dK_s], [dV_s]).
    """
    b, nh, t, d = q.shape
    n_kv = keys[0].shape[1]
    shape5 = (b, n_kv, nh // n_kv, t, d)
    do, qg = dout.float().reshape(shape5), q.float().reshape(shape5)
    lse_g = lse.view(b, n_kv, nh // n_kv, t)
    delta = (do * out.float().reshape(shape5)).sum(-1)  # [B, n_kv, G, T]
    dq = torch.zeros(shape5, dtype=torch.float32, device=q.device)
    dks, dvs = [], []
    for k, v in zip(keys, values):
        kf, vf = k.float()[:, :, None], v.float()[:, :, None]  # [B, n_kv, 1, T, d]
        p = torch.exp((qg * kf).sum(-1) * scale - lse_g)  # [B, n_kv, G, T]
        dd = p * ((do * vf).sum(-1) - delta) * scale
        dq = dq + dd[..., None] * kf
        dks.append((dd[..., None] * qg).sum(2).to(k.dtype))
        dvs.append((p[..., None] * do).sum(2).to(v.dtype))
    return (dq.reshape(b, nh, t, d) + dq_causal.float()).to(q.dtype), dks, dvs


_merge_fn: Callable = _merge_forward
_diag_backward_fn: Callable = _diag_backward


def compile_ttt_attention(**compile_kwargs: Any) -> None:
    """Use torch.compile'd merge/diagonal-gradient kernels (one graph per step count)."""
    global _merge_fn, _diag_backward_fn
    import torch._dynamo

    # one graph per TTT step count (up to TrainConfig.ttt_steps <= 32) plus a dynamic-shape one
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 40)
    _merge_fn = torch.compile(_merge_forward, **compile_kwargs)
    _diag_backward_fn = torch.compile(_diag_backward, **compile_kwargs)


def uncompile_ttt_attention() -> None:
    global _merge_fn, _diag_backward_fn
    _merge_fn, _diag_backward_fn = _merge_forward, _diag_backward


class _FastTTTAttention(torch.autograd.Function):
    """Causal flash attention over the step-0 keys, merged with k diagonal terms.

    With c = causal scores and e_s = q.K_s (own key of step s), the full softmax is
        lse = logsumexp(lse_c, e_1..e_k);  out = exp(lse_c - lse) o_c + sum_s exp(e_s - lse) V_s.
    Backward: the flash kernel recomputes P = exp(S - lse) and uses `out` only for
    D = rowsum(dO * out); handing it the merged `out` and merged `lse` makes it return the
    exact gradients of the causal block (the ring-attention trick). The diagonal terms
    get their softmax gradients in closed form (`_diag_backward`).
    """

    @staticmethod
    def forward(ctx, q: Tensor, k0: Tensor, v0: Tensor, *diag: Tensor) -> Tensor:
        steps = len(diag) // 2
        scale = q.shape[-1] ** -0.5
        groups = q.shape[1] // k0.shape[1]
        try:
            o_c, lse_c, state = _flash_forward(q, k0, v0, scale)
            expanded = False
        except RuntimeError:  # a flash build without native GQA: share heads explicitly
            o_c, lse_c, state = _flash_forward(q, repeat_kv(k0, groups), repeat_kv(v0, groups), scale)
            expanded = True
        if steps == 0:
            out, lse = o_c, lse_c
        else:
            out, lse = _merge_fn(q, o_c, lse_c, list(diag[:steps]), list(diag[steps:]), scale)
        ctx.save_for_backward(q, k0, v0, out, lse, *diag)
        ctx.state, ctx.scale, ctx.steps, ctx.expanded = state, scale, steps, expanded
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k0, v0, out, lse, *diag = ctx.saved_tensors
        steps, scale = ctx.steps, ctx.scale
        b, nh, t, d = q.shape
        n_kv = k0.shape[1]
        dout = dout.contiguous() if q.device.type == "cpu" else dout
        if ctx.expanded:
            dq, dk0, dv0 = _flash_backward(dout, q, repeat_kv(k0, nh // n_kv), repeat_kv(v0, nh // n_kv),
                                           out, lse, ctx.state, scale)
            dk0 = dk0.view(b, n_kv, nh // n_kv, t, d).sum(2)
            dv0 = dv0.view(b, n_kv, nh // n_kv, t, d).sum(2)
        else:
            dq, dk0, dv0 = _flash_backward(dout, q, k0, v0, out, lse, ctx.state, scale)
        if steps == 0:
            return dq, dk0, dv0
        dq, dks, dvs = _diag_backward_fn(q, dout, out, lse, list(diag[:steps]), list(diag[steps:]), scale, dq)
        return (dq, dk0, dv0, *dks, *dvs)
