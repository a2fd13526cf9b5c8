"""Run commands on a host and move files to and from it: over SSH (paramiko) or on this machine.

Owns the one `Executor` interface that deploy, benchmark and training stages use for `host: local`
and for inventory hosts: argv commands, detached servers in their own process group, uploads
that are fast, resumable, verified and atomic, downloads that are verified and atomic, and
tunnels to a host's loopback ports.

Risks, and what guards them:
- A command string built by hand lets a config value such as `x; touch pwned` run as shell
  code. Every command goes through `shell_command()`, which `shlex.quote`s each argv element,
  and both executors run exactly that string, so the quoting is tested on both.
- An unverified host key lets whoever sits in the path read checkpoints and run commands.
  Unknown or changed keys are refused (a `RejectPolicy`) with the fingerprint and the command
  that trusts it; nothing is ever added to known_hosts except by `trust_host`.
- An upload cut halfway must never leave a truncated file under the final name. Data lands in
  `<dest>.part`, is renamed only after its sha256 equals the local one, and a later upload
  continues from the `.part` size (the final hash decides whether that was safe). Downloads
  likewise land in `<local>.part` and are renamed only if they hash to the host's sha256.
- Upload speed: paramiko's SFTP `put` runs at ~0.36x scp; streaming into `cat` on an exec
  channel with aes128-gcm and packet-sized writes runs at ~0.93x (see
  /work/shared/reference/transfer-and-serving-perf.md, Part 1).
"""

from __future__ import annotations

import abc
import base64
import codecs
import contextlib
import functools
import hashlib
import logging
import os
import posixpath
import re
import select
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager, Iterator, Protocol, Sequence, TypeVar

import paramiko

from tasks.config import HostConfig

FAST_CIPHER = "aes128-gcm@openssh.com"
KEEPALIVE_S = 30
# paramiko starts a rekey itself after 512 MiB. If the server closes a channel just then (as
# it does when `cat` ends an upload), paramiko's transport thread blocks on its own rekey and
# the connection dies after 30 s (paramiko #822, open; seen here at the end of a 1 GiB
# upload). OpenSSH servers rekey on their own (sshd_config RekeyLimit: "between 1G and 4G,
# depending on the cipher"), a server-started rekey does not hit that bug, so paramiko's own
# threshold is set far above the server's.
CLIENT_REKEY_BYTES = 2**37
TAIL_LINES = 20
# `timeout -k`: seconds between SIGTERM and SIGKILL for a command that overran its timeout.
KILL_AFTER_S = 5
PROGRESS_EVERY_S = 5.0
# One download read takes up to this much: more than paramiko's 2 MiB channel window (see
# _channel_source).
DOWNLOAD_READ_BYTES = 1 << 22
# A blocked send or a silent peer for this long means the connection is gone.
CHANNEL_IO_TIMEOUT_S = 120.0
T = TypeVar("T")
TUNNEL_POLL_S = 0.5  # how often a tunnel's blocked reads look at stop()
SECRET_ENV_KEY = re.compile(r"KEY|TOKEN|PASSWORD|PASSWD|SECRET|PASSPHRASE|CREDENTIAL", re.IGNORECASE)
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MASK = "****"
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
# Exit status of `timeout` when it had to stop the command (TERM, then KILL).
TIMEOUT_EXIT_STATUSES = (124, 137)
MISSING = 3  # exit status the helper scripts below use for "no such file"

Progress = Callable[[str, int, int], None]


def logger() -> logging.Logger | logging.LoggerAdapter:
    """Prefect's run logger inside a flow or task run, else the `eagleops.remote` logger."""
    if "prefect" in sys.modules:  # no run context can exist before prefect was imported
        from prefect import get_run_logger
        from prefect.exceptions import MissingContextError

        try:
            return get_run_logger()
        except MissingContextError:
            pass
    return logging.getLogger("eagleops.remote")


# --------------------------------------------------------------------------- errors


class RemoteError(RuntimeError):
    """Base of every error raised here."""


class HostKeyError(RemoteError):
    """The host's key is not in known_hosts, or differs from the one recorded there."""


class ConnectError(RemoteError):
    """No SSH connection after the bounded retries (or authentication was refused)."""


class ConnectionLost(RemoteError):
    """The connection dropped during an operation; the executor's next call reconnects."""


class CommandTimeout(RemoteError):
    """A command ran past its timeout and was killed."""


class UploadVerifyError(RemoteError):
    """The uploaded bytes do not hash to the local file's sha256."""


class DownloadVerifyError(RemoteError):
    """The downloaded bytes do not hash to the remote file's sha256."""


def tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


class CommandFailed(RemoteError):
    """A command exited non-zero; carries argv, exit status and the tails of its output."""

    def __init__(self, host: str, shown: str, argv: list[str], exit_status: int, stdout: str, stderr: str):
        self.host, self.argv, self.exit_status = host, argv, exit_status
        self.stdout_tail, self.stderr_tail = tail(stdout), tail(stderr)
        message = f"[{host}] exit status {exit_status}: {shown}"
        if self.stderr_tail:
            message += f"\nstderr (last {TAIL_LINES} lines):\n{self.stderr_tail}"
        if self.stdout_tail:
            message += f"\nstdout (last {TAIL_LINES} lines):\n{self.stdout_tail}"
        super().__init__(message)


# --------------------------------------------------------------------------- results


@dataclass
class CommandResult:
    exit_status: int
    stdout: str
    stderr: str


@dataclass
class UploadResult:
    """One file's upload. `resumed_from` is the `.part` size the first attempt continued from."""

    local: str
    remote: str
    size: int
    sha256: str
    bytes_sent: int
    seconds: float
    skipped: bool = False
    resumed_from: int = 0
    restarted: bool = False  # a resumed `.part` failed verification and was sent again from zero
    transfer_seconds: float = 0.0  # streaming the bytes
    verify_seconds: float = 0.0  # the host re-reading and hashing the `.part`, and the rename

    @property
    def mb_per_s(self) -> float:
        return self.bytes_sent / 1e6 / max(self.seconds, 1e-9)


@dataclass
class DownloadResult:
    """One file's download. Not an UploadResult: nothing is sent, and downloads do not resume."""

    remote: str
    local: str
    size: int
    sha256: str
    bytes_received: int
    seconds: float
    skipped: bool = False
    transfer_seconds: float = 0.0  # streaming the bytes into `<local>.part`, hashing them on the way
    verify_seconds: float = 0.0  # the host hashing the file (before the transfer: it decides the skip)

    @property
    def mb_per_s(self) -> float:
        return self.bytes_received / 1e6 / max(self.seconds, 1e-9)


