"""One run at a time per run folder: an exclusive `flock` on `<run>/.run.lock`, and `<run>/holder.json` naming
who holds it (pid, the process's start time, host, Prefect flow run, since when).

The flock is the truth, the record only names the holder. A flock belongs to an open file description, so it
excludes a second process, a second thread of one process and a Retry of the same Prefect flow run alike; the
kernel drops it when its process dies, however it died (kill -9 included), so a dead run's folder is free for
the next one; a forked child (a DataLoader worker) closes its inherited copy at once, so it never keeps the folder
of a killed parent. A record left by such a run (its pid gone, or that pid now a process with another start time)
is stale and reported as taken over. The record is removed when the lock is released.

`keeping_run_folders` holds, until its block ends, the folders locked inside it on this thread (the nightly's
gate writes into the folder its experiment subflow ran in, after that subflow's teardown).

Light on purpose (no Prefect, MLflow or torch): `eagleops run` refuses a held folder before it starts anything.
Risk: flock on a network filesystem (NFS) is only as good as the server's lock support; two hosts sharing a
runs root over a filesystem without it are not excluded.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tasks.rundir import now_iso, write_json_atomic

LOCK_FILE = ".run.lock"
HOLDER_FILE = "holder.json"
# A holder writes its record just after taking the flock (and `holder_of`'s probe takes it for an instant):
# a refusal waits this long for a record to name before it names none.
RECORD_WAIT_S = 2.0


class RunFolderHeld(ValueError):
    """Another run holds the run folder: an expected error (one line, exit 2), like a bad --run-dir."""

    one_line_in_logs = True  # expected: its message names the holder, no traceback in the Prefect log (tasks.log)

    def __init__(self, run_dir: Path, holder: dict[str, Any] | None):
        self.run_dir, self.holder = run_dir, holder
        who = describe_holder(holder) if holder else "another process (it has not named itself yet)"
        stop = f"; wait for it to end or stop it (kill {holder['pid']})" if holder and holder.get("pid") else ""
        super().__init__(f"run folder {run_dir} is held by another run: {who}{stop}")


def describe_holder(holder: dict[str, Any]) -> str:
    return (f"pid {holder.get('pid')} on host {holder.get('host')}, Prefect flow run "
            f"{holder.get('flow_run_id') or 'none'}, since {holder.get('since')}")


def process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot): with the pid, names one process over time.
    None when there is no such process here."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and ')': fields 3.. follow the last ')'
    return int(stat.rsplit(")", 1)[1].split()[19])


def stale_reason(holder: dict[str, Any]) -> str | None:
    """Why a recorded holder is no longer alive; None when its process still runs here (or on another host,
    where it cannot be told)."""
    if holder.get("host") != socket.gethostname():
        return None
    pid = holder.get("pid")
    started = process_start_time(pid) if isinstance(pid, int) and pid > 0 else None
    if started is None:
        return "its process is gone"
    if started != holder.get("start_time"):
        return f"pid {pid} is another process now (start time differs)"
    return None


def read_holder(run_dir: str | Path) -> dict[str, Any] | None:
    path = Path(run_dir) / HOLDER_FILE
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):  # none (free), or caught half-replaced: nobody to name
        return None
    return holder if isinstance(holder, dict) else None


# Locks this process holds. A forked child (a DataLoader worker) shares the parent's open file description, and
# with it the flock: it would keep the folder held after its parent was killed, until it exited itself. The child
# closes its copy at once (closing is not unlocking: the parent's hold stays).
_HELD: weakref.WeakSet = weakref.WeakSet()


def _close_in_forked_child() -> None:
    for lock in list(_HELD):
        if lock._file is not None:
            lock._file.close()
            lock._file = None
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_forked_child)


class RunLock:
    """This run's hold on a run folder; `taken_over`: the stale holder record it replaced (None if none)."""

    def __init__(self, run_dir: Path, file, taken_over: dict[str, Any] | None, token: str):
        self.run_dir, self._file, self.taken_over, self._token = run_dir, file, taken_over, token

    @property
    def held(self) -> bool:
        return self._file is not None

    def takeover_line(self) -> str | None:
        """One line for the log when a dead run's record was replaced."""
        if self.taken_over is None:
            return None
        why = stale_reason(self.taken_over) or "its lock was free (a copied folder, or a record from another host)"
        return f"run folder {self.run_dir}: taking it over from {describe_holder(self.taken_over)}: {why}"

    def release(self) -> None:
        """Give the folder up (the record first, then the flock); inside `keeping_run_folders` on this thread,
        when that block ends. Idempotent."""
        if self._file is None:
            return
        scopes = getattr(_local, "scopes", [])
        if scopes:
            if self not in scopes[-1]:
                scopes[-1].append(self)
            return
        self._release_now()

    def _release_now(self) -> None:
        if self._file is None:
            return
        try:
            if (read_holder(self.run_dir) or {}).get("token") == self._token:
                (self.run_dir / HOLDER_FILE).unlink(missing_ok=True)
        finally:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
            _HELD.discard(self)


