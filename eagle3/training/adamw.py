"""torch.optim.AdamW's step as one compiled pass over each parameter, on AdamW's own state.

PyTorch's fused AdamW kernel moves its 28 B/param (read p, g, m, v; write p, m, v) at ~2.9 TB/s
on an H200 (4.1 ms of a 64 ms Llama-3.1-8B-draft step, 9.4 ms at Kimi-K2.5's width); the same
update written as tensor ops and compiled by inductor is one pointwise kernel per parameter. The
state stays torch's (`exp_avg`, `exp_avg_sq`, a float32 `step` tensor on the device, as the fused
optimizer keeps it), so checkpoints, resume and the LR scheduler see an ordinary AdamW.

Where the draft keeps a persistent compute-dtype copy of a parameter (`eagle3.draft.fused_layer.
shadow_of`), the same kernel also writes the updated parameter, cast, into that copy's rows: 2 B more
written per parameter instead of the next unroll's cast pass (read 4 B, write 2 B).

Inside a step that holds gradients (`eagle3.draft.held_grads`), a fused weight's gradient never
becomes an fp32 `.grad`: the kernel reads the held bf16 sum as it is (2 B instead of an upcast pass
writing 4 B and the update reading them), divided by the clip coefficient over the hold's scale.

Risk: the math must stay torch's AdamW (decoupled weight decay, bias corrections after the step
increment, the clip coefficient dividing the gradient as fused AdamW's `grad_scale` does);
tests/eagle3/training/test_train.py compares it with torch's fused step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from eagle3.draft.fused_layer import shadow_of, shadow_written
from eagle3.draft.held_grads import GradientHold


def _adamw_param(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor, lr: Tensor,
                 decay: Tensor, one_minus_beta1: Tensor, beta2: Tensor, one_minus_beta2: Tensor, log_beta1: Tensor,
                 log_beta2: Tensor, eps: Tensor, clip: Tensor, shadow: Tensor | None = None) -> None:
    """One AdamW update of one parameter in place; `step` (0-dim) is incremented first, as torch does.
    The hyperparameters are 0-dim float32 tensors (see `_hyperparameter_values`). `shadow` (the
    parameter's compute-dtype copy, if any) receives the updated parameter, cast."""
    step.add_(1)
    grad = grad.float() / clip  # a bf16 gradient (held, eagle3.draft.held_grads) is read as it is
    param.mul_(decay)
    exp_avg.lerp_(grad, one_minus_beta1)
    exp_avg_sq.mul_(beta2).add_(one_minus_beta2 * grad * grad)
    # 1 - beta**step as -expm1(step log beta): float32 keeps it to ~1e-7 where 1 - 0.999**step loses 1e-5
    bias_correction1 = -torch.expm1(step * log_beta1)
    bias_correction2_sqrt = (-torch.expm1(step * log_beta2)).sqrt()
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


@dataclass
class _GroupHyperparameters:
    """One parameter group's hyperparameters on one device (0-dim float32 tensors, in `_adamw_param`'s
    order) and the values they were last filled with."""

    tensors: tuple[Tensor, ...]
    filled: tuple[float, ...] | None = None

    def refresh(self, group: dict) -> None:
        """Fill the tensors whose value changed (usually the lr alone): fill kernels, not host->device copies."""
        values = _hyperparameter_values(group)
        for i, (tensor, value) in enumerate(zip(self.tensors, values)):
            if self.filled is None or self.filled[i] != value:
                tensor.fill_(value)
        self.filled = values


# optimizer -> {(group index, device): its _GroupHyperparameters}
_hyperparameter_tensors: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _hyperparameter_values(group: dict) -> tuple[float, ...]:
    """What `_adamw_param` takes after `step`, computed in double here: lr, 1 - lr * weight_decay,
    1 - beta1, beta2, 1 - beta2, log beta1, log beta2, eps."""
    lr, (beta1, beta2), weight_decay = float(group["lr"]), map(float, group["betas"]), float(group["weight_decay"])
    return lr, 1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, _log(beta1), _log(beta2), float(group["eps"])


def _log(beta: float) -> float:
    return math.log(beta) if beta > 0 else -math.inf  # beta 0: no averaging, bias correction 1


def _group_hyperparameters(optimizer: torch.optim.Optimizer, index: int, device: torch.device) -> tuple[Tensor, ...]:
    """The group's hyperparameters on `device` as 0-dim tensors, refreshed from the group here unless a
    CUDA graph is being captured: a graph would freeze the values, so its replays read the tensors that
    `load_hyperparameters` refreshes before each.

    Tensors, not Python floats: with floats, inductor's cache handed a kernel compiled for one
    optimizer's values to another's (torch 2.11, same process or a later one on the same machine:
    betas (0.9, 0.999) and weight decay 0.01 after (0.9, 0.95) and 0.1 were 3.7e-4 off in 3 steps;
    the kernel had the first betas baked into `beta ** step`; tests/eagle3/training/test_train.py keeps
    it out)."""
    groups = _hyperparameter_tensors.setdefault(optimizer, {})
    entry = groups.get((index, device))
    if entry is None:
        values = _hyperparameter_values(optimizer.param_groups[index])
        entry = groups[(index, device)] = _GroupHyperparameters(
            tuple(torch.empty((), dtype=torch.float32, device=device) for _ in values))
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        entry.refresh(optimizer.param_groups[index])
    return entry.tensors


def load_hyperparameters(optimizer: torch.optim.Optimizer) -> None:
    """Write each group's current lr (and betas, weight decay, eps) into the tensors a captured
    `adamw_step` reads (before a replay)."""
    for (index, _), entry in _hyperparameter_tensors.get(optimizer, {}).items():
        entry.refresh(optimizer.param_groups[index])


def eligible(optimizer: torch.optim.Optimizer) -> bool:
    """A plain fused AdamW on CUDA, after `compile_adamw()`: what `adamw_step` implements."""
    return _enabled and type(optimizer) is torch.optim.AdamW and all(
        g.get("fused") and not g.get("amsgrad") and not g.get("maximize") and not g.get("differentiable")
        for g in optimizer.param_groups)


@torch.no_grad()
def adamw_step(optimizer: torch.optim.AdamW, clip: Tensor, hold: GradientHold | None = None) -> None:
    """One step of `optimizer` (torch AdamW) with every gradient divided by `clip` (0-dim tensor >= 1); a
    parameter's gradient is its `.grad`, or what `hold` keeps for it (taken from the hold)."""
    for index, group in enumerate(optimizer.param_groups):
        hyperparameters = None
        for param in group["params"]:
            grad, divisor = _gradient(param, hold, clip)
            if grad is None:
                continue
            state = optimizer.state[param]
            if not state:  # as torch's fused AdamW initialises it
                state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if hyperparameters is None or hyperparameters[0].device != param.device:
                hyperparameters = _group_hyperparameters(optimizer, index, param.device)
            shadow = shadow_of(param)
            _adamw_fn(param, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], *hyperparameters,
                      divisor.to(param.device), shadow)
            if shadow is not None:
                shadow_written(param)
    optimizer._opt_called = True  # what torch's step wrapper records for the LR scheduler's order check


def _gradient(param: Tensor, hold: GradientHold | None, clip: Tensor) -> tuple[Tensor | None, Tensor]:
    """(gradient, what to divide it by): the held value over clip / its scale, else `.grad` over clip."""
    held = hold.pop(param) if hold is not None else None
    if held is None:
        return param.grad, clip
    return held.value, clip if held.scale is None else clip / held.scale