# --------------------------------------------------------------------------- commands


def is_secret_env_key(key: str) -> bool:
    return bool(SECRET_ENV_KEY.search(key))


def quote_path(path: str) -> str:
    """Shell-quote a path; a leading `~/` stays the host's home ("$HOME"/...)."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def _validated(argv: Sequence[object], env: dict[str, str] | None) -> list[str]:
    if isinstance(argv, (str, bytes)) or not argv:
        raise ValueError(f"argv must be a non-empty list of arguments, got {argv!r}")
    words = [os.fspath(a) if isinstance(a, os.PathLike) else a for a in argv]
    bad = [a for a in words if not isinstance(a, str) or "\0" in a]
    if bad:
        raise ValueError(f"argv elements must be strings without NUL bytes, got {bad!r}")
    for key in env or {}:
        if not ENV_NAME.match(key):
            raise ValueError(f"env: {key!r} is not a valid environment variable name")
    return words


def shell_command(argv: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None,
                  timeout: float | None = None) -> str:
    """The one shell line that runs `argv` literally: `cd D && timeout -k 5 T env K=V argv...`.

    Every argv element and `K=V` is `shlex.quote`d, so `$(id)` or `x; touch pwned` reach the
    program as text. coreutils `timeout` puts the command in its own process group and kills
    that whole group when the time is up, so nothing it started outlives the timeout.
    """
    words = [shlex.quote(a) for a in _validated(argv, env)]
    if env:
        words = ["env", *(shlex.quote(f"{k}={v}") for k, v in env.items()), *words]
    if timeout is not None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        words = ["timeout", "-k", str(KILL_AFTER_S), f"{timeout:.3f}", *words]
    line = " ".join(words)
    return f"cd {quote_path(cwd)} && {line}" if cwd else line


def describe_command(argv: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None) -> str:
    """The command as logged and put in errors: env values of secret-looking keys masked."""
    shown_env = [f"{k}={MASK if is_secret_env_key(k) else v}" for k, v in (env or {}).items()]
    line = shlex.join([*shown_env, *(str(a) for a in argv)])
    return f"(cd {cwd}) {line}" if cwd else line


class _OutputStream:
    """One output stream: decoded incrementally, logged line by line while it runs, kept whole."""

    def __init__(self, label: str, log_lines: bool):
        self.label, self.log_lines = label, log_lines
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._parts: list[str] = []
        self._pending = ""

    def feed(self, data: bytes, final: bool = False) -> None:
        text = self._decoder.decode(data, final)
        self._parts.append(text)
        if not self.log_lines:
            return
        *lines, self._pending = (self._pending + text).split("\n")
        if final and self._pending:
            lines, self._pending = [*lines, self._pending], ""
        for line in lines:
            logger().info("[%s] %s", self.label, line)

    def close(self) -> None:
        self.feed(b"", final=True)

    @property
    def text(self) -> str:
        return "".join(self._parts)


# Helper scripts run as `sh -c SCRIPT sh ARGS...`: the arguments arrive as "$1"... and are
# never parsed as shell code.
_SHA256_SCRIPT = """[ -f "$1" ] || exit 3
if command -v openssl >/dev/null 2>&1; then exec openssl dgst -sha256 -r "$1"; fi
exec "$2" -c "$3" "$1"
"""
_SHA256_PY = """import hashlib, sys
digest = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        digest.update(block)
print(digest.hexdigest())
"""
_SIZE_SCRIPT = '[ -f "$1" ] || exit 3; wc -c < "$1"'
# Upload bookkeeping in one round trip each (every exec costs a shell start on the host):
# before sending, create the directory and report whether dest exists and the `.part` size;
# after sending, hash the `.part` and rename it only if the hash is the expected one.
_UPLOAD_PROBE_SCRIPT = """mkdir -p "$(dirname "$1")" || exit 1
if [ -e "$1" ]; then echo 1; else echo 0; fi
if [ -f "$2" ]; then wc -c < "$2"; else echo 0; fi
"""
_UPLOAD_COMMIT_SCRIPT = """part=$1; dest=$2; want=$3
if command -v openssl >/dev/null 2>&1; then got=$(openssl dgst -sha256 -r "$part") || exit 1
else got=$("$4" -c "$5" "$part") || exit 1; fi
got=${got%% *}
if [ "$got" = "$want" ]; then mv -f "$part" "$dest" || exit 1; fi
echo "$got"
"""
# Files under $1 (symlinks followed, as `scp -r` does), relative to it, NUL-separated so any
# file name survives.
_LIST_FILES_SCRIPT = '[ -d "$1" ] || exit 3; cd "$1" && exec find -L . -type f -print0'
_READ_SCRIPT = '[ -f "$1" ] || exit 3; if [ -n "$2" ]; then exec tail -n "$2" "$1"; fi; exec cat "$1"'
_PORT_PY = """import socket, sys
probe = socket.socket()
probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is free
try:
    probe.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(3)
