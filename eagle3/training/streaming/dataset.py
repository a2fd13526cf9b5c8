"""The training side of a stream: the train split read by slot as the capture side writes it.

`StreamedDataset[slot]` is the sample DataPlan puts at that slot, read from the stream shard that
holds it (waiting for the capture side while it is not there yet); items have the contract of
`eagle3.data.datasets.HiddenStateDataset`. The trainer (eagle3.training.trainer) asks for slots
instead of sample indices when its train data is a StreamedDataset, and reports through `report`
what it consumed and where it checkpointed, which is what lets the capture side delete shards.

A shard is opened for each item and closed at once (safetensors copies the rows out): a loader
worker never keeps a deleted shard's disk space alive. Each shard is checked before use: its
stream key (the dataset's capture fingerprint + training's order) and its slots.

Risk: waiting forever on a capture side that died. While it waits, the reader checks the capture
side's state: failed (its error is raised here), dead (its pid is gone), or never started within
the session's stall timeout.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from safetensors import safe_open
from torch.utils.data import Dataset

from eagle3.data.datasets import shard_item
from eagle3.data.state_codec import FP8, STATE_DTYPES
from eagle3.training.schedule import DataPlan
from eagle3.training.streaming.layout import (
    producer_alive,
    read_producer_state,
    read_session,
    shard_name,
    stream_key,
    write_progress,
)

MAX_POLL_S = 1.0


class StreamGone(RuntimeError):
    """The capture side failed, died or never came: the shard training waits for will not arrive."""


class StreamedDataset(Dataset):
    """The train split of a stream session (`directory/session.json`), item i = slot i (see module docstring).

    Args:
        directory: the stream folder.
        data_manifest: the data stage's hidden_states manifest (dtype, capture fingerprint).
        decode: as HiddenStateDataset: "device" keeps fp8 states encoded for the trainer to decode on its GPU.
    """

    def __init__(self, directory: Path | str, data_manifest: dict, decode: str = "device") -> None:
        self.directory = Path(directory)
        session = read_session(self.directory)
        self.session, self.stream, self.stall_timeout_s = session.id, session.stream, session.stall_timeout_s
        self.key = stream_key(data_manifest["fingerprint"], session)
        self.dtype = data_manifest.get("dtype", "bfloat16")
        if self.dtype not in STATE_DTYPES:
            raise ValueError(f"stream of {self.directory}: dtype {self.dtype!r} is none of {sorted(STATE_DTYPES)}")
        self.decode_on_host = decode == "host" and self.dtype == FP8
        self._started: int | None = None
        self._checkpointed = 0
        self._capture_side_ready = False

    def __len__(self) -> int:
        """The train split's sample count (DataPlan's num_samples); the items are read by slot."""
        return self.stream.plan.num_samples

    # ---------------------------------------------------------------- the trainer's side of the session

    def check_plan(self, plan: DataPlan, total_steps: int) -> None:
        """The trainer's order must be the one the capture side follows."""
        if plan != self.stream.plan or total_steps != self.stream.total_steps:
            raise ValueError(f"the stream session in {self.directory} was planned for {self.stream.plan} over "
                             f"{self.stream.total_steps} steps; this training runs {plan} over {total_steps}")

    def report(self, rank: int, step: int, checkpoint: bool = False) -> None:
        """Rank `rank` finished the steps before `step` (and, for rank 0 with `checkpoint`, saved them)."""
        slot = self.stream.slot_of_step(step)
        if self._started is None:
            self._started = slot
        if checkpoint:
            self._checkpointed = slot
        write_progress(self.directory, self.session, rank, self._started, slot,
                       self._checkpointed if rank == 0 else None)

    # ---------------------------------------------------------------- items

    def __getitem__(self, slot: int) -> dict[str, torch.Tensor]:
        shard = self.stream.shard_of(slot)
        path = self._wait_for(shard)
        with safe_open(str(path), framework="pt") as fh:
            self._check_shard(fh, path, shard)
            lengths = fh.get_slice("lengths")[:].tolist()
            row = slot - self.stream.slots_of(shard)[0]
            start, length = sum(lengths[:row]), lengths[row]
            # get_slice copies the rows: nothing maps the file once it closes
            return shard_item(lambda key: fh.get_slice(key)[start : start + length], self.dtype, self.decode_on_host)

    def _check_shard(self, fh, path: Path, shard: int) -> None:
        key = (fh.metadata() or {}).get("stream_key")
        slots = fh.get_slice("slots")[:].tolist()
        if key != self.key or tuple(slots) != self.stream.slots_of(shard):
            raise ValueError(f"{path} holds slots {slots} of stream {key}, expected slots "
                             f"{list(self.stream.slots_of(shard))} of stream {self.key}: it was captured for another "
                             "dataset or training order")

    def _wait_for(self, shard: int) -> Path:
        """The shard's path once the capture side of this session has written it -- or kept it from before:
        nothing in the folder is read before that side has cleaned it up (its state says running)."""
        path = self.directory / shard_name(shard)
        waited, pause = time.monotonic(), 0.01
        while not (self._ready() and path.is_file()):
            self._check_capture_side(shard, time.monotonic() - waited)
            time.sleep(pause)
            pause = min(pause * 2, MAX_POLL_S)
        return path

    def _ready(self) -> bool:
        if not self._capture_side_ready:
            self._capture_side_ready = read_producer_state(self.directory, self.session) is not None
        return self._capture_side_ready

    def _check_capture_side(self, shard: int, waited_s: float) -> None:
        state = read_producer_state(self.directory, self.session)
        if state is None:
            if waited_s > self.stall_timeout_s:
                raise StreamGone(f"waited {waited_s:.0f} s for {shard_name(shard)} and no capture side of session "
                                 f"{self.session} started in {self.directory} (train.stall_timeout_s)")
            return
        if state["state"] == "failed":
            raise StreamGone(f"the capture side failed before {shard_name(shard)}: {state.get('error')}")
        if state["state"] == "done" or not producer_alive(state):
            what = "finished" if state["state"] == "done" else f"(pid {state['pid']}) is gone"
            raise StreamGone(f"the capture side {what} without writing {shard_name(shard)} in {self.directory}")
