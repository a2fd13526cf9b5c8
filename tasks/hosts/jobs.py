"""One command run detached on a host, watched from here: its log relayed, its end noticed.

A stage that must run where the data or the GPUs are (the data stage on `data.host`) starts its
command in its own process group on that host (`Executor.start_detached`, stdout and stderr to a
log file there), then polls: new complete log lines are handed to the caller as they arrive, and
the process's end is noticed. The command reports in JSON lines (`{"event": ...}`, as
`python -m eagle3.data.generate` prints them); other lines are relayed as they are. Whatever ends
the watch -- the command's end, an error here, Ctrl-C -- the process group is stopped. `run` watches
a job to its end; `start`, `poll` and `stop` watch one beside other work (a stream's capture side
beside training, tasks.stages.train.stream).

Risk: a job that dies without a word (OOM-killed, SIGKILL) must not look finished. Success is
the command's own `done` event, never only its disappearance; anything else raises with the
job's last error event and its log tail.
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tasks.hosts.remote import CommandFailed, Executor, RemoteError

POLL_S = 1.0
TAIL_LINES = 30
# The first FAST_FOR_S of a watch is polled every FAST_POLL_S: a job, server start or training of a few
# seconds is seen ending when it ends, not up to POLL_S later; a long one is then polled every POLL_S.
FAST_POLL_S = 0.25
FAST_FOR_S = 30.0


def poll_delay(started: float, slow_s: float) -> float:
    """Seconds to wait before the next poll of a watch that began at `started` (time.monotonic())."""
    return min(FAST_POLL_S, slow_s) if time.monotonic() - started < FAST_FOR_S else slow_s


class HostJobFailed(RuntimeError):
    """The job ended without its `done` event; the message names host, command and log tail."""


def new_log_lines(executor: Executor, log_file: str, offset: int) -> tuple[list[str], int]:
    """Complete lines of `log_file` after byte `offset`, and the offset after them (a line still
    being written waits for the next call)."""
    with contextlib.suppress(CommandFailed):
        text = executor.run(["tail", "-c", f"+{offset + 1}", log_file], check=True, log_output=False,
                            timeout=60).stdout
        return complete_lines(text, offset)
    return [], offset


def watch_once(executor: Executor, pid: int, log_file: str, offset: int) -> tuple[bool, list[str], int]:
    """One poll of a job in one command: whether process `pid` still runs, then (read after that) the complete
    lines of `log_file` after byte `offset` and the offset after them."""
    alive, text = executor.watch_log(pid, log_file, offset)
    return (alive, *complete_lines(text, offset))


def complete_lines(text: str, offset: int) -> tuple[list[str], int]:
    """The complete lines of `text` (read from byte `offset`), and the offset after them."""
    complete = text[: text.rfind("\n") + 1]
    return complete.splitlines(), offset + len(complete.encode())


@dataclass
class HostJob:
    executor: Executor
    label: str
    root: str  # the job's folder on the host: its log and pid files
    pid: int | None = None
    outcome: dict = field(default_factory=dict)  # its `done` and `error` events, once seen
    _offset: int = 0

    @property
    def log_file(self) -> str:
        return posixpath.join(self.root, f"{self.label}.log")

    @property
    def pid_file(self) -> str:
        return posixpath.join(self.root, f"{self.label}.pid")

    def run(self, argv: Sequence[str], *, env: dict[str, str] | None = None, on_event: Callable[[dict], None],
            on_line: Callable[[str], None]) -> dict:
        """Start `argv` on the host and watch it to its end; returns its `done` event.

        `on_event` gets each JSON event line, `on_line` every other line. Raises HostJobFailed when
        the job ends without `done` (its `error` event, if any, leads the message).
        """
        self.start(argv, env=env)
        started = time.monotonic()
        try:
            while self.poll(on_event, on_line):
                time.sleep(poll_delay(started, POLL_S))
        finally:
            self.stop()
        return self.result()

    def start(self, argv: Sequence[str], *, env: dict[str, str] | None = None) -> int:
        """Start `argv` detached in its own process group on the host; its pid."""
        self.executor.makedirs(self.root)
        self.pid = self.executor.start_detached(list(argv), env=env, cwd=self.root, log_file=self.log_file,
                                                pid_file=self.pid_file)
        self.outcome, self._offset = {}, 0
        return self.pid

    def poll(self, on_event: Callable[[dict], None], on_line: Callable[[str], None]) -> bool:
        """Relay the log lines written since the last poll; whether the job still runs."""
        alive, lines, self._offset = watch_once(self.executor, self.pid, self.log_file, self._offset)
        for line in lines:
            event = _event(line)
            if event is None:
                on_line(line)
                continue
            if event["event"] in ("done", "error"):
                self.outcome[event["event"]] = event
            on_event(event)
        return alive

    def stop(self) -> None:
        """Stop the job's process group (idempotent: a finished job's group is already gone)."""
        if self.pid is not None:
            with contextlib.suppress(RemoteError, OSError):
                self.executor.kill_group(self.pid)

    def result(self) -> dict:
        """The job's `done` event; HostJobFailed naming its error and log tail when it ended without one."""
        if "done" not in self.outcome:
            raise HostJobFailed(self._failure(self.outcome.get("error")))
        return self.outcome["done"]

    def _failure(self, error: dict | None) -> str:
        try:
            tail = self.executor.read_file(self.log_file, tail_lines=TAIL_LINES)
        except (FileNotFoundError, CommandFailed):
            tail = "(no log)"
        what = error["message"] if error else "it ended without reporting (killed?)"
        return f"{self.label} on {self.executor.name} failed: {what}; last lines of {self.log_file}:\n{tail}"

def _event(line: str) -> dict | None:
    if not line.startswith('{"event"'):
        return None
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None
