"""Teacher distribution and the soft-label loss of EAGLE-3 training.

Owns (reference eagle3-training.md §b.4):
- `compute_teacher`: target logits = last_hidden_states @ lm_head.T, computed in token
  chunks so the [T, V_target] logits never sit in memory at once; returns the fp32 softmax
  over the draft-vocab columns (`logits[..., t2d]`), its argmax, and whether the FULL-vocab
  argmax lies inside the draft vocab (positions where it does not are left out of the loss);
- `soft_cross_entropy`: -sum_v p_v log softmax(h W^T)_v over valid rows, computed in row
  chunks, with the gradient produced during the forward pass (the loss is terminal), so
  neither the draft logits nor their fp32 softmax are kept for backward;
- `soft_cross_entropy_unroll`, what training runs: the same loss for every TTT step at once, the
  steps' logits laid out by the teacher row they learn ([rows, K, Vd]) so one kernel reads each
  fp32 teacher row once for all K steps (K reads before: 1.8 GB of a Llama-3.1-8B step's traffic);
  the loss kernel went from 2.02 to 1.67 ms per step there.

Risk: the soft label is the target's distribution, not the dataset token; feeding
hard labels here still trains, but to a different objective.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from eagle3.draft.fused_layer import compute_copy
from eagle3.draft.held_grads import active_hold


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
    global _chunk_fn, _scaled_cast_fn, _teacher_chunk_fn, _rows_fn
    _chunk_fn = torch.compile(_soft_ce_chunk, **compile_kwargs)
    _scaled_cast_fn = torch.compile(_scaled_cast, **compile_kwargs)
    _teacher_chunk_fn = torch.compile(_teacher_chunk, **compile_kwargs)
    _rows_fn = torch.compile(_soft_ce_rows, **compile_kwargs)


def uncompile_loss_chunk() -> None:
    global _chunk_fn, _scaled_cast_fn, _teacher_chunk_fn, _rows_fn
    _chunk_fn, _scaled_cast_fn, _teacher_chunk_fn = _soft_ce_chunk, _scaled_cast, _teacher_chunk
    _rows_fn = _soft_ce_rows_eager


def _run_steps(hiddens, weight, targets, scales, chunk_rows, need_grads):
    """Per-step CE sums [K], correct rows, per-step grad_h, grad_w (= sum_k scale_k g_k^T h_k).

    The logit gradients of all steps go into one buffer (`_GradRows`) that a single GEMM reads
    for the head's weight gradient."""
    w = compute_copy([weight], hiddens[0].dtype)  # one cast for all steps (none if the optimizer wrote it)
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


def _accumulator(grad_w: Tensor) -> Tensor:
    """A sum of weight-gradient products in at least fp32 (bf16 products summed in fp32; fp64 stays)."""
    return grad_w.to(torch.promote_types(grad_w.dtype, torch.float32))


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
        self.grad_w = product if self.grad_w is None else _accumulator(self.grad_w).add_(product)
        self.filled, self.hiddens = 0, []

    def weight_grad(self) -> Tensor:
        self._flush()
        return self.grad_w


def _weight_grad(ctx, grad_w: Tensor, grad_loss: Tensor) -> Tensor | None:
    """The head weight's gradient grad_loss x grad_w for autograd, cast to the weight's dtype; None where
    the hold active at the forward (eagle3.draft.held_grads) keeps it, scaled, in the compute dtype."""
    if ctx.hold is not None and ctx.hold.offer(ctx.weight, grad_w, grad_loss.float()):
        return None
    return _scaled_cast_fn(grad_w, grad_loss, ctx.weight.dtype)


class _SoftCrossEntropySteps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, scales, spec, *hiddens):
        targets, chunk_rows = spec
        ce, correct, grad_hs, grad_w = _run_steps(hiddens, weight, targets, scales, chunk_rows, True)
        ctx.save_for_backward(grad_w, *grad_hs)
        ctx.weight, ctx.hold = weight, active_hold()
        ctx.mark_non_differentiable(ce, correct)
        return (ce * scales).sum(), ce, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_correct):
        grad_w, *grad_hs = ctx.saved_tensors
        grad_hs = [g * grad_loss.to(g.dtype) for g in grad_hs]
        return (_weight_grad(ctx, grad_w, grad_loss), None, None, *grad_hs)


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


def _soft_ce_rows(logits: Tensor, target_p: Tensor, target_ids: Tensor, valid: Tensor, scale: Tensor):
    """The loss of every TTT step at once on shared teacher rows.

    logits [N, K, Vd]: step k's draft logits at teacher row n (overwritten with scale * d ce / d logits,
    in the logits' dtype); target_p fp32 [N, 1, Vd]; target_ids [N, 1]; valid bool [N, K]; scale fp32
    [N, K]. Returns (ce fp32 [N, K], 0 where not valid; correct bool [N, K]). Compiled, the K rows of one
    teacher row are neighbouring programs of one kernel, so the teacher's row is read from memory once
    for all K steps instead of once per step."""
    logits32 = logits.float()
    logq = torch.log_softmax(logits32, dim=-1)
    validf = valid.float()
    ce = -(target_p * logq).sum(-1) * validf
    grad = (logq.exp() - target_p) * (validf * scale)[..., None]  # softmax(z) - p, as in _soft_ce_chunk
    correct = (logits32.argmax(-1) == target_ids) & valid
    logits.copy_(grad.to(logits.dtype))
    return ce, correct


