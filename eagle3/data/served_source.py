"""`data.source: served`: the data stage's samples from SGLang request dumps instead of prompts + regeneration.

Owns the window's resolution (`data.served.since/until/newest_days` -> epoch seconds), the read of the
dump folder on the machine that runs the data stage (`eagle3.data.served_dumps` does the reading), the
cap at `data.num_samples` (newest kept), the figures the data summary records (window, exclusions by
reason, files read/skipped/refused, the sampling settings the answers were served with) and the digest
of a dump folder's listing that the stage's fingerprint takes (so new dump files re-run the stage).

Nothing is regenerated: the answers are the target's own tokens as served. Risk: the listing digest
sees names and sizes, not content; SGLang writes each file once under a new name (its time, to the
second), so a changed file without a changed name or size is not expected.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path

from eagle3.config import DataConfig, ServedDumpsConfig
from eagle3.data.files import LogFn, ProgressFn
from eagle3.data.samples import SAMPLES_FILE, read_samples
from eagle3.data.served_dumps import (
    EXCLUSION_REASONS,
    ServedDumps,
    read_served_dumps,
    write_served_samples,
)

DAY_S = 86400.0
# The capture cache's figures of a night (eagle3.data.served_capture) logged as metrics.
CACHE_METRICS = ("new_samples", "known_samples", "replayed_samples", "replay_pool", "tokens_captured",
                 "bytes_captured", "bytes", "budget_bytes", "shards", "samples", "evicted_shards", "evicted_samples",
                 "evicted_bytes")


def resolve_window(served: ServedDumpsConfig, now: float) -> tuple[float | None, float | None]:
    """(since, until) in epoch seconds, half-open on finished time; None = open.

    newest_days N -> since = now - N days (now: when the data stage starts). Example: newest_days 1 at
    2026-01-02T06:00Z -> since 2026-01-01T06:00Z, until None (or data.served.until when set).
    """
    since = served.since.timestamp() if served.since is not None else None
    if served.newest_days is not None:
        since = now - served.newest_days * DAY_S
    until = served.until.timestamp() if served.until is not None else None
    if since is not None and until is not None and since >= until:
        raise ValueError(f"data.served: the window is empty: since {iso(since)} is not before until {iso(until)}")
    return since, until


def iso(epoch: float | None) -> str | None:
    """Epoch seconds as ISO-8601 UTC (None stays None: an open end)."""
    return None if epoch is None else datetime.fromtimestamp(epoch, timezone.utc).isoformat()


def listing_digest(entries: Iterable[tuple[str, int]]) -> str:
    """sha256 of a dump folder's `*.pkl` names and sizes, sorted: what the stage fingerprint sees of the dumps."""
    lines = sorted(f"{name}\t{size}" for name, size in entries if name.endswith(".pkl"))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def local_listing(folder: str | Path) -> list[tuple[str, int]]:
    """(name, size) of each `*.pkl` file of a folder on this machine; [] when the folder is missing."""
    path = Path(folder)
    if not path.is_dir():
        return []
    return [(p.name, p.stat().st_size) for p in path.glob("*.pkl") if p.is_file()]


def sampling_settings(dumps: ServedDumps) -> list[dict]:
    """The distinct sampling_params the kept answers were served with, each with its count, most used first."""
    counts = Counter(json.dumps(s.sampling_params, sort_keys=True) for s in dumps.samples)
    return [{"sampling_params": json.loads(key), "count": n} for key, n in counts.most_common()]


def _cap_newest(dumps: ServedDumps, num_samples: int) -> int:
    """Keep the newest num_samples samples (by finished time, file order kept); returns how many were cut."""
    cut = len(dumps.samples) - num_samples
    if cut <= 0:
        return 0
    newest = sorted(range(len(dumps.samples)), key=lambda i: dumps.samples[i].finished_time)[cut:]
    dumps.samples = [dumps.samples[i] for i in sorted(newest)]
    return cut


def _log_files(dumps: ServedDumps, log: LogFn) -> None:
    """One line per file read (the refused and skipped ones got theirs as they were met)."""
    for path in dumps.files_read:
        log(f"served: read {Path(path).name}")


