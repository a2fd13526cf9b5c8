"""Multi-latent attention (DeepSeek-V2 MLA) for the EAGLE-3 draft layer, as SGLang's Kimi-K2.x draft serves it.

Owns the MLA projections of `Eagle3DeepseekV2ForCausalLM`'s `midlayer.self_attn` (sgl-project/sglang
`python/sglang/srt/models/kimi_k25_eagle3.py`, attention from `deepseek_v2.py: DeepseekV2AttentionMLA`),
computed in the expanded ("MHA") form that training needs:

    a = [q_a_proj; kv_a_proj_with_mqa](x)                  # x [B, T, 2H] -> [B, T, r_q + r_kv + d_r]
    q = q_b_proj(q_a_layernorm(a[:r_q]))                   # [B, T, nh (d_n + d_r)]
    kv = kv_b_proj(kv_a_layernorm(a[r_q:r_q + r_kv]))      # [B, T, nh (d_n + d_v)]
    k_pe = a[r_q + r_kv:]                                  # [B, T, d_r], one rope key shared by all heads
    q_pe, k_pe = rope(q_pe), rope(k_pe)                    # interleaved (GPT-J) pairs, SGLang's default
    k = [k_nope, k_pe]; softmax scale = (d_n + d_r)^-0.5 * mscale^2 (DeepSeek YaRN)

SGLang serves the same function in the absorbed form (w_kc/w_vc folded into q and the output); the two
are equal up to rounding. To reuse the TTT attention unchanged (one head dim for q, k and v), v
[B, nh, T, d_v] is zero-padded to d_n + d_r and the padding is sliced off after the attention; the
YaRN attention factor is folded into q, since the TTT attention scales by q's head dim.

Risk: the checkpoint names ARE the format (`q_a_proj`, `q_a_layernorm`, `q_b_proj`,
`kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`); SGLang's loader fuses `q_a_proj` with
`kv_a_proj_with_mqa` by name and warns-and-skips any name it does not know.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude factor: 0.1 * mscale * ln(scale) + 1 for scale > 1, else 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, theta: float, scaling: dict) -> Tensor:
    """DeepSeek-YaRN inverse frequencies [dim/2] (fp64): interpolated below the correction range, extrapolated
    above it, linearly blended inside (sglang `DeepseekScalingRotaryEmbedding._compute_inv_freq`)."""
    factor = float(scaling["factor"])
    original = scaling.get("original_max_position_embeddings", 4096)
    beta_fast, beta_slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolated = (1 - ramp) * scaling.get("extrapolation_factor", 1.0)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


def yarn_factors(scaling: dict | None) -> tuple[float, float]:
    """(cos/sin magnitude, softmax-scale multiplier) of a DeepSeek-YaRN scaling dict; (1, 1) without one."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) not in ("yarn", "deepseek_yarn"):
        return 1.0, 1.0
    factor = float(scaling["factor"])
    magnitude = (yarn_mscale(factor, float(scaling.get("mscale", 1)))
                 / yarn_mscale(factor, float(scaling.get("mscale_all_dim", 0))) * scaling.get("attn_factor", 1.0))
    softmax = yarn_mscale(factor, float(scaling.get("mscale_all_dim", 0) or 0)) ** 2
    return magnitude, softmax


