"""The stream folder both sides share, and the small files through which they talk.

`<training out_dir>/stream/` on the data host, beside training's checkpoints:
- `session.json`: written before either side starts, by whoever starts both (`start_session`):
  the session id, the plan (`StreamPlan`: DataPlan, total steps, shard size), the stall timeout.
  A side that finds another session id there stops: it belongs to a run that was replaced.
- `manifest.json`: the capture side's record: what its shards hold (key, engine, dtype) and the
  shards on disk now, with bytes, sha256 and slots; per-epoch capture figures.
- `shard-000012.safetensors`: slots [12 S, 13 S) in training order (the eagle3.data.shards
  format); `.shard-000012.safetensors.tmp` while it is written, never read.
- `producer.json`: the capture side's state: session, pid, running / done / failed (+ its error).
- `progress/rank-00003.json`: each training rank's session, the slots it has consumed and, for
  rank 0, the slot of its last checkpoint.

Risk: a side acting on the other's stale files. Every file carries the session id and is
written atomically (temp + rename); files of another session are ignored.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3.config import TrainConfig
from eagle3.data.files import atomic_write_text
from eagle3.training.schedule import DataPlan, planned_steps

STREAM_DIR = "stream"
SESSION, MANIFEST, PRODUCER = "session.json", "manifest.json", "producer.json"
PROGRESS_DIR = "progress"


@dataclass(frozen=True)
class StreamPlan:
    """Training's order cut into stream shards: shard k holds slots [k * shard_size, (k + 1) * shard_size)."""

    plan: DataPlan
    total_steps: int
    shard_size: int

    @property
    def total_slots(self) -> int:
        return self.total_steps * self.plan.slots_per_step

    @property
    def num_shards(self) -> int:
        return math.ceil(self.total_slots / self.shard_size)

    def shard_of(self, slot: int) -> int:
        return slot // self.shard_size

    def slots_of(self, shard: int) -> tuple[int, int]:
        """[first, end) slots of `shard`."""
        first = shard * self.shard_size
        return first, min(first + self.shard_size, self.total_slots)

    def slot_of_step(self, step: int) -> int:
        """The first slot optimizer step `step` consumes (= the slots all earlier steps consumed)."""
        return step * self.plan.slots_per_step

    def epoch_of(self, slot: int) -> int:
        return slot // self.plan.slots_per_epoch

    def to_json(self) -> dict:
        return {"plan": asdict(self.plan), "total_steps": self.total_steps, "shard_size": self.shard_size}

    @classmethod
    def from_json(cls, data: dict) -> StreamPlan:
        return cls(DataPlan(**data["plan"]), data["total_steps"], data["shard_size"])


def plan_stream(train_cfg: TrainConfig, num_train_samples: int, world_size: int, shard_size: int) -> StreamPlan:
    """The stream of a training run: its DataPlan and step count, exactly as the Trainer makes them."""
    plan = DataPlan(num_train_samples, train_cfg.batch_size, world_size, train_cfg.grad_accum, train_cfg.seed)
    return StreamPlan(plan, planned_steps(plan, train_cfg.epochs, train_cfg.max_steps), shard_size)


@dataclass(frozen=True)
class Session:
    id: str
    stream: StreamPlan
    stall_timeout_s: float


def stream_key(data_fingerprint: str, session: Session) -> str:
    """What decides every stream shard's content: the dataset's capture fingerprint (samples, target, layers,
    engine, dtype) and training's order (DataPlan, shard size); written into each shard and checked by the
    training side. The run's length (total steps) decides only how many shards there are."""
    payload = [data_fingerprint, asdict(session.stream.plan), session.stream.shard_size]
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def shard_name(shard: int) -> str:
    return f"shard-{shard:06d}.safetensors"


def shard_index(name: str) -> int:
    return int(name.removeprefix("shard-").removesuffix(".safetensors"))


def start_session(directory: Path, stream: StreamPlan, stall_timeout_s: float) -> Session:
    """A new session in `directory`: both sides of it start after this, and ignore older sessions' files."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / PROGRESS_DIR).mkdir(exist_ok=True)
    for stale in (directory / PROGRESS_DIR).glob("*.json"):
        stale.unlink()
    session = Session(uuid.uuid4().hex, stream, stall_timeout_s)
    _write_json(directory / SESSION, {"id": session.id, **stream.to_json(), "stall_timeout_s": stall_timeout_s,
                                      "created": time.time()})
    return session


def read_session(directory: Path) -> Session:
    path = Path(directory) / SESSION
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no stream session (start_session is called before either side starts)")
    data = json.loads(path.read_text())
    return Session(data["id"], StreamPlan.from_json(data), data["stall_timeout_s"])


def current_session_id(directory: Path) -> str | None:
    try:
        return json.loads((Path(directory) / SESSION).read_text())["id"]
    except (FileNotFoundError, ValueError, KeyError):
        return None


# --------------------------------------------------------------------------- training's progress


def write_progress(directory: Path, session: str, rank: int, started: int, consumed: int,
                   checkpointed: int | None = None) -> None:
    """Rank `rank` started this session at slot `started` and has consumed every slot below `consumed`; rank 0
    also names its last checkpoint's slot."""
    record = {"session": session, "rank": rank, "started": started, "consumed": consumed, "time": time.time()}
    if checkpointed is not None:
        record["checkpointed"] = checkpointed
    _write_json(Path(directory) / PROGRESS_DIR / f"rank-{rank:05d}.json", record)


def read_progress(directory: Path, session: str) -> dict[int, dict]:
    """This session's progress records by rank (ranks that have not reported yet are absent)."""
    found = {}
    for path in (Path(directory) / PROGRESS_DIR).glob("rank-*.json"):
        record = _read_json(path)
        if record and record.get("session") == session:
            found[record["rank"]] = record | {"mtime": path.stat().st_mtime}
    return found


# --------------------------------------------------------------------------- the capture side's state


def write_producer_state(directory: Path, session: str, state: str, error: str | None = None) -> None:
    """`running` (with this process's pid and start time), `done` or `failed` (with the error)."""
    record = {"session": session, "state": state, "pid": os.getpid(), "started": _process_start(os.getpid())}
    if error is not None:
        record["error"] = error
    _write_json(Path(directory) / PRODUCER, record)


def read_producer_state(directory: Path, session: str) -> dict | None:
    record = _read_json(Path(directory) / PRODUCER)
    return record if record and record.get("session") == session else None


def producer_alive(record: dict) -> bool:
    """The process a `running` producer record names still runs (the same process: pid and start time)."""
    return _process_start(record["pid"]) == record.get("started")


def _process_start(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _write_json(path: Path, data: dict) -> None:
    atomic_write_text(path, json.dumps(data, indent=1))


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    """`python -m eagle3.training.streaming.layout start DIR --plan JSON --stall-timeout-s S`: a new session in
    DIR (on the data host, before either side starts); prints its id."""
    import argparse

    parser = argparse.ArgumentParser(prog="eagle3.training.streaming.layout", description=main.__doc__)
    parser.add_argument("command", choices=["start"])
    parser.add_argument("directory")
    parser.add_argument("--plan", required=True, help="StreamPlan.to_json() as JSON")
    parser.add_argument("--stall-timeout-s", type=float, required=True)
    args = parser.parse_args(argv)
    session = start_session(Path(args.directory), StreamPlan.from_json(json.loads(args.plan)), args.stall_timeout_s)
    print(session.id)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
