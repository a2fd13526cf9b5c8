"""Training: loss vs an unfused SpecForge-style reference, teacher, metrics, schedule, data
order, checkpoints, resume after SIGKILL, DDP/FSDP under torchrun (gloo, 2 ranks)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eagle3.config import TrainConfig
from eagle3.draft.losses import compute_teacher, soft_cross_entropy, soft_cross_entropy_reference
from eagle3.draft.masks import build_ttt_attention_mask
from eagle3.draft.model import DraftModelConfig, Eagle3DraftModel, repeat_kv
from eagle3.training.checkpoints import find_latest_checkpoint, load_draft_checkpoint, write_checkpoint
from eagle3.training.curves import build_training_figure, plot_training_curves
from eagle3.training.schedule import DataPlan, build_lr_lambda
from eagle3.training.trainer import Trainer
from eagle3.training.ttt import Eagle3TTTModule, metrics_from_stats, simulated_accept_length

REPO = Path(__file__).resolve().parents[3]
V, HT, VD = 96, 32, 48




# ---------------------------------------------------------------- synthetic world


def make_world(seed: int = 0):
    """A fake target: embedding, lm_head, and a vocab map of VD ids."""
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(V, HT, generator=g)
    lm_head = torch.randn(V, HT, generator=g)
    used = torch.randperm(V, generator=g)[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    return embed, lm_head, (used - torch.arange(VD), t2d)


def make_items(n: int, seed: int, embed: torch.Tensor, t_max: int = 16):
    """Dataset items of the eagle3/data/datasets.py contract; the teacher at t depends on token t, so
    the draft (which reads token t+1+k when predicting teacher t+1+k) can learn it."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n):
        length = int(torch.randint(t_max // 2, t_max + 1, (1,), generator=g))
        ids = torch.randint(0, V, (length,), generator=g)
        last = embed[ids] + 0.1 * torch.randn(length, HT, generator=g)
        aux = torch.cat([embed[ids], embed[ids].roll(1, 0), last], -1)
        loss_mask = torch.ones(length, dtype=torch.long)
        loss_mask[:3] = 0
        items.append({"input_ids": ids, "loss_mask": loss_mask, "aux_hidden_states": aux, "last_hidden_states": last})
    return items


# the draft variants the same TTT loop trains: GQA, and MLA with the EAGLE-3.1 options
MLA = dict(architecture="deepseek_mla", num_key_value_heads=4, head_dim=10, q_lora_rank=12, kv_lora_rank=8,
           qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)
DRAFT_VARIANTS = {"llama": {}, "llama-3.1": dict(fc_norm=True, norm_output=True), "mla": MLA,
                  "mla-3.1": dict(MLA, fc_norm=True, norm_output=True)}


def make_draft(embed, mapping, seed: int = 0, **options) -> Eagle3DraftModel:
    torch.manual_seed(seed)
    cfg = DraftModelConfig(**{**dict(hidden_size=HT, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=8, vocab_size=V, draft_vocab_size=VD, target_hidden_size=HT,
                                     aux_layer_ids=[1, 3, 5]), **options})
    draft = Eagle3DraftModel(cfg)
    draft.load_target_embedding(embed)
    draft.set_vocab_mapping(*mapping)
    return draft


def train_config(**kw) -> TrainConfig:
    base = dict(ttt_steps=3, batch_size=4, lr=1e-2, warmup_ratio=0.1, epochs=50, max_steps=8,
                log_every=1, eval_every=4, checkpoint_every=3)
    return TrainConfig(**{**base, **kw})


# ---------------------------------------------------------------- loss / teacher


def _reference_ttt_loss(draft, batch, lm_head, steps, decay):
    """SpecForge-style TTT: padding(x, left=False) shifts, dense-mask attention, unfused
    soft CE with `target[..., t2d]` and `t2d[argmax]` masking (per-step mean over counted rows)."""
    ids, mask = batch["input_ids"], batch["loss_mask"].bool() & batch["attention_mask"].bool()
    b, t = ids.shape
    logits_t = batch["last_hidden_states"] @ lm_head.T

    def pad_left(x):  # SpecForge padding(x, left=False): drop the first position, zero-fill the end
        return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], 1)

    target, tokens, lmask = pad_left(logits_t), pad_left(ids), pad_left(mask.long())
    hidden = draft.project(batch["aux_hidden_states"])
    pos = torch.arange(t)[None].expand(b, t)
    keys, values, total = [], [], 0.0
    for k in range(steps):
        cos, sin = draft.rotary_emb(pos + k, hidden.dtype)
        q, kk, vv = draft.midlayer.qkv(draft.embed_tokens(tokens), hidden, cos, sin)
        keys.append(kk)
        values.append(vv)
        groups = q.shape[1] // kk.shape[1]
        attn = F.scaled_dot_product_attention(
            q, repeat_kv(torch.cat(keys, 2), groups), repeat_kv(torch.cat(values, 2), groups),
            attn_mask=build_ttt_attention_mask(t, k))
        hidden = draft.midlayer.finish(attn, hidden)
        hidden = draft.norm(hidden) if draft.config.norm_output else hidden  # EAGLE-3.1: the next step gets it normed
        valid_rows = torch.arange(t) < t - 1 - k  # rows whose teacher index exists
        position_mask = draft.t2d[target.argmax(-1)] & lmask.bool() & valid_rows
        p = torch.softmax(target[..., draft.t2d].float(), -1)
        ce = soft_cross_entropy_reference(draft.compute_logits(hidden).reshape(b * t, -1),
                                          p.reshape(b * t, -1), position_mask.reshape(-1))
        total = total + decay**k * ce / position_mask.sum().clamp(min=1)
        tokens, target, lmask = pad_left(tokens), pad_left(target), pad_left(lmask)
    return total


@pytest.mark.parametrize("variant", ["llama", "mla-3.1"])
@pytest.mark.parametrize("attention", ["fast", "dense"])
def test_ttt_loss_and_grads_match_unfused_reference(attention, variant):
    embed, lm_head, mapping = make_world()
    draft = make_draft(embed, mapping, **DRAFT_VARIANTS[variant])
    from eagle3.training.schedule import default_collate_fn

    batch = default_collate_fn(make_items(3, 1, embed))
    module = Eagle3TTTModule(draft, train_config(attention=attention, loss_chunk_tokens=16))
    p, ids, in_vocab = compute_teacher(batch["last_hidden_states"], lm_head, draft.t2d, chunk_tokens=5)
    loss_mask = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    loss, stats = module(batch["input_ids"], batch["aux_hidden_states"], loss_mask, p, ids, in_vocab)
    grads = torch.autograd.grad(loss, [q for q in draft.parameters() if q.requires_grad])
    ref = _reference_ttt_loss(draft, batch, lm_head, 3, 0.8)
    ref_grads = torch.autograd.grad(ref, [q for q in draft.parameters() if q.requires_grad])
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert stats.shape == (4, 3) and (stats[1] <= stats[3]).all() and (stats[2] <= stats[1]).all()


def test_fused_soft_cross_entropy_equals_reference():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    weight = torch.randn(24, 16, generator=g, requires_grad=True)
    p = torch.softmax(torch.randn(37, 24, generator=g) * 3, -1)
    valid = torch.rand(37, generator=g) > 0.3
    ce, correct = soft_cross_entropy(hidden, weight, p, p.argmax(-1), valid, chunk_rows=8)
    ref = soft_cross_entropy_reference(hidden @ weight.T, p, valid)
    torch.testing.assert_close(ce, ref)
    g1, g2 = torch.autograd.grad(2.5 * ce, [hidden, weight])
    r1, r2 = torch.autograd.grad(2.5 * ref, [hidden, weight])
    torch.testing.assert_close(g1, r1)
    torch.testing.assert_close(g2, r2)
    assert torch.equal(correct, ((hidden @ weight.T).argmax(-1) == p.argmax(-1)) & valid)
    with torch.no_grad():
        ce_ng, _ = soft_cross_entropy(hidden, weight, p, p.argmax(-1), valid)
    torch.testing.assert_close(ce_ng, ref.detach())


