"""The unroll loss's CPU fast path computes the same bits as the loss written out (issue 38)."""

import torch

from eagle3.draft import losses


def _rows_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, k, vd = 64, 3, 40
    logits = torch.randn(n, k, vd, generator=g) * 3
    target_p = torch.softmax(torch.randn(n, 1, vd, generator=g) * 2, -1)
    return logits, target_p, target_p.argmax(-1), torch.rand(n, k, generator=g) > 0.3, torch.rand(n, k, generator=g)


def test_in_place_rows_are_bit_identical_to_the_written_out_rows():
    logits, target_p, target_ids, valid, scale = _rows_inputs()
    expected_grad, actual_grad = logits.clone(), logits.clone()
    expected = losses._soft_ce_rows(expected_grad, target_p, target_ids, valid, scale)
    actual = losses._soft_ce_rows_eager(actual_grad, target_p, target_ids, valid, scale)
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])
    assert torch.equal(actual_grad, expected_grad)


def test_unroll_loss_unchanged_by_the_reused_cpu_workspace():
    """Two calls share the CPU scratch buffers; each gives what a fresh process would (the second
    with leftovers of the first in the buffers)."""
    g = torch.Generator().manual_seed(1)
    b, t, k, h, vd = 2, 9, 3, 8, 16
    weight = torch.randn(vd, h, generator=g, requires_grad=True)
    target_p = torch.softmax(torch.randn(b, t, vd, generator=g), -1)
    counted = torch.rand(b, t, generator=g) > 0.2
    scales = torch.rand(k * b, generator=g)

    def run(normed):
        normed = [x.clone().requires_grad_() for x in normed]
        weight.grad = None
        loss, ce, correct = losses.soft_cross_entropy_unroll(normed, weight, target_p, target_p.argmax(-1),
                                                             counted, scales)
        loss.backward()
        return [loss, ce, correct, weight.grad, *(x.grad for x in normed)]

    first = [torch.randn(b, t, h, generator=g) for _ in range(k)]
    other = [torch.randn(b, t, h, generator=g) * 5 for _ in range(k)]
    losses._cpu_workspaces.clear()
    fresh = run(first)
    run(other)
    again = run(first)
    assert all(torch.equal(x, y) for x, y in zip(fresh, again))
