"""Warm starts of this machine's Python commands: `python -m eagle3.serve ...` (and the data and stream jobs)
forked from an `eagle3.forkserver` that has already imported them, instead of a fresh interpreter paying
torch's, transformers' and FastAPI's imports (~4-5 CPU-s) at every start.

`LocalExecutor.start_detached` asks `start_warm()` first; None means "start it cold" (the detach script), which is
also the answer whenever a warm start is not known to be the same as a cold one:
- switched off: EAGLEOPS_WARM_START=0 in this process's environment (read at every launch);
- not `PYTHON -m MODULE ...` for a module of WARM_MODULES (SGLang, torchrun, anything else: cold);
- an environment that differs from the server's in what is read at import time (IMPORT_TIME_ENV: threads,
  allocators, Python's own flags, the hub's caches): the child would run on libraries the server set up;
  at most MAX_SERVERS such environments get a server of their own, later ones start cold;
- the server refused (a second thread, a command line too long for its /proc room), could not start, or died.

One server per (python, import-time environment), started at the first warm launch of this process, in its
process group (Ctrl-C and a group kill reach it), stopped at this process's exit; it also exits by itself
within a second of this process's end. It listens on an abstract Unix socket and logs to an unlinked file, so
nothing of it stays on disk, whatever ends it. Every server preloads PRELOAD.
Children are sessions of their own, as cold ones are: stopping the server leaves them running.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Sequence

from tasks.hosts.remote.log import logger

SWITCH = "EAGLEOPS_WARM_START"
WARM_MODULES = frozenset({"eagle3.serve", "eagle3.data.generate", "eagle3.training.streaming.producer"})
# What a fork server imports before its first fork: the commands, and what they import only once they run (the
# tiny target's model class pulls transformers' masking and layer modules, ~1.5 CPU-s; uvicorn its HTTP loop).
PRELOAD = (*sorted(WARM_MODULES), "transformers.models.llama.modeling_llama", "uvicorn.loops.asyncio",
           "uvicorn.protocols.http.h11_impl")
IMPORT_TIME_ENV = ("PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH_", "CUDA_", "HF_",
                   "TRANSFORMERS_", "TOKENIZERS_", "LD_", "MALLOC_", "NUMPY_", "SGLANG_")
MAX_SERVERS = 3
START_TIMEOUT_S = 300.0  # the preload on a loaded 2-core machine: ~10 s, minutes when the disk is cold
ARG_ROOM = 8192  # bytes for a child's command line in /proc/PID/cmdline
ENV_ROOM = 32768  # bytes of environment a child may have beyond this process's own


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") != "0" and sys.platform.startswith("linux")


def start_warm(argv: Sequence[str], env: dict[str, str] | None, cwd: str | None, log_file: str,
               pid_file: str) -> int | None:
    """The pid of `argv` started warm (its own session, logging to `log_file`, its pid in `pid_file`), or None:
    start it cold."""
    if not enabled() or len(argv) < 3 or argv[1] != "-m" or argv[2] not in WARM_MODULES \
            or not os.path.isabs(argv[0]):
        return None
    full_env = {**os.environ, **(env or {})}
    server = _server_for(argv[0], _import_time(full_env), argv[2])
    if server is None:
        return None
    return server.spawn(argv, full_env, cwd or os.getcwd(), log_file, pid_file)  # a cold start runs where we do


def exit_status(pid: int) -> int | None:
    """The exit status of a warm-started child that ended (None: running, or not started warm here)."""
    for server in list(_SERVERS.values()):
        if server is not None and server.alive():
            code = server.status(pid)
            if code is not None:
                return code
    return None


# The signals a cold start's command has at their default whatever this process does with them: coreutils `timeout`
# (the detach script runs under it) catches these, and exec resets a caught signal.
RESET_BY_TIMEOUT = frozenset({signal.SIGALRM, signal.SIGHUP, signal.SIGTERM, signal.SIGCHLD, signal.SIGTTIN,
                              signal.SIGTTOU})
# ... and these it has ignored: the detach script starts it with `&`, which a non-interactive shell runs so.
IGNORED_BY_THE_DETACH = frozenset({signal.SIGINT, signal.SIGQUIT})


def cold_start_ignored() -> list[int]:
    """The signals a command started cold from this process now ignores: what this process ignores (exec keeps an
    ignored signal ignored) but those `timeout` resets, and SIGINT and SIGQUIT."""
    ignored = set(IGNORED_BY_THE_DETACH)
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            if sig not in RESET_BY_TIMEOUT and signal.getsignal(sig) == signal.SIG_IGN:
                ignored.add(sig)
    return sorted(int(sig) for sig in ignored)


def _import_time(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)))


class ForkServer:
    """One `python -m eagle3.forkserver` child of this process."""

    def __init__(self, python: str, import_env: tuple):
        self.python, self.import_env = python, import_env
        if dict(import_env).get("OPENBLAS_NUM_THREADS", "1") != "1":
            raise RuntimeError("OPENBLAS_NUM_THREADS != 1 would start threads in the fork server")
        outside = {k: v for k, v in os.environ.items() if not k.startswith(IMPORT_TIME_ENV)}
        env = {**outside, **dict(import_env), "OPENBLAS_NUM_THREADS": "1", "EAGLEOPS_FORKSERVER_ROOM": " " * ENV_ROOM}
        self.name = f"eagleops-warm-{os.getpid()}-{secrets.token_hex(8)}"  # abstract: nothing on disk, ever
        self.log = tempfile.TemporaryFile()  # unlinked: a kill -9 leaves no file either
        self.proc = subprocess.Popen(
            [python, "-m", "eagle3.forkserver", self.name, *(f"--preload={m}" for m in PRELOAD),
             "--room", " " * ARG_ROOM],
            env=env, cwd="/", stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT, close_fds=True)
        self.owner = os.getpid()

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(OSError):
                if self._ask({"op": "ping"}).get("ok"):
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"the fork server exited ({self.proc.returncode}): {self._log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the fork server did not preload within {timeout_s:.0f} s")
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.owner == os.getpid() and self.proc.poll() is None

    def spawn(self, argv: Sequence[str], env: dict[str, str], cwd: str | None, log_file: str,
              pid_file: str) -> int | None:
        try:
            answer = self._ask({"op": "spawn", "argv": list(argv), "env": env, "cwd": cwd, "log_file": log_file,
                                "pid_file": pid_file, "ignored": cold_start_ignored()})
        except OSError as err:
            logger().warning(f"warm start of {argv[2]}: the fork server did not answer ({err}); starting it cold")
            return None
        if "pid" in answer:
            return int(answer["pid"])
        logger().info(f"warm start of {argv[2]} refused: {answer.get('refused') or answer.get('error')}; "
                      "starting it cold")
        return None

    def status(self, pid: int) -> int | None:
        with contextlib.suppress(OSError, KeyError):
            return self._ask({"op": "status", "pid": int(pid)})["exit"]
        return None

    def _ask(self, request: dict) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(60)
            conn.connect("\0" + self.name)
            conn.sendall(json.dumps(request).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                block = conn.recv(1 << 16)
                if not block:
                    raise ConnectionError("the fork server closed the connection without an answer")
                data += block
        return json.loads(data)

    def stop(self) -> None:
        """Stop the server (its children live on); for the process that started it."""
        if self.owner != os.getpid():
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError, ValueError):
            end = os.fstat(self.log.fileno()).st_size
            return os.pread(self.log.fileno(), 3000, max(0, end - 3000)).decode(errors="replace")
        return "(no log)"


# (python, import-time environment) -> its server; None: it failed to start in this process, start cold
_SERVERS: dict[tuple, ForkServer | None] = {}
_LOCK = threading.Lock()


def _server_for(python: str, import_env: tuple, module: str) -> ForkServer | None:
    key = (python, import_env)
    with _LOCK:
        server = _SERVERS.get(key)
        if server is not None and not server.alive():
            _SERVERS.pop(key)  # died, or this is a forked copy of the process that started it
            server = None
        if key in _SERVERS or server is not None:
            return server
        if len(_SERVERS) >= MAX_SERVERS:
            return None
        try:
            server = ForkServer(python, import_env)
            server.wait_ready()
        except BaseException as err:
            if server is not None:
                server.stop()
            _SERVERS[key] = None
            if not isinstance(err, Exception):
                raise
            logger().warning(f"warm start unavailable ({err}); starting {module} cold")
            return None
        _SERVERS[key] = server
        logger().info(f"warm start: fork server pid {server.proc.pid} ({python}) preloaded {', '.join(PRELOAD)}")
        return server


@atexit.register
def stop_all() -> None:
    """Stop this process's fork servers (registered at exit; tests call it to start afresh)."""
    with _LOCK:
        servers = [s for s in _SERVERS.values() if s is not None]
        _SERVERS.clear()
    for server in servers:
        server.stop()