def test_soft_cross_entropy_steps_flush_a_full_gradient_buffer(monkeypatch):
    """A gradient buffer smaller than all steps' rows is flushed into an fp32 sum: same loss and
    gradients as the unfused per-step reference."""
    import eagle3.draft.losses as losses

    g = torch.Generator().manual_seed(1)
    weight = torch.randn(24, 16, generator=g, requires_grad=True)
    hiddens = [torch.randn(n, 16, generator=g, requires_grad=True) for n in (13, 9, 11)]
    targets = [(p := torch.softmax(torch.randn(h.shape[0], 24, generator=g) * 3, -1), p.argmax(-1),
                torch.rand(h.shape[0], generator=g) > 0.2) for h in hiddens]
    scales = torch.tensor([1.0, 0.8, 0.64])
    monkeypatch.setattr(losses, "_GRAD_BUFFER_BYTES", 10 * 24 * 4)  # 10 rows: flushes inside every step
    loss, ce, _ = losses.soft_cross_entropy_steps(hiddens, weight, targets, scales, chunk_rows=4)
    ref = sum(s * soft_cross_entropy_reference(h @ weight.T, p, v) for s, h, (p, _, v) in zip(scales, hiddens, targets))
    torch.testing.assert_close(loss, ref)
    got = torch.autograd.grad(loss, [weight, *hiddens])
    want = torch.autograd.grad(ref, [weight, *hiddens])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("budget_rows", [None, 2 * 22, 22, 5])
def test_unrolled_loss_equals_the_loss_step_by_step(monkeypatch, budget_rows):
    """soft_cross_entropy_unroll (every TTT step on the teacher rows they share) gives the per-step
    loss's value, statistics and every gradient, in fp64, on 3 right-padded sequences of up to 22
    tokens: with one block for the whole batch (None), blocks of 2 whole sequences, of 1, and of 5
    teacher rows of one sequence (rows shorter than the unroll's shift, so blocks start in padding)."""
    import eagle3.draft.losses as losses
    import eagle3.training.ttt as ttt
    from eagle3.training.schedule import default_collate_fn

    embed, lm_head, mapping = make_world()
    batch = {k: v.double() if v.is_floating_point() else v
             for k, v in default_collate_fn(make_items(3, 4, embed, t_max=22)).items()}
    if budget_rows is not None:  # bytes of `budget_rows` teacher rows x 6 steps x Vd fp64 logits
        monkeypatch.setattr(losses, "_GRAD_BUFFER_BYTES", budget_rows * 6 * mapping[0].shape[0] * 8)
    results = []
    for unrolled in (True, False):
        monkeypatch.setattr(ttt, "_unroll_loss", unrolled)
        draft = make_draft(embed, mapping).double()
        module = Eagle3TTTModule(draft, train_config(ttt_steps=6, loss_chunk_tokens=16))
        p, ids, in_vocab = compute_teacher(batch["last_hidden_states"], lm_head.double(), draft.t2d)
        loss_mask = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        loss, stats = module(batch["input_ids"], batch["aux_hidden_states"], loss_mask, p, ids, in_vocab)
        loss.backward()
        results.append((loss.item(), stats, {n: q.grad for n, q in draft.named_parameters() if q.requires_grad}))
    (loss_u, stats_u, grads_u), (loss_s, stats_s, grads_s) = results
    # CE sums are fp32 (whatever the logits' dtype) and summed in another order: fp32 rounding apart
    assert loss_u == pytest.approx(loss_s, rel=1e-6)
    torch.testing.assert_close(stats_u, stats_s, rtol=1e-6, atol=1e-9)
    assert stats_u[2].sum() > 0  # some rows correct: the comparison of `correct` means something
    for name in grads_s:
        torch.testing.assert_close(grads_u[name], grads_s[name], rtol=1e-9, atol=1e-12, msg=name)
    with torch.no_grad():  # evaluation: the same numbers without building gradients
        draft = make_draft(embed, mapping).double()
        module = Eagle3TTTModule(draft, train_config(ttt_steps=6))
        monkeypatch.setattr(ttt, "_unroll_loss", True)
        loss_ng, stats_ng = module(batch["input_ids"], batch["aux_hidden_states"], loss_mask, p, ids, in_vocab)
    assert loss_ng.item() == pytest.approx(loss_s, rel=1e-6)
    torch.testing.assert_close(stats_ng, stats_s, rtol=1e-6, atol=1e-9)


def test_teacher_restricts_to_draft_vocab_and_flags_out_of_vocab_argmax():
    g = torch.Generator().manual_seed(0)
    lm_head, last = torch.randn(10, 4, generator=g), torch.randn(2, 5, 4, generator=g)
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[1, 4, 6, 9]] = True
    p, ids, in_vocab = compute_teacher(last, lm_head, t2d, chunk_tokens=3)
    given = compute_teacher(last, lm_head, t2d, chunk_tokens=3, columns=torch.tensor([1, 4, 6, 9]))
    assert all(torch.equal(a, b) for a, b in zip((p, ids, in_vocab), given))
    logits = last @ lm_head.T
    torch.testing.assert_close(p, torch.softmax(logits[..., t2d], -1))
    assert torch.equal(in_vocab, t2d[logits.argmax(-1)])
    assert torch.equal(ids, logits[..., t2d].argmax(-1))
    assert 0 < in_vocab.sum() < in_vocab.numel()  # the example exercises both cases


def test_metrics_and_simulated_accept_length():
    stats = torch.tensor([[4.0, 6.0], [2.0, 3.0], [1.0, 1.0], [4.0, 4.0]])  # ce, counted, correct, masked
    m = metrics_from_stats(stats, 0.5, "val")
    assert m["val/loss_0"] == 2.0 and m["val/loss_1"] == 2.0 and m["val/loss"] == 2.0 + 0.5 * 2.0
    assert m["val/acc_0"] == 0.25 and m["val/acc_1"] == 0.25
    assert m["val/simulated_accept_length"] == pytest.approx(1 + 0.25 + 0.0625)
    assert simulated_accept_length([0.8, 0.5, 0.5]) == pytest.approx(1 + 0.8 + 0.4 + 0.2)


