"""The data stage end to end on the tiny target (eagle3.data.generate): offline shards, datasets, resume after SIGKILL, disk and vocab refusals, online mode."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

import eagle3.data.disk as disk_mod
import eagle3.data.tiny_target as tiny_target_mod
from eagle3.config import DataConfig, RegenerateConfig, TargetConfig
from eagle3.data.capture import TargetFeatureExtractor, capture_hidden_states
from eagle3.data.datasets import HiddenStateDataset, TokenizedDataset, collate_hidden_states
from eagle3.data.disk import InsufficientDiskSpaceError
from eagle3.data.files import file_sha256
from eagle3.data.generate import generate_dataset
from eagle3.data.prompts import builtin_conversations
from eagle3.data.samples import read_samples
from eagle3.data.target import load_target
from eagle3.environment import hidden_state_bytes as estimate_hidden_state_bytes


def _data_cfg(**overrides) -> DataConfig:
    fields = dict(
        num_samples=10,
        max_length=256,  # the test target's context; prompts of >= 256 tokens are dropped
        validation_fraction=0.2,
        shard_size=3,
        draft_vocab_size=64,
        capture_batch_size=4,
        regenerate=RegenerateConfig(max_new_tokens=12, batch_size=4),
    )
    return DataConfig(**(fields | overrides))


@pytest.fixture(scope="module")
def offline_run(tiny_target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("offline")
    events = []
    summary = generate_dataset(
        tiny_target_dir, TargetConfig(), _data_cfg(), out, lambda *e: events.append(e), log=lambda m: None
    )
    return out, summary, events


def test_offline_summary_and_manifest(offline_run):
    out, summary, events = offline_run
    n = summary["num_samples"]
    kept = n["train"] + n["validation"]
    assert kept + summary["num_dropped"] == 10 and kept >= 5 and n["validation"] == round(kept * 0.2)
    assert summary["aux_layer_ids"] == [1, 2, 3] and summary["hf_indices"] == [2, 3, 4]
    assert summary["architecture"] == "LlamaForCausalLM" and summary["hidden_size"] == 32
    assert 0 < summary["loss_mask_fraction"] < 1
    assert {stage for stage, _, _ in events} == {"prompts", "regenerate", "tokenize", "vocab", "hidden_states"}
    assert events[-1] == ("hidden_states", 10 - summary["num_dropped"], 10 - summary["num_dropped"])
    manifest = json.loads((out / "hidden_states" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["dtype"] == "bfloat16" and manifest["num_aux"] == 3
    tokens = summary["num_tokens"]["train"] + summary["num_tokens"]["validation"]
    assert sum(e["num_tokens"] for e in manifest["shards"]) == tokens
    assert [e["file"] for e in manifest["shards"]][0] == "train-00000.safetensors"
    assert all(e["sha256"] == file_sha256(out / "hidden_states" / e["file"]) for e in manifest["shards"])
    assert summary["hidden_states_bytes"] == sum(e["bytes"] for e in manifest["shards"])
    assert summary["hidden_states_estimate_bytes"] >= estimate_hidden_state_bytes(tokens, 32)
    assert (out / "vocab" / "vocab_map.safetensors").is_file() and summary["vocab"]["draft_vocab_size"] == 64


def test_samples_are_greedy_target_answers(offline_run, tiny_target_dir):
    out, _, _ = offline_run
    sample = json.loads((out / "samples.jsonl").read_text().splitlines()[0])
    model, tokenizer = load_target(tiny_target_dir)
    prompt = tokenizer.apply_chat_template(sample["messages"][:-1], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    stop = [tokenizer.convert_tokens_to_ids("<|end|>"), tokenizer.eos_token_id]
    new = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids),
        generation_config=GenerationConfig(do_sample=False, max_new_tokens=12, eos_token_id=stop, pad_token_id=2),
    )[0, ids.shape[1]:].tolist()
    new = new[: next((i for i, t in enumerate(new) if t in stop), len(new))]
    assert sample["messages"][-1]["content"] == tokenizer.decode(new, skip_special_tokens=True)


def test_hidden_state_dataset_matches_a_fresh_capture(offline_run, tiny_target_dir):
    out, summary, _ = offline_run
    train = HiddenStateDataset(out / "hidden_states", "train")
    assert len(train) == summary["num_samples"]["train"]
    assert len(HiddenStateDataset(out, "validation")) == summary["num_samples"]["validation"]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    first = next(s for s in samples if s["split"] == "train")
    item = train[0]
    assert set(item) == {"input_ids", "loss_mask", "aux_hidden_states", "last_hidden_states"}
    assert item["input_ids"].tolist() == first["input_ids"] and item["loss_mask"].tolist() == first["loss_mask"]
    assert item["input_ids"].dtype == torch.int64 and item["loss_mask"].dtype == torch.int64
    t = len(first["input_ids"])
    assert item["aux_hidden_states"].shape == (t, 96) and item["last_hidden_states"].shape == (t, 32)
    assert item["aux_hidden_states"].dtype == torch.bfloat16
    model, _ = load_target(tiny_target_dir)
    ids = torch.tensor([first["input_ids"]])
    aux, last = capture_hidden_states(model, ids, torch.ones_like(ids), [1, 2, 3])
    torch.testing.assert_close(item["aux_hidden_states"].float(), aux[0], atol=0.05, rtol=0.02)
    torch.testing.assert_close(item["last_hidden_states"].float(), last[0], atol=0.05, rtol=0.02)
    batch = collate_hidden_states([train[0], train[1]])
    assert batch["aux_hidden_states"].shape[:2] == batch["attention_mask"].shape == batch["input_ids"].shape


DATA_WORKER = textwrap.dedent(
    """
    import json, sys, threading
    from pathlib import Path
    import torch
    import eagle3.data.tiny_target
    from eagle3.config import DataConfig, TargetConfig
    from eagle3.data.generate import generate_dataset

    # one thread in every run: the killed, resumed and uninterrupted runs must compute alike
    eagle3.data.tiny_target._thread_count = lambda requested=0, own_threads=0: 1
    torch.set_num_threads(1)
    target, out, pause_stage, pause_at, cfg_json = sys.argv[1:6]

    def emit(*event):
        print(json.dumps(event), flush=True)

    def on_progress(stage, done, total):
        emit("progress", stage, done, total)
        if stage == pause_stage and done >= int(pause_at):
            emit("paused", stage, done, total)
            threading.Event().wait()  # until the test's SIGKILL

    summary = generate_dataset(Path(target), TargetConfig(), DataConfig.model_validate_json(cfg_json), Path(out),
                               on_progress=on_progress, log=lambda m: emit("log", m))
    emit("summary", summary)
    """
)


def _run_data_worker(script: Path, target: Path, out: Path, cfg: DataConfig, pause: tuple[str, int] | None):
    """Run DATA_WORKER; with `pause`, SIGKILL it once it reports that point (its output is on disk
    by then). Returns the events it printed."""
    stage, at = pause or ("never", 0)
    cmd = [sys.executable, str(script), str(target), str(out), stage, str(at), cfg.model_dump_json()]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3]), "OMP_NUM_THREADS": "1"}
    with open(out.parent / f"{out.name}-stderr.txt", "a") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True)
    watchdog = threading.Timer(300, proc.kill)  # a hung child fails the test instead of hanging it
    watchdog.start()
    events = []
    try:
        for line in proc.stdout:
            if line.startswith("["):
                events.append(json.loads(line))
            if events and events[-1][0] == "paused":
                os.killpg(proc.pid, signal.SIGKILL)
                break
        proc.wait(timeout=60)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()
    expected_rc = -signal.SIGKILL if pause else 0
    assert proc.returncode == expected_rc, (out.parent / f"{out.name}-stderr.txt").read_text()[-3000:]
    return events


def _logs(events) -> list[str]:
    return [e[1] for e in events if e[0] == "log"]


def test_sigkilled_data_stage_resumes_to_the_uninterrupted_dataset(tiny_target_dir, tmp_path, monkeypatch):
    """A real SIGKILL in regeneration, a regeneration log cut mid-line, a SIGKILL after the first
    shard; the resumed dataset equals an uninterrupted run's and finished work is not redone."""
    cfg = _data_cfg(num_samples=8, validation_fraction=0.25, shard_size=2, capture_batch_size=2,
                    hidden_states_dtype="float32", regenerate=RegenerateConfig(max_new_tokens=12, batch_size=1))
    script = tmp_path / "data_worker.py"
    script.write_text(DATA_WORKER)
    out = tmp_path / "killed"

    # 1. killed in regeneration, after some answers were recorded
    _run_data_worker(script, tiny_target_dir, out, cfg, pause=("regenerate", 4))
    (log_path,) = out.glob(".regenerated-*.jsonl")
    records = log_path.read_bytes()
    complete = records.count(b"\n")
    assert complete >= 4 and not (out / "samples.jsonl").exists()
    log_path.write_bytes(records[:-9])  # as if the kill had landed in the middle of the last record
    kept = records[: records.rindex(b"\n", 0, len(records) - 1) + 1]  # the complete records before it

    # 2. resume; stop at tokenization, while the regeneration log is still on disk
    events = _run_data_worker(script, tiny_target_dir, out, cfg, pause=("tokenize", 0))
    assert f"regenerate: resuming, {complete - 1}/8 answers already done" in _logs(events)
    resumed_log = log_path.read_bytes()
    assert resumed_log.startswith(kept)  # earlier answers neither redone nor rewritten
    indices = [json.loads(line)["i"] for line in resumed_log.splitlines()]
    assert sorted(indices) == list(range(8))  # each prompt once; the cut record was answered again

    # 3. resume; killed right after the first shard
    _run_data_worker(script, tiny_target_dir, out, cfg, pause=("hidden_states", 1))
    hs = out / "hidden_states"
    assert sorted(p.name for p in hs.iterdir() if not p.name.startswith(".")) == \
        ["manifest.json", "train-00000.safetensors"]
    assert not json.loads((hs / "manifest.json").read_text())["complete"]
    with pytest.raises(ValueError, match="incomplete"):
        HiddenStateDataset(hs)
    kept_mtimes = {p: p.stat().st_mtime_ns for p in (out / "samples.jsonl", hs / "train-00000.safetensors")}

    # 4. resume to the end; then an uninterrupted run for comparison
    events = _run_data_worker(script, tiny_target_dir, out, cfg, pause=None)
    summary = events[-1][1]
    assert any("reusing" in m for m in _logs(events)) and summary["shards_reused"] == 1
    assert not [e for e in events if e[0] == "progress" and e[1] == "regenerate"]
    assert {p: p.stat().st_mtime_ns for p in kept_mtimes} == kept_mtimes  # finished work not rewritten
    straight = tmp_path / "straight"
    _run_data_worker(script, tiny_target_dir, straight, cfg, pause=None)
    files = sorted(p.relative_to(straight) for p in straight.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert Path("hidden_states/train-00001.safetensors") in files
    for rel in files:
        assert (out / rel).read_bytes() == (straight / rel).read_bytes(), rel

    # 5. a corrupted finished shard is found by its sha256 and rewritten; the others are reused
    shard = hs / "train-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    monkeypatch.setattr(tiny_target_mod, "_thread_count", lambda requested=0, own_threads=0: 1)  # as the workers
    again = generate_dataset(tiny_target_dir, TargetConfig(), cfg, out, log=lambda m: None)
    manifest = json.loads((hs / "manifest.json").read_text())
    assert again["shards_reused"] == len(manifest["shards"]) - 1
    assert again["bytes_written"] == shard.stat().st_size
    assert shard.read_bytes() == (straight / "hidden_states" / shard.name).read_bytes()


def test_disk_space_error_names_the_numbers(tiny_target_dir, tmp_path, monkeypatch):
    class Usage:
        free = 1000

    monkeypatch.setattr(disk_mod.shutil, "disk_usage", lambda path: Usage)
    cfg = _data_cfg(num_samples=4, regenerate=RegenerateConfig(enabled=False))
    expected = r"need \d+ bytes .* but only 1000 bytes \(0\.000 GB\) are free"
    with pytest.raises(InsufficientDiskSpaceError, match=expected):
        generate_dataset(tiny_target_dir, TargetConfig(), cfg, tmp_path, log=lambda m: None)
    assert not list((tmp_path / "hidden_states").glob("*.safetensors"))


def test_online_mode_and_reference_answers(tiny_target_dir, tmp_path):
    cfg = _data_cfg(num_samples=6, hidden_states="online", regenerate=RegenerateConfig(enabled=False))
    summary = generate_dataset(tiny_target_dir, TargetConfig(aux_layer_ids=[0, 5]), cfg, tmp_path, log=lambda m: None)
    assert not (tmp_path / "hidden_states").exists() and summary["hidden_states_bytes"] == 0
    assert summary["aux_layer_ids"] == [0, 5] and summary["hf_indices"] == [1, 6]
    builtin = builtin_conversations(6, seed=0)
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    # the true continuations, not regenerated; order kept (prompts >= 256 tokens are dropped)
    positions = [builtin.index(s["messages"]) for s in samples]
    assert positions == sorted(positions) and len(positions) + summary["num_dropped"] == 6
    train = TokenizedDataset(tmp_path, "train")
    assert len(train) == summary["num_samples"]["train"] and set(train[0]) == {"input_ids", "loss_mask"}
    batch = collate_hidden_states([train[0], train[1]])
    extractor = TargetFeatureExtractor(tiny_target_dir, aux_layer_ids=[0, 5])
    aux, last = extractor(batch["input_ids"], batch["attention_mask"])
    assert aux.shape == (*batch["input_ids"].shape, 64) and last.shape == (*batch["input_ids"].shape, 32)


def test_draft_vocab_larger_than_target_is_rejected(tiny_target_dir, tmp_path):
    with pytest.raises(ValueError, match=r"draft_vocab_size=512 exceeds the target vocab \(300\)"):
        generate_dataset(tiny_target_dir, TargetConfig(), DataConfig(), tmp_path, log=lambda m: None)


def test_samples_carry_the_targets_own_greedy_token_stream(offline_run, tiny_target_dir):
    """Answers are kept as the ids the target generated, not re-tokenized from their text:
    serving decodes the target's own stream, so that is what the draft must train on."""
    out, _, _ = offline_run
    model, _ = load_target(tiny_target_dir)
    same = total = 0
    for sample in read_samples(out / "samples.jsonl"):
        ids, mask = sample["input_ids"], sample["loss_mask"]
        start = mask.index(1)
        assert all(mask[start:])  # prompt masked out, the whole answer masked in
        with torch.inference_mode():
            greedy = model.generate(torch.tensor([ids[:start]]), max_new_tokens=len(ids) - start, do_sample=False)
        same += sum(a == b for a, b in zip(greedy[0, start:].tolist(), ids[start:]))
        total += len(ids) - start
    # Batched (left-padded) generation may flip a near-tie now and then, hence not == 1.
    assert same / total >= 0.95
