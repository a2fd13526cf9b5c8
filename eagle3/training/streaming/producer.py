"""The capture side of a stream: the train split's hidden states, shard by shard in training's
order, never more than the disk budget ahead of training (`python -m eagle3.training.streaming.producer`).

One process on the data host, with the target's capture engine (eagle3.data.engines: the HF
engine placed over its devices, or SGLang's runner). It waits for training's rank 0 to say which
slot it starts at (0, or the slot of the checkpoint it resumed from), then captures stream shard
after stream shard (`StreamPlan`: slots in DataPlan order, so epoch e's samples come in
randperm(seed + e) order and every epoch is captured again). Before writing a shard it makes
room: the shards on disk plus this one must fit `data.stream.disk_budget_gb`. Shards every rank
has consumed that lie behind rank 0's last checkpoint are deleted at once (never read again);
consumed shards ahead of it are kept while the budget allows -- a training side killed before
its next checkpoint then resumes without recapturing them -- and evicted, latest first, when
the room is needed. When the budget is full of shards training has not consumed, it waits. A served
night's train samples name their rows in the capture cache (`cached`, eagle3.data.served_capture): their
shards are copied from there, no forward.

Resume: a shard is written under a hidden temp name, renamed when complete, then listed in the
manifest; a restarted capture side keeps the listed shards whose files still have their size
and deletes everything else (temp files, unlisted shards, shards of another plan), so it never
redoes a finished shard and training never reads a partial one.

Risk: a capture side that outlives its training side (the orchestrator was killed) would wait
forever on a full budget: when no rank of its session progressed for the session's stall
timeout, or a newer session replaced it, it stops.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle3.config import DataConfig
from eagle3.data.cache_rows import shard_from_cache
from eagle3.data.capture import FeatureExtractor
from eagle3.data.disk import budget_problem
from eagle3.data.dump import capture_shard
from eagle3.data.files import LogFn, ProgressFn, atomic_write_text
from eagle3.data.shards import STATE_DTYPES, _temp_name, _write_hidden_shard, safetensors_bytes
from eagle3.data.state_codec import manifest_state_fields
from eagle3.training.streaming.layout import (
    MANIFEST,
    Session,
    StreamPlan,
    current_session_id,
    read_progress,
    read_session,
    shard_index,
    shard_name,
    stream_key,
    write_producer_state,
)

POLL_S = 0.5


class StreamStopped(RuntimeError):
    """The capture side stopped on its own: its training side went silent or another session replaced it."""


@dataclass
class _Figures:
    """What this session captured, for the summary: shards, tokens and capture time per epoch, the disk peak."""

    captured: int = 0  # shards written this session (captured or copied from the cache)
    reused: int = 0
    from_cache: int = 0  # shards copied from the served capture cache (no forward)
    tokens_from_cache: int = 0
    high_water: int = 0
    epochs: dict[int, dict] = field(default_factory=dict)

    def add(self, stream: StreamPlan, first: int, lengths: list[int], seconds: float) -> None:
        """Shard of `lengths` samples from slot `first`, captured in `seconds` (shared out by tokens)."""
        total = sum(lengths) or 1
        for offset, n in enumerate(lengths):
            epoch = self.epochs.setdefault(stream.epoch_of(first + offset), {"samples": 0, "tokens": 0,
                                                                              "capture_s": 0.0})
            epoch["samples"] += 1
            epoch["tokens"] += n
            epoch["capture_s"] += seconds * n / total

    def summary(self) -> dict:
        tokens = sum(e["tokens"] for e in self.epochs.values())
        seconds = sum(e["capture_s"] for e in self.epochs.values())
        return {"shards_captured": self.captured - self.from_cache, "shards_reused": self.reused,
                "tokens_captured": tokens,
                "shards_from_cache": self.from_cache, "tokens_from_cache": self.tokens_from_cache,
                "capture_s": seconds, "capture_tok_s": tokens / seconds if seconds else None,
                "disk_high_water_bytes": self.high_water,
                "epochs": [{"epoch": e, **v} for e, v in sorted(self.epochs.items())]}


class _Shelf:
    """The stream shards on disk and their manifest, within the budget (`make_room`)."""

    def __init__(self, directory: Path, session: Session, header: dict, budget: int) -> None:
        self.directory, self.session, self.header, self.budget = directory, session, header, budget
        self.stream = session.stream
        self.shards: dict[int, dict] = self._kept_shards()
        self.reserved = 0  # the shard being written
        self.peak = self.on_disk()  # the most bytes the stream's files took at once
        self.last_progress = time.monotonic()
        self.progress_seen: dict[int, float] = {}
        self._save()

    def _kept_shards(self) -> dict[int, dict]:
        """The listed shards of this key whose files are whole; everything else in the folder goes."""
        path = self.directory / MANIFEST
        old = json.loads(path.read_text()) if path.is_file() else {}
        listed = {entry["shard"]: entry for entry in old.get("shards", [])} if old.get("key") == self.header["key"] else {}
        kept = {k: e for k, e in listed.items()
                if (self.directory / shard_name(k)).is_file()
                and (self.directory / shard_name(k)).stat().st_size == e["bytes"]}
        for path in self.directory.glob(".shard-*.tmp"):  # a write a kill cut short
            path.unlink()
        for path in self.directory.glob("shard-*.safetensors"):
            if shard_index(path.name) not in kept:
                path.unlink()
        return kept

    def describe_engine(self, extractor: FeatureExtractor, data_cfg: DataConfig) -> None:
        """What the shards hold, in the manifest: the engine that captures (as the data stage's manifest says it)."""
        self.header.update({
            "architecture": extractor.architecture, "num_hidden_layers": extractor.num_hidden_layers,
            "hidden_size": extractor.hidden_size, "aux_layer_ids": extractor.aux_layer_ids,
            "hf_indices": extractor.hf_indices, "engine": extractor.engine_record(),
            **manifest_state_fields(data_cfg.hidden_states_dtype, extractor.hidden_size)})
        self._save()

    def on_disk(self) -> int:
        return sum(e["bytes"] for e in self.shards.values()) + self.reserved

    def add(self, shard: int, digest: str, size: int, first: int, end: int, tokens: int) -> None:
        os.replace(_temp_name(self.directory / shard_name(shard)), self.directory / shard_name(shard))
        self.shards[shard] = {"shard": shard, "file": shard_name(shard), "bytes": size, "sha256": digest,
                              "slots": [first, end], "num_tokens": tokens}
        self.reserved = 0
        self._save()

    def delete(self, shards: list[int]) -> None:
        for shard in shards:
            (self.directory / shard_name(shard)).unlink(missing_ok=True)
            del self.shards[shard]
        if shards:
            self._save()

    def _save(self) -> None:
        entries = [self.shards[k] for k in sorted(self.shards)]
        atomic_write_text(self.directory / MANIFEST, json.dumps({**self.header, "shards": entries}, indent=1))

    # ---------------------------------------------------------------- training's side, as its files say

    def training_marks(self, start: int) -> tuple[int, int]:
        """(slots every rank has consumed, slot of rank 0's last checkpoint) of this session; a rank that has
        not reported counts as at `start`. Notes the time of the last progress any rank made."""
        records = read_progress(self.directory, self.session.id)
        for rank, record in records.items():
            if self.progress_seen.get(rank) != record["mtime"]:
                self.progress_seen[rank], self.last_progress = record["mtime"], time.monotonic()
        world = self.stream.plan.world_size
        consumed = min(records[r]["consumed"] if r in records else start for r in range(world))
        checkpointed = records.get(0, {}).get("checkpointed", start)
        return consumed, checkpointed

    def drop_finished(self, start: int) -> None:
        """Delete the shards no one will read again: consumed by every rank and behind the last checkpoint."""
        consumed, checkpointed = self.training_marks(start)
        behind = min(consumed, checkpointed)
        self.delete([k for k, e in self.shards.items() if e["slots"][1] <= behind])

    def make_room(self, shard: int, size: int, start: int, poll_s: float) -> None:
        """Return once `shard`'s `size` bytes fit the budget; wait for training while the budget is full of shards
        it has not consumed. Evicted to make room: consumed shards, latest first (they lie ahead of the
        checkpoint, so a training kill now would read them again: those right after it are kept longest, which a
        resume reads first while it frees room for the rest), then shards kept from before that come after
        `shard`, latest first (training reads `shard` before them; holding them could leave no room for it)."""
        while True:
            self.drop_finished(start)
            consumed, _ = self.training_marks(start)
            evictable = dict.fromkeys(sorted((k for k, e in self.shards.items() if e["slots"][1] <= consumed),
                                             reverse=True)
                                      + sorted((k for k in self.shards if k > shard), reverse=True))
            for victim in evictable:
                if self.on_disk() + size <= self.budget:
                    break
                self.delete([victim])
            if self.on_disk() + size <= self.budget:
                self.reserved = size
                self.peak = max(self.peak, self.on_disk())
                return
            self.check_alive()
            time.sleep(poll_s)

    def check_alive(self) -> None:
        """StreamStopped when training went silent for the session's stall timeout or a newer session began."""
        if current_session_id(self.directory) != self.session.id:
            raise StreamStopped(f"another stream session replaced {self.session.id} in {self.directory}")
        silent = time.monotonic() - self.last_progress
        if silent > self.session.stall_timeout_s:
            raise StreamStopped(f"no training rank reported progress for {silent:.0f} s (train.stall_timeout_s "
                                f"{self.session.stall_timeout_s:.0f}): the training side is gone; stopping the capture")


def run_capture_side(directory: Path, data_cfg: DataConfig, data_fingerprint: str,
                     open_engine: Callable[[], AbstractContextManager[FeatureExtractor]], train_samples: list[dict],
                     progress: ProgressFn, log: LogFn, poll_s: float = POLL_S) -> dict:
    """The capture side of `directory`'s session (see the module docstring), until training consumed it all.

    Args:
        directory: the stream folder; its session.json (layout.start_session) holds the plan.
        data_cfg: shard size, capture batch size, dtype, data.stream.disk_budget_gb.
        data_fingerprint: the data stage's capture fingerprint (its hidden_states manifest).
        open_engine: opens the capture engine (HF or SGLang) -- after the folder is cleaned up, so the
            training side may read the shards kept from before while the engine loads.
        train_samples: the train split in dataset order (DataPlan's sample indices), each with input_ids,
            loss_mask and id.
    Returns the session's figures: shards captured and reused, tokens and seconds per epoch, the disk peak.
    The state (`producer.json`) says running, done or failed, with the error.
    """
    session = read_session(directory)
    try:
        if session.stream.plan.num_samples != len(train_samples):
            raise ValueError(f"the stream session plans {session.stream.plan.num_samples} train samples, the dataset "
                             f"has {len(train_samples)}")
        header = {"key": stream_key(data_fingerprint, session), "session": session.id, **session.stream.to_json(),
                  "budget_bytes": int(data_cfg.stream.disk_budget_gb * 1e9)}
        shelf = _Shelf(directory, session, header, header["budget_bytes"])
        write_producer_state(directory, session.id, "running")  # the folder holds only this stream's whole shards
        with open_engine() as extractor:
            summary = _produce(shelf, extractor, train_samples, data_cfg, progress, log, poll_s)
    except BaseException as err:
        write_producer_state(directory, session.id, "failed", error=f"{type(err).__name__}: {err}")
        raise
    write_producer_state(directory, session.id, "done")
    return summary


def _produce(shelf: _Shelf, extractor: FeatureExtractor, train_samples: list[dict], data_cfg: DataConfig,
             progress: ProgressFn, log: LogFn, poll_s: float) -> dict:
    stream = shelf.stream
    _check_budget(shelf.budget, stream, data_cfg, extractor)
    shelf.describe_engine(extractor, data_cfg)
    start = _training_start(shelf, poll_s)
    figures = _Figures()
    log(f"stream: training starts at slot {start} of {stream.total_slots}; {stream.num_shards} shards of "
        f"{stream.shard_size} samples, at most {shelf.budget / 1e9:.3f} GB on disk; {len(shelf.shards)} kept")
    dtype = STATE_DTYPES[data_cfg.hidden_states_dtype]
    metadata = {"stream_key": shelf.header["key"]}
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="stream-writer") as writer:
        pending: tuple[int, int, int, int, Future] | None = None
        for shard in range(stream.shard_of(start), stream.num_shards):
            if shard in shelf.shards:
                figures.reused += 1
                continue
            first, end = stream.slots_of(shard)
            members = [train_samples[i] for i in stream.plan.samples_of_slots(first, end)]
            began = time.perf_counter()
            if all("cached" in s for s in members):  # served nights: the data stage captured them into the cache
                tensors = shard_from_cache(members)
                figures.from_cache += 1
                figures.tokens_from_cache += sum(len(s["input_ids"]) for s in members)
            else:
                tensors = capture_shard(extractor, members, data_cfg.capture_batch_size, dtype)
                figures.add(stream, first, [len(s["input_ids"]) for s in members], time.perf_counter() - began)
            tensors["slots"] = torch.tensor([first, end], dtype=torch.long)
            _finish(shelf, pending, figures)
            shelf.make_room(shard, safetensors_bytes(tensors, metadata), start, poll_s)
            tokens = int(tensors["lengths"].sum())
            write = writer.submit(_write_hidden_shard, tensors, shelf.directory / shard_name(shard), metadata)
            pending = (shard, first, end, tokens, write)
            del tensors  # the writer holds the only reference
            progress("stream_capture", shard + 1, stream.num_shards)
        _finish(shelf, pending, figures)
    _wait_until_consumed(shelf, start, poll_s)
    figures.high_water = shelf.peak
    summary = figures.summary() | {"budget_bytes": shelf.budget, "shards": stream.num_shards}
    log(f"stream: done; captured {summary['shards_captured']} shards ({summary['tokens_captured']} tokens), copied "
        f"{figures.from_cache} from the capture cache ({figures.tokens_from_cache} tokens), kept "
        f"{figures.reused} from before; disk peak {figures.high_water / 1e9:.3f} GB of {shelf.budget / 1e9:.3f} GB")
    return summary


