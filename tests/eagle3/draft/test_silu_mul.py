"""silu_mul: the fused gate/up activation and its one-pass backward against autograd's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import eagle3.draft.silu_mul as silu_mul_module
from eagle3.draft.silu_mul import silu_mul


def _reference(gate_up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and d/d gate_up by autograd, in fp64, on the same values."""
    x = gate_up.double().requires_grad_(True)
    gate, up = x.chunk(2, dim=-1)
    y = F.silu(gate) * up
    y.backward(grad.double())
    return y.detach(), x.grad


@pytest.mark.parametrize("compiled", [False, True])
def test_silu_mul_and_its_backward_equal_autograd_on_silu_times_up(compiled):
    """Both halves of the gradient (d gate: silu's derivative times up; d up: silu(gate)) in their place,
    to bf16 rounding, eager and compiled (the training path compiles it)."""
    torch.manual_seed(0)
    gate_up = (torch.randn(2, 16, 2 * 96) * 3).bfloat16().requires_grad_(True)
    grad = torch.randn(2, 16, 96).bfloat16()
    if compiled:
        silu_mul_module.compile_silu_mul()
    try:
        out = silu_mul(gate_up)
        out.backward(grad)
    finally:
        silu_mul_module.uncompile_silu_mul()
    want_out, want_grad = _reference(gate_up.detach(), grad)
    assert out.dtype == gate_up.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want_out, rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(gate_up.grad.double(), want_grad, rtol=2**-7, atol=1e-6)
