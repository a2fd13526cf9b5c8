"""What every module of the data wing shares: atomic text writes, file digests, the progress and
log callbacks its stages take, and the JSON event lines its commands print.

Risk: a disk that fills mid-write. A failed write removes its temp file (the space it took is
free again, nothing half-written stays) and its error names the file (`removed_on_failure`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

ProgressFn = Callable[[str, int, int], None]
LogFn = Callable[[str], None]


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file + rename, so readers never see a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with removed_on_failure(tmp, path):
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)


@contextlib.contextmanager
def removed_on_failure(tmp: Path, target: Path) -> Iterator[None]:
    """Remove `tmp` when the block fails; an OSError from write() (which names no file, e.g.
    `[Errno 28] No space left on device`) is re-raised naming `target`, the file being written."""
    try:
        yield
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.filename is None:
            raise OSError(err.errno, err.strerror, str(target)) from err
        raise


def file_sha256(path: Path) -> str:
    """sha256 of a file, streamed."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def emit_event(event: str, **fields) -> None:
    """One JSON line on stdout: what an orchestrator watching this command relays (progress, log lines,
    the outcome; tasks.hosts.jobs reads them)."""
    print(json.dumps({"event": event, **fields}), flush=True)
