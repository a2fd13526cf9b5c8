"""Export a trained draft for SGLang and for vLLM (speculators format), and validate it.

Owns the serving formats and the checks at the silent-failure boundary between training
and serving. SGLang's `LlamaForCausalLMEagle3.load_weights` drops unknown tensor names
silently and has no missing-weight check, reads the aux-layer ids only from the nested
`eagle_config`, and replaces the draft embedding by the target's: a wrongly exported draft
starts, runs, and accepts almost nothing. `validate_sglang_checkpoint` rejects each such
case with what SGLang would do (reference sglang-eagle3.md §2-3; sglang
`python/sglang/srt/models/llama_eagle3.py`).

Formats written:
- sglang/: config.json (LlamaForCausalLMEagle3, eagle_config with SGLang-convention ids)
  + model.safetensors with exactly `SGLANG_WEIGHT_KEYS` (no embed_tokens when the widths
  match: SGLang uses the target's); for the `deepseek_mla` draft, SGLang's
  `Eagle3DeepseekV2ForCausalLM` (sglang `srt/models/kimi_k25_eagle3.py`: model_type deepseek_v3,
  the MLA dims, `midlayer.self_attn.{q_a_proj, kv_a_proj_with_mqa, ...}`, which its `load_weights`
  fuses and splits by name and warns-and-skips when unknown). Either takes the EAGLE-3.1 flags
  `fc_norm` (+ `fc_norm.{i}.weight`) and `norm_output` as top-level config keys, as both classes read them.
- speculators/: vLLM's speculators layout (`Eagle3Speculator`, `transformer_layer_config`,
  `layers.0.*`), ids translated to vLLM's "input of layer k" convention.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from eagle3.config import ExportConfig
from eagle3.data.capture import max_capture_index, sglang_layers_to_capture
from eagle3.draft.model import MLA_DIMS, DraftModelConfig, Eagle3DraftModel, target_rope_settings

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
SGLANG_MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
_MODEL_TYPES = {SGLANG_ARCHITECTURE: "llama", SGLANG_MLA_ARCHITECTURE: "deepseek_v3"}
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
SPECULATORS_VERSION = "0.9.0"
# The tensors SGLang's LlamaForCausalLMEagle3 loads for a one-layer draft (bias-free fc, no
# norm_before_fc), in checkpoint naming.
SGLANG_WEIGHT_KEYS = (
    "fc.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)
# ... and the MLA draft's attention in their place (Eagle3DeepseekV2ForCausalLM.load_weights names)
_MLA_ATTENTION_KEYS = tuple(f"midlayer.self_attn.{n}.weight" for n in (
    "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"))
_EMBED_KEY = "embed_tokens.weight"
_LEFTOVER_PREFIXES = ("draft_model.", "model.", "module.", "_orig_mod.", "draft.")
_TARGET_EMBED_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight", "model.language_model.embed_tokens.weight")


@dataclass(frozen=True)
class Problem:
    """One finding of the validator; `message` says what SGLang would do with the checkpoint."""

    code: str
    message: str
    severity: str = "error"  # "error": SGLang would mis-load or fail; "warning": suspicious


# ============================================================================ target side


def read_target_config(target_dir: Path) -> dict[str, Any]:
    """The target's HF config.json (text sub-config merged in for multimodal wrappers)."""
    path = Path(target_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: expected the target model's config.json")
    config = json.loads(path.read_text())
    if "hidden_size" not in config and isinstance(config.get("text_config"), dict):
        config = {**config["text_config"], "architectures": config.get("architectures", [])}
    return config


def read_target_embedding(target_dir: Path) -> Tensor:
    """The target's input embedding [V, H] from its (possibly sharded) safetensors."""
    target_dir = Path(target_dir)
    index = target_dir / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
        else [p.name for p in sorted(target_dir.glob("*.safetensors"))]
    )
    for name in files:
        with safe_open(str(target_dir / name), framework="pt") as f:
            for key in _TARGET_EMBED_NAMES:
                if key in f.keys():
                    return f.get_tensor(key)
    raise FileNotFoundError(f"{target_dir}: no safetensors file holds one of {_TARGET_EMBED_NAMES}")


