"""The draft layer's weights as the TTT unroll uses them: fused, cast once, and with each weight's
gradient summed over the unroll inside its GEMMs.

Owns `FusedLayerWeights` (q/k/v as one [(nh + 2 n_kv) d, 2H] matrix and gate/up as one [2F, H]
matrix, cast once per unroll straight into the fused buffer in the compute dtype) and the linear
that every TTT step calls with them. Autograd would give each step its own weight-gradient GEMM
output and then add the K outputs up (K - 1 extra passes over every weight matrix: 2.3 ms of a
68 ms Llama-3.1-8B step, ~5 ms at Kimi-K2.5's width); here the first backward GEMM writes the
gradient, the later ones add into it in their epilogue (cuBLAS beta = 1), and the last one hands
each master parameter its slice, cast to the parameter's dtype by one (compiled) pass, or, inside a
step that holds gradients (`eagle3.draft.held_grads`), keeps it in the compute dtype for the
optimizer to read. The draft's fc joins the unroll's weights the same way (one use, cast once). (Summing in
fp32 inside the GEMMs instead, cuBLAS reading and writing an fp32 C, removes that cast but was
measured slower: the fp32-C GEMMs took ~2 ms more than the cast costs on a Llama-3.1-8B step.)

The compute-dtype copies themselves (`compute_copy`) persist between unrolls when the masters are
fp32 on CUDA: the optimizer writes each master's bf16 copy into its rows as it updates the master
(`eagle3.training.adamw` asks `shadow_of(param)`), so the next unroll finds them current and casts
nothing (a cast reads 4 B and writes 2 B per weight; the optimizer writes 2 B more instead: on a
Llama-3.1-8B step the cast kernels' 0.6 ms went, the optimizer took 0.26 ms more). A copy counts as
current while each master's `_version` and `data_ptr()` are what they were when it was last
written and no torch optimizer has stepped it since; any other change to a master (load_state_dict,
`.data =`) changes one of them and the rows are cast again. The optimizer step is watched on its own:
torch's fused AdamW kernel updates the parameters without moving their version counters (torch 2.11),
so a run with `train.compile: false` trained on its first weights until a global step hook forgot the
rows of every parameter an optimizer stepped.

Risk: the sum is handed over when the weight's last registered use has run its backward. Every
use registered in a forward with grad enabled must therefore receive a gradient in the same
backward (true of the TTT unroll: each step's output reaches the loss); a use whose output never
reaches the loss would hold the sum back. `FusedLayerWeights.pending()` says whether any is left.
A persistent copy is wrong only if a master changes without its version counter moving and outside
a torch optimizer's step (an in-place write through `.data`, a fused kernel called directly, or a
compiled function that mutates it other than the optimizer's update).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from eagle3.draft.held_grads import GradientHold, active_hold


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
    multiplies with, how many uses still owe a backward, the gradient summed so far, and the hold
    (eagle3.draft.held_grads) active when it was made, which keeps that sum in the compute dtype."""

    __slots__ = ("masters", "weight", "uses", "grad", "hold")

    def __init__(self, masters: list[Tensor], dtype: torch.dtype | None) -> None:
        self.masters, self.uses, self.grad = masters, 0, None
        self.weight = compute_copy(masters, dtype)
        self.hold: GradientHold | None = active_hold()

    def hand_over(self) -> list[Tensor | None]:
        """Each master's slice of the summed gradient, for autograd: None where the hold keeps it in
        the compute dtype, else cast to the master's dtype."""
        parts = self.grad.split([m.shape[0] for m in self.masters])
        self.grad = None
        return [None if self.hold is not None and self.hold.offer(m, g) else
                _upcast_fn(g, m.dtype) if g.dtype != m.dtype else g for g, m in zip(parts, self.masters)]


class _PersistentCopy:
    """cat(masters) in a compute dtype, kept between unrolls; the state each master had when its rows
    were last written (`_version`, `data_ptr()`) says whether the rows are current."""

    def __init__(self, masters: list[Tensor], dtype: torch.dtype) -> None:
        self.refs = [weakref.ref(m) for m in masters]
        self.dtype = dtype
        self.buffer = torch.empty((sum(m.shape[0] for m in masters), *masters[0].shape[1:]), dtype=dtype,
                                  device=masters[0].device)
        self.rows = dict(zip(map(id, masters), self.buffer.split([m.shape[0] for m in masters])))
        self.written: dict[int, tuple[int, int]] = {}

    def matches(self, masters: list[Tensor], dtype: torch.dtype) -> bool:
        return dtype == self.dtype and len(masters) == len(self.refs) and all(
            ref() is m for ref, m in zip(self.refs, masters))

    def mark_written(self, master: Tensor) -> None:
        self.written[id(master)] = (master._version, master.data_ptr())

    def forget(self, master: Tensor) -> None:
        self.written.pop(id(master), None)

    @torch.no_grad()
    def refresh(self, masters: list[Tensor]) -> Tensor:
        for master in masters:  # only the rows whose master changed since they were written
            if self.written.get(id(master)) != (master._version, master.data_ptr()):
                self.rows[id(master)].copy_(master)
                self.mark_written(master)
        return self.buffer