def test_lr_schedule_warmup_then_cosine_to_floor():
    f = build_lr_lambda(100, 0.1, 0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(55) == pytest.approx(0.55)
    assert f(100) == pytest.approx(0.1)
    assert all(f(i) >= f(i + 1) for i in range(10, 100))


def test_data_plan_is_deterministic_disjoint_and_covers_the_split():
    plan = DataPlan(num_samples=10, batch_size=2, world_size=2, grad_accum=1, seed=3)
    r0, r1 = list(plan.rank_batches(0, 0, 0)), list(plan.rank_batches(0, 1, 0))
    assert plan.steps_per_epoch == 3 and len(r0) == len(r1) == 3
    flat = sum(r0 + r1, [])
    assert set(flat) == set(range(10))  # 12 slots, wrap-around fills the last two
    assert r0 == list(plan.rank_batches(0, 0, 0)) and r0 != list(plan.rank_batches(1, 0, 0))
    assert list(plan.rank_batches(0, 0, 2)) == r0[2:]


# ---------------------------------------------------------------- trainer


def _trainer(tmp_path, **cfg):
    embed, lm_head, mapping = make_world()
    draft = make_draft(embed, mapping)
    metrics = []
    trainer = Trainer(draft, lm_head, train_config(**cfg), make_items(24, 1, embed), make_items(8, 2, embed),
                      tmp_path, on_metrics=lambda s, m: metrics.append((s, m)), log=lambda s: None)
    return trainer, metrics


def test_trainer_learns_reports_and_checkpoints(tmp_path):
    trainer, metrics = _trainer(tmp_path, max_steps=40, eval_every=40, checkpoint_every=20, log_every=5)
    summary = trainer.train()
    train_losses = [m["train/loss"] for _, m in metrics if "train/loss" in m]
    assert train_losses[-1] < 0.8 * train_losses[0]
    val = [m for _, m in metrics if "val/loss" in m][-1]
    assert {f"val/acc_{k}" for k in range(3)} <= set(val) and "val/simulated_accept_length" in val
    assert summary["steps"] == 40 and summary["finished"] and summary["metrics_split"] == "val"
    assert summary["simulated_accept_length"] == pytest.approx(val["val/simulated_accept_length"])
    assert len(summary["acc"]) == len(summary["loss"]) == 3
    json.dumps(summary)
    ckpt = Path(summary["checkpoint"])
    assert ckpt.name == "step_00000040" and find_latest_checkpoint(tmp_path / "checkpoints") == ckpt
    assert {p.name for p in ckpt.iterdir()} == {"model.safetensors", "draft_config.json", "train_state.pt",
                                                 "trainer_state.json"}
    reloaded = load_draft_checkpoint(ckpt, target_embedding=trainer.draft.embed_tokens.weight)
    for (name, a), b in zip(trainer.draft.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), name
    png = plot_training_curves(trainer.history, tmp_path / "curves.png")
    assert png.stat().st_size > 1000


def test_training_curves_are_titled_and_every_axis_names_its_unit():
    history = [{"step": 1, "train/loss": 9.0, "train/acc_0": 0.2, "train/acc_1": 0.1},
               {"step": 2, "train/loss": 7.5, "train/acc_0": 0.4, "train/acc_1": 0.2, "val/loss": 7.9,
                "val/acc_0": 0.35, "val/acc_1": 0.15, "val/simulated_accept_length": 1.4025}]
    figure = build_training_figure(history)
    axes = figure.axes
    assert [ax.get_title() for ax in axes] == [
        "Training loss: soft cross-entropy, $\\sum_k$ decay$^k$ over TTT steps",
        "$acc_k$ per TTT position, val (draft top-1 = target top-1)",
        "Simulated accept length, full depth 2: $1 + \\sum_k \\prod_{j \\leq k} acc_j$"]
    assert [ax.get_ylabel() for ax in axes] == ["nats per token", "share (0-1)", "tokens / verify step"]
    assert {ax.get_xlabel() for ax in axes} == {"optimizer step (count)"}
    assert [line.get_label() for line in axes[1].lines] == ["val acc_0", "val acc_1"]  # one split: fewer lines
    assert [list(line.get_ydata()) for line in axes[2].lines] == [[1.4025]]  # 1 + 0.35 + 0.35 * 0.15
    import matplotlib.pyplot as plt

    plt.close(figure)


def test_resume_refuses_a_different_config(tmp_path):
    trainer, _ = _trainer(tmp_path, max_steps=3)
    first = trainer.train()
    with pytest.raises(ValueError, match=r"\['lr'\]"):
        _trainer(tmp_path, max_steps=3, lr=5e-3)
    resumed, _ = _trainer(tmp_path, max_steps=3, log_every=2)  # cadence fields may change
    assert resumed.step == 3
    again = resumed.train()  # nothing left to train: the summary comes from the checkpoint's history
    assert again["steps"] == 3 and again["metrics_split"] == "val"
    assert again["final_metrics"] == first["final_metrics"]
    assert again["simulated_accept_length"] == first["simulated_accept_length"]


def test_checkpoint_write_is_atomic(tmp_path):
    root = tmp_path / "ckpt"
    write_checkpoint(root, 1, {"a.txt": lambda p: p.write_text("one")}, keep=2)

    def crash(path):
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        write_checkpoint(root, 2, {"a.txt": crash}, keep=2)
    assert find_latest_checkpoint(root).name == "step_00000001"
    (root / "latest").unlink()  # pointer lost: the highest complete step_* still wins, tmp dirs never
    assert find_latest_checkpoint(root).name == "step_00000001"
    for step in (2, 3, 4):
        write_checkpoint(root, step, {"a.txt": lambda p: p.write_text("x")}, keep=2)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000003", "step_00000004"]


RESUME_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, sys.argv[3])
    from test_train import make_world, make_draft, make_items, train_config
    from eagle3.training.trainer import Trainer
    mode, out = sys.argv[1], sys.argv[2]
    embed, lm_head, mapping = make_world()
    def on_progress(step, total):
        if mode == "kill" and step == 5:  # checkpoint 3 is on disk, step 5 is not
            os.kill(os.getpid(), signal.SIGKILL)
    trainer = Trainer(make_draft(embed, mapping), lm_head, train_config(), make_items(24, 1, embed),
                      make_items(8, 2, embed), out, on_progress=on_progress, log=lambda s: None)
    start = trainer.step
    trainer.train()
    print(json.dumps({"start": start}))
    """
)


def _run_script(script: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=120)


def _history(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]


def test_resume_after_sigkill_reproduces_the_uninterrupted_run(tmp_path):
    script = tmp_path / "resume_worker.py"
    script.write_text(RESUME_SCRIPT)
    tests_dir = str(Path(__file__).parent)
    straight = _run_script(script, "straight", str(tmp_path / "straight"), tests_dir)
    assert straight.returncode == 0, straight.stderr
    killed = _run_script(script, "kill", str(tmp_path / "killed"), tests_dir)
    assert killed.returncode == -9, killed.stderr  # died by SIGKILL
    assert len([h for h in _history(tmp_path / "killed") if "train/loss" in h]) == 5
    resumed = _run_script(script, "resume", str(tmp_path / "killed"), tests_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["start"] == 3
    want, got = _history(tmp_path / "straight"), _history(tmp_path / "killed")
    assert [h["step"] for h in got] == [h["step"] for h in want]
    for a, b in zip(want, got):
        assert a.keys() == b.keys()
        for key in a:
            if key != "train/tokens_per_s":
                assert a[key] == b[key], (a["step"], key)  # bit-identical on CPU


def run_torchrun(script: Path, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=2 script *args <this folder>`. One still running after `timeout_s`
    (a hung collective, or a machine too loaded to finish) is stopped whole and fails the test with its output,
    where every process's faulthandler printed where it waited (all of it also saved beside the script)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), *args,
           str(Path(__file__).parent)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_torchrun(proc)
        out, err = proc.communicate()
        saved = script.parent / f"{script.stem}.torchrun-output.txt"  # every stack, where the message cuts
        saved.write_text(f"{out}\n--- stderr ---\n{err}")
        pytest.fail(f"torchrun still running after {timeout_s:.0f} s, stopped; all its output in {saved}, the "
                    f"end of it (stacks) below:\n{out[-3000:]}{err[-40000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def stop_torchrun(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """SIGABRT (faulthandler prints each process's stacks), then SIGKILL, to torchrun's process group and to each
    rank's: torch.distributed.elastic starts every rank in a session of its own, so torchrun's group alone would
    leave the ranks (and their compile workers) running."""
    import psutil

    groups = [proc.pid, *(child.pid for child in psutil.Process(proc.pid).children())]
    for sig in (signal.SIGABRT, signal.SIGKILL):
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_group_alive(g, proc) for g in groups):
            time.sleep(0.2)


def _group_alive(group: int, leader: subprocess.Popen) -> bool:
    leader.poll()  # reap torchrun: an unreaped leader still counts as its group
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


STUBBORN_RANK = textwrap.dedent(
    """
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a rank stuck where SIGTERM does not stop it
    open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.pid"), "w").write(str(os.getpid()))
    time.sleep(600)
    """
)


@pytest.mark.slow
def test_an_interrupted_launch_stops_ranks_that_outlive_torchrun(tmp_path):
    """torchrun starts each rank in a session of its own: stopping torchrun's group must reach them too."""
    import psutil

    from eagle3.training.train import _kill_process_group

    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN_RANK)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(script), str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("rank*.pid"))) < 2 and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    ranks = [int(p.read_text()) for p in sorted(tmp_path.glob("rank*.pid"))]
    assert len(ranks) == 2 and all(os.getpgid(pid) == pid for pid in ranks)  # each leads a group of its own
    _kill_process_group(proc, grace_s=2)  # torchrun would wait 30 s for them before its own SIGKILL

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in ranks if alive(pid)]
    for pid in left:  # a failing run leaves nothing behind either
        os.kill(pid, signal.SIGKILL)
    assert left == []


