"""Attention masks of the EAGLE-3 training-time test (TTT) and of draft decoding.

Owns the dense boolean reference of the TTT mask (paper Fig. 6; SpecForge
`generate_eagle3_mask`) and the causal mask used by `Eagle3DraftModel.decoder_step`.
The fast training path in `eagle3/draft/model.py` never builds these matrices; it computes the
same attention as causal flash attention plus analytic diagonal terms, and the tests check
it against `build_ttt_mask` here. Risk: an off-by-one in these masks trains a draft that
attends to keys it never sees at decode time, which only shows up as low acceptance.

Convention everywhere: `True` = the query may attend to the key.
"""

from __future__ import annotations

import torch
from torch import Tensor


def build_ttt_mask(seq_len: int, step: int, device: torch.device | str | None = None) -> Tensor:
    """Dense TTT mask for unroll step `step` (0-based).

    Keys are laid out step-major: `[keys of step 0 (T) | keys of step 1 (T) | ... | step k]`.
    Query i attends to the step-0 keys j <= i (causal over the context) and to its own
    position's key of each later step 1..k (a diagonal per block).

    Worked example, T=3, step=2 (columns: step-0 keys 0..2 | step-1 keys | step-2 keys):

        q0: 1 0 0 | 1 0 0 | 1 0 0
        q1: 1 1 0 | 0 1 0 | 0 1 0
        q2: 1 1 1 | 0 0 1 | 0 0 1

    Returns:
        bool [T, (step + 1) * T].
    """
    if seq_len < 1 or step < 0:
        raise ValueError(f"build_ttt_mask: need seq_len >= 1 and step >= 0, got {seq_len}, {step}")
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(seq_len, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * step, dim=1)


def build_ttt_attention_mask(
    seq_len: int, step: int, attention_mask: Tensor | None = None, device: torch.device | str | None = None
) -> Tensor:
    """TTT mask broadcast to SDPA's 4-D layout, with optional key padding.

    Args:
        attention_mask: [B, T] (1 = real token) or None. A padded key is masked in every block.

    Returns:
        bool [B or 1, 1, T, (step + 1) * T].
    """
    mask = build_ttt_mask(seq_len, step, device)[None, None]  # [1, 1, T, (k+1)T]
    if attention_mask is None:
        return mask
    keys_ok = attention_mask.to(device=mask.device, dtype=torch.bool).repeat(1, step + 1)  # [B, (k+1)T]
    return mask & keys_ok[:, None, None, :]


def build_causal_mask(
    query_len: int, past_len: int, device: torch.device | str | None = None
) -> Tensor:
    """Causal mask for `query_len` new tokens appended after `past_len` cached ones.

    New query i (absolute position past_len + i) attends to every cached key and to the new
    keys 0..i. Example, past_len=2, query_len=2:

        q0: 1 1 | 1 0
        q1: 1 1 | 1 1

    Returns:
        bool [1, 1, query_len, past_len + query_len].
    """
    new = torch.ones(query_len, query_len, dtype=torch.bool, device=device).tril()
    past = torch.ones(query_len, past_len, dtype=torch.bool, device=device)
    return torch.cat([past, new], dim=1)[None, None]