def _architecture(target_config: dict) -> str:
    return (target_config.get("architectures") or ["LlamaForCausalLM"])[0]


# ============================================================================ writing


def sglang_architecture(cfg: DraftModelConfig) -> str:
    return SGLANG_MLA_ARCHITECTURE if cfg.is_mla else SGLANG_ARCHITECTURE


def _attention_shapes(cfg: DraftModelConfig) -> dict[str, tuple[int, ...]]:
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    if cfg.is_mla:
        rope, nope, v = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        shapes = [(cfg.q_lora_rank, 2 * h), (cfg.q_lora_rank,), (nh * (nope + rope), cfg.q_lora_rank),
                  (cfg.kv_lora_rank + rope, 2 * h), (cfg.kv_lora_rank,), (nh * (nope + v), cfg.kv_lora_rank), (h, nh * v)]
        return dict(zip(_MLA_ATTENTION_KEYS, shapes))
    q, kv = nh * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"midlayer.self_attn.q_proj.weight": (q, 2 * h), "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
            "midlayer.self_attn.v_proj.weight": (kv, 2 * h), "midlayer.self_attn.o_proj.weight": (h, q)}


def sglang_weight_shapes(cfg: DraftModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of each SGLang tensor for a draft config (either architecture, fc_norm's when set)."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    fc_norm = {f"fc_norm.{i}.weight": (cfg.target_hidden_size,) for i in range(cfg.num_aux_hidden_states)}
    return {
        "fc.weight": (h, cfg.num_aux_hidden_states * cfg.target_hidden_size),
        **(fc_norm if cfg.fc_norm else {}),
        **_attention_shapes(cfg),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }


def sglang_state_dict(model: Eagle3DraftModel, dtype: torch.dtype) -> dict[str, Tensor]:
    """Exactly SGLang's tensors (plus embed_tokens when SGLang cannot share the target's)."""
    state = model.state_dict()
    keys = list(sglang_weight_shapes(model.config)) + ([] if model.config.shares_target_embedding else [_EMBED_KEY])
    out = {}
    for key in keys:
        t = state[key].detach().cpu()
        out[key] = t.long() if key == "d2t" else t.bool() if key == "t2d" else t.to(dtype)
        out[key] = out[key].contiguous()
    return out


def _rope_keys(cfg: DraftModelConfig, target_config: dict) -> dict[str, Any]:
    """The target's RoPE keys verbatim (either transformers layout), else the draft's values."""
    keys = {k: target_config[k] for k in ("rope_theta", "rope_scaling", "rope_parameters") if k in target_config}
    if "rope_theta" not in keys and "rope_parameters" not in keys:
        keys["rope_theta"] = cfg.rope_theta
        keys["rope_scaling"] = cfg.rope_scaling
    return keys


def _llama_layer_config(cfg: DraftModelConfig, target_config: dict, dtype: str) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": max(cfg.max_position_embeddings, target_config.get("max_position_embeddings", 0)),
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
        **_rope_keys(cfg, target_config),
    }


def _mla_layer_config(cfg: DraftModelConfig, target_config: dict, dtype: str) -> dict[str, Any]:
    """The keys Eagle3DeepseekV2ForCausalLM and DeepseekV2AttentionMLA read, as a transformers DeepseekV3Config;
    `rope_interleave` explicit (SGLang rotates MLA's rope pairs interleaved unless it is false)."""
    layer = _llama_layer_config(cfg, target_config, dtype)
    del layer["head_dim"], layer["attention_bias"], layer["mlp_bias"]
    return {**layer, "model_type": "deepseek_v3", "num_key_value_heads": cfg.num_attention_heads,
            "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
            "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim, "rope_interleave": True}


def build_sglang_config(cfg: DraftModelConfig, target_config: dict, dtype: str = "bfloat16") -> dict[str, Any]:
    """config.json for SGLang's LlamaForCausalLMEagle3 (or Eagle3DeepseekV2ForCausalLM for the MLA draft)."""
    layer = _mla_layer_config if cfg.is_mla else _llama_layer_config
    config = {
        "architectures": [sglang_architecture(cfg)],
        **layer(cfg, target_config, dtype),
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "num_aux_hidden_states": cfg.num_aux_hidden_states,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
            "use_aux_hidden_state": True,
            "norm_before_fc": False,
        },
    }
    for key in ("bos_token_id", "eos_token_id"):
        if key in target_config:
            config[key] = target_config[key]
    return config


def export_sglang(model: Eagle3DraftModel, target_config: dict, out_dir: Path, dtype: str = "bfloat16") -> Path:
    """Write config.json + model.safetensors in SGLang's format; returns the directory."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(build_sglang_config(model.config, target_config, dtype), indent=2))
    save_file(sglang_state_dict(model, getattr(torch, dtype)), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def build_speculators_config(
    cfg: DraftModelConfig, target_config: dict, speculative_tokens: int, verifier: str, dtype: str = "bfloat16"
) -> dict[str, Any]:
    """config.json of the vLLM speculators format; ids in vLLM's convention (input of layer k)."""
    vllm_ids = sglang_layers_to_capture(_architecture(target_config), list(cfg.aux_layer_ids),
                                        target_config.get("num_hidden_layers", 0))
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], **_llama_layer_config(cfg, target_config, dtype)},
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": vllm_ids,
        # vLLM's speculators adapter defaults a missing key to True; EAGLE/SpecForge/SGLang layout is False.
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": target_config.get("architectures", [])},
        },
    }


