"""`<run_dir>/servers.json`: every server a run started, keyed `host:port:pid`, with its status.

Owns reading the file and changing one entry of it. The deploy stage, the benchmark's per-setting
servers, the data stage's regeneration servers and the teardown write it; `eagleops teardown` and a
Prefect hook may do so from another process.

Risk: lost entries. A read-modify-write by two writers at once keeps only one of their changes (a
server recorded `starting` by one thread and never seen by the teardown). Each change holds an
exclusive `flock` on `.servers.json.lock` beside the file from its read to its atomic replace;
flock locks belong to an open file, so threads of one process exclude each other as processes do.
The replace goes through a temp file of its own per process and thread (`write_json_atomic`), so a
reader (who takes no lock) sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tasks.rundir import write_json_atomic

SERVERS_FILE = "servers.json"
LOCK_FILE = ".servers.json.lock"


def registry_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / SERVERS_FILE


def read_servers(run_dir: str | Path) -> dict[str, dict[str, Any]]:
    """Every recorded server by key ({} when the run started none); ValueError naming the file if it is not JSON."""
    path = registry_path(run_dir)
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err}); the servers it recorded are unknown") from err


def record_server(run_dir: str | Path, key: str, entry: dict[str, Any]) -> None:
    """Set one server's entry, under the registry's lock: no concurrent writer's entry is lost."""
    with _locked(Path(run_dir)):
        servers = read_servers(run_dir)
        servers[key] = entry
        write_json_atomic(registry_path(run_dir), servers)


@contextlib.contextmanager
def _locked(run_dir: Path) -> Iterator[None]:
    with open(run_dir / LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
