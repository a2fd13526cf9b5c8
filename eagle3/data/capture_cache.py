"""The capture cache on the data host: hidden-state shards earlier nights captured, found again by each
sample's content, so a night captures only what no earlier night captured (`data.served.cache`).

Layout of one cache folder (`data.served.cache`):

    <cache>/<space>/space.json      what decides the states (target identity, aux layer ids, dtype, engine)
                                    and the dump header of the first capture (engine record, sizes)
    <cache>/<space>/index.json      every shard: its night, bytes, mtime, sha256 and the content address,
                                    split and token count of each of its rows (row = the sample's place in it)
    <cache>/<space>/nights/<id>/    one night's capture: `eagle3.data.dump` shards + their manifest.json
    <cache>/<space>/.lock           held (flock) by the one data stage that plans, captures and evicts

A space is one `capture_key`: another target, other aux layers, dtype or engine is another folder, so a
sample is a hit only where the same states would be captured again.

Risk: a shard trusted while it is not what was written. A shard is written under a hidden temp name and
renamed once whole (`eagle3.data.shards`), and listed in the index (written atomically) only after; at
every open each listed shard's size and mtime are checked against the index and a mismatch drops the
shard (its samples are captured again). Folders under nights/ the index does not list (a capture a kill
cut short) are deleted unless tonight resumes them. Eviction removes whole shards, oldest night first,
never one `pinned` (what tonight's training reads).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.data.files import LogFn, atomic_write_text

INDEX = "index.json"
SPACE = "space.json"
NIGHTS = "nights"
INDEX_FORMAT = 1


def sample_address(input_ids: list[int], loss_mask: list[int]) -> str:
    """Content address of a sample: sha256 of the JSON `[input_ids, loss_mask]` (no spaces)."""
    return hashlib.sha256(json.dumps([input_ids, loss_mask], separators=(",", ":")).encode()).hexdigest()


def capture_key(target_identity: str, aux_layer_ids: list[int], dtype: str, engine: str) -> str:
    """What decides a sample's hidden states besides its content: the target (config, weights, tokenizer),
    the aux layers captured, the stored dtype and the capture engine."""
    payload = {"target": target_identity, "aux_layer_ids": list(aux_layer_ids), "dtype": dtype, "engine": engine}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class CachedRow:
    """Where a cached sample is: its shard (relative to the space) and row, and what it is."""

    shard: str
    row: int
    tokens: int
    split: str


@dataclass
class Eviction:
    """What an eviction removed."""

    shards: int = 0
    samples: int = 0
    bytes: int = 0


@dataclass
class CaptureCache:
    """One space of the cache, opened (locked, verified) by `open_cache`."""

    directory: Path
    key: str
    shards: dict[str, dict] = field(default_factory=dict)  # relative shard path -> index entry
    dropped: list[str] = field(default_factory=list)  # one line per shard the check refused this time

    # ---------------------------------------------------------------- lookups

    def rows(self) -> dict[str, CachedRow]:
        """Every cached sample by content address (a sample cached twice: its newest night's row)."""
        found: dict[str, CachedRow] = {}
        for name, entry in sorted(self.shards.items(), key=lambda item: _night_order(item)):
            for row, (address, tokens, split) in enumerate(entry["samples"]):
                found[address] = CachedRow(name, row, tokens, split)
        return found

    def path(self, shard: str) -> Path:
        return self.directory / shard

    def total_bytes(self) -> int:
        return sum(e["bytes"] for e in self.shards.values())

    def header(self) -> dict | None:
        """The dump manifest header (engine record, layers, sizes) of this space's first capture."""
        path = self.directory / SPACE
        return json.loads(path.read_text()).get("header") if path.is_file() else None

    # ---------------------------------------------------------------- changes

    def night_dir(self, night: str) -> Path:
        return self.directory / NIGHTS / night

    def register(self, night: str, manifest: dict, members: dict[str, list[dict]], captured_at: float,
                 header: dict) -> None:
        """List a finished capture's shards (its dump `manifest`; `members`: shard file -> its samples in row
        order, each with `address`, `input_ids` and `split`) in the index, written atomically."""
        for entry in manifest["shards"]:
            name = f"{NIGHTS}/{night}/{entry['file']}"
            stat = self.path(name).stat()
            self.shards[name] = {
                "night": night, "captured_at": captured_at, "bytes": entry["bytes"], "sha256": entry["sha256"],
                "mtime_ns": stat.st_mtime_ns, "split": entry["split"],
                "samples": [[s["address"], len(s["input_ids"]), s["split"]] for s in members[entry["file"]]],
            }
        if not (self.directory / SPACE).is_file() or self.header() is None:
            atomic_write_text(self.directory / SPACE, json.dumps({"key": self.key, "header": header}, indent=1))
        self.save()

    def evict(self, budget: int, incoming: int, pinned: set[str], log: LogFn,
              keep_night: str | None = None) -> Eviction:
        """Delete unpinned shards, oldest night first, until the cache plus `incoming` bytes fit `budget`
        (`keep_night`: tonight's capture folder, kept while it is being written)."""
        done = Eviction()
        for name, entry in sorted(self.shards.items(), key=_night_order):
            if self.total_bytes() + incoming <= budget:
                break
            if name in pinned:
                continue
            self.path(name).unlink(missing_ok=True)
            del self.shards[name]
            done.shards, done.samples, done.bytes = done.shards + 1, done.samples + len(entry["samples"]), \
                done.bytes + entry["bytes"]
        if done.shards:
            self.save()
            self.remove_unlisted(keep_night)
            log(f"capture cache: evicted {done.shards} shards ({done.samples} samples, {done.bytes / 1e9:.3f} GB), "
                "oldest nights first")
        return done

    def remove_unlisted(self, keep_night: str | None = None) -> None:
        """Night folders the index does not list (a capture cut short; all shards evicted), but the one tonight
        resumes."""
        listed = {e["night"] for e in self.shards.values()} | ({keep_night} if keep_night else set())
        root = self.directory / NIGHTS
        for night in root.iterdir() if root.is_dir() else ():
            if night.name not in listed:
                shutil.rmtree(night, ignore_errors=True)

    def save(self) -> None:
        atomic_write_text(self.directory / INDEX, json.dumps(
            {"format": INDEX_FORMAT, "key": self.key, "shards": self.shards}, separators=(",", ":")))


def _night_order(item: tuple[str, dict]) -> tuple[float, str]:
    name, entry = item
    return entry["captured_at"], name


@contextlib.contextmanager
def open_cache(root: Path, key: str, log: LogFn) -> Iterator[CaptureCache]:
    """The space of `key` under `root`, locked for this process until the block exits, its index checked."""
    directory = Path(root) / key[:16]
    directory.mkdir(parents=True, exist_ok=True)
    with _locked(directory / ".lock", log):
        cache = CaptureCache(directory, key, _read_index(directory, key))
        _drop_changed(cache, log)
        yield cache


@contextlib.contextmanager
def _locked(path: Path, log: LogFn) -> Iterator[None]:
    """An exclusive flock on `path`: one data stage at a time plans, captures and evicts in a space."""
    with path.open("a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"capture cache: waiting for {path} (another data stage is capturing into this cache)")
            started = time.monotonic()
            fcntl.flock(fh, fcntl.LOCK_EX)
            log(f"capture cache: got {path} after {time.monotonic() - started:.0f} s")
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _read_index(directory: Path, key: str) -> dict[str, dict]:
    path = directory / INDEX
    if not path.is_file():
        return {}
    index = json.loads(path.read_text())
    if index.get("format") != INDEX_FORMAT or index.get("key") != key:
        raise ValueError(f"{path}: expected format {INDEX_FORMAT} of capture key {key[:16]}..., found format "
                         f"{index.get('format')} of key {str(index.get('key'))[:16]}...")
    return index["shards"]


def _drop_changed(cache: CaptureCache, log: LogFn) -> None:
    """Shards whose file is missing or differs in size or mtime from the index: dropped (captured again)."""
    for name, entry in list(cache.shards.items()):
        path = cache.path(name)
        problem = _file_problem(path, entry)
        if problem:
            cache.dropped.append(f"{name}: {problem}")
            log(f"capture cache: {name}: {problem}; dropped, its {len(entry['samples'])} samples will be captured "
                "again")
            path.unlink(missing_ok=True)
            del cache.shards[name]
    if cache.dropped:
        cache.save()


def _file_problem(path: Path, entry: dict) -> str | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return "missing"
    if stat.st_size != entry["bytes"]:
        return f"{stat.st_size} bytes, the index says {entry['bytes']}"
    if stat.st_mtime_ns != entry["mtime_ns"]:
        return "modified since it was captured"
    return None


def shard_rows(entries: Iterable[tuple[str, int]]) -> dict[str, list[int]]:
    """(shard, row) pairs grouped by shard, rows sorted."""
    grouped: dict[str, list[int]] = {}
    for shard, row in entries:
        grouped.setdefault(shard, []).append(row)
    return {shard: sorted(rows) for shard, rows in sorted(grouped.items())}


def night_id(new_addresses: Iterable[str]) -> str:
    """A night's capture folder, named by the samples it captures: a rerun after a kill resumes it."""
    return hashlib.sha256("\n".join(sorted(new_addresses)).encode()).hexdigest()[:16]