def _check_budget(budget: int, stream, data_cfg: DataConfig, extractor: FeatureExtractor) -> None:
    """The budget must hold every shard one optimizer step reads (layout.min_budget_shards), at their largest."""
    problem = budget_problem(budget, stream.plan.slots_per_step, data_cfg, extractor.hidden_size,
                             len(extractor.hf_indices))
    if problem:
        raise ValueError(problem)


def _training_start(shelf: _Shelf, poll_s: float) -> int:
    """The slot training started at in this session (0, or its checkpoint's), from rank 0's reports."""
    while True:
        record = read_progress(shelf.directory, shelf.session.id).get(0)
        if record is not None:
            shelf.last_progress = time.monotonic()
            return record["started"]
        shelf.check_alive()
        time.sleep(poll_s)


def _finish(shelf: _Shelf, pending, figures: _Figures) -> None:
    """Wait for the shard being written (if any), rename it into place and list it; nothing is pending after."""
    if pending is not None:
        shard, first, end, tokens, write = pending
        digest, size = write.result()
        shelf.add(shard, digest, size, first, end, tokens)
        figures.captured += 1


def _wait_until_consumed(shelf: _Shelf, start: int, poll_s: float) -> None:
    """After the last shard: delete shards as training finishes them, then whatever is left."""
    total = shelf.stream.total_slots
    while shelf.training_marks(start)[0] < total:
        shelf.drop_finished(start)
        shelf.check_alive()
        time.sleep(poll_s)
    shelf.delete(sorted(shelf.shards))


