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


def _teacher_chunk(logits: Tensor, t2d: Tensor, columns: Tensor, softcap: float | None):
    """Target logits [n, V] -> (draft-vocab softmax fp32 [n, Vd], its argmax [n], full argmax in vocab [n])."""
    if softcap:
        logits = torch.tanh(logits.float() / softcap) * softcap
    in_vocab = t2d[logits.argmax(-1)]
    draft_logits = logits.index_select(-1, columns).float()  # [n, Vd]
    return torch.softmax(draft_logits, dim=-1), draft_logits.argmax(-1), in_vocab


_teacher_chunk_fn: Callable = _teacher_chunk


@torch.no_grad()
def compute_teacher(
    last_hidden_states: Tensor, lm_head: Tensor, t2d: Tensor, chunk_tokens: int = 4096, softcap: float | None = None,
    columns: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Teacher soft labels over the draft vocabulary.

    Args:
        last_hidden_states: [B, T, H_t] target post-final-norm states.
        lm_head: [V, H_t] target output embedding (any float dtype; the matmul runs in it).
        t2d: bool [V]; True for the Vd target ids of the draft vocab.
        softcap: the target's `final_logit_softcapping` (logits = c * tanh(logits / c)), if any.
        columns: int64 [Vd] the ascending target ids where t2d is True (`Eagle3DraftModel.
            draft_vocab_columns`); None = computed here, which waits for the device (nonzero).
    Returns:
        target_p fp32 [B, T, Vd], target_ids int64 [B, T] (argmax in draft-vocab ids),
        in_vocab bool [B, T] (the full-vocab argmax is a draft-vocab token).
    """
    b, t, h = last_hidden_states.shape
    flat = last_hidden_states.reshape(b * t, h)
    columns = t2d.nonzero().squeeze(-1) if columns is None else columns
    probs, ids, in_vocab = [], [], []
    for start in range(0, b * t, chunk_tokens):
        logits = flat[start : start + chunk_tokens].to(lm_head.dtype) @ lm_head.T  # [n, V]
        p_c, ids_c, in_vocab_c = _teacher_chunk_fn(logits, t2d, columns, softcap)
        probs.append(p_c)
        ids.append(ids_c)
        in_vocab.append(in_vocab_c)
    return (
        torch.cat(probs).view(b, t, -1),
        torch.cat(ids).view(b, t),
        torch.cat(in_vocab).view(b, t),
    )


def _soft_ce_chunk(logits: Tensor, target_p: Tensor, target_ids: Tensor, valid: Tensor, scale: Tensor,
                   grad_out: Tensor | None = None):
    """logits [n, Vd] -> (ce_sum fp32, scale * d ce_sum / d logits in the logits' dtype, correct [n]).

    Softmax and the loss run in fp32 whatever the logits' dtype. With `grad_out` ([n, Vd], a slice of
    the buffer the head's weight-gradient GEMM reads) the gradient is written there (compiled, the
    kernel stores into it directly) and returned as that buffer."""
    logits32 = logits.float()
    logq = torch.log_softmax(logits32, dim=-1)
    validf = valid.float()
    ce_sum = -((target_p * logq).sum(-1) * validf).sum()
    # d/dz [-sum_v p_v log softmax(z)_v] = softmax(z) * sum(p) - p = softmax(z) - p
    grad = ((logq.exp() - target_p) * (validf * scale)[:, None]).to(logits.dtype)
    correct = (logits32.argmax(-1) == target_ids) & valid
    if grad_out is not None:
        grad_out.copy_(grad)
        grad = grad_out
    return ce_sum, grad, correct


def _scaled_cast(grad: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return (grad.float() * scale).to(dtype)


_chunk_fn: Callable = _soft_ce_chunk
_scaled_cast_fn: Callable = _scaled_cast
# Rows of logit gradients (all steps) gathered before one weight-gradient GEMM.
_GRAD_BUFFER_BYTES = 2 << 30


def compile_loss_chunk(**compile_kwargs) -> None:
    """Use torch.compile'd chunk kernels (fuse the fp32 softmax passes, and the teacher's
    argmax/column gather/softmax) from now on."""
    global _chunk_fn, _scaled_cast_fn, _teacher_chunk_fn
    _chunk_fn = torch.compile(_soft_ce_chunk, **compile_kwargs)
    _scaled_cast_fn = torch.compile(_scaled_cast, **compile_kwargs)
    _teacher_chunk_fn = torch.compile(_teacher_chunk, **compile_kwargs)


def uncompile_loss_chunk() -> None:
    global _chunk_fn, _scaled_cast_fn, _teacher_chunk_fn
    _chunk_fn, _scaled_cast_fn, _teacher_chunk_fn = _soft_ce_chunk, _scaled_cast, _teacher_chunk


def _run_steps(hiddens, weight, targets, scales, chunk_rows, need_grads):
    """Per-step CE sums [K], correct rows, per-step grad_h, grad_w (= sum_k scale_k g_k^T h_k).

    The logit gradients of all steps go into one buffer (`_GradRows`) that a single GEMM reads
    for the head's weight gradient."""
    w = weight.to(hiddens[0].dtype)  # one cast for all steps
    ce_sums, correct, grad_hs = [], [], []
    rows = _GradRows(sum(h.shape[0] for h in hiddens), w.shape[0], w.dtype, w.device) if need_grads else None
    for k, (hidden, (target_p, target_ids, valid)) in enumerate(zip(hiddens, targets)):
        grad_h = torch.empty_like(hidden) if need_grads else None
        ce_k = hidden.new_zeros((), dtype=torch.float32)
        for s in range(0, hidden.shape[0], chunk_rows):
            h_c = hidden[s : s + chunk_rows]
            ce, g, ok = _chunk_fn(h_c @ w.T, target_p[s : s + chunk_rows], target_ids[s : s + chunk_rows],
                                  valid[s : s + chunk_rows], scales[k],
                                  rows.take(h_c) if need_grads else None)
            ce_k = ce_k + ce
            correct.append(ok)
            if need_grads:
                torch.mm(g, w, out=grad_h[s : s + chunk_rows])
        ce_sums.append(ce_k)
        grad_hs.append(grad_h)
    return torch.stack(ce_sums), torch.cat(correct), grad_hs, rows.weight_grad() if need_grads else None


