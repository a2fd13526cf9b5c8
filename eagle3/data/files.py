"""What every module of the data wing shares: atomic text writes, file digests, and the
progress and log callbacks its stages take.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

ProgressFn = Callable[[str, int, int], None]
LogFn = Callable[[str], None]


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file + rename, so readers never see a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def file_sha256(path: Path) -> str:
    """sha256 of a file, streamed."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
