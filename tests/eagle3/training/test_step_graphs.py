"""Whole steps as CUDA graphs (eagle3/training/step_graphs.py): padding to a length bucket changes no step
(CPU), and replayed steps train as the eager ones do (GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3.training.schedule import default_collate_fn
from eagle3.training.step_graphs import bucket_length
from eagle3.training.trainer import Trainer
from tests.eagle3.training.test_train import make_draft, make_items, make_world, train_config

REPO = Path(__file__).resolve().parents[3]


def _trainer(tmp_path, device_items, **cfg) -> Trainer:
    embed, lm_head, mapping = make_world()
    return Trainer(make_draft(embed, mapping), lm_head, train_config(**cfg), device_items, device_items[:4], tmp_path,
                   log=lambda s: None)


def test_bucket_length_rounds_up_to_whole_buckets():
    assert [bucket_length(n, 16) for n in (1, 16, 17, 32, 33)] == [16, 16, 32, 32, 48]


def test_a_step_of_micro_batches_padded_to_a_bucket_equals_the_unpadded_step(tmp_path, monkeypatch):
    """The graph path's inputs (`_graph_inputs`: micro-batches of different lengths padded to one bucket)
    give the step the eager path gives: same stats, grad norm and updated weights. On the CPU in fp32, also
    on a GPU host (exact there; bf16 on a GPU would round differently per shape): the step function is
    the one a graph records."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the trainer's device: the CPU
    embed, _, _ = make_world()
    items = make_items(8, 3, embed, t_max=24)
    micro_batches = [default_collate_fn(items[:2]), default_collate_fn(items[2:4])]
    lengths = [b["input_ids"].shape[1] for b in micro_batches]
    assert lengths[0] != lengths[1] and bucket_length(max(lengths), 16) > max(lengths)  # both get padded

    eager = _trainer(tmp_path / "eager", items, batch_size=2, grad_accum=2, cuda_graph_bucket=16)
    padded = _trainer(tmp_path / "padded", items, batch_size=2, grad_accum=2, cuda_graph_bucket=16)
    inputs = padded._graph_inputs(micro_batches)
    assert {t.shape[1] for batch in inputs for t in batch.values()} == {32}
    stats_e, norm_e = eager._compute_step(micro_batches)
    stats_p, norm_p = padded._compute_step(inputs)

    assert stats_e[1].sum() > 0  # something was counted
    torch.testing.assert_close(stats_p, stats_e, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm_p, norm_e, rtol=1e-5, atol=1e-7)
    lr = eager.optimizer.param_groups[0]["lr"]
    for (name, a), b in zip(eager.draft.named_parameters(), padded.draft.parameters()):
        if not a.requires_grad:
            continue
        # the gradients, as AdamW's first moment holds them (0.1 g / clip): continuous in g. The weights are not:
        # AdamW's first update is lr g / (|g| + 1e-8), so a gradient near 1e-8 turns rounding into up to +-lr
        # (seen on a 16-core host: the padded GEMMs sum in another order)
        torch.testing.assert_close(padded.optimizer.state[b]["exp_avg"], eager.optimizer.state[a]["exp_avg"],
                                   rtol=1e-4, atol=1e-9, msg=name)
        torch.testing.assert_close(b, a, rtol=0, atol=2.5 * lr, msg=name)
    assert all(p.grad is None for p in padded.params)  # as a captured step must leave them


def _cuda_history(tmp_path, items, **cfg) -> tuple[list[dict], Trainer]:
    trainer = _trainer(tmp_path, items, **cfg)
    trainer.train()
    return trainer.history, trainer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lengths", ["fixed", "varied"])
def test_replayed_steps_train_as_the_eager_steps(tmp_path, lengths):
    """The trainer with cuda_graphs (two eager steps per bucket, then capture and replays) against the same
    trainer without, same seed and data, a learning rate that changes every step (warm-up then cosine: a
    frozen lr would show) and validation between steps. Fixed lengths: no padding, the same kernels, equal but
    for the run-to-run noise of cuDNN attention's backward (atomic adds). Varied lengths: padded to 16-token
    buckets, other GEMM shapes, equal within bf16 rounding."""
    embed, _, _ = make_world()
    items = make_items(24, 1, embed, t_max=32) if lengths == "varied" else [
        {k: v[:32] for k, v in item.items()} for item in make_items(24, 1, embed, t_max=64)]
    cfg = dict(batch_size=2, grad_accum=2, max_steps=12, warmup_ratio=0.2, eval_every=6, checkpoint_every=6,
               compile=True, cuda_graph_bucket=16)
    graphed, trainer = _cuda_history(tmp_path / "graphed", items, cuda_graphs=True, **cfg)
    eager, reference = _cuda_history(tmp_path / "eager", items, cuda_graphs=False, **cfg)

    assert reference.step_graphs is None and trainer.step_graphs.graphs and trainer.step_graphs.replays >= 6
    assert [h["step"] for h in graphed] == [h["step"] for h in eager]
    lrs = [h["train/lr"] for h in graphed if "train/lr" in h]
    assert len(set(lrs)) == len(lrs) - 1  # every step's differs but for the peak, which warm-up's end and step 1 share
    rel, weights = (2e-4, dict(rtol=1e-4, atol=1e-5)) if lengths == "fixed" else (5e-3, dict(rtol=1e-2, atol=1e-3))
    # accuracies (and the accept length made of them) count argmax hits: bf16 rounding may flip one of the
    # ~95 positions (H200, 2026-12-03: step 7's acc_2 0.0842 vs 0.0947) where the losses agree to 5e-3
    flips = 1e-6 if lengths == "fixed" else 0.025
    for g, e in zip(graphed, eager):
        for key in e:
            if not key.endswith(("tokens_per_s", "peak_memory_gib")):
                within = flips if "/acc" in key or key.endswith("accept_length") else 1e-6
                assert g[key] == pytest.approx(e[key], rel=rel, abs=within), (g["step"], key)
    for (name, a), b in zip(reference.draft.named_parameters(), trainer.draft.parameters()):
        torch.testing.assert_close(b, a, **weights, msg=name)


_UNCAPTURABLE = """
import torch
from eagle3.training.step_graphs import StepGraphs

def step(inputs):
    total = inputs[0]["x"].sum()
    return (total * float(total.item() > 0),)  # the .item() is what a capture refuses

graphs = StepGraphs(step, warmup=1)
x = torch.arange(4.0, device="cuda")
print("eager", graphs([{"x": x}])[0].item(), flush=True)
graphs([{"x": x + 1}])
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_step_that_cannot_be_captured_stops_with_an_error_naming_the_setting():
    """A step that waits for the device (`.item()`) cannot be recorded: the warm-up step runs, then the capture
    fails with an error that names train.cuda_graphs. In a child process: a failed capture leaves torch's CUDA
    state broken for the rest of the process (the reason there is no eager fallback)."""
    proc = subprocess.run([sys.executable, "-c", _UNCAPTURABLE], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 1 and "eager 6.0" in proc.stdout
    assert "CUDA graph capture failed for 1 inputs of shapes [4]" in proc.stderr, proc.stderr[-2000:]
    assert "set train.cuda_graphs: false" in proc.stderr
