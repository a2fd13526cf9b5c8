"""Teacher distribution and the soft-label loss of EAGLE-3 training.

Owns (reference eagle3-training.md §b.4):
- `compute_teacher`: target logits = last_hidden_states @ lm_head.T, computed in token
  chunks so the [T, V_target] logits never sit in memory at once; returns the fp32 softmax
  over the draft-vocab columns (`logits[..., t2d]`), its argmax, and whether the FULL-vocab
  argmax lies inside the draft vocab (positions where it does not are left out of the loss);
- `soft_cross_entropy`: -sum_v p_v log softmax(h W^T)_v over valid rows, computed in row
  chunks, with the gradient produced during the forward pass (the loss is terminal), so
  neither the draft logits nor their fp32 softmax are kept for backward.

Risk: the soft label is the target's distribution, not the dataset token; feeding
hard labels here still trains, but to a different objective.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


@torch.no_grad()
def compute_teacher(
    last_hidden_states: Tensor, lm_head: Tensor, t2d: Tensor, chunk_tokens: int = 4096, softcap: float | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Teacher soft labels over the draft vocabulary.

    Args:
        last_hidden_states: [B, T, H_t] target post-final-norm states.
        lm_head: [V, H_t] target output embedding (any float dtype; the matmul runs in it).
        t2d: bool [V]; True for the Vd target ids of the draft vocab.
        softcap: the target's `final_logit_softcapping` (logits = c * tanh(logits / c)), if any.
    Returns:
        target_p fp32 [B, T, Vd], target_ids int64 [B, T] (argmax in draft-vocab ids),
        in_vocab bool [B, T] (the full-vocab argmax is a draft-vocab token).
    """
    b, t, h = last_hidden_states.shape
    flat = last_hidden_states.reshape(b * t, h)
    columns = t2d.nonzero().squeeze(-1)
    probs, ids, in_vocab = [], [], []
    for start in range(0, b * t, chunk_tokens):
        logits = flat[start : start + chunk_tokens].to(lm_head.dtype) @ lm_head.T  # [n, V]
        if softcap:
            logits = torch.tanh(logits.float() / softcap) * softcap
        in_vocab.append(t2d[logits.argmax(-1)])
        draft_logits = logits.index_select(-1, columns).float()  # [n, Vd]
        probs.append(torch.softmax(draft_logits, dim=-1))
        ids.append(draft_logits.argmax(-1))
    return (
        torch.cat(probs).view(b, t, -1),
        torch.cat(ids).view(b, t),
        torch.cat(in_vocab).view(b, t),
    )


def _soft_ce_chunk(logits: Tensor, target_p: Tensor, target_ids: Tensor, valid: Tensor, scale: Tensor):
    """logits [n, Vd] -> (ce_sum fp32, scale * d ce_sum / d logits in the logits' dtype, correct [n]).

    Softmax and the loss run in fp32 whatever the logits' dtype."""
    logits32 = logits.float()
    logq = torch.log_softmax(logits32, dim=-1)
    validf = valid.float()
    ce_sum = -((target_p * logq).sum(-1) * validf).sum()
    # d/dz [-sum_v p_v log softmax(z)_v] = softmax(z) * sum(p) - p = softmax(z) - p
    grad = ((logq.exp() - target_p) * (validf * scale)[:, None]).to(logits.dtype)
    correct = (logits32.argmax(-1) == target_ids) & valid
    return ce_sum, grad, correct


