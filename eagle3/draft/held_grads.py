"""Weight gradients kept in the compute dtype they were summed in, for an optimizer that reads them there.

The draft's large weights (the fused layer's q/k/v, o, gate/up, down; fc; the lm_head) get their
gradient as one bf16 sum per unroll: the fused layer's backward GEMMs add into it in their epilogue,
the loss computes the head's in one GEMM. Handed to autograd, that sum becomes an fp32 `.grad`: a cast
pass (read 2 B, write 4 B per weight), then the clip's norm and AdamW each read 4 B. Held here instead,
the norm and `eagle3.training.adamw` read the 2 B sum: 10 B per weight less and no fp32 `.grad`
(on a Kimi-K2.5-width step ~1B weights: ~10 GB of traffic, ~3 ms of ~135). The numbers are the same:
the fp32 `.grad` was the bf16 sum upcast.

Scope: only inside `hold_gradients()`, which a step enters when what follows its backward reads the
hold (`eagle3.training.trainer.clip_and_step` with the compiled AdamW). A weight records the hold
active when its forward ran (`active_hold()`), because the backward runs on autograd's device thread.
On exit, whatever is still held is given to `.grad` (upcast and scaled), so nothing is lost where a
step stops early or something else reads `.grad`.

Risk: a weight whose gradient arrives twice in one hold (grad_accum > 1 micro-batches) must still get
the sum. The second arrival releases the first into `.grad` and goes to autograd, which adds: those
steps run as without the hold (`.grad` in fp32).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor


@dataclass
class HeldGradient:
    """A parameter's gradient = value (compute dtype) x scale (0-dim fp32, None for 1)."""

    value: Tensor
    scale: Tensor | None = None

    def materialize(self, dtype: torch.dtype) -> Tensor:
        grad = self.value.float() if self.scale is None else self.value.float() * self.scale
        return grad.to(dtype)


class GradientHold:
    """Held gradients by parameter; see the module docstring."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[Tensor, HeldGradient]] = {}

    def __contains__(self, param: Tensor) -> bool:
        return id(param) in self._held

    def __len__(self) -> int:
        return len(self._held)

    def offer(self, param: Tensor, value: Tensor, scale: Tensor | None = None) -> bool:
        """Hold `value` (x `scale`) as `param`'s gradient. False where the caller must hand it to autograd
        instead: a parameter whose gradient is already held or in `.grad` (then released into `.grad`
        first, so autograd adds the two), or one whose gradient already has its own dtype."""
        if value.dtype == param.dtype:
            return False
        if id(param) in self._held or param.grad is not None:
            self.release(param)
            return False
        self._held[id(param)] = (param, HeldGradient(value, scale))
        return True

    def pop(self, param: Tensor) -> HeldGradient | None:
        entry = self._held.pop(id(param), None)
        return None if entry is None else entry[1]

    @torch.no_grad()
    def release(self, param: Tensor | None = None) -> None:
        """Give `param`'s held gradient (None: every one) to `.grad`, upcast and scaled, added to what is there."""
        entries = [self._held.pop(id(param), None)] if param is not None else list(self._held.values())
        if param is None:
            self._held.clear()
        for entry in filter(None, entries):
            master, held = entry
            grad = held.materialize(master.dtype)
            master.grad = grad if master.grad is None else master.grad.add_(grad)

    def gradients(self, params: list[Tensor]) -> list[tuple[Tensor, Tensor | None]]:
        """(gradient, scale) of each parameter that has one: the held value and its scale, else `.grad`."""
        out = []
        for param in params:
            held = self._held.get(id(param))
            if held is not None:
                out.append((held[1].value, held[1].scale))
            elif param.grad is not None:
                out.append((param.grad, None))
        return out


def total_norm(gradients: list[tuple[Tensor, Tensor | None]]) -> Tensor:
    """The global L2 norm of scale x gradient over `gradients` (GradientHold.gradients), in fp32 whatever
    their dtypes: each gradient is read once, in its own dtype. One reduction per tensor: at Kimi-K2.5's
    width the foreach norm's chunked launches read the ~1B bf16 gradients at 2.2 TB/s (0.89 ms on an
    H200), a reduction per tensor at 3.2 TB/s (0.63 ms)."""
    norms = []
    for grad, scale in gradients:
        norm = torch.linalg.vector_norm(grad, dtype=torch.float32)
        norms.append(norm if scale is None else norm * scale.abs())
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


_active: GradientHold | None = None


def active_hold() -> GradientHold | None:
    """The hold gradients computed from now on go to (None: autograd's `.grad`, as usual)."""
    return _active


@contextlib.contextmanager
def hold_gradients(enabled: bool = True) -> Iterator[GradientHold | None]:
    """Hold compute-dtype weight gradients of the forwards run inside (see the module docstring); yields the
    hold (None where not `enabled`). On exit, what is still held goes to `.grad`."""
    global _active
    if not enabled:
        yield None
        return
    hold, previous = GradientHold(), _active
    _active = hold
    try:
        yield hold
    finally:
        _active = previous
        hold.release()
