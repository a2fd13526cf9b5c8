"""The `Executor` interface, the base both executors share, and `LocalExecutor` (this machine).

Owns what deploy, benchmark and training stages call for `host: local` and for inventory hosts:
argv commands, detached servers in their own process group, files; uploads and downloads come
from transfers.py, SSH hosts from ssh.py (`SSHExecutor`).
"""

from __future__ import annotations

import abc
import contextlib
import functools
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import ContextManager, Iterator, Protocol, Sequence

from tasks.hosts.remote.commands import (
    _ALIVE_SCRIPT,
    _DETACH_SCRIPT,
    _IDENTITY_SCRIPT,
    _KILL_GROUP_SCRIPT,
    _PORT_LISTENER_PY,
    _PORT_PY,
    _READ_SCRIPT,
    _WATCH_SCRIPT,
    KILL_AFTER_S,
    MISSING,
    NOT_OURS,
    TIMEOUT_EXIT_STATUSES,
    CommandResult,
    _OutputStream,
    _sh,
    _validated,
    describe_command,
    shell_command,
)
from tasks.hosts.remote.errors import (
    TAIL_LINES,
    CommandFailed,
    CommandTimeout,
    RemoteError,
    tail,
)
from tasks.hosts.remote.log import logger
from tasks.hosts.remote.transfers import (
    DownloadResult,
    Progress,
    UploadResult,
    _HostProcess,
    _VerifiedTransfers,
)
from tasks.hosts.remote.warm_start import start_warm


class Executor(Protocol):
    """Where commands run and files go: this machine (`LocalExecutor`) or an SSH host."""

    name: str

    def run(self, argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
            timeout: float | None = None, check: bool = True, stdin: bytes | None = None,
            log_output: bool = True) -> CommandResult: ...
    def start_detached(self, argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
                       log_file: str, pid_file: str) -> int: ...
    def is_alive(self, pid: int) -> bool: ...
    def watch_log(self, pid: int, log_file: str, offset: int) -> tuple[bool, str]: ...
    def process_identity(self, pid: int) -> str | None: ...
    def kill_group(self, pid: int, timeout: float = 15, identity: str | None = None) -> bool: ...
    def read_file(self, path: str, tail_lines: int | None = None, from_line: int | None = None) -> str: ...
    def path_exists(self, path: str) -> bool: ...
    def makedirs(self, path: str) -> None: ...
    def sha256(self, path: str) -> str | None: ...
    def expand_path(self, path: str) -> str: ...
    def upload_file(self, local: str | Path, remote: str, progress: Progress | None = None) -> UploadResult: ...
    def upload_dir(self, local_dir: str | Path, remote_dir: str, progress: Progress | None = None) -> list[UploadResult]: ...
    def download_file(self, remote: str, local: str | Path, progress: Progress | None = None) -> DownloadResult: ...
    def download_dir(self, remote_dir: str, local_dir: str | Path,
                     progress: Progress | None = None) -> list[DownloadResult]: ...
    def port_in_use(self, port: int) -> bool: ...
    def port_listener(self, port: int, group: int) -> str: ...
    def first_free_port(self, port: int, tries: int = 200) -> int: ...
    def forward(self, remote_port: int) -> ContextManager[int]: ...
    def close(self) -> None: ...