DDP_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, sys.argv[3])
    from test_train import make_world, make_draft, make_items, train_config
    from eagle3.training.trainer import Trainer
    strategy, out = sys.argv[1], sys.argv[2]
    embed, lm_head, mapping = make_world()
    cfg = train_config(strategy=strategy, devices=2, batch_size=2, max_steps=30, log_every=5,
                       eval_every=30, checkpoint_every=30)
    trainer = Trainer(make_draft(embed, mapping), lm_head, cfg, make_items(24, 1, embed), make_items(8, 2, embed),
                      out, log=lambda s: None)
    summary = trainer.train()
    fc = trainer.draft.fc.weight
    fc = fc.full_tensor() if hasattr(fc, "full_tensor") else fc
    rank = int(os.environ["RANK"])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"fc_sum": float(fc.double().sum()), "fc_abs": float(fc.double().abs().sum()),
                   "world": trainer.info.world_size, "summary": summary}, f)
    torch.distributed.destroy_process_group()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_torchrun_two_ranks_agree_and_learn(tmp_path, strategy):
    script = tmp_path / "ddp_worker.py"
    script.write_text(DDP_SCRIPT)
    proc = run_torchrun(script, strategy, str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["world"] == ranks[1]["world"] == 2
    assert ranks[0]["fc_sum"] == ranks[1]["fc_sum"] and ranks[0]["fc_abs"] == ranks[1]["fc_abs"]
    losses = [h["train/loss"] for h in _history(tmp_path) if "train/loss" in h]
    assert len(losses) == 6 and losses[-1] < 0.85 * losses[0]
    assert ranks[0]["summary"]["metrics_split"] == "val"
    assert (tmp_path / "checkpoints" / "step_00000030" / "model.safetensors").exists()
    embed, _, _ = make_world()
    load_draft_checkpoint(tmp_path / "checkpoints" / "step_00000030", target_embedding=embed)


# Same global batch, three ways: one process with micro-batches of 2B, one process with grad_accum
# doubled, two ranks with B each. Lengths (8..16) and loss masks differ per sample, so the halves of
# a global batch count different numbers of positions: a per-rank or per-micro-batch mean differs.
GLOBAL_BATCH = dict(ttt_steps=3, lr=1e-2, warmup_ratio=0.0, max_steps=4, log_every=1, eval_every=100,
                    checkpoint_every=100)

EQUIVALENCE_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, sys.argv[3])
    from test_train import GLOBAL_BATCH, make_world, make_draft, make_items, train_config
    from eagle3.training.trainer import Trainer
    strategy, out = sys.argv[1], sys.argv[2]
    embed, lm_head, mapping = make_world()
    cfg = train_config(**GLOBAL_BATCH, strategy=strategy, devices=2, batch_size=3, grad_accum=2)
    Trainer(make_draft(embed, mapping), lm_head, cfg, make_items(24, 1, embed), make_items(8, 2, embed), out,
            log=lambda s: None).train()
    torch.distributed.destroy_process_group()
    """
)


def _train_steps(tmp_path, **cfg) -> list[tuple[float, float]]:
    """(train/loss, train/grad_norm) of each optimizer step of a single-process run."""
    trainer, metrics = _trainer(tmp_path, **GLOBAL_BATCH, **cfg)
    trainer.train()
    return [(m["train/loss"], m["train/grad_norm"]) for _, m in metrics if "train/loss" in m]


def test_counted_positions_follow_the_ttt_shift():
    from eagle3.training.ttt import counted_positions

    loss_mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    in_vocab = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    # counted = [[0,1,0,1,0],[1,1,1,0,0]]; step k counts positions k+1.. ; step 5 has none
    assert counted_positions(loss_mask, in_vocab, 5).tolist() == [4.0, 2.0, 1.0, 0.0, 0.0]


def test_grad_accum_normalises_over_the_whole_optimizer_step(tmp_path):
    """grad_accum=2 of B samples == one micro-batch of 2B (DataPlan gives both the same samples)."""
    whole = _train_steps(tmp_path / "whole", batch_size=6, grad_accum=1)
    halves = _train_steps(tmp_path / "halves", batch_size=3, grad_accum=2)
    assert len(whole) == len(halves) == 4
    for step, ((loss_w, norm_w), (loss_h, norm_h)) in enumerate(zip(whole, halves), start=1):
        assert loss_h == pytest.approx(loss_w, rel=1e-5), step
        assert norm_h == pytest.approx(norm_w, rel=1e-5), step


def test_two_ranks_take_the_same_global_batch_as_one_process():
    single = DataPlan(num_samples=24, batch_size=6, world_size=1, grad_accum=2, seed=0)
    ranks = [DataPlan(num_samples=24, batch_size=3, world_size=2, grad_accum=2, seed=0) for _ in range(2)]
    for epoch in (0, 1):
        whole = list(single.rank_batches(epoch, 0, 0))
        halves = [list(plan.rank_batches(epoch, r, 0)) for r, plan in enumerate(ranks)]
        assert [sorted(h0 + h1) for h0, h1 in zip(*halves)] == [sorted(w) for w in whole]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_match_one_process_on_the_same_global_batch(tmp_path, strategy):
    """Loss and grad norm at every step of a 2-rank run (B=3, grad_accum=2) equal one process's
    (B=6, grad_accum=2) in fp32: the loss is normalised by the global count of counted positions."""
    script = tmp_path / "equivalence_worker.py"
    script.write_text(EQUIVALENCE_SCRIPT)
    proc = run_torchrun(script, strategy, str(tmp_path / "ranks"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    two_ranks = [(h["train/loss"], h["train/grad_norm"]) for h in _history(tmp_path / "ranks") if "train/loss" in h]
    single = _train_steps(tmp_path / "single", batch_size=6, grad_accum=2)
    assert len(two_ranks) == len(single) == 4
    for step, ((loss_1, norm_1), (loss_2, norm_2)) in enumerate(zip(single, two_ranks), start=1):
        assert loss_2 == pytest.approx(loss_1, rel=1e-5), step
        assert norm_2 == pytest.approx(norm_1, rel=1e-5), step


@pytest.mark.parametrize("variant", DRAFT_VARIANTS)
def test_ttt_module_fused_layer_weights_equal_the_layer_on_its_own_parameters(variant):
    """The training path's fused GEMMs (q/k/v -- MLA: q_a/kv_a -- and gate/up as one weight each, every
    weight's gradient summed over the TTT unroll inside its backward GEMMs, eagle3/draft/fused_layer.py) give
    the loss and the gradient of every parameter that the layer run on its own parameters gives (autograd
    summing the steps' weight gradients), in fp64 so any dropped or doubled step shows; for each draft
    variant (GQA, MLA, each with fc_norm + norm_output)."""
    embed, lm_head, mapping = make_world()
    from eagle3.training.schedule import default_collate_fn

    batch = {k: v.double() if v.is_floating_point() else v
             for k, v in default_collate_fn(make_items(4, 3, embed, t_max=24)).items()}
    results = []
    for fused in (True, False):
        draft = make_draft(embed, mapping, **DRAFT_VARIANTS[variant]).double()
        with torch.no_grad():  # norms away from 1, so a norm used twice or skipped shows
            for name, param in draft.named_parameters():
                if param.dim() == 1:
                    param.add_(0.3 * torch.randn_like(param))
        if not fused:
            draft.fused_layer_weights = lambda dtype: None  # ttt_step then uses the parameters themselves
        module = Eagle3TTTModule(draft, train_config(ttt_steps=4))
        p, ids, in_vocab = compute_teacher(batch["last_hidden_states"], lm_head.double(), draft.t2d)
        loss, _ = module(batch["input_ids"], batch["aux_hidden_states"], batch["loss_mask"].bool(), p, ids, in_vocab)
        loss.backward()
        results.append((loss.item(), {n: q.grad for n, q in draft.named_parameters() if q.requires_grad}))
    (loss_f, grads_f), (loss_p, grads_p) = results
    assert loss_f == pytest.approx(loss_p, rel=1e-12)
    key = "midlayer.self_attn.kv_b_proj.weight" if "mla" in variant else "midlayer.self_attn.k_proj.weight"
    assert grads_f.keys() == grads_p.keys() and key in grads_f
    assert ("fc_norm.2.weight" in grads_f) == ("3.1" in variant)
    for name in grads_p:
        torch.testing.assert_close(grads_f[name], grads_p[name], rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_ttt_module_cuda_bf16_fast_matches_dense():
    """On CUDA under bf16 autocast the flash path gives the dense-mask loss and gradients."""
    embed, lm_head, mapping = make_world()
    from eagle3.training.schedule import default_collate_fn

    batch = {k: v.cuda() for k, v in default_collate_fn(make_items(4, 3, embed, t_max=64)).items()}
    results = []
    for attention in ("dense", "fast"):
        draft = make_draft(embed, mapping).cuda()
        module = Eagle3TTTModule(draft, train_config(attention=attention, ttt_steps=4))
        p, ids, in_vocab = compute_teacher(batch["last_hidden_states"], lm_head.cuda(), draft.t2d)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = module(batch["input_ids"], batch["aux_hidden_states"], batch["loss_mask"].bool(), p, ids, in_vocab)
        loss.backward()
        results.append((loss.item(), torch.cat([q.grad.flatten() for q in draft.parameters() if q.requires_grad])))
    (loss_d, grad_d), (loss_f, grad_f) = results
    assert abs(loss_d - loss_f) < 1e-2 * abs(loss_d)
    assert (grad_f - grad_d).norm() / grad_d.norm() < 3e-2


def test_clip_folded_into_fused_adamw_equals_clip_grad_norm():
    from eagle3.training.trainer import clip_and_step

    results = []
    for folded in (False, True):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(5, 7)), torch.nn.Parameter(torch.randn(3))]
        opt = torch.optim.AdamW(params, lr=0.1, fused=True)
        for scale in (10.0, 0.01):  # one clipped step, one unclipped step
            for p in params:
                p.grad = scale * torch.ones_like(p).cumsum(0)
            if folded:
                norm = clip_and_step(opt, params, 0.5)
            else:
                norm = torch.nn.utils.clip_grad_norm_(params, 0.5)
                opt.step()
        results.append(([p.detach().clone() for p in params], float(norm)))
    for a, b in zip(results[0][0], results[1][0]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert results[0][1] == pytest.approx(results[1][1])


def _adamw_runs(step_fn, device: str, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8) -> list[torch.Tensor]:
    """Three AdamW steps (weight decay on, a clipped and two unclipped gradients) from fixed weights."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 33, device=device)), torch.nn.Parameter(torch.randn(7, device=device))]
    opt = torch.optim.AdamW(params, lr=3e-2, betas=betas, weight_decay=weight_decay, eps=eps, fused=True)
    for i, clip in enumerate((4.0, 1.0, 1.0)):
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i)).to(device) * (i + 1)
        opt.param_groups[0]["lr"] = 3e-2 / (i + 1)  # as the scheduler changes it
        step_fn(opt, torch.tensor(clip, device=device))
    return [p.detach().cpu() for p in params] + [opt.state[params[0]]["exp_avg_sq"].cpu(),
                                                  opt.state[params[0]]["step"].cpu()]


