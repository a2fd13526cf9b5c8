"""The offline dump: the target's hidden states of every sample captured into shards
(`eagle3.data.shards`), resumable shard by shard.

Risk: the dump must keep pace with the target's forward: device->host copies overlap the next
batch's forward (`_HostCopier`, one for the whole dump) and each shard is written and hashed on a
writer thread while it is being captured (`_capture_and_write`, `_ShardStream`).
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from eagle3.config import DataConfig
from eagle3.data.capture import FeatureExtractor
from eagle3.data.disk import _dump_bytes, check_disk_space
from eagle3.data.files import LogFn, ProgressFn
from eagle3.data.state_codec import SCALES_KEY, encode_aux_fp8, scale_block
from eagle3.data.shards import (
    SPLITS,
    STATE_DTYPES,
    _clear_stale,
    _manifest_header,
    _safetensors_blocks,
    _shard_entry,
    _temp_name,
    _verified_shards,
    _write_manifest,
    plan_shards,
    write_hashed,
)


class _HostCopier:
    """Device -> host copies of captured states that overlap the next batch's forward.

    Each batch's packed states are copied (non_blocking, on a side stream) into one of two
    staging buffers, page-locked on CUDA so the copy is real DMA; the previous batch's buffer is
    then moved into the shard's host tensors while the GPU runs the current forward. The only
    waits are on a copy queued one batch earlier, never a sync per sample. On CPU the same
    ring runs with plain buffers and synchronous copies.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.slots: list[list[torch.Tensor]] = [[], []]
        self.pending: list[tuple[int, object, list[torch.Tensor]] | None] = [None, None]
        self.turn = 0

    def _staging(self, slot: int, sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        buffers = self.slots[slot]
        if len(buffers) != len(sources) or any(b.shape[0] < s.shape[0] for b, s in zip(buffers, sources, strict=True)):
            buffers = [torch.empty(s.shape, dtype=s.dtype, pin_memory=self.cuda) for s in sources]
            self.slots[slot] = buffers
        return [b[: s.shape[0]] for b, s in zip(buffers, sources, strict=True)]

    def copy(self, sources: Sequence[torch.Tensor], destinations: Sequence[torch.Tensor]) -> None:
        """Queue sources (device tensors) -> destinations (host tensors of the same shapes)."""
        slot, self.turn = self.turn, 1 - self.turn
        self._drain(slot)  # this slot's previous batch (two batches ago) must be out of it
        staging = self._staging(slot, sources)
        event = None
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(sources[0].device))  # sources are computed
            with torch.cuda.stream(self.stream):
                for dst, src in zip(staging, sources, strict=True):
                    dst.copy_(src, non_blocking=True)
                    src.record_stream(self.stream)  # keep src's memory until the copy has run
                event = torch.cuda.Event()
                event.record(self.stream)
        else:
            for dst, src in zip(staging, sources, strict=True):
                dst.copy_(src)
        self.pending[slot] = (slot, event, list(destinations))
        self._drain(1 - slot)  # the previous batch: its copy was queued before this forward ran

    def _drain(self, slot: int) -> None:
        if self.pending[slot] is None:
            return
        _, event, destinations = self.pending[slot]
        if event is not None:
            event.synchronize()
        for dst, src in zip(destinations, self.slots[slot], strict=True):
            dst.copy_(src[: dst.shape[0]])
        self.pending[slot] = None

    def finish(self) -> None:
        """Wait for every queued copy; the destinations are complete after this."""
        for slot in (self.turn, 1 - self.turn):
            self._drain(slot)


def capture_shard(extractor: FeatureExtractor, members: list[dict], batch_size: int, dtype: torch.dtype) -> dict:
    """Hidden states of one shard's samples, packed back to back (see module docstring).

    Per batch: one forward of the extractor (`capture_rows`: the real tokens only, on its device),
    converted to `dtype` there ([n_real, k*H] and [n_real, H]; torch.float8_e4m3fn: the aux states
    encoded as e4m3 + block scales, eagle3/data/state_codec.py, the last state in bf16), and one
    asynchronous copy of each into the shard's host tensors (`_HostCopier`), so copying batch b
    overlaps the forward of batch b + 1. Any extractor with `capture_rows`, `hf_indices`,
    `hidden_size` and `device` works: the HF engine's `TargetFeatureExtractor` or SGLang's
    (`eagle3.data.sglang_engine`).
    """
    tensors = _shard_tensors(extractor, members, dtype)
    copier = _HostCopier(extractor.device)
    for _ in _capture_batches(extractor, members, batch_size, dtype, tensors, copier):
        pass
    copier.finish()
    return tensors


_STATE_KEYS = ("aux_hidden_states", SCALES_KEY, "last_hidden_states")