def acquire_run_folder(run_dir: str | Path, flow_run_id: str | None) -> RunLock:
    """Take the run folder for this process, or raise RunFolderHeld naming its holder (waits only for a
    just-started holder to name itself, up to RECORD_WAIT_S)."""
    run_dir = Path(run_dir).resolve()
    file = open(run_dir / LOCK_FILE, "a")  # not inherited by the servers this run starts (O_CLOEXEC)
    deadline = time.monotonic() + RECORD_WAIT_S
    while True:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = read_holder(run_dir)  # a dead run's record may stay until the new holder replaces it
            if (holder is not None and stale_reason(holder) is None) or time.monotonic() >= deadline:
                file.close()
                raise RunFolderHeld(run_dir, _live(holder)) from None
            time.sleep(0.05)
    try:
        lock = RunLock(run_dir, file, read_holder(run_dir), f"{os.getpid()}-{time.time_ns()}-{threading.get_ident()}")
        write_json_atomic(run_dir / HOLDER_FILE, {
            "pid": os.getpid(), "start_time": process_start_time(os.getpid()), "host": socket.gethostname(),
            "flow_run_id": flow_run_id, "since": now_iso(), "token": lock._token})
        _HELD.add(lock)
    except BaseException:
        fcntl.flock(file, fcntl.LOCK_UN)
        file.close()
        raise
    return lock


def holder_of(run_dir: str | Path) -> dict[str, Any] | None:
    """Who holds the folder now ({} when held but not named yet), or None when it is free; holds nothing."""
    path = Path(run_dir) / LOCK_FILE
    if not path.is_file():
        return None
    with open(path, "r") as file:
        try:  # shared: two probes never refuse each other
            fcntl.flock(file, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return read_holder(run_dir) or {}
        fcntl.flock(file, fcntl.LOCK_UN)
    return None


def refuse_if_held(run_dir: str | Path) -> None:
    """RunFolderHeld naming the holder when another run holds the folder (waits RECORD_WAIT_S at most for a
    just-started holder to name itself); nothing when it is free."""
    deadline = time.monotonic() + RECORD_WAIT_S
    while (holder := holder_of(run_dir)) is not None and (holder == {} or stale_reason(holder)) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    if holder is not None:
        raise RunFolderHeld(Path(run_dir).resolve(), _live(holder))


def _live(holder: dict[str, Any] | None) -> dict[str, Any] | None:
    """The record when it names a live holder; None for none, or for a dead run's not yet replaced."""
    return holder if holder and stale_reason(holder) is None else None


_local = threading.local()


@contextlib.contextmanager
def keeping_run_folders() -> Iterator[None]:
    """Run folders locked inside this block on this thread stay held until it ends (and are released then)."""
    kept: list[RunLock] = []
    _local.scopes = [*getattr(_local, "scopes", []), kept]
    try:
        yield
    finally:
        _local.scopes = _local.scopes[:-1]
        for lock in kept:
            lock.release()  # to the enclosing block if any, else now