def apply_rotary_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, h, T, d]; cos/sin [B, T, d] in the rotate-half layout ([f, f]); rotates the pairs (x0, x1), (x2, x3), ...
    by frequency 0, 1, ... (GPT-J style: SGLang's MLA rope with is_neox_style False)."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :, :half].to(x.dtype), sin[:, None, :, :half].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)


class MLARMSNorm(nn.Module):
    """RMSNorm over the latent width (fp32 statistics, as eagle3.draft.model.RMSNorm)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


class MLAAttention(nn.Module):
    """The draft's MLA projections; `project` returns q/k/v in the TTT attention's layout (v zero-padded)."""

    def __init__(self, config) -> None:
        super().__init__()
        h, nh = config.hidden_size, config.num_attention_heads
        self.num_heads = nh
        self.r_q, self.r_kv = config.q_lora_rank, config.kv_lora_rank
        self.d_nope, self.d_rope, self.d_v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.head_dim, self.value_dim = self.d_nope + self.d_rope, self.d_v
        self.q_a_proj = nn.Linear(2 * h, self.r_q, bias=False)
        self.q_a_layernorm = MLARMSNorm(self.r_q, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(self.r_q, nh * self.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * h, self.r_kv + self.d_rope, bias=False)
        self.kv_a_layernorm = MLARMSNorm(self.r_kv, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.r_kv, nh * (self.d_nope + self.d_v), bias=False)
        self.o_proj = nn.Linear(nh * self.d_v, h, bias=False)
        self.q_scale = yarn_factors(config.rope_scaling)[1]  # the scores' mscale^2, applied to q (scores are linear in q)

    def latents(self, a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """a [B, T, r_q + r_kv + d_r] -> normed q latent [B, T, r_q], normed kv latent [B, T, r_kv], k_pe [B, T, d_r]."""
        q_lat, kv_lat, k_pe = a.split([self.r_q, self.r_kv, self.d_rope], dim=-1)
        return self.q_a_layernorm(q_lat), self.kv_a_layernorm(kv_lat), k_pe

    def heads(self, q: Tensor, kv: Tensor, k_pe: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, T, nh (d_n + d_r)], kv [B, T, nh (d_n + d_v)], k_pe [B, T, d_r] ->
        q, k [B, nh, T, d_n + d_r] (rope on the last d_r, q scaled by the YaRN factor), v [B, nh, T, d_n + d_r] (padded)."""
        b, t, _ = q.shape
        nh = self.num_heads
        q = q.view(b, t, nh, self.head_dim).transpose(1, 2)
        q_nope, q_pe = q.split([self.d_nope, self.d_rope], dim=-1)
        kv = kv.view(b, t, nh, self.d_nope + self.d_v).transpose(1, 2)
        k_nope, v = kv.split([self.d_nope, self.d_v], dim=-1)
        k_pe = apply_rotary_interleaved(k_pe[:, None], cos, sin).expand(b, nh, t, self.d_rope)
        q = torch.cat([q_nope, apply_rotary_interleaved(q_pe, cos, sin)], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k = torch.cat([k_nope, k_pe], dim=-1)
        return q, k, F.pad(v, (0, self.head_dim - self.d_v))

    def project(self, x: Tensor, cos: Tensor, sin: Tensor, weights: dict | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, 2H] -> q, k, v [B, nh, T, d_n + d_r] (see `heads`); `weights`: cast copies by checkpoint name."""
        def w(name: str, module: nn.Linear) -> Tensor:
            return module.weight if weights is None else weights.get(f"midlayer.self_attn.{name}.weight", module.weight)

        a = torch.cat([F.linear(x, w("q_a_proj", self.q_a_proj)),
                       F.linear(x, w("kv_a_proj_with_mqa", self.kv_a_proj_with_mqa))], dim=-1)
        q_lat, kv_lat, k_pe = self.latents(a)
        return self.heads(F.linear(q_lat, w("q_b_proj", self.q_b_proj)), F.linear(kv_lat, w("kv_b_proj", self.kv_b_proj)),
                          k_pe, cos, sin)

    def weight_groups(self) -> dict[str, list[Tensor]]:
        """The weights as the fused unroll groups them (eagle3.draft.fused_layer): q_a and kv_a read the same x."""
        return {"qkv_a": [self.q_a_proj.weight, self.kv_a_proj_with_mqa.weight], "q_b": [self.q_b_proj.weight],
                "kv_b": [self.kv_b_proj.weight], "o": [self.o_proj.weight]}

    def output(self, attn: Tensor) -> Tensor:
        """attn [B, nh, T, d_n + d_r] (padded v) -> [B, T, nh d_v], o_proj's input."""
        b, _, t, _ = attn.shape
        return attn[..., : self.d_v].transpose(1, 2).reshape(b, t, -1)