def _soft_ce_rows_in_place(logits: Tensor, target_p: Tensor, target_ids: Tensor, valid: Tensor, scale: Tensor):
    """`_soft_ce_rows` for fp32 logits, eager: the same ops on the same values in the same order (results
    bit-identical), but the ce product and the gradient are written into `logits` itself, leaving one
    [N, K, Vd] temporary (logq) instead of six. On CPU each temporary of that size (29 MB at the demo's
    8 x 256 teacher rows x 7 steps x 512) is a fresh mmap the kernel zero-fills page by page: the
    temporaries cost more than the math (91 -> 48 ms a call at 1 thread, tests/benchmarks/NOTES_demo.md)."""
    correct = (logits.argmax(-1) == target_ids) & valid  # before the logits are overwritten
    logq = torch.log_softmax(logits, dim=-1)
    validf = valid.float()
    ce = -torch.mul(target_p, logq, out=logits).sum(-1) * validf
    torch.exp(logq, out=logits).sub_(target_p).mul_((validf * scale)[..., None])  # softmax(z) - p, scaled
    return ce, correct


def _soft_ce_rows_eager(logits: Tensor, target_p: Tensor, target_ids: Tensor, valid: Tensor, scale: Tensor):
    """Uncompiled `_soft_ce_rows`: in place where that gives the same bits (fp32 logits), else as written."""
    fn = _soft_ce_rows_in_place if logits.dtype == torch.float32 else _soft_ce_rows
    return fn(logits, target_p, target_ids, valid, scale)


_rows_fn: Callable = _soft_ce_rows_eager