def _torch_fused_step(opt, clip):
    opt.grad_scale = clip
    opt.step()
    del opt.grad_scale


def test_one_pass_adamw_update_equals_torchs_fused_adamw():
    from eagle3.training.adamw import adamw_step

    for got, want in zip(_adamw_runs(adamw_step, "cpu"), _adamw_runs(_torch_fused_step, "cpu")):
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)


def test_the_compiled_adamw_update_follows_each_optimizers_own_hyperparameters():
    """One compiled update serving optimizers with other betas, weight decay and eps, as a sweep or a
    second run on the same machine does: each matches torch's fused AdamW with its own values. With the
    hyperparameters passed as Python floats, inductor's cache handed the second optimizer the kernel
    compiled for the first (torch 2.11: max error 3.7e-4 after 3 steps on the CPU; the H200's kernel had the
    same constants baked in)."""
    from eagle3.training import adamw

    adamw.compile_adamw()
    try:
        sets = [((0.9, 0.95), 0.1, 1e-8), ((0.9, 0.999), 0.01, 1e-8), ((0.0, 0.99), 0.0, 1e-6)]
        for betas, weight_decay, eps in sets:
            got = _adamw_runs(adamw.adamw_step, "cpu", betas, weight_decay, eps)
            want = _adamw_runs(_torch_fused_step, "cpu", betas, weight_decay, eps)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7, msg=f"betas {betas}, weight decay {weight_decay}")
    finally:
        adamw.uncompile_adamw()


def test_adamw_writes_the_persistent_weight_copy_and_a_changed_master_is_cast_again():
    """The compute-dtype copy of fused masters (eagle3/draft/fused_layer.py) is written by the optimizer's
    update and found current by the next unroll; a master changed any other way (load_state_dict, an
    eager optimizer step) makes its rows be cast again. Registered by hand here: on CPU compute_copy
    makes no persistent copies."""
    import eagle3.draft.fused_layer as fused_layer
    from eagle3.training.adamw import adamw_step

    torch.manual_seed(0)
    masters = [torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(3, 6))]
    copy = fused_layer.register_persistent_copy(masters, torch.bfloat16)
    try:
        assert torch.equal(copy.refresh(masters), torch.cat(masters).bfloat16())
        opt = torch.optim.AdamW(masters, lr=0.1, fused=True)
        for m in masters:
            m.grad = torch.randn_like(m)
        adamw_step(opt, torch.tensor(1.0))  # writes both masters' rows, cast, as it updates them
        assert torch.equal(copy.buffer, torch.cat(masters).detach().bfloat16())
        before = copy.buffer.clone()
        assert torch.equal(copy.refresh(masters), before)  # current: nothing cast again
        with torch.no_grad():
            masters[1].mul_(2.0)  # a change the optimizer did not make (as load_state_dict's copy_)
        assert torch.equal(copy.refresh(masters)[4:], (masters[1].detach() * 1).bfloat16())
        assert torch.equal(copy.buffer[:4], before[:4])
        masters[0].data = torch.randn(4, 6)  # new storage: the version counter may not move, the pointer does
        assert torch.equal(copy.refresh(masters)[:4], masters[0].detach().bfloat16())
        for m in masters:
            m.grad = torch.randn_like(m)
        versions = [m._version for m in masters]
        opt.step()  # torch's fused kernel: the masters change, their version counters do not
        assert [m._version for m in masters] == versions
        assert torch.equal(copy.refresh(masters), torch.cat(masters).detach().bfloat16())
    finally:
        fused_layer._persistent_copies.pop(masters[0], None)
        for m in masters:
            fused_layer._shadows.pop(m, None)


HELD = {"fc.weight", "lm_head.weight", "midlayer.mlp.down_proj.weight", "midlayer.mlp.gate_proj.weight",
        "midlayer.mlp.up_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.o_proj.weight",
        "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.v_proj.weight"}


def _bf16_unroll(embed, lm_head, mapping, micro_batches: int = 1, loss_scale: float = 3.0):
    """A draft and the bf16 (CPU autocast) TTT backward of `micro_batches` batches, each loss x loss_scale
    (the head's gradient then arrives with that scale)."""
    from eagle3.training.schedule import default_collate_fn

    draft = make_draft(embed, mapping)
    module = Eagle3TTTModule(draft, train_config(ttt_steps=3))
    for seed in range(micro_batches):
        batch = default_collate_fn(make_items(4, 3 + seed, embed, t_max=24))
        p, ids, in_vocab = compute_teacher(batch["last_hidden_states"], lm_head, draft.t2d)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = module(batch["input_ids"], batch["aux_hidden_states"], batch["loss_mask"].bool(), p, ids,
                             in_vocab)
        (loss * loss_scale).backward()
    return draft


def test_held_gradients_are_the_bf16_sums_that_autograd_would_have_upcast():
    """Inside `hold_gradients` the big weights' gradients stay the bf16 sums their GEMMs produced (the head's
    with the loss's incoming gradient as a scale) and `.grad` stays empty; given to `.grad` (on leaving the
    hold) they are exactly what autograd's upcast gives without a hold. With two micro-batches in one hold
    the second arrival sends both to `.grad`, where they add up as without it."""
    from eagle3.draft.held_grads import hold_gradients

    embed, lm_head, mapping = make_world()
    plain = _bf16_unroll(embed, lm_head, mapping)
    with hold_gradients() as hold:
        held = _bf16_unroll(embed, lm_head, mapping)
        params = dict(held.named_parameters())
        assert {n for n, q in params.items() if q in hold} == HELD
        for name in HELD:
            assert params[name].grad is None and hold.gradients([params[name]])[0][0].dtype == torch.bfloat16, name
        assert float(hold.gradients([params["lm_head.weight"]])[0][1]) == 3.0
        assert all(q.grad is not None for n, q in params.items() if q.requires_grad and n not in HELD)
    assert len(hold) == 0  # released on leaving
    for (name, want), got in zip(plain.named_parameters(), held.parameters()):
        if want.requires_grad:
            assert torch.equal(got.grad, want.grad), name

    plain = _bf16_unroll(embed, lm_head, mapping, micro_batches=2)
    with hold_gradients() as hold:
        held = _bf16_unroll(embed, lm_head, mapping, micro_batches=2)
        assert len(hold) == 0  # each weight's second gradient sent the first to .grad
    for (name, want), got in zip(plain.named_parameters(), held.parameters()):
        if want.requires_grad:
            assert torch.equal(got.grad, want.grad), name