class _GradRows:
    """Logit-gradient rows of every step, gathered for one weight-gradient GEMM: cat(g)^T cat(h).

    `take(h)` hands out the next [n, Vd] slice of a buffer of at most `_GRAD_BUFFER_BYTES`
    (the chunk kernel writes its gradient there, no copy) and remembers h; a full buffer is
    flushed into the fp32 sum first."""

    def __init__(self, total_rows: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        capacity = max(1, min(total_rows, _GRAD_BUFFER_BYTES // (width * dtype.itemsize)))
        self.buffer = torch.empty(capacity, width, dtype=dtype, device=device)
        self.filled, self.hiddens, self.grad_w = 0, [], None

    def take(self, h: Tensor) -> Tensor:
        n = h.shape[0]
        if self.filled + n > self.buffer.shape[0]:
            self._flush()
        if n > self.buffer.shape[0]:  # a chunk wider than the whole budget gets its own buffer
            self.buffer = torch.empty(n, self.buffer.shape[1], dtype=self.buffer.dtype, device=self.buffer.device)
        view = self.buffer[self.filled : self.filled + n]
        self.filled += n
        self.hiddens.append(h)
        return view

    def _flush(self) -> None:
        if not self.filled:
            return
        h = self.hiddens[0] if len(self.hiddens) == 1 else torch.cat(self.hiddens)
        product = self.buffer[: self.filled].T @ h  # [Vd, H]
        self.grad_w = product if self.grad_w is None else self.grad_w.float().add_(product)
        self.filled, self.hiddens = 0, []

    def weight_grad(self) -> Tensor:
        self._flush()
        return self.grad_w


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