"""
# The child writes its own pid (it is the new session's leader, so pid == process group id)
# before exec'ing the command; the parent waits for that file instead of trusting `$!`.
_DETACH_SCRIPT = """log=$1; pidfile=$2; dir=$3; shift 3
mkdir -p "$(dirname "$log")" "$(dirname "$pidfile")" || exit 1
rm -f "$pidfile"
if [ -n "$dir" ]; then cd "$dir" || exit 1; fi
setsid sh -c 'echo $$ > "$0"; exec "$@"' "$pidfile" "$@" > "$log" 2>&1 < /dev/null &
i=0
while [ ! -s "$pidfile" ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done
[ -s "$pidfile" ] || { echo "no pid in $pidfile after 10 s" >&2; exit 1; }
cat "$pidfile"
"""
_ALIVE_SCRIPT = """kill -0 "$1" 2>/dev/null || exit 1
case "$(ps -o stat= -p "$1" 2>/dev/null)" in Z*) exit 1;; esac
exit 0
"""
# Members of the group that are not zombies; TERM, wait up to $2 s, then KILL.
_KILL_GROUP_SCRIPT = """group=$1; limit=$(( $2 * 10 ))
alive() { ps -e -o pgid=,stat= | awk -v g="$group" '$1 == g && $2 !~ /^Z/ {found = 1} END {exit !found}'; }
alive || exit 0
kill -TERM "-$group" 2>/dev/null
i=0
while alive && [ $i -lt $limit ]; do sleep 0.1; i=$((i+1)); done
alive || exit 0
echo "process group $group still running after SIGTERM and $2 s; sending SIGKILL" >&2
kill -KILL "-$group" 2>/dev/null
i=0
while alive && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done
alive && { echo "process group $group survived SIGKILL" >&2; exit 1; }
exit 0
"""


def _sh(script: str, *args: object) -> list[str]:
    return ["sh", "-c", script, "sh", *(str(a) for a in args)]


# --------------------------------------------------------------------------- uploads


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class ByteProgress:
    """Default upload progress: `what: done/total MB (MB/s, ETA)` at most every `every_s`."""

    def __init__(self, label: str, every_s: float = PROGRESS_EVERY_S):
        self.label, self.every_s = label, every_s
        self._start: tuple[float, int] | None = None
        self._last = 0.0

    def __call__(self, what: str, done: int, total: int) -> None:
        now = time.monotonic()
        if self._start is None:
            self._start, self._last = (now, done), now
            return
        if now - self._last < self.every_s and done < total:
            return
        self._last = now
        rate = (done - self._start[1]) / max(now - self._start[0], 1e-9)
        eta = f", ETA {(total - done) / rate:.0f} s" if rate > 0 and done < total else ""
        logger().info(f"{self.label} {what}: {done / 1e6:.1f}/{total / 1e6:.1f} MB ({rate / 1e6:.1f} MB/s{eta})")


class _Sink(Protocol):
    chunk_size: int

    def write(self, data: bytes) -> None: ...
    def finish(self) -> None: ...
    def abort(self) -> None: ...


class _FileSink:
    """LocalExecutor: the `.part` file opened directly."""

    chunk_size = 1 << 20

    def __init__(self, path: str, append: bool):
        self._file = open(path, "ab" if append else "wb")

    def write(self, data: bytes) -> None:
        self._file.write(data)

    def finish(self) -> None:
        self._file.close()

    def abort(self) -> None:
        self._file.close()


# --------------------------------------------------------------------------- executors


class Executor(Protocol):
    """Where commands run and files go: this machine (`LocalExecutor`) or an SSH host."""

    name: str

    def run(self, argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
            timeout: float | None = None, check: bool = True, stdin: bytes | None = None,
            log_output: bool = True) -> CommandResult: ...
    def start_detached(self, argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
                       log_file: str, pid_file: str) -> int: ...
    def is_alive(self, pid: int) -> bool: ...
    def kill_group(self, pid: int, timeout: float = 15) -> None: ...
    def read_file(self, path: str, tail_lines: int | None = None) -> str: ...
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
    def forward(self, remote_port: int) -> ContextManager[int]: ...
    def close(self) -> None: ...


class _ExecutorBase(abc.ABC):
    """Everything both executors share, built on `_execute` (run one shell line), `_open_sink` and
    `_open_source`."""

    name: str
    python: str

    # -- subclass hooks
    @abc.abstractmethod
    def _execute(self, command: str, stdin: bytes | None, out: _OutputStream, err: _OutputStream,
                 deadline: float | None) -> int | None:
        """Run one shell line; its exit status (None when the deadline passed)."""

    @abc.abstractmethod
    def _open_sink(self, path: str, append: bool) -> _Sink:
        """A writable stream into `path` on the host."""

    @abc.abstractmethod
    def _open_source(self, path: str) -> Iterator[bytes]:
        """The bytes of `path` on the host, in chunks; raises at the end if the stream broke.

        A generator: closing it early (the caller failed) releases the file or channel.
        """

    @abc.abstractmethod
    def _home(self) -> str:
        """The user's home directory on the host."""

    def _recover(self) -> None:
        """Make the next call usable after a ConnectionLost (SSH: reconnect)."""

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

    def kill_group(self, pid: int, timeout: float = 15) -> None:
        """SIGTERM the process group `pid`, wait up to `timeout` s, then SIGKILL. Idempotent."""
        result = self.run(_sh(_KILL_GROUP_SCRIPT, int(pid), max(1, int(timeout))), log_output=False,
                          timeout=timeout + 30, check=False)
        if result.stderr.strip():
            logger().warning("[%s] %s", self.name, result.stderr.strip())
        if result.exit_status != 0:
            raise RemoteError(f"[{self.name}] could not stop process group {pid}: {result.stderr.strip()}")
        logger().info("[%s] process group %d stopped", self.name, pid)

    def port_in_use(self, port: int) -> bool:
        """Whether binding 127.0.0.1:`port` on that host fails (something already serves it)."""
        return self.run([self.python, "-c", _PORT_PY, str(int(port))], check=False, log_output=False,
                        timeout=60).exit_status == MISSING

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

    def read_file(self, path: str, tail_lines: int | None = None) -> str:
        path = self.expand_path(path)
        result = self.run(_sh(_READ_SCRIPT, path, tail_lines or ""), check=False, log_output=False, timeout=300)
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

    def sha256(self, path: str) -> str | None:
        """The file's sha256 (`openssl dgst -sha256`, else python hashlib); None if it is absent."""
        path = self.expand_path(path)
        result = self.run(_sh(_SHA256_SCRIPT, path, self.python, _SHA256_PY), check=False, log_output=False)
        if result.exit_status == MISSING:
            return None
        if result.exit_status != 0:
            raise CommandFailed(self.name, f"sha256 {path}", ["sha256", path], result.exit_status, result.stdout,
                                result.stderr)
        digest = result.stdout.split()[0].lower() if result.stdout.split() else ""
        if not SHA256_HEX.match(digest):
            raise RemoteError(f"[{self.name}] sha256 of {path}: unexpected output {result.stdout!r}")
        return digest

    def file_size(self, path: str) -> int | None:
        result = self.run(_sh(_SIZE_SCRIPT, self.expand_path(path)), check=False, log_output=False, timeout=60)
        if result.exit_status == MISSING:
            return None
        if result.exit_status != 0:
            raise CommandFailed(self.name, f"size {path}", ["wc", "-c", path], result.exit_status, "", result.stderr)
        return int(result.stdout.strip())

    # -- uploads
    def upload_file(self, local: str | Path, remote: str, progress: Progress | None = None, *,
                    reconnects: int = 2) -> UploadResult:
        """Copy `local` to `remote` on the host: skipped if equal, resumable, verified, atomic.

        Bytes go to `<remote>.part` (continuing from its size if one exists), the host's sha256
        of it must equal the one computed while reading `local`, then it is renamed. A resumed
        `.part` that fails verification is sent again once from zero. After a dropped
        connection the upload reconnects and resumes, at most `reconnects` times.
        `progress(what, done_bytes, total_bytes)` is called per chunk (it rate-limits itself).
        """
        local = Path(local)
        if not local.is_file():
            raise FileNotFoundError(f"upload source {local} is not a file")
        remote = self.expand_path(remote)
        progress = progress or ByteProgress(f"[{self.name}] upload")
        return self._reconnecting(lambda: self._upload_once(local, remote, progress), reconnects,
                                  f"upload of {local}", "resume")

    def _reconnecting(self, transfer: Callable[[], T], reconnects: int, what: str, then: str) -> T:
        """`transfer()`, again after a dropped connection (reconnected first), at most `reconnects` times."""
        for attempt in range(reconnects + 1):
            try:
                return transfer()
            except ConnectionLost as err:
                if attempt == reconnects:
                    raise
                logger().warning("[%s] %s interrupted (%s); reconnecting to %s", self.name, what, err, then)
                self._recover()
        raise AssertionError("unreachable")

    def _upload_once(self, local: Path, remote: str, progress: Progress) -> UploadResult:
        started, size, part = time.monotonic(), local.stat().st_size, remote + ".part"
        probe = self.run(_sh(_UPLOAD_PROBE_SCRIPT, remote, part), log_output=False, timeout=60).stdout.split()
        dest_exists, offset = probe[0] == "1", int(probe[1])
        if dest_exists:
            local_hash = sha256_file(local)
            if self.sha256(remote) == local_hash:
                logger().info("[%s] %s already has sha256 %s; upload skipped", self.name, remote, local_hash[:12])
                return UploadResult(str(local), remote, size, local_hash, 0, time.monotonic() - started, skipped=True)
        if offset > size:  # a `.part` of some other, longer file
            offset = 0
        resumed_from, sent_total, restarted, transfer_s, verify_s = offset, 0, False, 0.0, 0.0
        while True:
            phase = time.monotonic()
            sent, local_hash = self._stream(local, part, offset, size, progress)
            sent_total, transfer_s, phase = sent_total + sent, transfer_s + time.monotonic() - phase, time.monotonic()
            remote_hash = self._commit_if_hash(part, remote, local_hash)
            verify_s += time.monotonic() - phase
            if remote_hash == local_hash:
                break
            if restarted:
                self.run(["rm", "-f", part], log_output=False, timeout=60)
                raise UploadVerifyError(f"[{self.name}] upload {local} -> {remote}: sha256 mismatch after sending "
                                        f"from zero: local {local_hash}, remote {remote_hash}")
            logger().warning("[%s] %s: sha256 %s != local %s after resuming at byte %d; sending again from zero",
                             self.name, part, remote_hash, local_hash, offset)
            offset, restarted = 0, True
        result = UploadResult(str(local), remote, size, local_hash, sent_total, time.monotonic() - started,
                              resumed_from=resumed_from, restarted=restarted, transfer_seconds=transfer_s,
                              verify_seconds=verify_s)
        logger().info("[%s] uploaded %s -> %s: %.1f MB in %.1f s (%.1f MB/s; sending %.1f s, verifying %.1f s)%s",
                      self.name, local, remote, sent_total / 1e6, result.seconds, result.mb_per_s, transfer_s, verify_s,
                      f", resumed from byte {resumed_from}" if resumed_from else "")
        return result

    def _commit_if_hash(self, part: str, remote: str, expected: str) -> str:
        """Rename `part` to `remote` if its sha256 is `expected`; return the hash found."""
        result = self.run(_sh(_UPLOAD_COMMIT_SCRIPT, part, remote, expected, self.python, _SHA256_PY),
                          log_output=False)
        found = result.stdout.strip().lower()
        if not SHA256_HEX.match(found):
            raise RemoteError(f"[{self.name}] sha256 of {part}: unexpected output {result.stdout!r}")
        return found

    def _stream(self, local: Path, part: str, offset: int, size: int, progress: Progress) -> tuple[int, str]:
        """Send `local[offset:]` onto the end of `part`; return (bytes sent, sha256 of all of `local`)."""
        digest = hashlib.sha256()
        sent = 0
        with open(local, "rb", buffering=1 << 20) as f:
            # The bytes already on the host are hashed, not sent: the final compare covers them.
            for block in iter(lambda: f.read(min(1 << 20, offset - f.tell())), b""):
                digest.update(block)
            sink = self._open_sink(part, append=offset > 0)
            try:
                for chunk in iter(lambda: f.read(sink.chunk_size), b""):
                    digest.update(chunk)
                    sink.write(chunk)
                    sent += len(chunk)
                    progress(local.name, offset + sent, size)
            except BaseException:
                sink.abort()
                raise
            sink.finish()
        progress(local.name, offset + sent, size)
        return sent, digest.hexdigest()

    def upload_dir(self, local_dir: str | Path, remote_dir: str, progress: Progress | None = None) -> list[UploadResult]:
        """Upload every file under `local_dir` to `remote_dir`, keeping the relative layout."""
        local_dir = Path(local_dir)
        if not local_dir.is_dir():
            raise FileNotFoundError(f"upload source {local_dir} is not a directory")
        remote_dir = self.expand_path(remote_dir)
        dirs = sorted(p for p in local_dir.rglob("*") if p.is_dir())
        self.run(["mkdir", "-p", remote_dir, *(posixpath.join(remote_dir, d.relative_to(local_dir).as_posix())
                                              for d in dirs)], log_output=False, timeout=60)
        files = sorted(p for p in local_dir.rglob("*") if p.is_file())
        return [self.upload_file(p, posixpath.join(remote_dir, p.relative_to(local_dir).as_posix()), progress)
                for p in files]

    # -- downloads
    def download_file(self, remote: str, local: str | Path, progress: Progress | None = None, *,
                      reconnects: int = 2) -> DownloadResult:
        """Copy `remote` on the host to `local`: skipped if equal, verified, atomic.

        The host hashes `remote` first; that sha256 decides the skip and is what the received
        bytes, hashed while they are written to `<local>.part`, must equal before the rename. A
        failed attempt leaves `local` as it was and no `.part`. After a dropped connection it
        reconnects and starts again from zero, at most `reconnects` times (checkpoints are
        fetched once, at the end of a run: resuming is not worth a second code path).
        `progress(what, done_bytes, total_bytes)` is called per chunk (it rate-limits itself).
        """
        remote, local = self.expand_path(remote), Path(local)
        progress = progress or ByteProgress(f"[{self.name}] download")
        return self._reconnecting(lambda: self._download_once(remote, local, progress), reconnects,
                                  f"download of {remote}", "start again")

    def _download_once(self, remote: str, local: Path, progress: Progress) -> DownloadResult:
        started = time.monotonic()
        size, expected = self._remote_size_and_sha256(remote)
        verify_s = time.monotonic() - started
        if local.is_file() and local.stat().st_size == size and sha256_file(local) == expected:
            logger().info("[%s] %s already has sha256 %s; download skipped", self.name, local, expected[:12])
            return DownloadResult(remote, str(local), size, expected, 0, time.monotonic() - started, skipped=True,
                                  verify_seconds=verify_s)
        phase = time.monotonic()
        received = self._receive(remote, local, size, expected, progress)
        result = DownloadResult(remote, str(local), size, expected, received, time.monotonic() - started,
                                transfer_seconds=time.monotonic() - phase, verify_seconds=verify_s)
        logger().info("[%s] downloaded %s -> %s: %.1f MB in %.1f s (%.1f MB/s; hashing on the host %.1f s)",
                      self.name, remote, local, received / 1e6, result.seconds, result.mb_per_s, verify_s)
        return result

    def _remote_size_and_sha256(self, remote: str) -> tuple[int, str]:
        """Size (for progress) and sha256 of `remote`; FileNotFoundError naming host and path."""
        expected = self.sha256(remote)
        size = self.file_size(remote) if expected is not None else None
        if expected is None or size is None:
            raise FileNotFoundError(f"[{self.name}] {remote}: no such file to download")
        return size, expected

    def _receive(self, remote: str, local: Path, size: int, expected: str, progress: Progress) -> int:
        """Stream `remote` into `<local>.part`, rename it to `local` if it hashes to `expected`.

        Returns the bytes received. Any failure removes the `.part`: a download starts from zero.
        """
        part, name = local.with_name(local.name + ".part"), posixpath.basename(remote)
        local.parent.mkdir(parents=True, exist_ok=True)
        digest, received = hashlib.sha256(), 0
        try:
            with open(part, "wb") as f, contextlib.closing(self._open_source(remote)) as chunks:
                for chunk in chunks:
                    digest.update(chunk)
                    f.write(chunk)
                    received += len(chunk)
                    progress(name, received, size)
            progress(name, received, size)
            if digest.hexdigest() != expected:
                raise DownloadVerifyError(f"[{self.name}] download {remote} -> {local}: sha256 mismatch: remote "
                                          f"{expected}, received {digest.hexdigest()} ({received} of {size} bytes)")
            os.replace(part, local)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        return received

    def download_dir(self, remote_dir: str, local_dir: str | Path,
                     progress: Progress | None = None) -> list[DownloadResult]:
        """Download every file under `remote_dir` into `local_dir`, keeping the relative layout.

        A missing `remote_dir`, or one without files, raises FileNotFoundError: a training run
        whose results are not there must not look like one that produced nothing.
        """
        remote_dir, local_dir = self.expand_path(remote_dir), Path(local_dir)
        result = self.run(_sh(_LIST_FILES_SCRIPT, remote_dir), check=False, log_output=False, timeout=300)
        if result.exit_status == MISSING:
            raise FileNotFoundError(f"[{self.name}] {remote_dir}: no such directory to download")
        if result.exit_status != 0:
            raise CommandFailed(self.name, f"list {remote_dir}", ["find", remote_dir], result.exit_status, "",
                                result.stderr)
        relative = sorted(posixpath.normpath(p) for p in result.stdout.split("\0") if p)
        if not relative:
            raise FileNotFoundError(f"[{self.name}] {remote_dir}: no files to download")
        return [self.download_file(posixpath.join(remote_dir, rel), local_dir.joinpath(*rel.split("/")), progress)
                for rel in relative]

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

    def _open_sink(self, path: str, append: bool) -> _Sink:
        return _FileSink(path, append)

    def _open_source(self, path: str) -> Iterator[bytes]:
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise FileNotFoundError(f"[{self.name}] {path}: no such file to download") from None
        with f:
            yield from iter(lambda: f.read(1 << 20), b"")

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