def test_clip_and_step_on_held_bf16_gradients_equals_torchs_adamw_on_their_fp32_grad(monkeypatch):
    """The clip's norm and the compiled AdamW's update (run eagerly here) read the held bf16 sums and the
    head's scale; torch's fused AdamW reads the fp32 `.grad` autograd made of the same sums: the same norm,
    the same clipped step, and nothing left held. The moments are compared too: AdamW's first update is
    ~lr x sign(g), blind to the gradient's scale."""
    from eagle3.draft.held_grads import hold_gradients
    from eagle3.training import adamw
    from eagle3.training.trainer import clip_and_step

    monkeypatch.setattr(adamw, "_enabled", True)  # eligible: the update as the trainer runs it on CUDA
    embed, lm_head, mapping = make_world()
    results = []
    for hold_them in (True, False):
        with hold_gradients(hold_them) as hold:
            draft = _bf16_unroll(embed, lm_head, mapping)
            params = [q for q in draft.parameters() if q.requires_grad]
            opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
            assert adamw.eligible(opt)
            norm = clip_and_step(opt, params, 0.05, hold)
            assert hold is None or len(hold) == 0
        results.append((float(norm), [t.detach().clone() for q in params
                                      for t in (q, opt.state[q]["exp_avg"], opt.state[q]["exp_avg_sq"])]))
    (norm_held, after_held), (norm_fp32, after_fp32) = results
    assert norm_fp32 > 0.05  # the clip is active
    assert norm_held == pytest.approx(norm_fp32, rel=1e-6)
    for i, (got, want) in enumerate(zip(after_held, after_fp32)):  # weight, moment 1, moment 2 per parameter
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7 if i % 3 == 0 else 1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_training_steps_on_cuda_are_the_same_with_persistent_weight_copies():
    """Three bf16 training steps that keep the persistent weight copies, against the same steps casting
    every weight at every unroll: with the compiled AdamW, which writes the copies, and with torch's fused
    AdamW (`train.compile: false`), whose kernel leaves the version counters alone (on the H200,
    2026-12-03, that run trained on its first weights: losses 11.44, 11.17, 11.04 against 11.44, 11.00,
    10.58). Each copy holds its updated master cast to bf16 at the end. Not bit for bit: step 1's loss
    differed in the 6th digit (10.995489 vs 10.995474; AdamW compiled with and without the copy's store
    presumably rounds a few weights differently). A copy one update stale moves the loss by the whole
    step (~4% here), far outside the bound. The compiled AdamW also runs once more reading the held bf16
    gradient sums (eagle3.draft.held_grads), as the trainer does: the same losses and grad norms."""
    import eagle3.draft.fused_layer as fused_layer
    from eagle3.draft.held_grads import hold_gradients
    from eagle3.training import adamw
    from eagle3.training.schedule import default_collate_fn
    from eagle3.training.trainer import clip_and_step

    embed, lm_head, mapping = make_world()
    batch = {k: v.cuda() for k, v in default_collate_fn(make_items(4, 3, embed, t_max=64)).items()}

    def three_steps(persistent: bool, hold: bool = False) -> tuple[list[float], int]:  # [loss, norm] x 3
        fused_layer.set_persistent_copies(persistent)
        draft = make_draft(embed, mapping).cuda()
        params = [q for q in draft.parameters() if q.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
        module = Eagle3TTTModule(draft, train_config(ttt_steps=4))
        p, ids, in_vocab = compute_teacher(batch["last_hidden_states"], lm_head.cuda(), draft.t2d)
        losses = []
        for _ in range(3):
            with hold_gradients(hold) as held:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss, _ = module(batch["input_ids"], batch["aux_hidden_states"], batch["loss_mask"].bool(),
                                     p, ids, in_vocab)
                loss.backward()
                assert held is None or len(held) == 9
                norm = clip_and_step(opt, params, 0.5, held)
            opt.zero_grad(set_to_none=True)
            losses += [loss.item(), norm.item()]
        for copy in {id(c): c for q in params if (c := fused_layer._shadows.get(q)) is not None}.values():
            copy.refresh([ref() for ref in copy.refs])  # as the next unroll would
        shadows = [(fused_layer.shadow_of(q), q) for q in params if fused_layer.shadow_of(q) is not None]
        for shadow, q in shadows:  # q cast, to the rounding of one bf16 step
            torch.testing.assert_close(shadow.float(), q.detach().bfloat16().float(), rtol=2**-7, atol=0)
        return losses, len(shadows)

    try:
        for compiled in (True, False):
            (adamw.compile_adamw if compiled else adamw.uncompile_adamw)()
            (losses_p, shadowed), (losses_c, none) = three_steps(True), three_steps(False)
            assert (shadowed, none) == (9, 0)  # fc, q, k, v, o, gate, up, down, lm_head (norms: as they are)
            assert losses_p[:2] == losses_c[:2], compiled  # the first unroll casts in both (loss, grad norm)
            assert losses_p == pytest.approx(losses_c, rel=1e-4), compiled
            if compiled:  # the trainer's path: AdamW and the clip read the bf16 gradient sums
                losses_h, _ = three_steps(True, hold=True)
                assert losses_h[:2] == pytest.approx(losses_p[:2], rel=1e-6)
                assert losses_h == pytest.approx(losses_p, rel=1e-4)
    finally:
        adamw.uncompile_adamw()
        fused_layer.set_persistent_copies(True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_adamw_update_on_cuda_equals_torchs_fused_adamw():
    from eagle3.training import adamw

    adamw.compile_adamw()
    try:
        got = _adamw_runs(adamw.adamw_step, "cuda")
    finally:
        adamw.uncompile_adamw()
    for a, b in zip(got, _adamw_runs(_torch_fused_step, "cuda")):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


# ---------------------------------------------------------------- integration: the real tiny target


@pytest.fixture(scope="module")
def tiny_dataset(tiny_target_dir, tmp_path_factory):
    """An offline dataset (fp32 dump) of the session tiny target, made by eagle3.data."""
    from eagle3.config import DataConfig, RegenerateConfig, TargetConfig
    from eagle3.data.generate import generate_dataset

    out = tmp_path_factory.mktemp("draft-data")
    cfg = DataConfig(num_samples=12, max_length=256, validation_fraction=0.25, shard_size=4, draft_vocab_size=64,
                     capture_batch_size=4, hidden_states_dtype="float32",
                     regenerate=RegenerateConfig(max_new_tokens=16, batch_size=4))
    summary = generate_dataset(tiny_target_dir, TargetConfig(), cfg, out, log=lambda m: None)
    return out, summary


def _integration_cfg(**kw) -> TrainConfig:
    return TrainConfig(**{**dict(ttt_steps=3, batch_size=3, max_steps=6, epochs=50, lr=3e-3, log_every=1,
                                 eval_every=3, checkpoint_every=3), **kw})


def test_train_draft_offline_then_export_on_the_tiny_target(tiny_dataset, tiny_target_dir, tmp_path):
    from eagle3.config import ExportConfig
    from eagle3.draft.vocab import load_draft_vocab
    from eagle3.export import export_checkpoint, load_exported, read_target_config, validate_sglang_checkpoint
    from eagle3.training.train import train_draft

    data_dir, data_summary = tiny_dataset
    aux = data_summary["aux_layer_ids"]
    metrics = []
    summary = train_draft(data_dir, tiny_target_dir, _integration_cfg(), tmp_path / "run", aux_layer_ids=aux,
                          draft_vocab_size=64, on_metrics=lambda s, m: metrics.append((s, m)), log=lambda m: None)
    assert summary["finished"] and summary["steps"] == 6 and summary["metrics_split"] == "val"
    last_val = [m for _, m in metrics if "val/loss" in m][-1]
    acc = [last_val[f"val/acc_{k}"] for k in range(3)]
    assert summary["acc"] == acc
    assert summary["simulated_accept_length"] == pytest.approx(1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2])
    assert Path(summary["curves_png"]).stat().st_size > 1000
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 6
    assert [s for s, m in metrics if "train/loss" in m] == [1, 2, 3, 4, 5, 6]

    result = export_checkpoint(Path(summary["checkpoint"]), tiny_target_dir,
                               ExportConfig(formats=["sglang", "speculators"], dtype="float32"), tmp_path / "export")
    sglang_dir = Path(result["formats"]["sglang"])
    assert validate_sglang_checkpoint(sglang_dir, read_target_config(tiny_target_dir)) == []
    exported = load_exported(sglang_dir, target_dir=tiny_target_dir)
    trained = load_draft_checkpoint(Path(summary["checkpoint"]), target_embedding=exported.embed_tokens.weight)
    vocab = load_draft_vocab(data_dir / "vocab")
    assert torch.equal(exported.d2t, vocab.d2t) and torch.equal(exported.t2d, vocab.t2d)
    assert exported.config.aux_layer_ids == aux
    ids = torch.randint(0, exported.config.vocab_size, (1, 5))
    aux_in = torch.randn(1, 5, exported.fc.in_features)
    with torch.no_grad():
        outs = [m.compute_logits(m.decoder_step(ids, m.project(aux_in), torch.arange(5)[None])[0])
                for m in (exported, trained)]
    assert torch.equal(outs[0], outs[1])

    with pytest.raises(ValueError, match="captured at aux layers"):
        train_draft(data_dir, tiny_target_dir, _integration_cfg(), tmp_path / "bad", aux_layer_ids=[0, 1, 2],
                    draft_vocab_size=64, log=lambda m: None)


def test_train_draft_online_features_match_offline(tiny_dataset, tiny_target_dir, tmp_path):
    """Online mode (target run inside training) sees the same features as the fp32 offline dump."""
    from eagle3.data.capture import TargetFeatureExtractor
    from eagle3.training.train import train_draft

    data_dir, data_summary = tiny_dataset
    aux = data_summary["aux_layer_ids"]
    cfg = _integration_cfg(max_steps=2, eval_every=2, checkpoint_every=2)
    runs = {}
    for mode, features in (("offline", None), ("online", TargetFeatureExtractor(tiny_target_dir, aux))):
        losses = []
        train_draft(data_dir, tiny_target_dir, cfg, tmp_path / mode, aux_layer_ids=aux, draft_vocab_size=64,
                    online_features=features, on_metrics=lambda s, m: losses.append(m), log=lambda m: None)
        runs[mode] = [m["train/loss"] for m in losses if "train/loss" in m]
    assert len(runs["online"]) == 2
    assert runs["online"] == pytest.approx(runs["offline"], rel=1e-4)


def test_bench_train_tiny_runs_on_cpu(tmp_path):
    """tests/benchmarks/bench_train.py --tiny: the GPU benchmark's code path, smoke-tested on CPU."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "benchmarks" / "bench_train.py"), "--tiny",
                           "--iters", "2", "--out", str(out)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    dense, fast = report["results"]
    assert (dense["variant"], fast["variant"]) == ("dense_eager", "fast_eager")
    assert fast["first_loss"] == pytest.approx(dense["first_loss"], rel=1e-5)
    assert fast["first_grad_norm"] == pytest.approx(dense["first_grad_norm"], rel=1e-4)
    assert report["flops_per_token"]["total"] > 0 and "MFU" in proc.stdout


@pytest.mark.slow
def test_train_draft_with_two_devices_relaunches_under_torchrun(tiny_dataset, tiny_target_dir, tmp_path):
    """devices=2 outside torchrun: train_draft relaunches itself (gloo on CPU) and relays metrics."""
    from eagle3.training.train import train_draft

    data_dir, data_summary = tiny_dataset
    metrics, logs = [], []
    summary = train_draft(data_dir, tiny_target_dir, _integration_cfg(devices=2, batch_size=2, max_steps=4,
                                                                        eval_every=4, checkpoint_every=4),
                          tmp_path, aux_layer_ids=data_summary["aux_layer_ids"], draft_vocab_size=64,
                          on_metrics=lambda s, m: metrics.append((s, m)), log=logs.append)
    assert summary["steps"] == 4 and summary["finished"], logs[-20:]
    assert [s for s, m in metrics if "train/loss" in m] == [1, 2, 3, 4]
    assert any("val/simulated_accept_length" in m for _, m in metrics)
    assert (tmp_path / "checkpoints" / "step_00000004" / "model.safetensors").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_trainer_on_cuda_compiled_bf16_learns_and_checkpoints(tmp_path):
    """The GPU training path end to end: bf16 autocast, compiled layer and loss, fused AdamW
    with the clip folded into it, frozen bf16 embedding."""
    trainer, metrics = _trainer(tmp_path, max_steps=40, eval_every=40, checkpoint_every=40, log_every=10)
    assert trainer.autocast_dtype == torch.bfloat16 and trainer.draft.embed_tokens.weight.dtype == torch.bfloat16
    summary = trainer.train()
    losses = [m["train/loss"] for _, m in metrics if "train/loss" in m]
    assert losses[-1] < 0.8 * losses[0], losses
    assert summary["finished"] and summary["metrics_split"] == "val"
    assert all(math.isfinite(m["train/grad_norm"]) for _, m in metrics if "train/grad_norm" in m)
    embed, _, _ = make_world()
    load_draft_checkpoint(Path(summary["checkpoint"]), target_embedding=embed)


# ---------------------------------------------------------------- scale-out: input pipeline, launch, FSDP


def _bench_train_module():
    """tests/benchmarks/bench_train.py, for its synthetic target and dataset writers."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_train", REPO / "tests" / "benchmarks" / "bench_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rank_steps_run_across_epoch_boundaries_from_any_step():
    plan = DataPlan(num_samples=10, batch_size=2, world_size=2, grad_accum=1, seed=3)  # 3 steps per epoch
    by_epoch = [b for e in range(3) for b in plan.rank_batches(e, 1, 0)]
    assert len(by_epoch) == 9 and list(plan.rank_steps(1, 0, 9)) == by_epoch
    assert list(plan.rank_steps(1, 2, 7)) == by_epoch[2:7]  # mid-epoch start, stop inside epoch 2
    accum = DataPlan(num_samples=12, batch_size=1, world_size=2, grad_accum=2, seed=0)  # 3 steps per epoch
    steps = list(accum.rank_steps(0, 2, 4))
    assert steps == list(accum.rank_batches(0, 0, 4)) + list(accum.rank_batches(1, 0, 0))[:2]


def test_loader_workers_train_exactly_like_the_training_thread(tmp_path):
    """num_workers > 0 reads and collates in other processes (pids recorded by the collate
    function) and gives bit-identical training to loading on the training thread. The 4 steps
    span 2 epochs, yet one set of training workers serves them (plus one for the evaluation)."""
    from eagle3.training.schedule import default_collate_fn

    runs = {}
    for workers in (0, 2):
        pids = tmp_path / f"pids-{workers}.txt"

        def collate(items, pids=pids):
            with open(pids, "a") as f:
                f.write(f"{os.getpid()}\n")
            return default_collate_fn(items)

        embed, lm_head, mapping = make_world()
        metrics = []
        cfg = train_config(**GLOBAL_BATCH, batch_size=6, grad_accum=2, num_workers=workers, prefetch_factor=2)
        Trainer(make_draft(embed, mapping), lm_head, cfg, make_items(24, 1, embed), make_items(8, 2, embed),
                tmp_path / f"run-{workers}", collate_fn=collate, on_metrics=lambda s, m: metrics.append(m),
                log=lambda s: None).train()
        runs[workers] = [(m["train/loss"], m["train/grad_norm"]) for m in metrics if "train/loss" in m]
        loader_pids = set(pids.read_text().split())
        assert (loader_pids == {str(os.getpid())}) == (workers == 0), loader_pids
        assert len(loader_pids) == (1 if workers == 0 else 2 * workers)  # training + final evaluation
    assert len(runs[0]) == 4 and runs[2] == runs[0]


def test_torchrun_env_gives_each_rank_its_share_of_the_cores():
    from eagle3.training.torchrun import torchrun_env

    cores = len(os.sched_getaffinity(0))
    env = torchrun_env(2, 1, {"PATH": "/bin"})
    assert env["OMP_NUM_THREADS"] == str(max(1, (cores - 2) // 2))
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO) and env["PATH"] == "/bin"
    assert torchrun_env(2, 1, {"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"  # an explicit choice is kept
    assert torchrun_env(64, 4, {})["OMP_NUM_THREADS"] == "1"  # never 0 on a small machine


FSDP_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, sys.argv[3])
    from test_train import make_world, make_draft, make_items, train_config
    from eagle3.training.trainer import Trainer
    precision, out = sys.argv[1], sys.argv[2]
    embed, lm_head, mapping = make_world()
    cfg = train_config(strategy="fsdp", devices=2, batch_size=2, max_steps=2, precision=precision, eval_every=2,
                       checkpoint_every=2)
    trainer = Trainer(make_draft(embed, mapping), lm_head, cfg, make_items(24, 1, embed), make_items(8, 2, embed),
                      out, log=lambda s: None)
    gathered, inputs = {}, {}

    def record(module, args, kwargs):  # runs after FSDP's own pre-forward (registered first): gathered weights
        gathered.update(fc=str(module.draft.fc.weight.dtype))
        inputs.update({k: str(kwargs[k].dtype) for k in ("target_p", "loss_norm") if k in kwargs})

    trainer.module.register_forward_pre_hook(record, with_kwargs=True)
    shards = {n: [p.to_local().numel() if hasattr(p, "to_local") else None, p.numel(), p.requires_grad]
              for n, p in trainer.module.named_parameters()}
    trainer.train()
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"shards": shards, "gathered": gathered, "inputs": inputs}, f)
    torch.distributed.destroy_process_group()
    """
)


@pytest.mark.slow
def test_fsdp_splits_every_parameter_and_gathers_bf16_weights(tmp_path):
    """Each rank holds half of every trained parameter at rest (master weights, hence grads and
    AdamW state); the frozen target embedding stays whole (never gathered); under bf16 the weights
    the forward sees are gathered in bf16, not fp32."""
    script = tmp_path / "fsdp_worker.py"
    script.write_text(FSDP_SCRIPT)
    proc = run_torchrun(script, "bf16", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    trained = {n: v for n, v in ranks[0]["shards"].items() if v[2]}
    assert len(trained) >= 10 and "draft.fc.weight" in trained
    for name, (local, total, _) in trained.items():
        assert local * 2 == total and ranks[1]["shards"][name] == [local, total, True], name
    assert ranks[0]["shards"]["draft.embed_tokens.weight"] == [None, V * HT, False]  # frozen: not a DTensor
    assert ranks[0]["gathered"] == ranks[1]["gathered"] == {"fc": "torch.bfloat16"}
    # the teacher distribution and the loss divisor reach the loss in fp32 (not cast with the weights)
    assert ranks[0]["inputs"] == {"target_p": "torch.float32", "loss_norm": "torch.float32"}
    losses = [h["train/loss"] for h in _history(tmp_path) if "train/loss" in h]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited while we looked
            continue
        if text in args:
            found.append(f"{cmdline.parent.name}: {args[:200]}")
    return found


@pytest.mark.slow
def test_a_failing_rank_is_named_with_its_log_and_nothing_is_left_running(tmp_path):
    """A validation shard from another capture (wrong aux width) that only rank 1 reads: rank 1
    dies in its first evaluation; train_draft raises naming rank 1, its error and log tail, and
    no rank, loader worker or torchrun outlives the call. Each rank ran with its share of the cores."""
    from eagle3.data.shards import _write_shard
    from eagle3.training.torchrun import torchrun_env
    from eagle3.training.train import train_draft

    bench = _bench_train_module()
    shape = bench.TINY
    target = bench.write_synthetic_target(tmp_path / "target", shape)
    data = bench.write_synthetic_dataset(tmp_path / "data", shape, {"train": [16] * 8, "validation": [16, 16]},
                                         shard_size=1)
    k_width = len(shape["aux_layer_ids"]) * shape["target_hidden_size"]
    _write_shard({"input_ids": torch.zeros(16, dtype=torch.long), "loss_mask": torch.ones(16, dtype=torch.uint8),
                  "lengths": torch.tensor([16]), "sample_ids": torch.tensor([9]),
                  "aux_hidden_states": torch.zeros(16, k_width + 8, dtype=torch.bfloat16),
                  "last_hidden_states": torch.zeros(16, shape["target_hidden_size"], dtype=torch.bfloat16)},
                 data / "hidden_states" / "validation-00001.safetensors")
    out = tmp_path / "run"
    cfg = TrainConfig(ttt_steps=2, batch_size=1, max_steps=3, eval_every=1, checkpoint_every=100, devices=2,
                      num_workers=1)
    logs = []
    with pytest.raises(RuntimeError) as failure:
        train_draft(data, target, cfg, out, aux_layer_ids=shape["aux_layer_ids"],
                    draft_vocab_size=shape["draft_vocab_size"], log=logs.append)
    message = str(failure.value)
    first = message.split("\n")[0]
    assert "rank 1 failed" in first and "ValueError: aux_hidden_states: expected last dim" in first, message[:2000]
    tail = message.split(f"--- last lines of {out / 'torchrun_logs'}")[1]  # rank 1's stderr.log, from its dir
    assert "/attempt_0/1/stderr.log ---" in tail and "[rank1]: ValueError: aux_hidden_states" in tail
    assert "rank 0 failed first" not in message  # rank 0 at most lost its peer (or torchrun stopped it first)
    assert not _processes_mentioning(str(out)), "processes left running"
    threads = torchrun_env(2, cfg.num_workers)["OMP_NUM_THREADS"]
    assert any(f"rank 0/2: {threads} torch threads, 1 loader workers" in line for line in logs), logs[-30:]


def test_bench_train_loop_tiny_runs_the_real_trainer_on_cpu(tmp_path):
    """bench_train.py --loop --tiny: train_draft on synthetic shards of the dataset format, timed
    per log window (the GPU benchmark's code path, one process on CPU)."""
    out = tmp_path / "loop.json"
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "benchmarks" / "bench_train.py"), "--loop", "--tiny",
                           "--modes", "single", "--steps", "4", "--log-every", "2", "--skip-windows", "1",
                           "--work-dir", str(tmp_path / "work"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    (single,) = json.loads(out.read_text())["results"]
    assert single["mode"] == "single" and single["steps"] == 4 and len(single["window_tokens_per_s"]) == 2
    assert single["tokens_per_s"] == single["window_tokens_per_s"][1] and single["mfu"] > 0
    assert math.isfinite(single["first_loss"]) and "tok/s/GPU" in proc.stdout
    history = [json.loads(line) for line in (tmp_path / "work" / "run-single" / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history if "train/loss" in h] == [2, 4]


def test_training_refuses_shards_whose_engine_hooked_other_layers():
    from eagle3.training.train import _check_dataset_layers

    manifest = {"architecture": "LlamaForCausalLM", "num_hidden_layers": 8, "aux_layer_ids": [1, 3, 4],
                "engine": {"name": "sglang", "version": "0.5.23", "capture_indices": [2, 4, 5]}}
    _check_dataset_layers(manifest, [1, 3, 4])  # Llama rule: ids + 1
    manifest["engine"]["capture_indices"] = [1, 3, 4]  # an engine that took the ids as indices
    with pytest.raises(ValueError, match=r"captured HF hidden_states \[1, 3, 4\].*from HF hidden_states \[2, 4, 5\]"):
        _check_dataset_layers(manifest, [1, 3, 4])


_WORKER = """
import sys, threading
from eagle3.training.loader import quiet_when_the_trainer_is_gone

def serve(error):  # as multiprocessing.resource_sharer's serving thread reports a failed hand-over
    try:
        raise error
    except BaseException:
        sys.excepthook(*sys.exc_info())

if sys.argv[1] == "quiet":
    quiet_when_the_trainer_is_gone(0)
for error in (BrokenPipeError(32, "Broken pipe"), ValueError("a real bug")):
    thread = threading.Thread(target=serve, args=(error,))
    thread.start()
    thread.join()
serve(ConnectionResetError("in the main thread"))
"""


@pytest.mark.parametrize("setup", ["plain", "quiet"])
def test_a_loader_worker_keeps_quiet_about_the_trainer_having_gone(setup):
    """SIGTERM to a training run can stop the trainer while a DataLoader worker hands it a batch; the worker's
    hand-over thread then prints a BrokenPipeError traceback into the run's log. With the worker setup the
    trainer installs, connection errors outside the worker's main thread print nothing; other errors do."""
    proc = subprocess.run([sys.executable, "-c", _WORKER, setup], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "ValueError: a real bug" in proc.stderr and "ConnectionResetError: in the main thread" in proc.stderr
    assert ("BrokenPipeError" in proc.stderr) == (setup == "plain")