def _shard_tensors(extractor: FeatureExtractor, members: list[dict], dtype: torch.dtype) -> dict:
    """A shard's tensors in file order: ids, loss mask, lengths and sample ids (filled), then the
    state tensors (allocated, filled batch by batch by `_capture_batches`)."""
    lengths = [len(s["input_ids"]) for s in members]
    k, hidden, tokens = len(extractor.hf_indices), extractor.hidden_size, sum(lengths)
    fp8 = dtype == torch.float8_e4m3fn
    tensors = {
        "input_ids": torch.tensor([t for s in members for t in s["input_ids"]], dtype=torch.long),
        "loss_mask": torch.tensor([t for s in members for t in s["loss_mask"]], dtype=torch.uint8),
        "lengths": torch.tensor(lengths, dtype=torch.long),
        "sample_ids": torch.tensor([s["id"] for s in members], dtype=torch.long),
        "aux_hidden_states": torch.empty((tokens, k * hidden), dtype=dtype),  # [N_tok, k*H]
    }
    if fp8:
        tensors[SCALES_KEY] = torch.empty((tokens, k * hidden // scale_block(hidden)), dtype=torch.float32)
    tensors["last_hidden_states"] = torch.empty((tokens, hidden), dtype=torch.bfloat16 if fp8 else dtype)
    return tensors


def _capture_batches(extractor: FeatureExtractor, members: list[dict], batch_size: int, dtype: torch.dtype,
                     tensors: dict, copier: _HostCopier) -> Iterator[int]:
    """Capture `members` batch by batch into the state tensors of `tensors` (see `capture_shard`);
    yields the rows queued so far after each batch. A batch's rows are in place once the copier has
    drained it: during the next `copier.copy` (whichever shard that batch is of) or `copier.finish`."""
    fp8 = dtype == torch.float8_e4m3fn
    block = scale_block(extractor.hidden_size)
    states = [tensors[key] for key in _STATE_KEYS if key in tensors]
    offset = 0
    for b in range(0, len(members), batch_size):
        rows = [s["input_ids"] for s in members[b : b + batch_size]]
        aux, last = extractor.capture_rows(rows)  # [n_real, k*H], [n_real, H] on the extractor's device
        packed = [*encode_aux_fp8(aux, block), last.bfloat16()] if fp8 else [aux.to(dtype), last.to(dtype)]
        n = aux.shape[0]
        copier.copy(packed, [out[offset : offset + n] for out in states])
        offset += n
        yield offset


_SHARD_WRITERS = 2


def dump_hidden_states(
    extractor: FeatureExtractor, samples: list[dict], directory: Path, data_cfg: DataConfig,
    fingerprint: str, progress: ProgressFn, log: LogFn, splits: tuple[str, ...] = SPLITS, reserve_bytes: int = 0,
) -> dict:
    """Write (or resume) the shards of `splits` + manifest.json; returns a small summary.

    Shards already written by a run with the same fingerprint and intact sha256 are kept;
    free space is checked for the remaining ones (plus `reserve_bytes` the host keeps for later,
    the streamed train shards' budget) before anything is computed.
    """
    directory.mkdir(parents=True, exist_ok=True)
    dtype = STATE_DTYPES[data_cfg.hidden_states_dtype]
    plan = plan_shards(samples, data_cfg.shard_size, splits)
    done = _verified_shards(directory, fingerprint)
    _clear_stale(directory, set(done))
    todo = [(name, members) for name, members in plan if name not in done]
    todo_tokens = sum(len(s["input_ids"]) for _, members in todo for s in members)
    k, hidden = len(extractor.hf_indices), extractor.hidden_size
    need = _dump_bytes(todo_tokens, sum(len(m) for _, m in todo), hidden, k, data_cfg.hidden_states_dtype)
    check_disk_space(directory, need + reserve_bytes, log)
    manifest = _manifest_header(extractor, data_cfg, fingerprint, samples, splits)
    entries = dict(done)
    planned = sum(len(m) for _, m in plan)
    counts = {"written": 0, "finished": sum(len(m) for name, m in plan if name in done)}
    progress("hidden_states", counts["finished"], planned)

    def on_written(name: str, members: list[dict], digest: str, size: int) -> None:
        entries[name] = _shard_entry(name, members, digest, size)
        counts["written"] += size
        counts["finished"] += len(members)
        _write_manifest(directory, manifest, [entries[n] for n, _ in plan if n in entries], complete=False)
        progress("hidden_states", counts["finished"], planned)

    try:
        _capture_and_write(extractor, todo, directory, data_cfg.capture_batch_size, dtype, on_written)
    except BaseException:  # e.g. a full disk: the other writer's finished temp file goes too (space freed)
        _clear_stale(directory, set(entries))
        raise
    _write_manifest(directory, manifest, [entries[n] for n, _ in plan], complete=True)
    total = sum(e["bytes"] for e in entries.values())
    return {"estimate_bytes": need, "bytes_written": counts["written"], "bytes_total": total,
            "shards": len(plan), "shards_reused": len(done), "engine": manifest["engine"]}


def _capture_and_write(
    extractor: FeatureExtractor, todo: list[tuple[str, list[dict]]], directory: Path, batch_size: int,
    dtype: torch.dtype, on_written: Callable[[str, list[dict], str, int], None],
) -> None:
    """Capture every shard of `todo` and write it on writer threads; `on_written(name, members,
    sha256, bytes)` runs in plan order once a shard's file is renamed into place.

    Shards stream: one `_HostCopier` serves the whole dump, so no shard boundary waits for the GPU to
    drain (the next shard's first forward is queued before the last batch's rows are copied out), and
    each shard's writer writes and hashes its file while the shard is captured, up to the aux rows
    copied so far (`_ShardStream`); the tensors after the aux states in the file wait for the last
    batch. So after the last forward only the tail of the last shard is left to write and hash
    (~40% of an fp8 shard, ~35% of a bf16 one, plus its last batch's aux rows) instead of the whole
    shard (one sha256 stream runs ~2 GB/s). At most _SHARD_WRITERS + 1 shards are in RAM. Files stay
    hidden until renamed here in plan order, right before `on_written` lists them: the visible shards
    are always those the manifest lists (plus, for an instant, the one being added).
    """
    pending: collections.deque = collections.deque()  # (name, members, write future, stream), plan order
    queued: collections.deque = collections.deque()  # (stream, rows) of batches whose copy may be in flight
    copier = _HostCopier(extractor.device)

    def release(keep: int) -> None:
        while len(queued) > keep:
            stream, rows = queued.popleft()
            stream.rows_ready(rows)

    def finish_oldest() -> None:
        name, members, write, stream = pending.popleft()
        if not stream.complete():  # its last batch is still in the copier: drain it (never wait on it)
            copier.finish()
            release(0)
        digest, size = write.result()
        os.replace(_temp_name(directory / name), directory / name)
        on_written(name, members, digest, size)

    with ThreadPoolExecutor(max_workers=_SHARD_WRITERS, thread_name_prefix="shard-writer") as writer:
        try:
            for name, members in todo:
                while len(pending) >= _SHARD_WRITERS:
                    finish_oldest()
                stream = _ShardStream(_shard_tensors(extractor, members, dtype))
                pending.append((name, members, writer.submit(_write_streamed_shard, stream, directory / name), stream))
                for rows in _capture_batches(extractor, members, batch_size, dtype, stream.tensors, copier):
                    queued.append((stream, rows))
                    release(1)  # copy() has drained every batch queued before this one
            copier.finish()
            release(0)
            while pending:
                finish_oldest()
        except BaseException:
            for *_, stream in pending:  # writers waiting for rows that will not come
                stream.abort()
            raise


class _ShardStream:
    """A shard whose state rows arrive batch by batch, and how far its file can be written so far.

    File order (`_safetensors_blocks`): header, the ids/mask/lengths/sample ids (known before the
    capture), the aux states (rows in capture order), then the scales and last states, which can
    only follow once every row is in."""

    def __init__(self, tensors: dict) -> None:
        self.tensors: dict | None = tensors
        aux = tensors["aux_hidden_states"]
        keys = list(tensors)
        header = len(next(iter(_safetensors_blocks(tensors))))
        self.aux_start = header + sum(_nbytes(tensors[k]) for k in keys[: keys.index("aux_hidden_states")])
        self.row_bytes = aux.shape[1] * aux.element_size()
        self.total_rows = aux.shape[0]
        self.size = header + sum(_nbytes(t) for t in tensors.values())
        self.rows, self.aborted = 0, False
        self.changed = threading.Condition()

    def rows_ready(self, rows: int) -> None:
        with self.changed:
            self.rows = rows
            self.changed.notify_all()

    def abort(self) -> None:
        with self.changed:
            self.aborted = True
            self.changed.notify_all()

    def complete(self) -> bool:
        return self.rows == self.total_rows

    def wait_until_written(self, end: int) -> None:
        """Block until the file's bytes [0, end) are in the tensors (raise if the capture stopped)."""
        with self.changed:
            while not self.aborted and end > (self.size if self.complete() else
                                              self.aux_start + self.rows * self.row_bytes):
                self.changed.wait()
            if self.aborted:
                raise RuntimeError("shard capture stopped before its states were complete")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _write_streamed_shard(stream: _ShardStream, path: Path) -> tuple[str, int]:
    """`_write_hidden_shard` of a shard still being captured: each block is written (and hashed, on a
    second thread, in file order) once the rows it holds are in. Same bytes, same temp name."""
    try:
        return write_hashed(path, _safetensors_blocks(stream.tensors), ready=stream.wait_until_written)
    finally:
        stream.tensors = None  # the shard's RAM goes as soon as its file is written