# --------------------------------------------------------------------------- SSH


def known_hosts_path(host: HostConfig) -> Path:
    return Path(os.path.expanduser(host.known_hosts or "~/.ssh/known_hosts"))


def host_key_name(host: HostConfig) -> str:
    """The name known_hosts files use: `addr`, or `[addr]:port` off port 22."""
    return host.address if host.port == 22 else f"[{host.address}]:{host.port}"


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's `SHA256:...` fingerprint, as `ssh-keygen -lf` prints it."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


class _RejectUnknownHost(paramiko.RejectPolicy):
    """RejectPolicy whose error shows the fingerprint, the known_hosts file and the trust command."""

    def __init__(self, host: HostConfig):
        self.host = host

    def missing_host_key(self, client, hostname, key):
        raise HostKeyError(
            f"host key of {self.host.name} ({hostname}) is not known: it offers {key.get_name()} {fingerprint(key)}, "
            f"which is not in known_hosts file {known_hosts_path(self.host)}. If that fingerprint is the host's, "
            f"record it with: eagleops hosts trust {self.host.name}"
        )


def _changed_key_error(host: HostConfig, err: paramiko.BadHostKeyException) -> HostKeyError:
    return HostKeyError(
        f"host key of {host.name} ({host_key_name(host)}) CHANGED: it offers {err.key.get_name()} "
        f"{fingerprint(err.key)} but known_hosts file {known_hosts_path(host)} records "
        f"{err.expected_key.get_name()} {fingerprint(err.expected_key)}. This can be a man-in-the-middle; if the "
        f"host was reinstalled, check the new fingerprint and run: eagleops hosts trust {host.name}"
    )


