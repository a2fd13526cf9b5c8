"""A disk that fills while a stage runs: recognised in the stage's error and described in one line.

The early check (`eagle3.data.disk.check_disk_space`) refuses a dump that cannot fit; this is for
the disk that fills afterwards (another job, a log, a checkpoint larger than expected). Python
raises `OSError(ENOSPC)` (or EDQUOT for a quota), but libraries re-raise it as their own error
with the C text inside (safetensors `os error 28`, SQLite `database or disk is full`), so the
whole exception chain and its text are searched. `describe_disk_full` names what filled (the
filesystem: mount point and size), where (the file being written, else the stage folder) and
how much is free there now.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_TEXT = re.compile(
    r"No space left on device|Disk quota exceeded|os error (?:28|122)\b|database or disk is full", re.IGNORECASE
)


def disk_full_error(err: BaseException) -> BaseException | None:
    """The exception in `err`'s chain that says the disk is full, or None."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in NO_SPACE_ERRNOS:
            return current
        if _NO_SPACE_TEXT.search(str(current)):
            return current
        current = current.__cause__ or current.__context__
    return None


def describe_disk_full(full: BaseException, fallback: Path) -> str:
    """`the filesystem at /data (20.0 GiB) is full: writing /data/x failed (No space left on device);
    64.0 KiB free now` -- `fallback` is where the stage writes, for an error that names no file."""
    filename = getattr(full, "filename", None)
    path = Path(os.fsdecode(filename)) if filename else Path(fallback)
    where = _existing(path)
    usage = shutil.disk_usage(where)
    reason = full.strerror if isinstance(full, OSError) and full.strerror else "No space left on device"
    target = f"writing {path}" if filename else f"writing in {path}"
    return (f"the filesystem at {mount_point(where)} ({human_bytes(usage.total)}) is full: {target} failed "
            f"({reason}); {human_bytes(usage.free)} free now")


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem holding `path` (an existing path)."""
    current = path.resolve()
    while not os.path.ismount(current) and current != current.parent:
        current = current.parent
    return current


def human_bytes(count: int) -> str:
    """1536 -> `1.5 KiB`."""
    if count < 1024:
        return f"{count} B"
    value = count / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _existing(path: Path) -> Path:
    """`path` or its nearest existing parent (the file that failed may have been removed)."""
    current = path
    while not current.exists() and current != current.parent:
        current = current.parent
    return current