class _ExecutorBase(_VerifiedTransfers):
    """Everything both executors share, built on `_execute` (run one shell line) and `_open_process`
    (a shell line whose stdin and stdout carry an upload or a download: transfers.py)."""

    name: str
    python: str

    # -- subclass hooks
    @abc.abstractmethod
    def _execute(self, command: str, stdin: bytes | None, out: _OutputStream, err: _OutputStream,
                 deadline: float | None) -> int | None:
        """Run one shell line; its exit status (None when the deadline passed)."""

    @abc.abstractmethod
    def _home(self) -> str:
        """The user's home directory on the host."""

    # -- commands
    def run(self, argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
            timeout: float | None = None, check: bool = True, stdin: bytes | None = None,
            log_output: bool = True) -> CommandResult:
        """Run `argv` (each element quoted) with `env` added, in `cwd`, killed after `timeout` s.

        Output is logged line by line while it runs (unless `log_output=False`). Raises
        CommandTimeout, or CommandFailed on a non-zero exit when `check`.
        """
        command = shell_command(argv, env, cwd, timeout)
        shown = describe_command(argv, env, cwd)
        log = logger()
        (log.info if log_output else log.debug)("[%s] $ %s", self.name, shown)
        out, err = _OutputStream(self.name, log_output), _OutputStream(f"{self.name} stderr", log_output)
        started = time.monotonic()
        # The host's `timeout` does the killing; this client-side deadline only covers a host
        # that stopped answering.
        deadline = started + timeout + KILL_AFTER_S + 10 if timeout is not None else None
        status = self._execute(command, stdin, out, err, deadline)
        out.close()
        err.close()
        overran = timeout is not None and time.monotonic() - started >= timeout
        if status is None or (overran and status in TIMEOUT_EXIT_STATUSES):
            raise CommandTimeout(f"[{self.name}] timed out after {timeout} s and was killed: {shown}"
                                 + (f"\nstderr (last {TAIL_LINES} lines):\n{tail(err.text)}" if err.text else ""))
        if check and status != 0:
            raise CommandFailed(self.name, shown, list(argv), status, out.text, err.text)
        return CommandResult(status, out.text, err.text)

    def start_detached(self, argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
                       log_file: str, pid_file: str) -> int:
        """Start `argv` in its own session and process group, stdout+stderr to `log_file`; its pid."""
        words = _validated(argv, env)
        log_file, pid_file = self.expand_path(log_file), self.expand_path(pid_file)
        # env goes to the launcher as env (the detached child inherits it), so secret values stay
        # masked in every log line and error message instead of sitting in the launcher's argv.
        result = self.run(_sh(_DETACH_SCRIPT, log_file, pid_file, self.expand_path(cwd) if cwd else "", *words),
                          env=env, log_output=False, timeout=60)
        pid = int(result.stdout.strip())
        logger().info("[%s] started pid %d: %s (log %s)", self.name, pid, describe_command(argv, env, cwd), log_file)
        return pid

    def is_alive(self, pid: int) -> bool:
        return self.run(_sh(_ALIVE_SCRIPT, int(pid)), check=False, log_output=False, timeout=30).exit_status == 0

    def watch_log(self, pid: int, log_file: str, offset: int) -> tuple[bool, str]:
        """Whether process `pid` runs, and the text of `log_file` after byte `offset` (read after that check; ''
        when the log cannot be read), in one command: a watch polls both, several times a second."""
        result = self.run(_sh(_WATCH_SCRIPT, int(pid), log_file, offset + 1), check=False, log_output=False,
                          timeout=60)
        status, _, text = result.stdout.partition("\n")
        return status == "1", text if result.exit_status == 0 else ""

    def process_identity(self, pid: int) -> str | None:
        """`boot id:start time` of process `pid` on the host (None: no such process), to recognise it later."""
        result = self.run(_sh(_IDENTITY_SCRIPT, int(pid)), check=False, log_output=False, timeout=30)
        return (result.stdout.strip() or None) if result.exit_status == 0 else None

    def kill_group(self, pid: int, timeout: float = 15, identity: str | None = None) -> bool:
        """SIGTERM the process group `pid`, wait up to `timeout` s, then SIGKILL. Idempotent.

        With `identity` (from `process_identity` at launch), nothing is signalled when the pid now
        belongs to another process (pid reuse): False. True when the group is gone.
        """
        result = self.run(_sh(_KILL_GROUP_SCRIPT, int(pid), max(1, int(timeout)), identity or ""), log_output=False,
                          timeout=timeout + 30, check=False)
        if result.exit_status == NOT_OURS:
            logger().warning("[%s] %s", self.name, result.stderr.strip())
            return False
        if result.stderr.strip():
            logger().warning("[%s] %s", self.name, result.stderr.strip())
        if result.exit_status != 0:
            raise RemoteError(f"[{self.name}] could not stop process group {pid}: {result.stderr.strip()}")
        logger().info("[%s] process group %d stopped", self.name, pid)
        return True

    def port_in_use(self, port: int) -> bool:
        """Whether binding 127.0.0.1:`port` on that host fails (something already serves it)."""
        return self.run([self.python, "-c", _PORT_PY, str(int(port))], check=False, log_output=False,
                        timeout=60).exit_status == MISSING

    def port_listener(self, port: int, group: int) -> str:
        """Who listens on TCP `port` at that host: "group" (a process of process group `group`), "other" or
        "nobody" -- whether a server started there took its port or something else holds it (Linux /proc)."""
        answer = self.run([self.python, "-c", _PORT_LISTENER_PY, str(int(port)), str(int(group))], log_output=False,
                          timeout=60).stdout.strip()
        if answer not in ("group", "other", "nobody"):
            raise RemoteError(f"[{self.name}] port listener probe answered {answer!r}")
        return answer

    def first_free_port(self, port: int, tries: int = 200) -> int:
        """The first port from `port` on that nothing listens on at this host (another run's servers or
        torchrun store may). Risk: free when asked is not held; the caller binds it within seconds."""
        for candidate in range(port, min(port + tries, 65536)):
            if not self.port_in_use(candidate):
                return candidate
        raise RuntimeError(f"no free port in {port}..{min(port + tries, 65536) - 1} on {self.name}")

    # -- files
    @functools.cached_property
    def home(self) -> str:
        return self._home()

    def expand_path(self, path: str) -> str:
        """`~` and `~/x` resolved against the host's home; other paths unchanged."""
        path = os.fspath(path)
        if path == "~" or path.startswith("~/"):
            return self.home + path[1:]
        return path

    def read_file(self, path: str, tail_lines: int | None = None, from_line: int | None = None) -> str:
        """The file's text: its last `tail_lines` lines, or from line `from_line` (1-based) on, or all of it."""
        path = self.expand_path(path)
        result = self.run(_sh(_READ_SCRIPT, path, tail_lines or "", from_line or ""), check=False, log_output=False,
                          timeout=300)
        if result.exit_status == MISSING:
            raise FileNotFoundError(f"[{self.name}] {path}: no such file")
        if result.exit_status != 0:
            raise CommandFailed(self.name, f"read {path}", ["cat", path], result.exit_status, "", result.stderr)
        return result.stdout

    def path_exists(self, path: str) -> bool:
        return self.run(["test", "-e", self.expand_path(path)], check=False, log_output=False,
                        timeout=60).exit_status == 0

    def makedirs(self, path: str) -> None:
        self.run(["mkdir", "-p", self.expand_path(path)], log_output=False, timeout=60)

    def close(self) -> None:
        """Release connections; nothing to do for this machine."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LocalExecutor(_ExecutorBase):
    """`host: local`: the same shell line an SSH host would get, run by `sh -c` here."""

    def __init__(self, python: str = sys.executable):
        self.name, self.python = "local", python

    def _home(self) -> str:
        return str(Path.home())

    def start_detached(self, argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
                       log_file: str, pid_file: str) -> int:
        """As on any host; a `python -m eagle3.serve` (or data / stream job) forks from this process's warm fork
        server where that is the same as a cold start (tasks.hosts.remote.warm_start; EAGLEOPS_WARM_START=0: off)."""
        words = _validated(argv, env)
        log_file, pid_file = self.expand_path(log_file), self.expand_path(pid_file)
        pid = start_warm(words, env, self.expand_path(cwd) if cwd else None, log_file, pid_file)
        if pid is None:
            return super().start_detached(words, env=env, cwd=cwd, log_file=log_file, pid_file=pid_file)
        logger().info("[%s] started pid %d (warm): %s (log %s)", self.name, pid, describe_command(argv, env, cwd),
                      log_file)
        return pid

    def _open_process(self, command: str) -> _HostProcess:
        return _LocalProcess(command)

    def _execute(self, command: str, stdin: bytes | None, out: _OutputStream, err: _OutputStream,
                 deadline: float | None) -> int | None:
        proc = subprocess.Popen(["sh", "-c", command], stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        writer = None
        if stdin:
            writer = threading.Thread(target=_write_and_close, args=(proc.stdin, stdin), daemon=True)
            writer.start()
        streams = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
        while streams:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select(list(streams), [], [], wait if wait is None else min(wait, 1.0))
            if deadline is not None and time.monotonic() > deadline:
                _kill_session(proc)
                return None
            for fd in ready:
                data = os.read(fd, 1 << 16)
                streams[fd].feed(data) if data else streams.pop(fd)
        status = proc.wait()
        if writer:
            writer.join()
        proc.stdout.close()
        proc.stderr.close()
        return status if status >= 0 else 128 - status  # killed by a signal: shell convention

    @contextlib.contextmanager
    def forward(self, remote_port: int) -> Iterator[int]:
        """The host is this machine: its 127.0.0.1:`remote_port` is reachable as is."""
        yield remote_port


class _LocalProcess:
    """LocalExecutor: the shell line under `sh -c` with stdin and stdout as pipes; stderr kept by a thread.

    The same transfer_host.py exchange an SSH host runs, so both executors share one code path for
    transfers. Python ignores SIGPIPE, so writing to a command that ended raises BrokenPipeError,
    as `_HostProcess` asks.
    """

    write_size = 1 << 20

    def __init__(self, command: str):
        self._proc = subprocess.Popen(["sh", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, start_new_session=True)
        self._stderr: list[bytes] = []
        self._reader = threading.Thread(target=_read_all, args=(self._proc.stderr, self._stderr), daemon=True)
        self._reader.start()

    def write(self, data: bytes) -> None:
        self._proc.stdin.write(data)
        self._proc.stdin.flush()

    def close_stdin(self) -> None:
        with contextlib.suppress(BrokenPipeError):
            self._proc.stdin.close()

    def read(self) -> bytes:
        return self._proc.stdout.read1(1 << 20)

    def wait(self) -> tuple[int, str]:
        self.close_stdin()
        status = self._proc.wait()
        self._reader.join()
        return (status if status >= 0 else 128 - status), b"".join(self._stderr).decode(errors="replace")

    def close(self) -> None:
        if self._proc.poll() is None:  # the transfer failed half way: stop the command with it
            _kill_session(self._proc)
        self.close_stdin()
        self._proc.stdout.close()
        self._reader.join()


def _read_all(pipe, parts: list[bytes]) -> None:
    with pipe:
        for block in iter(lambda: pipe.read1(1 << 16), b""):
            parts.append(block)


def _write_and_close(pipe, data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError):
        pipe.write(data)
    with contextlib.suppress(BrokenPipeError):
        pipe.close()


def _kill_session(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=KILL_AFTER_S)
            return
        except subprocess.TimeoutExpired:
            continue
