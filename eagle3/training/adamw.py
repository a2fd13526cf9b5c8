"""torch.optim.AdamW's step as one compiled pass over each parameter, on AdamW's own state.

PyTorch's fused AdamW kernel moves its 28 B/param (read p, g, m, v; write p, m, v) at ~2.9 TB/s
on an H200 (4.1 ms of a 64 ms Llama-3.1-8B-draft step, 9.4 ms at Kimi-K2.5's width); the same
update written as tensor ops and compiled by inductor is one pointwise kernel per parameter. The
state stays torch's (`exp_avg`, `exp_avg_sq`, a float32 `step` tensor on the device, as the fused
optimizer keeps it), so checkpoints, resume and the LR scheduler see an ordinary AdamW.

Where the draft keeps a persistent compute-dtype copy of a parameter (`eagle3.draft.fused_layer.
shadow_of`), the same kernel also writes the updated parameter, cast, into that copy's rows: 2 B more
written per parameter instead of the next unroll's cast pass (read 4 B, write 2 B).

Risk: the math must stay torch's AdamW (decoupled weight decay, bias corrections after the step
increment, the clip coefficient dividing the gradient as fused AdamW's `grad_scale` does);
tests/eagle3/training/test_train.py compares it with torch's fused step.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from eagle3.draft.fused_layer import shadow_of, shadow_written


def _adamw_param(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor, lr: Tensor,
                 beta1: Tensor, beta2: Tensor, weight_decay: Tensor, eps: Tensor, clip: Tensor,
                 shadow: Tensor | None = None) -> None:
    """One AdamW update of one parameter in place; `step` (0-dim) is incremented first, as torch does.
    The hyperparameters are 0-dim float64 tensors (see `_group_hyperparameters`). `shadow` (the
    parameter's compute-dtype copy, if any) receives the updated parameter, cast."""
    step.add_(1)
    grad = grad / clip
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, (1 - beta1).to(exp_avg.dtype))  # lerp wants its weight in the input's dtype
    exp_avg_sq.mul_(beta2).add_((1 - beta2) * grad * grad)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step).sqrt()
    param.sub_(lr / bias_correction1 * exp_avg / (exp_avg_sq.sqrt() / bias_correction2_sqrt + eps))
    if shadow is not None:
        shadow.copy_(param)


_adamw_fn: Callable = _adamw_param
_enabled = False


def compile_adamw(**compile_kwargs) -> None:
    """From now on `clip_and_step` runs eligible AdamW steps through the compiled update."""
    global _adamw_fn, _enabled
    _adamw_fn = torch.compile(_adamw_param, dynamic=True, **compile_kwargs)
    _enabled = True


def uncompile_adamw() -> None:
    global _adamw_fn, _enabled
    _adamw_fn, _enabled = _adamw_param, False


# optimizer -> {(group index, device): the group's hyperparameters as 0-dim float64 device tensors}
_hyperparameter_tensors: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _hyperparameter_values(group: dict) -> tuple[float, ...]:
    """lr, beta1, beta2, weight_decay, eps: the order `_adamw_param` takes them in."""
    beta1, beta2 = group["betas"]
    return float(group["lr"]), float(beta1), float(beta2), float(group["weight_decay"]), float(group["eps"])


def _group_hyperparameters(optimizer: torch.optim.Optimizer, index: int, device: torch.device) -> tuple[Tensor, ...]:
    """The group's hyperparameters on `device` as 0-dim float64 tensors, refreshed from the group here
    unless a CUDA graph is being captured: a graph would freeze the values, so its replays read the
    tensors that `load_hyperparameters` refreshes before each.

    Tensors, not Python floats: with floats, inductor's cache handed a kernel compiled for one
    optimizer's values to another's (torch 2.11, same process or a later one on the same machine:
    betas (0.9, 0.999) and weight decay 0.01 after (0.9, 0.95) and 0.1 were 3.7e-4 off in 3 steps;
    tests/eagle3/training/test_train.py keeps it out). float64: `1 - beta2` and the bias corrections
    keep the precision they had as Python floats."""
    tensors = _hyperparameter_tensors.setdefault(optimizer, {})
    values = tensors.get((index, device))
    if values is None:
        values = tensors[(index, device)] = tuple(torch.empty((), dtype=torch.float64, device=device) for _ in range(5))
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _fill(values, _hyperparameter_values(optimizer.param_groups[index]))
    return values


def _fill(tensors: tuple[Tensor, ...], values: tuple[float, ...]) -> None:
    for tensor, value in zip(tensors, values):
        tensor.fill_(value)  # a fill kernel, not a host->device copy (no sync)


def load_hyperparameters(optimizer: torch.optim.Optimizer) -> None:
    """Write each group's current lr (and betas, weight decay, eps) into the tensors a captured
    `adamw_step` reads (before a replay)."""
    for (index, _), tensors in _hyperparameter_tensors.get(optimizer, {}).items():
        _fill(tensors, _hyperparameter_values(optimizer.param_groups[index]))


def eligible(optimizer: torch.optim.Optimizer) -> bool:
    """A plain fused AdamW on CUDA, after `compile_adamw()`: what `adamw_step` implements."""
    return _enabled and type(optimizer) is torch.optim.AdamW and all(
        g.get("fused") and not g.get("amsgrad") and not g.get("maximize") and not g.get("differentiable")
        for g in optimizer.param_groups)


@torch.no_grad()
def adamw_step(optimizer: torch.optim.AdamW, clip: Tensor) -> None:
    """One step of `optimizer` (torch AdamW) with every gradient divided by `clip` (0-dim tensor >= 1)."""
    for index, group in enumerate(optimizer.param_groups):
        hyperparameters = None
        for param in group["params"]:
            if param.grad is None:
                continue
            state = optimizer.state[param]
            if not state:  # as torch's fused AdamW initialises it
                state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if hyperparameters is None or hyperparameters[0].device != param.device:
                hyperparameters = _group_hyperparameters(optimizer, index, param.device)
            shadow = shadow_of(param)
            _adamw_fn(param, param.grad, state["exp_avg"], state["exp_avg_sq"], state["step"], *hyperparameters,
                      clip.to(param.device), shadow)
            if shadow is not None:
                shadow_written(param)
    optimizer._opt_called = True  # what torch's step wrapper records for the LR scheduler's order check