_persistent_enabled = True
# first master -> its fused copy (weak: a copy goes with its parameters); master -> (its copy, its rows)
_persistent_copies: WeakIdKeyDictionary = WeakIdKeyDictionary()
_shadows: WeakIdKeyDictionary = WeakIdKeyDictionary()


def set_persistent_copies(enabled: bool) -> None:
    """Keep compute-dtype weight copies between unrolls (see the module docstring); False: cast every
    unroll (benchmarks compare both). Dropping them frees their memory."""
    global _persistent_enabled
    _persistent_enabled = enabled
    if not enabled:
        _persistent_copies.clear()
        _shadows.clear()


def compute_copy(masters: list[Tensor], dtype: torch.dtype | None) -> Tensor:
    """cat(masters) in `dtype` (None: the masters' own) for one unroll: the persistent copy, refreshed
    where a master changed, when the masters are fp32 CUDA tensors cast to bf16/fp16; else a fresh copy."""
    dtype = dtype or masters[0].dtype
    if not (_persistent_enabled and masters[0].is_cuda and dtype in (torch.bfloat16, torch.float16)
            and all(m.dtype == torch.float32 for m in masters)):
        return _fused_copy(masters, dtype)
    copy = _persistent_copies.get(masters[0])
    if copy is None or not copy.matches(masters, dtype):
        copy = register_persistent_copy(masters, dtype)
    return copy.refresh(masters)


def register_persistent_copy(masters: list[Tensor], dtype: torch.dtype) -> _PersistentCopy:
    """A new persistent copy of `masters`, found by `compute_copy` and `shadow_of` from now on."""
    _watch_optimizer_steps()
    copy = _PersistentCopy(masters, dtype)
    _persistent_copies[masters[0]] = copy
    for master in masters:
        _shadows[master] = copy
    return copy


_optimizer_hook = None


def _watch_optimizer_steps() -> None:
    """After any torch optimizer's step, the rows of the parameters it stepped are stale (see the module
    docstring). `eagle3.training.adamw`'s update does not go through `Optimizer.step` and marks the
    rows it writes itself."""
    global _optimizer_hook
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_post_hook(_forget_stepped_rows)


def _forget_stepped_rows(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            copy = _shadows.get(param)
            if copy is not None:
                copy.forget(param)


def shadow_of(param: Tensor) -> Tensor | None:
    """The rows of `param`'s persistent compute-dtype copy, for an optimizer that writes them as it
    updates `param` and then calls `shadow_written(param)`; None if it has none."""
    copy = _shadows.get(param)
    return None if copy is None else copy.rows.get(id(param))


def shadow_written(param: Tensor) -> None:
    """`param`'s rows of its persistent copy now hold `param` cast (written by the optimizer's update)."""
    copy = _shadows.get(param)
    if copy is not None:
        copy.mark_written(param)


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
                grads = slot.hand_over()
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

    qkv [(nh + 2 n_kv) d, 2H] = cat(q_proj, k_proj, v_proj) (MLA: qkv_a = cat(q_a_proj, kv_a_proj_with_mqa),
    q_b, kv_b); o [H, nh d]; gate_up [2F, H] =
    cat(gate_proj, up_proj); down [H, F]; fc [H, k H_t] where given. Gradients flow back to the
    parameters once per unroll.
    """

    slots: dict[str, WeightGradSlot] = field(default_factory=dict)

    def linear(self, name: str, x: Tensor) -> Tensor:
        return accumulating_linear(x, self.slots[name])

    def weight(self, name: str) -> Tensor:
        return self.slots[name].weight

    def pending(self) -> list[str]:
        """Weights whose registered uses have not all run their backward yet."""
        return [name for name, slot in self.slots.items() if slot.uses]


def fuse_layer_weights(layer: nn.Module, dtype: torch.dtype | None, fc: nn.Linear | None = None) -> FusedLayerWeights:
    """`FusedLayerWeights` of an `Eagle3DecoderLayer` (and the draft's bias-free `fc`, if given), in `dtype`
    (None: the parameters' own)."""
    mlp = layer.mlp
    groups = {**layer.self_attn.weight_groups(),  # GQA: qkv, o; MLA: qkv_a, q_b, kv_b, o
              "gate_up": [mlp.gate_proj.weight, mlp.up_proj.weight], "down": [mlp.down_proj.weight]}
    if fc is not None and fc.bias is None:
        groups["fc"] = [fc.weight]
    return FusedLayerWeights({name: WeightGradSlot(masters, dtype) for name, masters in groups.items()})
