"""Process plumbing for `eagleops run`: a temporary Prefect API the terminal cannot kill, and signals.

Without PREFECT_API_URL, Prefect starts a temporary API server as a child in the caller's
process group, so a terminal's Ctrl-C (SIGINT to the whole group) killed the API mid-run: the
flow then spent minutes retrying "Error logging to API" with hundreds of traceback lines, and a
SIGTERM'd run left that server orphaned under PID 1. Here the server runs in its own session
(the terminal's signals never reach it), dies with its parent (PR_SET_PDEATHSIG, even on
kill -9), and is stopped in a `finally`. SIGTERM is turned into an exception like Ctrl-C's, so
both unwind through the pipeline, which records the interrupted stage before the process exits.
The server is started before the flow's modules are imported (torch, MLflow: seconds) and waited
for only when the flow is about to run: its ~14 s boot and those imports overlap.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import IO

import httpx

_PR_SET_PDEATHSIG = 1
STARTUP_TIMEOUT_S = 120.0


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt (same unwinding)."""

    signal_name = "SIGTERM"


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the parent dies (Linux), whatever killed it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the finally below still stops the server on a clean exit
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_command(port: int) -> list[str]:
    """The API-only server Prefect itself starts for ephemeral runs (prefect.server.api.server)."""
    prefect_dir = Path(find_spec("prefect").origin).parent  # found, not imported: the caller may not have yet
    return [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect_dir.parent),
            "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "error", "--lifespan", "on"]


def _tail(log: IO[bytes], size: int = 2000) -> str:
    """The last `size` bytes of the server's log; pread leaves the offset it shares with the server alone."""
    end = os.fstat(log.fileno()).st_size
    return os.pread(log.fileno(), size, max(0, end - size)).decode(errors="replace")


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float, log: IO[bytes]) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the temporary Prefect server exited with {proc.returncode} before it was "
                                   f"ready:\n{_tail(log)}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/health").status_code == 200:
                    return
            time.sleep(0.2)
    raise RuntimeError(f"the temporary Prefect server at {url} was not ready within {timeout:.0f}s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@dataclass(frozen=True)
class TemporaryServer:
    """A temporary Prefect API server that was started; whether it answers yet is not known."""

    proc: subprocess.Popen
    url: str
    log: IO[bytes]  # nameless (O_TMPFILE): nothing to remove, even after a kill -9


@contextlib.contextmanager
def temporary_server() -> Iterator[TemporaryServer | None]:
    """Start the run's temporary Prefect server now, without waiting for it (None when PREFECT_API_URL is set:
    no server to start). The caller imports its flow meanwhile, then enters `prefect_api(server)`. The server
    is stopped on leaving, however the block ends (an error or a signal during the imports
    included)."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        yield None
        return
    port = _free_port()
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    server_log = tempfile.TemporaryFile()
    proc = subprocess.Popen(_server_command(port), env=env, start_new_session=True, preexec_fn=_die_with_parent,
                            stdout=server_log, stderr=subprocess.STDOUT)
    try:
        yield TemporaryServer(proc, f"http://127.0.0.1:{port}/api", server_log)
    finally:
        _stop(proc)
        server_log.close()


@contextlib.contextmanager
def prefect_api(server: TemporaryServer | None) -> Iterator[str]:
    """The Prefect API to run against: PREFECT_API_URL if set, else `server` (from `temporary_server`) once it
    answers; Prefect's queued logs and events are sent before the block ends (the server stops after it)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    configured = PREFECT_API_URL.value()
    if configured:
        yield configured
        return
    if server is None:
        raise RuntimeError("PREFECT_API_URL is not set and no temporary Prefect server was started")
    _wait_healthy(server.proc, server.url, STARTUP_TIMEOUT_S, server.log)
    with temporary_settings(updates={PREFECT_API_URL: server.url}):
        try:
            yield server.url
        finally:
            _drain_prefect_workers()


def _drain_prefect_workers(timeout: float = 10.0) -> None:
    """Send the logs and events still queued while the server is up: drained at exit instead,
    they met a stopped server and retried for minutes ("Error logging to API")."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout)


class _RedactingStream:
    """sys.stdout/sys.stderr stand-in: every write passes through `tasks.config.secrets.redact` first
    (third-party prints, e.g. a library printing its server URL, never go through logging)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        from tasks.config.secrets import redact

        return self._stream.write(redact(text))

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def redacted_stdio() -> Iterator[None]:
    """Mask secrets in whatever this process prints while the run lasts."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _RedactingStream(sys.stdout), _RedactingStream(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def signals_as_exceptions() -> Iterator[None]:
    """SIGTERM raises `Terminated` (a KeyboardInterrupt) for the duration; SIGINT already raises."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