# --------------------------------------------------------------------------- command line (on the data host)


def main(argv: list[str] | None = None) -> int:
    """`python -m eagle3.training.streaming.producer --target-dir T --dataset-dir D --stream-dir S --config C.json`:
    the capture side of S's stream session, with the target at T and the data stage's dataset D (its train
    split, layers and fingerprint). Progress, log lines and the outcome are JSON lines on stdout."""
    import argparse
    import contextlib

    from eagle3.config import TargetConfig
    from eagle3.data.engines import open_capture_engine
    from eagle3.data.files import emit_event
    from eagle3.data.samples import SAMPLES_FILE, read_samples
    from eagle3.data.shards import MANIFEST as DATA_MANIFEST
    from eagle3.data.tiny_target import cpu_threads

    parser = argparse.ArgumentParser(prog="eagle3.training.streaming.producer", description=main.__doc__)
    for flag in ("--target-dir", "--dataset-dir", "--stream-dir", "--config"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args(argv)
    raw = json.loads(Path(args.config).read_text())
    target_cfg, data_cfg = TargetConfig.model_validate(raw["target"]), DataConfig.model_validate(raw["data"])
    dataset = Path(args.dataset_dir)
    data_manifest = json.loads((dataset / "hidden_states" / DATA_MANIFEST).read_text())
    train = read_samples(dataset / SAMPLES_FILE, "train")
    target_dir = Path(args.target_dir)
    try:
        with cpu_threads() if not torch.cuda.is_available() else contextlib.nullcontext():
            summary = run_capture_side(
                Path(args.stream_dir), data_cfg, data_manifest["fingerprint"],
                lambda: open_capture_engine(target_dir, target_cfg, data_cfg, data_manifest["aux_layer_ids"]), train,
                progress=lambda stage, done, total: emit_event("progress", stage=stage, done=done, total=total),
                log=lambda message: emit_event("log", message=message))
    except (ValueError, OSError, RuntimeError) as exc:
        emit_event("error", message=f"{type(exc).__name__}: {exc}")
        raise
    emit_event("done", summary=summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
