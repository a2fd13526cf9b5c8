"""Streamed hidden states (eagle3.training.streaming): the real capture side (`python -m
eagle3.training.streaming.producer`, the tiny target) and the real trainer, meeting in a stream
folder on a tmpfs mounted for the test, whose usage the test samples itself.

Oracles: an offline run on the same samples (captured one sample per forward on both sides, so
the states are bit-equal) for the loss per step; the filesystem's own usage for the disk bound;
the uninterrupted run for every resume.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from eagle3.config import DataConfig, RegenerateConfig, StreamConfig, TargetConfig, TrainConfig
from eagle3.data.samples import SAMPLES_FILE, SAMPLES_META
from eagle3.training.schedule import DataPlan
from eagle3.training.streaming.layout import (
    MANIFEST,
    StreamPlan,
    plan_stream,
    read_producer_state,
    shard_name,
    start_session,
)
from tests.helpers import mounted_tmpfs

REPO = Path(__file__).resolve().parents[3]
BUDGET_GB = 0.0012  # ~3 shards of ~0.4 MB: the whole stream (2 epochs, 18 shards) is ~7 MB
TRAIN_SAMPLES = 34  # of the 64 built-in prompts, those whose answer fits data.max_length
SMALL_FILES = 160 << 10  # the stream's JSON files and their temp copies: 4 KiB pages on the tmpfs


def data_config(mode: str, budget_gb: float = BUDGET_GB, dtype: str = "float32") -> DataConfig:
    stream = StreamConfig(disk_budget_gb=budget_gb) if mode == "stream" else None
    return DataConfig(num_samples=64, max_length=256, validation_fraction=0.2, shard_size=4, draft_vocab_size=64,
                      capture_batch_size=1, hidden_states_dtype=dtype, hidden_states=mode, stream=stream,
                      regenerate=RegenerateConfig(max_new_tokens=48, batch_size=8))


def train_config(**kw) -> TrainConfig:
    return TrainConfig(**{**dict(ttt_steps=3, batch_size=4, epochs=2, lr=3e-3, log_every=1, eval_every=9,
                                 checkpoint_every=5, num_workers=0, stall_timeout_s=60), **kw})


@pytest.fixture(scope="module")
def datasets(tiny_target_dir, tmp_path_factory):
    """The same samples twice (34 train, 8 validation): every split captured offline, and the validation split
    only (stream)."""
    from eagle3.data.generate import generate_dataset

    root = tmp_path_factory.mktemp("stream-data")
    offline, streamed = root / "offline", root / "stream"
    summary = generate_dataset(tiny_target_dir, TargetConfig(), data_config("offline"), offline, log=lambda m: None)
    streamed.mkdir()
    for name in (SAMPLES_FILE, SAMPLES_META):  # the same samples: the data stage reuses them by fingerprint
        shutil.copy(offline / name, streamed / name)
    generate_dataset(tiny_target_dir, TargetConfig(), data_config("stream"), streamed, log=lambda m: None)
    assert summary["num_samples"]["train"] == TRAIN_SAMPLES
    return offline, streamed, summary["aux_layer_ids"]


@pytest.fixture
def disk(tmp_path):
    """A 32 MiB tmpfs mounted as the stream folder of a training run at tmp_path/run: its usage counts every
    byte there, deleted-but-open files too (and nothing of the run's checkpoints beside it)."""
    with mounted_tmpfs(tmp_path / "run" / "stream", "32m") as mount:
        yield mount


class UsageProbe:
    """The tmpfs's used bytes, sampled every millisecond on a thread; `peak` is the most seen."""

    def __init__(self, mount: Path) -> None:
        self.mount, self.peak, self.samples, self._stop = mount, 0, 0, threading.Event()
        self._base = shutil.disk_usage(mount).used
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, shutil.disk_usage(self.mount).used - self._base)
            self.samples += 1
            time.sleep(0.001)

    def __enter__(self) -> UsageProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def start_producer(tiny_target_dir: Path, dataset: Path, stream_dir: Path, tmp_path: Path,
                   budget_gb: float = BUDGET_GB, dtype: str = "float32") -> subprocess.Popen:
    config = tmp_path / "producer.json"
    config.write_text(json.dumps({"target": TargetConfig().model_dump(mode="json"),
                                  "data": data_config("stream", budget_gb, dtype).model_dump(mode="json")}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "eagle3.training.streaming.producer", "--target-dir",
                             str(tiny_target_dir), "--dataset-dir", str(dataset), "--stream-dir", str(stream_dir),
                             "--config", str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)


def producer_outcome(proc: subprocess.Popen) -> dict:
    """The producer's `done` event (its summary); fails the test with its output otherwise."""
    out, _ = proc.communicate(timeout=120)
    events = [json.loads(line) for line in out.splitlines() if line.startswith('{"event"')]
    done = [e for e in events if e["event"] == "done"]
    assert proc.returncode == 0 and done, out[-3000:]
    return done[0]["summary"]


def begin(out_dir: Path, cfg: TrainConfig) -> Path:
    """A stream session of the train split on one rank, as the train_draft task starts one."""
    stream_dir = out_dir / "stream"
    start_session(stream_dir, plan_stream(cfg, TRAIN_SAMPLES, 1, 4), cfg.stall_timeout_s)
    return stream_dir


def run_training(dataset: Path, tiny_target_dir: Path, cfg: TrainConfig, out_dir: Path, aux: list[int]) -> list[dict]:
    from eagle3.training.train import train_draft

    rows: list[dict] = []
    train_draft(dataset, tiny_target_dir, cfg, out_dir, aux_layer_ids=aux, draft_vocab_size=64,
                on_metrics=lambda step, m: rows.append({"step": step, **m}), log=lambda m: None)
    return rows


def losses(rows: list[dict]) -> list[tuple]:
    return [(r["step"], r.get("train/loss"), r.get("val/loss")) for r in rows if "train/loss" in r or "val/loss" in r]


# --------------------------------------------------------------------------- the order


def test_stream_shards_hold_the_slots_in_training_order():
    plan = DataPlan(num_samples=5, batch_size=2, world_size=1, grad_accum=1, seed=7)
    perm0 = torch.randperm(5, generator=torch.Generator().manual_seed(7)).tolist()
    perm1 = torch.randperm(5, generator=torch.Generator().manual_seed(8)).tolist()
    # 3 global batches of 2 per epoch, the last one wrapped around: 6 slots per epoch
    assert plan.epoch_order(0) == perm0 + perm0[:1] and plan.slots_per_epoch == 6
    stream = StreamPlan(plan, total_steps=5, shard_size=4)  # 5 steps = 10 slots over 2 epochs -> 3 shards
    assert (stream.total_slots, stream.num_shards, stream.slots_of(2)) == (10, 3, (8, 10))
    assert plan.samples_of_slots(4, 8) == [perm0[4], perm0[0], perm1[0], perm1[1]]  # shard 1 crosses the epoch
    assert list(plan.rank_steps(0, 2, 4, slots=True)) == [[4, 5], [6, 7]]
    assert list(plan.rank_steps(0, 2, 4)) == [plan.samples_of_slots(4, 6), plan.samples_of_slots(6, 8)]
    two = DataPlan(num_samples=8, batch_size=1, world_size=2, grad_accum=2, seed=0)
    assert list(two.rank_steps(1, 0, 2, slots=True)) == [[1], [3], [5], [7]]  # rank 1: the 2nd of each pair


# --------------------------------------------------------------------------- loss, disk, deletion


@pytest.mark.slow
def test_streamed_training_has_the_offline_loss_per_step_within_the_disk_bound(
        datasets, tiny_target_dir, disk, tmp_path):
    offline, streamed, aux = datasets
    cfg = train_config()
    expected = losses(run_training(offline, tiny_target_dir, cfg, tmp_path / "offline", aux))

    out_dir = disk.parent
    stream_dir = begin(out_dir, cfg)
    with UsageProbe(disk) as usage:
        producer = start_producer(tiny_target_dir, streamed, stream_dir, tmp_path)
        rows = run_training(streamed, tiny_target_dir, cfg.model_copy(update={"num_workers": 2}), out_dir, aux)
        summary = producer_outcome(producer)

    assert losses(rows) == expected and len(expected) == 18 + 2  # 9 steps an epoch (34 samples, 4 a step), 2 validations
    budget = int(BUDGET_GB * 1e9)
    whole_stream = summary["tokens_captured"] * (4 * 32 * 4)  # fp32, 3 aux + last, H 32
    assert whole_stream > 3 * budget  # so a capture side that ignored the budget would break it
    print(f"stream disk: tmpfs peak {usage.peak} B ({usage.samples} samples), capture side's own peak "
          f"{summary['disk_high_water_bytes']} B, budget {budget} B, whole stream {whole_stream} B")
    assert usage.samples > 100 and 0 < usage.peak <= budget + SMALL_FILES, (usage.peak, budget)
    assert summary["disk_high_water_bytes"] <= budget
    assert summary["shards_captured"] == 18 and [e["samples"] for e in summary["epochs"]] == [36, 36]  # 2 wrapped
    assert not list(stream_dir.glob("*.safetensors"))  # every shard deleted once consumed
    assert json.loads((stream_dir / MANIFEST).read_text())["shards"] == []


@pytest.mark.slow
def test_fp8_streamed_shards_train_like_fp8_offline_shards(datasets, tiny_target_dir, tmp_path):
    """data.hidden_states_dtype float8_e4m3 streams too: encoded states and their scales, decoded by the trainer."""
    from eagle3.data.generate import generate_dataset

    offline32, _, aux = datasets
    folders = {"offline": tmp_path / "offline-fp8", "stream": tmp_path / "stream-fp8"}
    for mode, folder in folders.items():
        folder.mkdir()
        for name in (SAMPLES_FILE, SAMPLES_META):
            shutil.copy(offline32 / name, folder / name)
        generate_dataset(tiny_target_dir, TargetConfig(), data_config(mode, dtype="float8_e4m3"), folder,
                         log=lambda m: None)
    cfg = train_config(max_steps=6)
    expected = losses(run_training(folders["offline"], tiny_target_dir, cfg, tmp_path / "offline", aux))
    out_dir = tmp_path / "run"
    stream_dir = begin(out_dir, cfg)
    producer = start_producer(tiny_target_dir, folders["stream"], stream_dir, tmp_path, dtype="float8_e4m3")
    rows = run_training(folders["stream"], tiny_target_dir, cfg, out_dir, aux)
    summary = producer_outcome(producer)
    assert losses(rows) == expected and len(expected) == 6 + 1  # 6 steps, the validation after the last
    assert json.loads((stream_dir / MANIFEST).read_text())["dtype"] == "float8_e4m3" and summary["shards_captured"] == 6


# --------------------------------------------------------------------------- kills


@pytest.mark.slow
def test_a_killed_capture_side_resumes_keeping_its_finished_shards(datasets, tiny_target_dir, tmp_path):
    offline, streamed, aux = datasets
    cfg = train_config(max_steps=12)
    expected = losses(run_training(offline, tiny_target_dir, cfg, tmp_path / "offline", aux))
    out_dir = tmp_path / "run"
    stream_dir = begin(out_dir, cfg)
    producer = start_producer(tiny_target_dir, streamed, stream_dir, tmp_path)
    killer = threading.Thread(target=kill_when, args=(producer, lambda: listed(stream_dir) >= 2), daemon=True)
    killer.start()
    from eagle3.training.streaming.dataset import StreamGone

    with pytest.raises(StreamGone, match="is gone"):
        run_training(streamed, tiny_target_dir, cfg, out_dir, aux)
    killer.join()
    assert listed(stream_dir) >= 2  # (a shard being written when the kill came is left as a temp file: dropped next)

    begin(out_dir, cfg)  # the rerun: a new session; training resumes from its checkpoint (or step 0)
    producer = start_producer(tiny_target_dir, streamed, stream_dir, tmp_path)
    rows = run_training(streamed, tiny_target_dir, cfg, out_dir, aux)
    summary = producer_outcome(producer)
    assert summary["shards_reused"] >= 1 and summary["shards_captured"] + summary["shards_reused"] <= 12
    resumed_at = rows[0]["step"]
    assert losses(rows) == [row for row in expected if row[0] >= resumed_at]


@pytest.mark.slow
def test_a_killed_training_side_resumes_from_its_checkpoint_without_recapturing_kept_shards(
        datasets, tiny_target_dir, tmp_path):
    offline, streamed, aux = datasets
    cfg = train_config(max_steps=12, checkpoint_every=4)
    out_dir = tmp_path / "run"
    stream_dir = begin(out_dir, cfg)
    roomy = 4 * BUDGET_GB  # ~11 shards: no shard is ever evicted for room, so every kept one must be used
    producer = start_producer(tiny_target_dir, streamed, stream_dir, tmp_path, roomy)
    trainer = start_training_process(streamed, tiny_target_dir, cfg, out_dir, aux, tmp_path)
    kill_when(trainer, lambda: trained_steps(out_dir) >= 6)  # past the checkpoint at step 4
    producer.send_signal(signal.SIGTERM)  # as the orchestrator stops the capture side after a failed training
    producer.wait(timeout=60)
    on_disk = {p.name for p in stream_dir.glob("shard-*.safetensors")}

    begin(out_dir, cfg)
    producer = start_producer(tiny_target_dir, streamed, stream_dir, tmp_path, roomy)
    rows = run_training(streamed, tiny_target_dir, cfg, out_dir, aux)
    summary = producer_outcome(producer)
    assert rows[0]["step"] == 5  # resumed after the step-4 checkpoint
    needed = {shard_name(k) for k in range(4, 12)}  # steps 5..12 read slots 16..47: shards 4..11
    assert summary["shards_reused"] == len(needed & on_disk) >= 1
    assert summary["shards_captured"] == len(needed - on_disk)
    uninterrupted = losses(run_training(offline, tiny_target_dir, cfg, tmp_path / "offline", aux))
    assert losses(rows) == [row for row in uninterrupted if row[0] >= 5]


def test_the_capture_side_stops_when_no_training_rank_reports(datasets, tiny_target_dir, tmp_path):
    _, streamed, _ = datasets
    stream_dir = tmp_path / "stream"
    start_session(stream_dir, plan_stream(train_config(), TRAIN_SAMPLES, 1, 4), stall_timeout_s=2)
    producer = start_producer(tiny_target_dir, streamed, stream_dir, tmp_path)
    out, _ = producer.communicate(timeout=120)
    assert producer.returncode != 0 and "no training rank reported progress" in out, out[-2000:]
    state = read_producer_state(stream_dir, json.loads((stream_dir / "session.json").read_text())["id"])
    assert state["state"] == "failed" and "StreamStopped" in state["error"]


def test_a_budget_below_one_steps_shards_is_refused_naming_the_field(datasets, tiny_target_dir, tmp_path):
    import contextlib

    from eagle3.data.capture import TargetFeatureExtractor
    from eagle3.data.samples import read_samples
    from eagle3.training.streaming.producer import run_capture_side

    _, streamed, aux = datasets
    stream_dir = tmp_path / "stream"
    start_session(stream_dir, plan_stream(train_config(batch_size=8), TRAIN_SAMPLES, 1, 4), stall_timeout_s=5)
    small = data_config("stream").model_copy(update={"stream": StreamConfig(disk_budget_gb=0.0005)})
    extractor = TargetFeatureExtractor(tiny_target_dir, aux)
    with pytest.raises(ValueError, match=r"data.stream.disk_budget_gb 0.0005 GB is below .* reads up to 3 shards"):
        run_capture_side(stream_dir, small, "fingerprint", lambda: contextlib.nullcontext(extractor),
                         read_samples(streamed / SAMPLES_FILE, "train"), lambda *a: None, lambda m: None)
    assert read_producer_state(stream_dir, json.loads((stream_dir / "session.json").read_text())["id"])["state"] == "failed"


def test_a_restarted_capture_side_keeps_only_whole_listed_shards(tmp_path):
    from eagle3.training.streaming.producer import _Shelf

    stream_dir = tmp_path / "stream"
    session = start_session(stream_dir, plan_stream(train_config(), TRAIN_SAMPLES, 1, 4), stall_timeout_s=5)
    for k, size in ((0, 100), (1, 100), (2, 100), (3, 100)):
        (stream_dir / shard_name(k)).write_bytes(b"x" * size)
    (stream_dir / f".{shard_name(4)}.tmp").write_bytes(b"partial")
    (stream_dir / shard_name(2)).write_bytes(b"x" * 60)  # cut short outside our writer: size differs
    header = {"key": "k1"}
    listed = [{"shard": k, "file": shard_name(k), "bytes": 100, "slots": [4 * k, 4 * k + 4]} for k in (0, 2, 3)]
    (stream_dir / MANIFEST).write_text(json.dumps({"key": "k1", "shards": listed}))
    shelf = _Shelf(stream_dir, session, header, budget=10_000)
    assert sorted(shelf.shards) == [0, 3]  # 1 unlisted (renamed, then killed before listing), 2 the wrong size
    assert sorted(p.name for p in stream_dir.iterdir() if p.suffix in (".safetensors", ".tmp")) == [
        shard_name(0), shard_name(3)]
    other = _Shelf(stream_dir, session, {"key": "k2"}, budget=10_000)  # another plan
    assert other.shards == {} and not list(stream_dir.glob("shard-*"))


# --------------------------------------------------------------------------- helpers of the kill tests


def listed(stream_dir: Path) -> int:
    try:
        return len(json.loads((stream_dir / MANIFEST).read_text())["shards"])
    except (FileNotFoundError, ValueError):
        return 0


def trained_steps(out_dir: Path) -> int:
    try:
        rows = [json.loads(line) for line in (out_dir / "history.jsonl").read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return 0
    return max((r["step"] for r in rows), default=0)


def kill_when(proc: subprocess.Popen, condition, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None and time.monotonic() < deadline, "the process ended before the kill"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def start_training_process(dataset: Path, tiny_target_dir: Path, cfg: TrainConfig, out_dir: Path, aux: list[int],
                           tmp_path: Path) -> subprocess.Popen:
    """The training side as its own process (`python -m eagle3.training.train`, a rank's entry), to be killed."""
    config = tmp_path / "train.json"
    config.write_text(cfg.model_dump_json())
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "eagle3.training.train", "--data-dir", str(dataset), "--target-dir",
                             str(tiny_target_dir), "--out-dir", str(out_dir), "--config", str(config),
                             "--aux-layer-ids", ",".join(map(str, aux)), "--draft-vocab-size", "64"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def test_room_is_made_from_consumed_shards_latest_first_then_from_kept_shards_read_last(tmp_path):
    """The eviction order, on a shelf of fake shards of 100 bytes each: (1) consumed shards ahead of the
    checkpoint go latest first, so those a resume reads first stay; (2) with nothing consumed, shards kept from
    before that come after the one to write go, latest first."""
    from eagle3.training.streaming.layout import write_progress
    from eagle3.training.streaming.producer import _Shelf

    stream_dir = tmp_path / "stream"
    session = start_session(stream_dir, plan_stream(train_config(), TRAIN_SAMPLES, 1, 4), stall_timeout_s=5)
    listed = []
    for k in range(2, 7):  # shards 2..6 on disk: slots 8..28
        (stream_dir / shard_name(k)).write_bytes(b"x" * 100)
        listed.append({"shard": k, "file": shard_name(k), "bytes": 100, "slots": [4 * k, 4 * k + 4]})
    (stream_dir / MANIFEST).write_text(json.dumps({"key": "k", "shards": listed}))
    shelf = _Shelf(stream_dir, session, {"key": "k"}, budget=500)
    # training started at its checkpoint, slot 8 (shard 2), and has consumed shards 2 and 3
    write_progress(stream_dir, session.id, 0, started=8, consumed=16, checkpointed=8)
    shelf.make_room(7, 100, start=8, poll_s=0.01)
    assert sorted(shelf.shards) == [2, 4, 5, 6]  # 3 went, 2 (read first after a kill) stayed

    other = tmp_path / "other"
    session = start_session(other, plan_stream(train_config(), TRAIN_SAMPLES, 1, 4), stall_timeout_s=5)
    for entry in listed:
        (other / entry["file"]).write_bytes(b"x" * 100)
    (other / MANIFEST).write_text(json.dumps({"key": "k", "shards": listed}))
    shelf = _Shelf(other, session, {"key": "k"}, budget=500)
    # a resume at slot 4 (shard 1, not on disk): nothing consumed yet; shard 1 needs room first
    write_progress(other, session.id, 0, started=4, consumed=4, checkpointed=4)
    shelf.make_room(1, 100, start=4, poll_s=0.01)
    assert sorted(shelf.shards) == [2, 3, 4, 5] and shelf.reserved == 100  # 6, read last, gave up its room