def _fast_transport(sock, **kwargs) -> paramiko.Transport:
    """A Transport that prefers aes128-gcm; a server without it negotiates the next cipher."""
    transport = paramiko.Transport(sock, **kwargs)
    options = transport.get_security_options()
    options.ciphers = (FAST_CIPHER, *(c for c in options.ciphers if c != FAST_CIPHER))
    transport.packetizer.REKEY_BYTES = CLIENT_REKEY_BYTES
    return transport


_JUMP_SPEC = re.compile(r"^(?P<user>[^@\s]+)@(?P<address>[^@\s:]+)(:(?P<port>\d{1,5}))?$")


def resolve_jump_host(host: HostConfig, inventory: Sequence[HostConfig] = ()) -> HostConfig | None:
    """`host.jump_host` as a HostConfig: an inventory name, or `user@addr[:port]` using host's key files."""
    spec = host.jump_host
    if not spec:
        return None
    match = _JUMP_SPEC.match(spec)
    if match:
        return host.model_copy(update={
            "name": f"{host.name}-jump", "address": match["address"], "port": int(match["port"] or 22),
            "user": match["user"], "jump_host": None,
        })
    for candidate in inventory:
        if candidate.name == spec:
            return candidate
    raise ValueError(f"hosts[{host.name}].jump_host: '{spec}' is neither user@host[:port] nor one of hosts[].name "
                     f"{[h.name for h in inventory]}")