def served_record(dumps: ServedDumps, folder: str, capped: int) -> dict:
    """What the data summary records of the served source (window as ISO timestamps, counts by reason)."""
    return {
        "dumps": folder,
        "window": {"since": iso(dumps.since), "until": iso(dumps.until)},
        "excluded": {r: dumps.excluded.get(r, 0) for r in EXCLUSION_REASONS} | {"over_num_samples": capped},
        "files_read": [Path(p).name for p in dumps.files_read],
        "files_skipped": dumps.files_skipped,
        "files_refused": dumps.files_refused,
        "num_samples": len(dumps.samples),
        "num_prompt_tokens": sum(len(s.prompt_ids) for s in dumps.samples),
        "num_output_tokens": sum(len(s.output_ids) for s in dumps.samples),
        "sampling_params": sampling_settings(dumps),
    }


def _no_usable_samples(folder: str, dumps: ServedDumps) -> ValueError:
    excluded = ", ".join(f"{r} {n}" for r, n in dumps.excluded.items() if n) or "none"
    return ValueError(
        f"data.served.dumps {folder}: no usable served sample in the window {iso(dumps.since)} .. {iso(dumps.until)} "
        f"({len(dumps.files_read)} files read, {len(dumps.files_skipped)} skipped, {len(dumps.files_refused)} "
        f"refused; left out: {excluded})")


def prepare_served_samples(data_cfg: DataConfig, out_dir: Path, progress: ProgressFn, log: LogFn,
                           now: float | None = None) -> tuple[list[dict], dict]:
    """samples.jsonl (+ meta) in out_dir from the dumps in data.served.dumps, read on this machine.

    The dumps are read again on every run (new files may have come; the shards are reused by the samples'
    content). Returns (samples, meta); meta["served"] is served_record's figures. Raises ValueError naming
    data.served.dumps when the window holds no usable sample.
    """
    folder = data_cfg.served.dumps or ""
    if not Path(folder).is_dir():
        raise FileNotFoundError(f"data.served.dumps {folder}: no such folder on this machine (the data host)")
    since, until = resolve_window(data_cfg.served, time.time() if now is None else now)
    progress("served", 0, 1)
    dumps = read_served_dumps(folder, data_cfg.max_length, since, until, log)
    progress("served", 1, 1)
    _log_files(dumps, log)
    if not dumps.samples:
        raise _no_usable_samples(folder, dumps)
    capped = _cap_newest(dumps, data_cfg.num_samples)
    meta = write_served_samples(dumps, out_dir, data_cfg.validation_fraction)
    record = served_record(dumps, folder, capped)
    if not any(s["split"] == "train" for s in read_samples(Path(out_dir) / SAMPLES_FILE)):
        raise ValueError(f"data.served.dumps {folder}: the window's {len(dumps.samples)} served sample(s) all fell in "
                         "the validation split; widen the window or lower data.validation_fraction")
    meta["served"] = record
    log(f"served: {record['num_samples']} samples ({record['num_prompt_tokens']} prompt + "
        f"{record['num_output_tokens']} answer tokens) from {len(dumps.files_read)} files, window "
        f"{record['window']['since']} .. {record['window']['until']}, left out: {record['excluded']}")
    log(f"served: sampling settings {json.dumps(record['sampling_params'])}")
    return read_samples(Path(out_dir) / SAMPLES_FILE), meta


def served_metrics(summary: dict) -> dict[str, int]:
    """The served source's counts as MLflow metrics (empty for data.source: prompts)."""
    served = summary.get("served") or {}
    metrics = {f"served_excluded_{reason}": n for reason, n in served.get("excluded", {}).items()}
    if served:
        metrics |= {"served_files_read": len(served["files_read"]), "served_files_skipped":
                    len(served["files_skipped"]), "served_files_refused": len(served["files_refused"]),
                    "served_sampling_settings": len(served["sampling_params"])}
    cache = served.get("cache") or {}
    metrics |= {f"served_{key}": cache[key] for key in CACHE_METRICS if key in cache}
    if cache:
        metrics["served_no_new_traffic"] = int(bool(summary.get("no_new_traffic")))
    return metrics