def _scaled_cast(grad: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return (grad.float() * scale).to(dtype)


_chunk_fn: Callable = _soft_ce_chunk
_scaled_cast_fn: Callable = _scaled_cast
# Rows of logit gradients (all steps) gathered before one weight-gradient GEMM.
_GRAD_BUFFER_BYTES = 2 << 30


def compile_loss_chunk(**compile_kwargs) -> None:
    """Use torch.compile'd chunk kernels (fuse the fp32 softmax passes) from now on."""
    global _chunk_fn, _scaled_cast_fn
    _chunk_fn = torch.compile(_soft_ce_chunk, **compile_kwargs)
    _scaled_cast_fn = torch.compile(_scaled_cast, **compile_kwargs)


def _run_steps(hiddens, weight, targets, scales, chunk_rows, need_grads):
    """Per-step CE sums [K], correct rows, per-step grad_h, grad_w (= sum_k scale_k g_k^T h_k)."""
    w = weight.to(hiddens[0].dtype)  # one cast for all steps
    ce_sums, correct, grad_hs = [], [], []
    grad_w, pending_g, pending_h, pending_bytes = None, [], [], 0
    for k, (hidden, (target_p, target_ids, valid)) in enumerate(zip(hiddens, targets)):
        grad_h = torch.empty_like(hidden) if need_grads else None
        ce_k = hidden.new_zeros((), dtype=torch.float32)
        for s in range(0, hidden.shape[0], chunk_rows):
            h_c = hidden[s : s + chunk_rows]
            ce, g, ok = _chunk_fn(h_c @ w.T, target_p[s : s + chunk_rows], target_ids[s : s + chunk_rows],
                                  valid[s : s + chunk_rows], scales[k])
            ce_k = ce_k + ce
            correct.append(ok)
            if need_grads:
                grad_h[s : s + chunk_rows] = g @ w
                pending_g.append(g)
                pending_h.append(h_c)
                pending_bytes += g.numel() * g.element_size()
                if pending_bytes >= _GRAD_BUFFER_BYTES:
                    grad_w = _flush_weight_grad(grad_w, pending_g, pending_h)
                    pending_bytes = 0
        ce_sums.append(ce_k)
        grad_hs.append(grad_h)
    if need_grads and pending_g:
        grad_w = _flush_weight_grad(grad_w, pending_g, pending_h)
    return torch.stack(ce_sums), torch.cat(correct), grad_hs, grad_w


def _flush_weight_grad(grad_w, pending_g, pending_h):
    """One GEMM over every gathered row: cat(g)^T cat(h) [Vd, H]; fp32 sum across flushes."""
    g = pending_g[0] if len(pending_g) == 1 else torch.cat(pending_g)
    h = pending_h[0] if len(pending_h) == 1 else torch.cat(pending_h)
    pending_g.clear()
    pending_h.clear()
    product = g.T @ h
    return product if grad_w is None else grad_w.float().add_(product)


class _SoftCrossEntropySteps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, scales, spec, *hiddens):
        targets, chunk_rows = spec
        ce, correct, grad_hs, grad_w = _run_steps(hiddens, weight, targets, scales, chunk_rows, True)
        ctx.save_for_backward(grad_w, *grad_hs)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(ce, correct)
        return (ce * scales).sum(), ce, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_correct):
        grad_w, *grad_hs = ctx.saved_tensors
        grad_hs = [g * grad_loss.to(g.dtype) for g in grad_hs]
        return (_scaled_cast_fn(grad_w, grad_loss, ctx.weight_dtype), None, None, *grad_hs)


def soft_cross_entropy_steps(
    hiddens: list[Tensor],
    weight: Tensor,
    targets: list[tuple[Tensor, Tensor, Tensor]],
    scales: Tensor,
    chunk_rows: int = 4096,
) -> tuple[Tensor, Tensor, Tensor]:
    """Soft-label cross-entropy of a linear head for several TTT steps at once.

    The logit gradients are produced during the forward pass (the loss is terminal), so no
    logits or fp32 softmax are kept for backward, the head weight is cast once, and its
    gradient is one GEMM over all steps' rows instead of a sum of per-step products.

    Args:
        hiddens: per step [N_k, H] normed draft hidden states; weight: [Vd, H] draft lm_head.
        targets: per step (target_p fp32 [N_k, Vd], target_ids [N_k] teacher argmax in draft
            ids, valid bool [N_k] rows that count).
        scales: fp32 [K] weight of each step's CE sum in the loss (no gradient).
    Returns:
        loss = sum_k scales[k] * ce[k] (differentiable), ce fp32 [K] (sum over valid rows of
        -sum_v p log q), correct bool [sum N_k] (draft argmax == teacher argmax on valid rows).
    """
    scales = scales.detach().float()
    if torch.is_grad_enabled() and (weight.requires_grad or any(h.requires_grad for h in hiddens)):
        return _SoftCrossEntropySteps.apply(weight, scales, (targets, chunk_rows), *hiddens)
    ce, correct, _, _ = _run_steps(hiddens, weight, targets, scales, chunk_rows, False)
    return (ce * scales).sum(), ce, correct


def soft_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target_p: Tensor,
    target_ids: Tensor,
    valid: Tensor,
    chunk_rows: int = 4096,
) -> tuple[Tensor, Tensor]:
    """One-step form of `soft_cross_entropy_steps`.

    Args:
        hidden: [N, H] normed draft hidden states; weight: [Vd, H] draft lm_head.
        target_p: fp32 [N, Vd] teacher probabilities; target_ids: [N] teacher argmax (draft ids).
        valid: bool [N] rows that count (loss mask and teacher argmax inside the draft vocab).
    Returns:
        (sum over valid rows of -sum_v p log q  [scalar fp32, differentiable],
         correct bool [N]: draft argmax == teacher argmax on valid rows).
    """
    one = torch.ones(1, device=hidden.device)
    loss, _, correct = soft_cross_entropy_steps([hidden], weight, [(target_p, target_ids, valid)], one, chunk_rows)
    return loss, correct


def soft_cross_entropy_reference(
    logits: Tensor, target_p: Tensor, valid: Tensor
) -> Tensor:
    """Unfused form (SpecForge `-sum(p * log_softmax(logits))` restricted to valid rows), for tests."""
    return -((target_p * torch.log_softmax(logits.float(), dim=-1)).sum(-1) * valid.float()).sum()