class SSHExecutor(_ExecutorBase):
    """An inventory host over SSH (paramiko); reconnects on the next call after a dropped connection."""

    def __init__(self, host: HostConfig, inventory: Sequence[HostConfig] = (), *, retry_backoff_s: float = 1.0,
                 _hops: int = 0):
        if _hops > 4:
            raise ValueError(f"hosts[{host.name}].jump_host: more than 4 jumps (a loop?)")
        self.host, self.name, self.python = host, host.name, host.python
        self._inventory, self._backoff, self._hops = tuple(inventory), retry_backoff_s, _hops
        self._pkey = _load_key(host)
        self._jump_config = resolve_jump_host(host, inventory)
        self._jump: SSHExecutor | None = None
        self._client: paramiko.SSHClient | None = None
        self._lock = threading.Lock()
        self._connect()

    # -- connection
    def _connect(self) -> None:
        attempts = self.host.connect_retries + 1
        where = f"{self.host.user}@{self.host.address}:{self.host.port}"
        for attempt in range(1, attempts + 1):
            try:
                self._client = self._open_client()
                logger().info("[%s] connected to %s (cipher %s)", self.name, where, self.cipher)
                return
            except paramiko.AuthenticationException as err:
                raise ConnectError(f"[{self.name}] {where}: authentication refused ({err}); check hosts[{self.name}]"
                                   f".user / key_file / key_passphrase") from err
            except (OSError, EOFError, paramiko.SSHException) as err:  # host keys raise HostKeyError: not here
                last = err
                if attempt < attempts:
                    delay = min(self._backoff * 2 ** (attempt - 1), 30.0)
                    logger().warning("[%s] connect to %s failed (%s: %s); retry %d/%d in %.1f s", self.name, where,
                                     type(err).__name__, err, attempt, attempts - 1, delay)
                    time.sleep(delay)
        raise ConnectError(f"[{self.name}] could not connect to {where} after {attempts} attempts: "
                           f"{type(last).__name__}: {last}") from last

    def _open_client(self) -> paramiko.SSHClient:
        client = paramiko.SSHClient()
        client.set_missing_host_key_policy(_RejectUnknownHost(self.host))
        if known_hosts_path(self.host).exists():
            client.load_host_keys(str(known_hosts_path(self.host)))
        timeout = self.host.connect_timeout_s
        try:
            client.connect(
                self.host.address, self.host.port, username=self.host.user, pkey=self._pkey,
                allow_agent=self._pkey is None, look_for_keys=self._pkey is None, sock=self._jump_channel(),
                timeout=timeout, banner_timeout=timeout, auth_timeout=timeout, channel_timeout=timeout,
                transport_factory=_fast_transport,
            )
        except paramiko.BadHostKeyException as err:
            client.close()
            raise _changed_key_error(self.host, err) from None
        except BaseException:
            client.close()
            raise
        client.get_transport().set_keepalive(KEEPALIVE_S)
        return client

    def _jump_channel(self) -> paramiko.Channel | None:
        if self._jump_config is None:
            return None
        if self._jump is None:
            self._jump = SSHExecutor(self._jump_config, self._inventory, retry_backoff_s=self._backoff,
                                     _hops=self._hops + 1)
        return _open_direct_tcpip(self._jump._transport(), self.host.address, self.host.port,
                                  self.host.connect_timeout_s)

    def _transport(self) -> paramiko.Transport:
        """The live transport, reconnecting first if the connection dropped."""
        with self._lock:
            transport = self._client.get_transport() if self._client else None
            if transport is None or not transport.is_active():
                logger().warning("[%s] connection is gone; reconnecting", self.name)
                self._close_client()
                self._connect()
                transport = self._client.get_transport()
            return transport

    def _recover(self) -> None:
        with self._lock:
            self._close_client()

    @property
    def cipher(self) -> str:
        transport = self._client.get_transport() if self._client else None
        return transport.local_cipher if transport else ""

    def _close_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def close(self) -> None:
        with self._lock:
            self._close_client()
        if self._jump is not None:
            self._jump.close()
            self._jump = None

    def _home(self) -> str:
        home = self.run(["sh", "-c", 'printf %s "$HOME"'], log_output=False, timeout=60).stdout
        if not home.startswith("/"):
            raise RemoteError(f"[{self.name}] $HOME is {home!r}, not an absolute path")
        return home

    # -- commands
    def _open_channel(self) -> paramiko.Channel:
        try:
            channel = self._transport().open_session(timeout=self.host.connect_timeout_s)
        except (OSError, EOFError, paramiko.SSHException) as err:
            raise ConnectionLost(f"[{self.name}] could not open a channel: {err}") from err
        channel.settimeout(CHANNEL_IO_TIMEOUT_S)
        return channel

    def _execute(self, command: str, stdin: bytes | None, out: _OutputStream, err: _OutputStream,
                 deadline: float | None) -> int | None:
        channel = self._open_channel()
        try:
            try:
                channel.exec_command(command)
                if stdin:
                    channel.sendall(stdin)
                channel.shutdown_write()
                status = _pump(channel, out, err, deadline)
            except (OSError, EOFError, paramiko.SSHException) as error:
                raise ConnectionLost(f"[{self.name}] connection lost while running a command: {error}") from error
            if status == -1 and not channel.get_transport().is_active():
                raise ConnectionLost(f"[{self.name}] connection lost while running a command")
            return status
        finally:
            _close_quietly(channel)

    def _open_sink(self, path: str, append: bool) -> _Sink:
        return _ChannelSink(self, path, append)

    def _open_source(self, path: str) -> Iterator[bytes]:
        return _channel_source(self, path)

    @contextlib.contextmanager
    def forward(self, remote_port: int) -> Iterator[int]:
        """A local port whose connections reach the host's 127.0.0.1:`remote_port` (direct-tcpip)."""
        tunnel = _Tunnel(self, int(remote_port))
        try:
            yield tunnel.local_port
        finally:
            tunnel.stop()


