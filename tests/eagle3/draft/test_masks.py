"""EAGLE-3 TTT mask: spelled-out matrices, and the fast attention that implements it."""

from __future__ import annotations

import pytest
import torch

from eagle3.draft.masks import build_causal_mask, build_ttt_attention_mask, build_ttt_mask
from eagle3.draft.model import _ttt_attention_math, ttt_attention


def test_ttt_mask_step0_is_causal():
    expected = torch.tensor(
        [
            [1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 0],
            [1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(build_ttt_mask(4, 0), expected)


def test_ttt_mask_three_steps_spelled_out():
    # T = 4, step 2 (the third TTT step): causal over the step-0 keys, then each query sees
    # only its own position's key in the step-1 and step-2 blocks.
    expected = torch.tensor(
        [
            # step-0 keys | step-1 keys | step-2 keys
            [1, 0, 0, 0,   1, 0, 0, 0,   1, 0, 0, 0],
            [1, 1, 0, 0,   0, 1, 0, 0,   0, 1, 0, 0],
            [1, 1, 1, 0,   0, 0, 1, 0,   0, 0, 1, 0],
            [1, 1, 1, 1,   0, 0, 0, 1,   0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )  # fmt: skip
    assert torch.equal(build_ttt_mask(4, 2), expected)


def test_ttt_mask_step1_spelled_out():
    expected = torch.tensor(
        [
            [1, 0, 0,   1, 0, 0],
            [1, 1, 0,   0, 1, 0],
            [1, 1, 1,   0, 0, 1],
        ],
        dtype=torch.bool,
    )  # fmt: skip
    assert torch.equal(build_ttt_mask(3, 1), expected)


def test_ttt_attention_mask_masks_padded_keys_in_every_block():
    mask = build_ttt_attention_mask(3, 1, attention_mask=torch.tensor([[1, 1, 0]]))
    expected = torch.tensor(
        [
            [1, 0, 0,   1, 0, 0],
            [1, 1, 0,   0, 1, 0],
            [1, 1, 0,   0, 0, 0],
        ],
        dtype=torch.bool,
    )  # fmt: skip
    assert mask.shape == (1, 1, 3, 6)
    assert torch.equal(mask[0, 0], expected)


def test_causal_mask_with_past():
    expected = torch.tensor(
        [
            [1, 1,   1, 0, 0],
            [1, 1,   1, 1, 0],
            [1, 1,   1, 1, 1],
        ],
        dtype=torch.bool,
    )  # fmt: skip
    assert torch.equal(build_causal_mask(3, 2)[0, 0], expected)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="seq_len"):
        build_ttt_mask(0, 1)


def _inputs(dtype, steps, b=2, nh=4, n_kv=2, t=9, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nh, t, d, generator=g, dtype=dtype).requires_grad_()
    keys = [torch.randn(b, n_kv, t, d, generator=g, dtype=dtype).requires_grad_() for _ in range(steps + 1)]
    values = [torch.randn(b, n_kv, t, d, generator=g, dtype=dtype).requires_grad_() for _ in range(steps + 1)]
    return q, keys, values


def _run(fn, q, keys, values, grad_out):
    for x in (q, *keys, *values):
        x.grad = None
    out = fn(q, keys, values)
    (out.float() * grad_out).sum().backward()
    return [out.detach().float()] + [x.grad.detach().float() for x in (q, *keys, *values)]


@pytest.mark.parametrize("steps", [0, 1, 3])
def test_fast_ttt_attention_equals_dense_mask_reference(steps):
    """Values and every gradient (q, each step's k and v) of the flash + diagonal merge
    equal SDPA with the dense EAGLE-3 mask."""
    q, keys, values = _inputs(torch.float32, steps)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    dense = _run(lambda *a: ttt_attention(*a, impl="dense"), q, keys, values, grad_out)
    fast = _run(lambda *a: ttt_attention(*a, impl="fast"), q, keys, values, grad_out)
    math_ = _run(_ttt_attention_math, q, keys, values, grad_out)
    for ref, got, other in zip(dense, fast, math_):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(other, ref, atol=2e-5, rtol=1e-4)


def test_fast_ttt_attention_bf16_close_to_fp32_reference():
    q, keys, values = _inputs(torch.float32, 2, t=16, d=16)
    ref = ttt_attention(q, keys, values, impl="dense").detach()
    got = ttt_attention(q.bfloat16(), [k.bfloat16() for k in keys], [v.bfloat16() for v in values], impl="fast")
    rel = (got.float() - ref).norm() / ref.norm()
    assert rel < 1e-2


def test_dense_attention_differs_from_plain_causal():
    """Guard that the mask matters: dropping the diagonal terms changes the output."""
    q, keys, values = _inputs(torch.float32, 2)
    with torch.no_grad():
        full = ttt_attention(q, keys, values, impl="fast")
        causal_only = ttt_attention(q, keys[:1], values[:1], impl="fast")
    assert not torch.allclose(full, causal_only, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n_kv", [2, 8])
@pytest.mark.parametrize("backend", ["cudnn", "flash"])
def test_fast_ttt_attention_cuda_flash_matches_fp32_dense_reference(n_kv, backend, monkeypatch):
    """bf16 CUDA fast path (GQA and MHA, head_dim 128; causal block by cuDNN or FA2, each given the
    merged out/LSE in backward) vs the dense mask on fp32 copies."""
    import eagle3.draft.model as model_mod

    monkeypatch.setattr(model_mod, "_causal_backend", backend)
    g = torch.Generator(device="cuda").manual_seed(0)
    shape_q, shape_kv = (2, 8, 384, 128), (2, n_kv, 384, 128)
    q = torch.randn(shape_q, device="cuda", generator=g)
    keys = [torch.randn(shape_kv, device="cuda", generator=g) for _ in range(4)]
    values = [torch.randn(shape_kv, device="cuda", generator=g) for _ in range(4)]
    grad_out = torch.randn(shape_q, device="cuda", generator=g)
    leaves_ref = [x.clone().requires_grad_() for x in (q, *keys, *values)]
    leaves_bf = [x.bfloat16().requires_grad_() for x in (q, *keys, *values)]
    ref = ttt_attention(leaves_ref[0], leaves_ref[1:5], leaves_ref[5:], impl="dense")
    (ref * grad_out).sum().backward()
    got = ttt_attention(leaves_bf[0], leaves_bf[1:5], leaves_bf[5:], impl="fast")
    (got.float() * grad_out).sum().backward()
    for a, b in zip([ref] + [x.grad for x in leaves_ref], [got] + [x.grad for x in leaves_bf]):
        rel = (b.float() - a).norm() / a.norm()
        assert rel < 2e-2, rel
