"""The draft layer's weights as the TTT unroll uses them: fused, cast once, and with each weight's
gradient summed over the unroll inside its GEMMs.

Owns `FusedLayerWeights` (q/k/v as one [(nh + 2 n_kv) d, 2H] matrix and gate/up as one [2F, H]
matrix, cast once per unroll straight into the fused buffer in the compute dtype) and the linear
that every TTT step calls with them. Autograd would give each step its own weight-gradient GEMM
output and then add the K outputs up (K - 1 extra passes over every weight matrix: 2.3 ms of a
68 ms Llama-3.1-8B step, ~5 ms at Kimi-K2.5's width); here the first backward GEMM writes the
gradient, the later ones add into it in their epilogue (cuBLAS beta = 1), and the last one hands
each master parameter its slice, cast to the parameter's dtype by one (compiled) pass.

Risk: the sum is handed over when the weight's last registered use has run its backward. Every
use registered in a forward with grad enabled must therefore receive a gradient in the same
backward (true of the TTT unroll: each step's output reaches the loss); a use whose output never
reaches the loss would hold the sum back. `FusedLayerWeights.pending()` says whether any is left.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn


def _upcast(grad: Tensor, dtype: torch.dtype) -> Tensor:
    return grad.to(dtype)


_upcast_fn: Callable = _upcast  # compile_upcast: a vectorized kernel instead of the eager dtype copy


def compile_upcast(**compile_kwargs) -> None:
    global _upcast_fn
    _upcast_fn = torch.compile(_upcast, dynamic=True, **compile_kwargs)


def uncompile_upcast() -> None:
    global _upcast_fn
    _upcast_fn = _upcast


class WeightGradSlot:
    """One fused weight over an unroll: its master parameters, the compute-dtype copy every step
    multiplies with, how many uses still owe a backward, and the gradient summed so far."""

    __slots__ = ("masters", "weight", "uses", "grad")

    def __init__(self, masters: list[Tensor], dtype: torch.dtype | None) -> None:
        self.masters, self.uses, self.grad = masters, 0, None
        self.weight = _fused_copy(masters, dtype)


@torch.no_grad()
def _fused_copy(masters: list[Tensor], dtype: torch.dtype | None) -> Tensor:
    """cat(masters) in `dtype`, each cast straight into its rows (no separate cast and cat passes)."""
    dtype = dtype or masters[0].dtype
    if len(masters) == 1 and masters[0].dtype == dtype:
        return masters[0].detach()
    rows = sum(m.shape[0] for m in masters)
    fused = torch.empty((rows, *masters[0].shape[1:]), dtype=dtype, device=masters[0].device)
    for part, master in zip(fused.split([m.shape[0] for m in masters]), masters):
        part.copy_(master)
    return fused


class _AccumulatingLinear(torch.autograd.Function):
    """y = x W^T (x [N, in], W = slot.weight [out, in]); the masters' gradient is summed in `slot`
    across calls and returned, split per master, by the last one (see module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, slot: WeightGradSlot, *masters: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        ctx.slot = slot
        return x @ slot.weight.T

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (x,), slot = ctx.saved_tensors, ctx.slot
        grad_x = grad_out @ slot.weight if ctx.needs_input_grad[0] else None
        grads: list[Tensor | None] = [None] * len(slot.masters)
        if any(ctx.needs_input_grad[2:]):
            if slot.grad is None:
                slot.grad = grad_out.T @ x  # [out, in]
            else:
                slot.grad.addmm_(grad_out.T, x)  # accumulated in the GEMM's epilogue, no separate add
            slot.uses -= 1
            if slot.uses == 0:
                parts = slot.grad.split([m.shape[0] for m in slot.masters])
                grads = [_upcast_fn(g, m.dtype) if g.dtype != m.dtype else g for g, m in zip(parts, slot.masters)]
                slot.grad = None
        return (grad_x, None, *grads)


def accumulating_linear(x: Tensor, slot: WeightGradSlot) -> Tensor:
    """x [..., in] @ slot.weight[out, in]^T -> [..., out]; the masters' gradient is summed in `slot`."""
    if torch.is_grad_enabled() and any(m.requires_grad for m in slot.masters):
        slot.uses += 1  # counted here: inside Function.forward grad mode is off
    out = _AccumulatingLinear.apply(x.reshape(-1, x.shape[-1]), slot, *slot.masters)
    return out.view(*x.shape[:-1], slot.weight.shape[0])


@dataclass
class FusedLayerWeights:
    """The layer's projection weights for one TTT unroll (compute dtype, fused where the inputs are shared).

    qkv [(nh + 2 n_kv) d, 2H] = cat(q_proj, k_proj, v_proj); o [H, nh d]; gate_up [2F, H] =
    cat(gate_proj, up_proj); down [H, F]. Gradients flow back to the parameters once per unroll.
    """

    slots: dict[str, WeightGradSlot] = field(default_factory=dict)

    def linear(self, name: str, x: Tensor) -> Tensor:
        return accumulating_linear(x, self.slots[name])

    def weight(self, name: str) -> Tensor:
        return self.slots[name].weight

    def pending(self) -> list[str]:
        """Weights whose registered uses have not all run their backward yet."""
        return [name for name, slot in self.slots.items() if slot.uses]


def fuse_layer_weights(layer: nn.Module, dtype: torch.dtype | None) -> FusedLayerWeights:
    """`FusedLayerWeights` of an `Eagle3DecoderLayer`, in `dtype` (None: the parameters' own)."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = {"qkv": [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], "o": [attn.o_proj.weight],
              "gate_up": [mlp.gate_proj.weight, mlp.up_proj.weight], "down": [mlp.down_proj.weight]}
    return FusedLayerWeights({name: WeightGradSlot(masters, dtype) for name, masters in groups.items()})