def _load_key(host: HostConfig) -> paramiko.PKey | None:
    if host.key_file is None:
        return None
    path = os.path.expanduser(host.key_file)
    passphrase = host.key_passphrase.get_secret_value().encode() if host.key_passphrase else None
    try:
        return paramiko.PKey.from_path(path, password=passphrase)
    except FileNotFoundError:
        raise FileNotFoundError(f"hosts[{host.name}].key_file: {path} does not exist") from None
    except (paramiko.PasswordRequiredException, TypeError):  # cryptography raises TypeError for a missing one
        raise ConnectError(f"hosts[{host.name}].key_file: {path} is encrypted; set key_passphrase") from None
    except (paramiko.SSHException, ValueError) as err:
        raise ConnectError(f"hosts[{host.name}].key_file: cannot load {path}: {err}") from None


def _close_quietly(channel: paramiko.Channel) -> None:
    """Close a channel whose connection may already be gone (closing then raises EOFError)."""
    with contextlib.suppress(OSError, EOFError, paramiko.SSHException):
        channel.close()


def _open_direct_tcpip(transport: paramiko.Transport, address: str, port: int, timeout: float) -> paramiko.Channel:
    return transport.open_channel("direct-tcpip", (address, port), ("127.0.0.1", 0), timeout=timeout)


def _pump(channel: paramiko.Channel, out: _OutputStream, err: _OutputStream, deadline: float | None) -> int | None:
    """Feed stdout/stderr to their streams until the command ends; None past the deadline.

    Polls with a short, growing pause instead of select() on `channel.fileno()`: that fileno is a
    pipe that paramiko's transport thread writes to while this thread may be closing it, and a
    write that loses the race raises EPIPE/EBADF in the transport thread, which then drops the
    whole SSH connection (and every tunnel and command on it).
    """
    pause = _Backoff()
    while True:
        if channel.recv_ready():
            out.feed(channel.recv(1 << 16))
            pause.reset()
        elif channel.recv_stderr_ready():
            err.feed(channel.recv_stderr(1 << 16))
            pause.reset()
        elif channel.exit_status_ready() and (channel.eof_received or channel.closed):
            return channel.recv_exit_status()
        elif deadline is not None and time.monotonic() > deadline:
            return None
        else:
            pause.sleep()


class _Backoff:
    """Idle waits of 1 ms doubling to 50 ms: quick on chatty output, cheap on a quiet command."""

    FIRST_S, LAST_S = 0.001, 0.05

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.next_s = self.FIRST_S

    def sleep(self) -> None:
        time.sleep(self.next_s)
        self.next_s = min(self.next_s * 2, self.LAST_S)


class _ChannelSink:
    """SSHExecutor: bytes streamed into `cat` on an exec channel, in packet-sized writes.

    `Channel.sendall` re-slices its whole buffer after every packet (paramiko #2659), so
    handing it more than one packet costs CPU; `out_max_packet_size - 64` leaves room for the
    packet header.
    """

    def __init__(self, executor: SSHExecutor, path: str, append: bool):
        self.executor, self.path = executor, path
        self.channel = executor._open_channel()
        try:
            self.channel.exec_command(f"cat {'>>' if append else '>'} {shlex.quote(path)}")
        except (OSError, EOFError, paramiko.SSHException) as err:
            _close_quietly(self.channel)
            raise ConnectionLost(f"[{executor.name}] upload to {path}: {err}") from err
        self.chunk_size = self.channel.out_max_packet_size - 64

    def write(self, data: bytes) -> None:
        try:
            self.channel.sendall(data)
        except (OSError, EOFError, paramiko.SSHException) as err:
            raise ConnectionLost(f"[{self.executor.name}] upload to {self.path} cut: {err}") from err

    def finish(self) -> None:
        err = _OutputStream(f"{self.executor.name} stderr", log_lines=False)
        try:
            self.channel.shutdown_write()
            status = _pump(self.channel, err, err, time.monotonic() + CHANNEL_IO_TIMEOUT_S)
        except (OSError, EOFError, paramiko.SSHException) as error:
            raise ConnectionLost(f"[{self.executor.name}] upload to {self.path} cut: {error}") from error
        finally:
            _close_quietly(self.channel)
        err.close()
        if status is None or (status == -1 and not self.channel.get_transport().is_active()):
            raise ConnectionLost(f"[{self.executor.name}] upload to {self.path}: no exit status from cat")
        if status != 0:
            raise CommandFailed(self.executor.name, f"cat > {self.path}", ["cat", self.path], status, "", err.text)

    def abort(self) -> None:
        _close_quietly(self.channel)


def _channel_source(executor: SSHExecutor, path: str) -> Iterator[bytes]:
    """SSHExecutor: the stdout of `cat` on an exec channel, read with blocking recv (never select).

    Reads ask for more than the channel window (2 MiB) so each takes the whole buffer: paramiko
    drops a partial read from the front of its buffer (`del buf[:n]`), a copy of what is left
    per read (256 MiB on loopback streamed at ~190 MB/s with 64 KiB reads, ~270 MB/s with
    4 MiB). Stderr is drained on the way so it can never hold the channel's window.
    """
    channel = executor._open_channel()
    err = _OutputStream(f"{executor.name} stderr", log_lines=False)
    try:
        try:
            channel.exec_command(f"cat {shlex.quote(path)}")
            while data := channel.recv(DOWNLOAD_READ_BYTES):
                yield data
                if channel.recv_stderr_ready():
                    err.feed(channel.recv_stderr(1 << 16))
            status = _pump(channel, err, err, time.monotonic() + CHANNEL_IO_TIMEOUT_S)
        except (OSError, EOFError, paramiko.SSHException) as error:  # a silent host times out: OSError
            raise ConnectionLost(f"[{executor.name}] download of {path} cut: {error}") from error
    finally:
        _close_quietly(channel)
    err.close()
    # A cut connection closes the channel without EOF (and paramiko unlinks channels before it
    # marks the transport inactive, so is_active() can still say True here).
    if status is None or (status == -1 and not channel.eof_received):
        raise ConnectionLost(f"[{executor.name}] download of {path}: the channel closed before cat ended")
    if status != 0:
        raise CommandFailed(executor.name, f"cat {path}", ["cat", path], status, "", err.text)