def _unroll_chunks(b: int, t: int, rows: int):
    """(b0, b1, r0, r1) teacher-row blocks of at most `rows` rows: whole sequences when one fits, else
    row ranges of one sequence."""
    if rows >= t:
        for b0 in range(0, b, rows // t):
            yield b0, min(b, b0 + rows // t), 0, t
        return
    for i in range(b):
        for r0 in range(0, t, rows):
            yield i, i + 1, r0, min(t, r0 + rows)


# CPU scratch buffers of `_run_unroll` by name, kept between calls (see `_workspace`)
_cpu_workspaces: dict[str, Tensor] = {}


def _workspace(name: str, numel: int, like: Tensor) -> Tensor:
    """An uninitialised [numel] buffer in `like`'s dtype and device. On CPU it is kept and reused: a fresh
    tensor of the unroll's size is a new mmap whose pages the kernel zero-fills on first touch, every
    step (CUDA's caching allocator already reuses its blocks). Only for scratch that dies with the call."""
    if like.device.type != "cpu":
        return torch.empty(numel, dtype=like.dtype, device=like.device)
    buffer = _cpu_workspaces.get(name)
    if buffer is None or buffer.dtype != like.dtype or buffer.numel() < numel:
        buffer = _cpu_workspaces[name] = torch.empty(numel, dtype=like.dtype)
    return buffer[:numel]


def _run_unroll(normed, weight, teacher, scales, need_grads):
    """Per-(step, sequence) CE sums [K, B], correct rows per step [K], grad of each normed [B, T, H],
    grad_w; see `soft_cross_entropy_unroll`.

    Alignment: step k (s = k + 1) reads teacher row r at query r - s, so teacher row r of sequence b
    holds the logits of steps 0..min(K, r) - 1; rows r < s of step k are padding (zero logits, not
    valid). Worked example, T = 4, K = 2: teacher row 1 = step 0's query 0; row 3 = step 0's query 2
    and step 1's query 1; step 1 has no row 1 (padding)."""
    target_p, target_ids, counted = teacher
    k_steps, (b, t, h) = len(normed), normed[0].shape
    w = compute_copy([weight], normed[0].dtype)  # none cast if the optimizer wrote it (fused_layer.py)
    vd = w.shape[0]
    rows = max(1, _GRAD_BUFFER_BYTES // (k_steps * vd * w.element_size()))  # teacher rows per block
    logits_buf = _workspace("logits", min(rows, b * t) * k_steps * vd, w)
    hidden_buf = _workspace("hidden", min(rows, b * t) * k_steps * h, w) if need_grads else None
    shifts = torch.arange(1, k_steps + 1, device=w.device)
    ce_sum = torch.zeros(k_steps, b, dtype=torch.float32, device=w.device)
    correct = torch.zeros(k_steps, dtype=torch.long, device=w.device)
    grads = [torch.empty_like(x) for x in normed] if need_grads else None
    grad_w = None
    for b0, b1, r0, r1 in _unroll_chunks(b, t, rows):
        g, n = b1 - b0, r1 - r0
        logits = logits_buf[: g * n * k_steps * vd].view(g, n, k_steps, vd)  # [g, R, K, Vd]
        hc = hidden_buf[: g * n * k_steps * h].view(g, n, k_steps, h) if need_grads else None
        spans = _fill_unroll_logits(normed, w, logits, hc, b0, r0, r1)
        valid = counted[b0:b1, r0:r1, None] & (torch.arange(r0, r1, device=w.device)[:, None] >= shifts)  # [g, R, K]
        scale = scales.view(k_steps, b)[:, b0:b1].T[:, None, :].expand(g, n, k_steps)
        ce, ok = _rows_fn(logits.view(g * n, k_steps, vd), target_p[b0:b1, r0:r1].reshape(g * n, 1, vd),
                          target_ids[b0:b1, r0:r1].reshape(g * n, 1), valid.reshape(g * n, k_steps),
                          scale.reshape(g * n, k_steps))
        ce_sum[:, b0:b1] += ce.view(g, n, k_steps).sum(1).T
        correct += ok.sum(0)
        if need_grads:
            for j, k, lo, q0, q1 in spans:  # d loss / d normed rows = d loss / d logits @ W
                torch.mm(logits[j, lo:, k], w, out=grads[k][b0 + j, q0:q1])
            product = logits.view(-1, vd).T @ hc.view(-1, h)  # [Vd, H]: every step's rows in one GEMM
            grad_w = product if grad_w is None else _accumulator(grad_w).add_(product)
    if need_grads:
        for k, grad in enumerate(grads):
            grad[:, t - k - 1 :].zero_()  # queries without a teacher row
    return ce_sum, correct, grads, grad_w


def _fill_unroll_logits(normed, w, logits, hc, b0, r0, r1):
    """logits[j, r - r0, k] = normed[k][b0 + j, r - k - 1] @ w.T (and hc the same rows of normed) for the
    teacher rows r0 <= r < r1 that step k has; padding rows zero. Returns the spans (j, k, lo, q0, q1):
    rows lo.. of block j, step k hold queries q0..q1 - 1."""
    spans = []
    g, n, k_steps, _ = logits.shape
    for j in range(g):
        for k in range(k_steps):
            lo = min(max(0, k + 1 - r0), n)  # first row of this block that step k has
            if lo:
                logits[j, :lo, k].zero_()
                if hc is not None:
                    hc[j, :lo, k].zero_()
            if lo == n:
                continue
            q0, q1 = r0 + lo - k - 1, r1 - k - 1
            rows = normed[k][b0 + j, q0:q1]  # [R - lo, H]
            torch.mm(rows, w.T, out=logits[j, lo:, k])
            if hc is not None:
                hc[j, lo:, k].copy_(rows)
            spans.append((j, k, lo, q0, q1))
    return spans


class _SoftCrossEntropyUnroll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, scales, teacher, *normed):
        ce, correct, grads, grad_w = _run_unroll(normed, weight, teacher, scales, True)
        ctx.save_for_backward(grad_w, *grads)
        ctx.weight, ctx.hold = weight, active_hold()
        ctx.mark_non_differentiable(ce, correct)
        return (ce.flatten() * scales).sum(), ce, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_correct):
        grad_w, *grads = ctx.saved_tensors
        grads = [g * grad_loss.to(g.dtype) for g in grads]
        return (_weight_grad(ctx, grad_w, grad_loss), None, None, *grads)


def soft_cross_entropy_unroll(
    normed: list[Tensor],
    weight: Tensor,
    target_p: Tensor,
    target_ids: Tensor,
    counted: Tensor,
    scales: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Soft-label cross-entropy of the draft head for every step of one TTT unroll, on the teacher rows
    the steps share (`soft_cross_entropy_steps` for this layout, one loss kernel per teacher block).

    Args:
        normed: per step k [B, T, H] normed draft hidden states; query t of step k learns teacher row
            t + k + 1 (queries without one are ignored and get zero gradient).
        weight: [Vd, H] draft lm_head. target_p fp32 [B, T, Vd], target_ids [B, T] (teacher argmax in
            draft ids), counted bool [B, T]: teacher rows in the loss (loss mask and in-vocab argmax).
        scales: fp32 [K * B] weight of block (k, b) = scales[k * B + b] in the loss (no gradient).
    Returns:
        loss = sum_(k,b) scales * ce (differentiable), ce fp32 [K, B] (CE sums over counted rows), correct
        [K] (rows where the draft argmax equals the teacher argmax, counted rows only).
    """
    scales = scales.detach().float()
    teacher = (target_p, target_ids, counted)
    if torch.is_grad_enabled() and (weight.requires_grad or any(x.requires_grad for x in normed)):
        return _SoftCrossEntropyUnroll.apply(weight, scales, teacher, *normed)
    ce, correct, _, _ = _run_unroll(normed, weight, teacher, scales, False)
    return (ce.flatten() * scales).sum(), ce, correct


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