def export_speculators(
    model: Eagle3DraftModel, target_config: dict, out_dir: Path, dtype: str, speculative_tokens: int, verifier: str,
    embedding: Tensor,
) -> Path:
    """Write the vLLM speculators format (`layers.0.*` names); returns the directory.

    `embedding` [V, H] is written as `embed_tokens.weight` even when the draft shares the target's:
    speculators 0.9.0's own loader (transformers 5.19) leaves an absent embedding uninitialised in
    about 2 of 3 loads, while vLLM itself replaces it with the target's anyway.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = build_speculators_config(model.config, target_config, speculative_tokens, verifier, dtype)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    state = {k.replace("midlayer.", "layers.0.", 1): v for k, v in sglang_state_dict(model, getattr(torch, dtype)).items()}
    state[_EMBED_KEY] = embedding.to(getattr(torch, dtype)).contiguous()
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


# ============================================================================ reading


def _draft_config_from_export(config: dict) -> DraftModelConfig:
    if config.get("speculators_model_type") == "eagle3":
        layer = config["transformer_layer_config"]
        verifier_arch = (config["speculators_config"]["verifier"].get("architectures") or ["LlamaForCausalLM"])[0]
        ids = [i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]]  # vLLM -> SGLang convention
        if any(name in verifier_arch.lower() for name in ("deepseek", "kimik25", "glm4moelite", "gptoss")):
            raise ValueError(f"load_exported: aux-id translation for a {verifier_arch} verifier is not one-to-one; "
                             "load the sglang/ export instead")
        flat = {**layer, "draft_vocab_size": config["draft_vocab_size"], "target_hidden_size": config.get("target_hidden_size"),
                "fc_norm": config.get("fc_norm"), "norm_output": config.get("norm_output")}
    else:
        flat, ids = config, config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    theta, scaling = target_rope_settings(flat)
    mla = (config.get("architectures") or [None])[0] == SGLANG_MLA_ARCHITECTURE
    return DraftModelConfig(
        architecture="deepseek_mla" if mla else "llama", fc_norm=bool(flat.get("fc_norm") or flat.get("use_aux_norm")),
        norm_output=bool(flat.get("norm_output", False)),
        **({name: flat[name] for name in MLA_DIMS} if mla else {}),
        hidden_size=flat["hidden_size"], intermediate_size=flat["intermediate_size"],
        num_attention_heads=flat["num_attention_heads"], num_key_value_heads=flat["num_key_value_heads"],
        head_dim=flat["qk_nope_head_dim"] + flat["qk_rope_head_dim"] if mla
        else flat.get("head_dim") or flat["hidden_size"] // flat["num_attention_heads"],
        vocab_size=flat["vocab_size"], draft_vocab_size=flat["draft_vocab_size"],
        target_hidden_size=flat.get("target_hidden_size") or flat["hidden_size"], aux_layer_ids=list(ids),
        rms_norm_eps=flat.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=flat.get("max_position_embeddings", 2048), hidden_act=flat.get("hidden_act", "silu"),
    )


def load_exported(
    draft_dir: Path, target_embedding: Tensor | None = None, target_dir: Path | None = None
) -> Eagle3DraftModel:
    """Rebuild an exported draft (sglang/ or speculators/ layout) in the dtype it was saved in.

    The embedding comes from `target_embedding`, else from `target_dir`'s safetensors, else
    from the checkpoint itself (only drafts narrower than the target carry one).
    """
    draft_dir = Path(draft_dir)
    config = json.loads((draft_dir / "config.json").read_text())
    model = Eagle3DraftModel(_draft_config_from_export(config))
    state = {k.replace("layers.0.", "midlayer.", 1): v for k, v in load_file(str(draft_dir / "model.safetensors")).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {_EMBED_KEY}:
        raise ValueError(f"{draft_dir}: missing tensors {sorted(set(missing) - {_EMBED_KEY})}, unknown {unexpected}")
    if _EMBED_KEY in missing:
        if target_embedding is None and target_dir is None:
            raise ValueError(f"{draft_dir} has no embed_tokens (SGLang shares the target's): pass target_embedding or target_dir")
        model.load_target_embedding(target_embedding if target_embedding is not None else read_target_embedding(target_dir))
    dtype = state["fc.weight"].dtype
    return model.to(dtype)


# ============================================================================ validation


def _check_config(config: dict, target_config: dict) -> list[Problem]:
    problems = []
    arch = config.get("architectures") or []
    if arch not in ([SGLANG_ARCHITECTURE], [SGLANG_MLA_ARCHITECTURE]):
        problems.append(Problem("architecture", f"architectures is {arch}: SGLang picks the draft class from "
                                f"architectures[0] and only {SGLANG_ARCHITECTURE} (GQA) or {SGLANG_MLA_ARCHITECTURE} "
                                "(MLA) loads this layout (a plain LlamaForCausalLM draft is not rewritten into it)"))
    model_type = _MODEL_TYPES.get(arch[0] if arch else "", "llama")
    if config.get("model_type") != model_type:
        problems.append(Problem("model_type", f"model_type is {config.get('model_type')!r}: SGLang parses the "
                                f"{arch[0] if arch else 'draft'} config as transformers' {model_type!r} config"))
    if arch == [SGLANG_MLA_ARCHITECTURE]:
        problems += _check_mla_config(config)
    if config.get("num_hidden_layers") != 1:
        problems.append(Problem("num_hidden_layers", f"num_hidden_layers is {config.get('num_hidden_layers')}: SGLang "
                                "would build extra decoder layers this one-layer checkpoint has no weights for "
                                "(left at their initial values)"))
    if "draft_vocab_size" not in config:
        problems.append(Problem("draft_vocab_size_missing", "draft_vocab_size is absent: SGLang reads "
                                "config.draft_vocab_size in the constructor and fails with AttributeError at load"))
    elif config["draft_vocab_size"] is None:
        problems.append(Problem("draft_vocab_size_null", "draft_vocab_size is null: SGLang then loads the target's "
                                "full-vocab lm_head and ignores this draft's lm_head.weight"))
    if config.get("tie_word_embeddings", False):
        problems.append(Problem("tie_word_embeddings", "tie_word_embeddings is true: SGLang makes lm_head the "
                                "embedding, replaces it by the target's full-vocab embedding and keeps its first "
                                "draft_vocab_size columns; this checkpoint's lm_head.weight is dropped"))
    if config.get("vocab_size") != target_config.get("vocab_size"):
        problems.append(Problem("vocab_size", f"vocab_size {config.get('vocab_size')} != target's "
                                f"{target_config.get('vocab_size')}: the draft shares the target's embedding and "
                                "t2d indexes the target vocab"))
    target_h = config.get("target_hidden_size", config.get("hidden_size"))
    if target_h != target_config.get("hidden_size"):
        problems.append(Problem("target_hidden_size", f"target_hidden_size {target_h} != target hidden_size "
                                f"{target_config.get('hidden_size')}: SGLang sizes fc from it and the load would "
                                "fail or the features would not match"))
    problems += _check_rope_and_length(config, target_config)
    problems += _check_layer_ids(config, target_config)
    return problems


def _check_mla_config(config: dict) -> list[Problem]:
    """What Eagle3DeepseekV2ForCausalLM reads and has no default for (kimi_k25_eagle3.py, deepseek_v2.py)."""
    problems = [Problem("mla_dims", f"{name} is absent: {SGLANG_MLA_ARCHITECTURE} builds its multi-latent attention "
                        "from it (and refuses a draft without q_lora_rank)") for name in MLA_DIMS if not config.get(name)]
    if config.get("rope_interleave") is False:
        problems.append(Problem("rope_interleave", "rope_interleave is false: SGLang then rotates MLA's rope part "
                                "neox-style, while the draft was trained with interleaved pairs"))
    if config.get("eagle_config", {}).get("norm_before_fc") or config.get("norm_before_fc"):
        problems.append(Problem("norm_before_fc", f"norm_before_fc is set: {SGLANG_MLA_ARCHITECTURE} has no input_norm "
                                "and ignores it"))
    return problems


def _check_rope_and_length(config: dict, target_config: dict) -> list[Problem]:
    problems = []
    draft_len, target_len = config.get("max_position_embeddings", 0), target_config.get("max_position_embeddings", 0)
    if draft_len < target_len:
        problems.append(Problem("max_position_embeddings", f"max_position_embeddings {draft_len} < target's "
                                f"{target_len}: SGLang builds the draft's RoPE/context for {draft_len} positions and "
                                "acceptance collapses on longer contexts (SpecForge #249)"))
    if target_rope_settings(config) != target_rope_settings(target_config):
        problems.append(Problem("rope", f"draft RoPE {target_rope_settings(config)} != target's "
                                f"{target_rope_settings(target_config)}: SGLang applies the draft config's RoPE, so "
                                "draft positions disagree with training (SpecForge #265)"))
    return problems


def _check_layer_ids(config: dict, target_config: dict) -> list[Problem]:
    num_layers = target_config.get("num_hidden_layers", 0)
    eagle = config.get("eagle_config")
    ids = (eagle or {}).get("eagle_aux_hidden_state_layer_ids")
    default = [2, num_layers // 2, num_layers - 3]
    if ids is None:
        where = "only at the top level" if "eagle_aux_hidden_state_layer_ids" in config else "nowhere"
        return [Problem("aux_layer_ids_location", f"eagle_aux_hidden_state_layer_ids is {where}: SGLang reads the ids "
                        f"only from eagle_config and would capture its default layers (capture indices {default})")]
    problems = []
    if not eagle.get("use_aux_hidden_state", True):
        problems.append(Problem("use_aux_hidden_state", "eagle_config.use_aux_hidden_state is false: SGLang would not "
                                "capture aux hidden states and the draft would skip fc"))
    if eagle.get("norm_before_fc", config.get("norm_before_fc", False)):
        problems.append(Problem("norm_before_fc", "norm_before_fc is true: SGLang normalises the fc input with an "
                                "input_norm this draft was not trained with"))
    if list(ids) != sorted(set(ids)):
        problems.append(Problem("aux_layer_ids_order", f"ids {ids} are not strictly ascending: SGLang captures in "
                                "ascending layer order, once per layer, so the fc input chunks would be permuted or missing"))
    try:
        capture = sglang_layers_to_capture(_architecture(target_config), list(ids), num_layers)
        top = max_capture_index(_architecture(target_config), num_layers)
    except ValueError as err:
        return problems + [Problem("aux_layer_ids_rule", f"cannot check the layer ids: {err}")]
    bad = [i for i, c in zip(ids, capture) if not 0 <= c <= top]
    if bad:
        problems.append(Problem("aux_layer_ids_range", f"ids {bad} map to capture indices outside 0..{top} of a "
                                f"{num_layers}-layer target (SGLang config id k = output of layer k; id "
                                f"{num_layers - 1} is the final layer, whose output the capture loop never visits): "
                                "those features are silently missing"))
    elif list(ids) == default and num_layers > 6:
        problems.append(Problem("aux_layer_ids_hf_convention", f"ids {ids} equal SGLang's default capture indices (HF "
                                f"hidden_states indices); as config ids SGLang adds 1 and captures HF "
                                f"{[i + 1 for i in ids]}. Features taken at SGLang's default are written "
                                f"{[i - 1 for i in ids]}", "warning"))
    if len(ids) != 3:
        problems.append(Problem("aux_layer_count", f"{len(ids)} aux layers: SGLang releases before "
                                "num_aux_hidden_states support build fc for exactly 3", "warning"))
    return problems


def _check_weights(weights: dict[str, Tensor], config: dict) -> list[Problem]:
    problems = []
    try:
        cfg = _draft_config_from_export(config)
    except (KeyError, TypeError, ValueError) as err:
        return [Problem("config_incomplete", f"config.json cannot describe the draft ({err!r}); shapes not checked")]
    shapes = sglang_weight_shapes(cfg)
    optional = {_EMBED_KEY} if cfg.shares_target_embedding else set()
    for key in sorted(set(weights) - set(shapes) - optional):
        stripped = next((key[len(p):] for p in _LEFTOVER_PREFIXES if key.startswith(p) and key[len(p):] in shapes), None)
        if stripped:
            problems.append(Problem("key_prefix", f"{key}: leftover prefix of {stripped}; SGLang drops names it does "
                                    "not know silently and the tensor stays at its initial value"))
        else:
            how = "with a warning" if cfg.is_mla else "silently"
            problems.append(Problem("unknown_key", f"{key}: not a tensor of {sglang_architecture(cfg)}; SGLang drops "
                                    f"it {how}"))
    if not cfg.shares_target_embedding and _EMBED_KEY not in weights:
        problems.append(Problem("missing_key", f"{_EMBED_KEY}: the draft is narrower than the target, so SGLang "
                                "does not share the target's embedding and this one stays at its initial value"))
    for key, shape in shapes.items():
        if key not in weights:
            what = ("draft index = target id: SGLang proposes the first draft_vocab_size target ids" if key == "d2t"
                    else "SGLang skips it silently (t2d is unused by SGLang but needed by vLLM and reload)"
                    if key == "t2d" else "SGLang has no missing-weight check: it stays at its initial value")
            problems.append(Problem("missing_key", f"{key} missing: {what}"))
            continue
        tensor = weights[key]
        if tuple(tensor.shape) != shape:
            code = "d2t_length" if key == "d2t" else "shape"
            problems.append(Problem(code, f"{key}: shape {list(tensor.shape)}, expected {list(shape)} from config.json; "
                                    "SGLang's weight loader fails or mis-maps it"))
        want = torch.int64 if key == "d2t" else torch.bool if key == "t2d" else None
        if (want is not None and tensor.dtype != want) or (want is None and not tensor.is_floating_point()):
            problems.append(Problem("dtype", f"{key}: dtype {tensor.dtype}, expected {want or 'a float dtype'}"))
    problems += _check_vocab_maps(weights, cfg)
    return problems


def _check_vocab_maps(weights: dict[str, Tensor], cfg: DraftModelConfig) -> list[Problem]:
    d2t, t2d = weights.get("d2t"), weights.get("t2d")
    if d2t is None or t2d is None or d2t.numel() != cfg.draft_vocab_size or t2d.numel() != cfg.vocab_size:
        return []
    target_ids = d2t.long() + torch.arange(d2t.numel())
    if target_ids.min() < 0 or target_ids.max() >= cfg.vocab_size:
        return [Problem("d2t_range", "d2t + arange leaves the target vocab: SGLang's hot_token_id would propose "
                        "invalid target ids")]
    if not torch.equal(target_ids, t2d.bool().nonzero().squeeze(-1)):
        return [Problem("d2t_t2d", "d2t and t2d disagree (draft id i must be the i-th target id of t2d): the draft "
                        "was trained on one mapping and SGLang serves another")]
    return []


def validate_sglang_checkpoint(draft_dir: Path, target_config: dict) -> list[Problem]:
    """Every way SGLang would silently mis-load `draft_dir` for this target (empty = loads as trained)."""
    draft_dir = Path(draft_dir)
    config_path, weights_path = draft_dir / "config.json", draft_dir / "model.safetensors"
    if not config_path.exists():
        return [Problem("missing_config", f"{config_path} missing: SGLang cannot build the draft")]
    config = json.loads(config_path.read_text())
    problems = _check_config(config, target_config)
    if not weights_path.exists():
        return problems + [Problem("missing_weights", f"{weights_path} missing: SGLang would load no draft weights")]
    return problems + _check_weights(load_file(str(weights_path)), config)


def assert_valid_sglang_checkpoint(draft_dir: Path, target_config: dict) -> list[Problem]:
    """Raise ValueError listing the errors; returns the warnings otherwise."""
    problems = validate_sglang_checkpoint(draft_dir, target_config)
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        raise ValueError(f"{draft_dir} would be mis-loaded by SGLang:\n" + "\n".join(f"- [{p.code}] {p.message}" for p in errors))
    return problems


def validate_speculators_checkpoint(draft_dir: Path, target_config: dict) -> list[Problem]:
    """Keys, the explicit norm flags and vLLM-convention ids of a speculators export."""
    draft_dir = Path(draft_dir)
    config = json.loads((draft_dir / "config.json").read_text())
    problems = []
    if config.get("norm_before_residual") is not False:
        problems.append(Problem("norm_before_residual", "norm_before_residual is not explicitly false: vLLM's "
                                "speculators adapter then assumes true and applies hidden_norm before the residual"))
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    num_layers = target_config.get("num_hidden_layers", 0)
    if not ids or not all(0 <= i <= num_layers - 1 for i in ids):
        problems.append(Problem("aux_layer_ids_range", f"ids {ids}: vLLM reads them as 'input of layer k' and needs "
                                f"0..{num_layers - 1}; missing ids fall back to vLLM's default layers"))
    expected = {k.replace("midlayer.", "layers.0.", 1) for k in sglang_weight_shapes(_draft_config_from_export(config))}
    with safe_open(str(draft_dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    found = keys - {_EMBED_KEY}
    if found != expected:
        problems.append(Problem("keys", f"missing {sorted(expected - found)}, unknown {sorted(found - expected)}"))
    if _EMBED_KEY not in keys:
        problems.append(Problem("embed_tokens_missing", f"{_EMBED_KEY} is absent: speculators 0.9.0's loader "
                                "(transformers 5.19) leaves the embedding uninitialised in about 2 of 3 loads"))
    verifier = config.get("speculators_config", {}).get("verifier", {}).get("name_or_path", "")
    if str(verifier).startswith("/") and Path(verifier).exists():
        problems.append(Problem("verifier_local_path", f"verifier {verifier} is a path on this machine: on a serving "
                                "host it names nothing; give the host's target path or a model id", "warning"))
    return problems


# ============================================================================ serving wiring

TRAINING_RECORD = "eagleops_training.json"  # beside config.json in the SGLang export; SGLang ignores it


def describe_hf_indices(indices: list[int]) -> list[str]:
    """HF hidden_states indices as layer names: 0 -> "embeddings", j -> "layer j-1" (its output)."""
    return ["embeddings" if i == 0 else f"layer {i - 1}" for i in indices]


def check_serving_wiring(draft_dir: Path, target_config: dict, record: dict | None) -> list[Problem]:
    """Will SGLang feed this draft what it was trained on? The export validator's checks against the
    serving target's config.json, plus the training record (what the data stage captured) against the
    layers SGLang captures for the draft's eagle_config ids on this target.
    """
    problems = validate_sglang_checkpoint(Path(draft_dir), target_config)
    if record is None:
        return problems + [Problem("training_record", f"{TRAINING_RECORD} is absent: what the draft was trained on "
                                   "cannot be compared with what the server feeds", "warning")]
    arch, layers = _architecture(target_config), target_config.get("num_hidden_layers")
    if record.get("architecture") != arch or record.get("num_hidden_layers") != layers:
        problems.append(Problem("training_target", f"trained on a {record.get('num_hidden_layers')}-layer "
                                f"{record.get('architecture')} target, serving a {layers}-layer {arch}"))
        return problems
    ids = json.loads((Path(draft_dir) / "config.json").read_text()).get("eagle_config", {}).get(
        "eagle_aux_hidden_state_layer_ids")
    try:
        fed = sglang_layers_to_capture(arch, list(ids) if ids is not None else None, layers)
    except ValueError as err:
        return problems + [Problem("layer_rule", f"cannot tell which layers SGLang feeds: {err}")]
    # what the capture engine actually hooked (the shards' manifest), else what the data stage asked for
    trained = list((record.get("capture_engine") or {}).get("capture_indices") or record.get("hf_indices", []))
    if fed != trained:
        problems.append(Problem("layer_mismatch", f"the draft was trained on {describe_hf_indices(trained)} "
                                f"(HF hidden_states {trained}) but SGLang will feed {describe_hf_indices(fed)} "
                                f"(HF hidden_states {fed}, from eagle_config ids {ids})"))
    return problems


# ============================================================================ stage entry


def export_checkpoint(checkpoint_path: Path, target_dir: Path, cfg: ExportConfig, out_dir: Path) -> dict[str, Any]:
    """Export a training checkpoint (a `step_*` dir, or a run's `checkpoints/`) in each
    configured format and validate it.

    Returns {"formats": {name: dir}, "validation": {name: [problem dicts]}, "warnings": n};
    raises ValueError when an export has errors (SGLang or vLLM would mis-load it).
    """
    from eagle3.training.checkpoints import find_latest_checkpoint, load_draft_checkpoint

    out_dir, checkpoint_path = Path(out_dir), Path(checkpoint_path)
    if (checkpoint_path / "latest").exists():  # a run's checkpoints/ directory: take its latest
        checkpoint_path = find_latest_checkpoint(checkpoint_path)
    target_config = read_target_config(Path(target_dir))
    model = load_draft_checkpoint(checkpoint_path)
    result: dict[str, Any] = {"formats": {}, "validation": {}}
    for fmt in cfg.formats:
        if fmt == "sglang":
            path = export_sglang(model, target_config, out_dir / "sglang", cfg.dtype)
            problems = validate_sglang_checkpoint(path, target_config)
        else:
            verifier = cfg.verifier_name_or_path or str(Path(target_dir).resolve())
            embedding = read_target_embedding(target_dir) if model.config.shares_target_embedding \
                else model.embed_tokens.weight.detach()
            path = export_speculators(model, target_config, out_dir / "speculators", cfg.dtype, cfg.speculative_tokens,
                                      verifier, embedding)
            problems = validate_speculators_checkpoint(path, target_config)
        result["formats"][fmt] = str(path)
        result["validation"][fmt] = [asdict(p) for p in problems]
    errors = [p for probs in result["validation"].values() for p in probs if p["severity"] == "error"]
    if errors:
        raise ValueError("export failed validation: " + "; ".join(f"[{p['code']}] {p['message']}" for p in errors))
    result["warnings"] = sum(len(p) for p in result["validation"].values())
    return result