class _Tunnel:
    """A listener on 127.0.0.1:0 whose connections are piped through direct-tcpip channels."""

    def __init__(self, executor: SSHExecutor, remote_port: int):
        self.executor, self.remote_port = executor, remote_port
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.5)
        self.local_port = self._listener.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept_loop)
        logger().info("[%s] tunnel 127.0.0.1:%d -> %s:127.0.0.1:%d", executor.name, self.local_port, executor.name,
                      remote_port)

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name=f"tunnel-{self.local_port}")
        thread.start()
        self._threads.append(thread)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # listener closed by stop()
            channel = self._open(peer)
            if channel is None:
                conn.close()
                continue
            self._spawn(self._pipe, conn, channel)

    def _open(self, peer) -> paramiko.Channel | None:
        """A direct-tcpip channel to the port; a second try after a dropped connection (it reconnects)."""
        for attempt in (1, 2):
            try:
                return self.executor._transport().open_channel(
                    "direct-tcpip", ("127.0.0.1", self.remote_port), peer, timeout=self.executor.host.connect_timeout_s)
            except (OSError, EOFError, paramiko.SSHException, RemoteError) as err:
                logger().warning("[%s] tunnel to port %d refused%s: %r", self.executor.name, self.remote_port,
                                 "; trying again" if attempt == 1 else "", err)
        return None

    def _pipe(self, conn: socket.socket, channel: paramiko.Channel) -> None:
        """One thread per direction with blocking reads (never select() on the channel, see _pump).

        An end that finishes half-closes the other side, as a TCP proxy should: the client reads
        the server's EOF instead of a reset, and a request already sent still gets its answer.
        """
        conn.settimeout(TUNNEL_POLL_S)
        channel.settimeout(TUNNEL_POLL_S)
        upstream = threading.Thread(target=self._copy, args=(conn.recv, channel.sendall, channel.shutdown_write),
                                    daemon=True, name=f"tunnel-{self.local_port}-up")
        upstream.start()
        try:
            self._copy(channel.recv, conn.sendall, lambda: conn.shutdown(socket.SHUT_WR))
            upstream.join()
        finally:
            conn.close()
            _close_quietly(channel)

    def _copy(self, recv: Callable[[int], bytes], send: Callable[[bytes], None], finish: Callable[[], None]) -> None:
        """recv -> send until EOF (then `finish`), an error on either end, or stop()."""
        while not self._stop.is_set():
            try:
                data = recv(1 << 16)
            except TimeoutError:
                continue
            except (OSError, EOFError, paramiko.SSHException):
                return
            try:
                if not data:
                    finish()
                    return
                send(data)
            except (OSError, EOFError, paramiko.SSHException):
                return

    def stop(self) -> None:
        self._stop.set()
        self._listener.close()
        for thread in self._threads:
            thread.join(timeout=5)


# --------------------------------------------------------------------------- entry points


def connect(host: HostConfig | str | None, inventory: Sequence[HostConfig] = (), *,
            retry_backoff_s: float = 1.0) -> LocalExecutor | SSHExecutor:
    """An executor for `host`: None or "local" -> this machine, else SSH (raises ConnectError, HostKeyError)."""
    if host is None or host == "local":
        return LocalExecutor()
    if isinstance(host, str):
        names = [h.name for h in inventory]
        if host not in names:
            raise ValueError(f"host '{host}' is neither 'local' nor one of hosts[].name {names}")
        host = next(h for h in inventory if h.name == host)
    return SSHExecutor(host, inventory, retry_backoff_s=retry_backoff_s)


def expand_remote_path(executor: Executor, path: str) -> str:
    """`path` with a leading `~` resolved to the home directory on the executor's host."""
    return executor.expand_path(path)


def _fetch_host_key(host: HostConfig, inventory: Sequence[HostConfig]) -> paramiko.PKey:
    """The key the host presents, read during key exchange, before any authentication."""
    jump_config = resolve_jump_host(host, inventory)
    jump = SSHExecutor(jump_config, inventory) if jump_config else None
    try:
        if jump:
            sock = _open_direct_tcpip(jump._transport(), host.address, host.port, host.connect_timeout_s)
        else:
            sock = socket.create_connection((host.address, host.port), timeout=host.connect_timeout_s)
        transport = paramiko.Transport(sock)
        try:
            transport.start_client(timeout=host.connect_timeout_s)
            return transport.get_remote_server_key()
        finally:
            transport.close()
    except (OSError, EOFError, paramiko.SSHException) as err:
        raise ConnectError(f"[{host.name}] could not read the host key of {host_key_name(host)}: {err}") from err
    finally:
        if jump:
            jump.close()


def host_key_fingerprint(host: HostConfig, inventory: Sequence[HostConfig] = ()) -> tuple[str, str]:
    """(key type, "SHA256:...") of the key `host` presents now, for a person to compare."""
    key = _fetch_host_key(host, inventory)
    return key.get_name(), fingerprint(key)


def trust_host(host: HostConfig, inventory: Sequence[HostConfig] = ()) -> str:
    """Record the key `host` presents now in its known_hosts file, replacing older entries for it.

    Only for a person who has checked the fingerprint (`eagleops hosts trust NAME`); returns
    a one-line description of what was recorded.
    """
    key = _fetch_host_key(host, inventory)
    path, name = known_hosts_path(host), host_key_name(host)
    kept = [line for line in (path.read_text().splitlines() if path.exists() else [])
            if not _known_hosts_line_matches(line, name)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([*kept, f"{name} {key.get_name()} {key.get_base64()}"]) + "\n")
    message = f"recorded {key.get_name()} {fingerprint(key)} for {name} ({host.name}) in {path}"
    logger().info(message)
    return message


def _known_hosts_line_matches(line: str, name: str) -> bool:
    if not line.strip() or line.lstrip().startswith("#"):
        return False
    fields = line.split()
    for pattern in fields[0].split(","):
        if pattern.startswith("|1|"):
            if paramiko.HostKeys.hash_host(name, pattern) == pattern:
                return True
        elif pattern == name:
            return True
    return False
