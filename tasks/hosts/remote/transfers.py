"""Verified transfers: uploads that are resumable, verified and atomic, downloads that are verified and atomic.

Owns `_VerifiedTransfers`, the upload and download half of the executor base (built on its
`run` and `expand_path`, and on the `_open_process` byte streams each executor implements), the
client's side of the exchange with transfer_host.py (which runs on the host, one command per
file), the host's sha256 of a file, the result types, `sha256_file`, `ByteProgress`.

Each side hashes the bytes in the same pass that moves them: the client while it reads and
sends (or receives and writes), the host while it receives and writes (or reads and sends). The
host compares the two digests and renames; nothing is read a second time.

Risk, and what guards it:
- An upload cut halfway must never leave a truncated file under the final name. Data lands in
  `<dest>.part` and is renamed only when the host's sha256 of it equals the client's; a later
  upload continues from the `.part` size after both sides hash the prefix they keep (once, at
  the resume), so a foreign or damaged `.part` fails the same comparison and is sent again from
  zero. Downloads land in `<local>.part` and are renamed only if they hash to the host's sha256.
- A digest of the stream is only as good as the stream's framing: the host reads exactly the
  announced byte count before the client's digest line, and a host program that ends early is
  an error carrying its exit status and stderr, never a short file that hashes equal.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import os
import posixpath
import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Protocol, TypeVar

import tasks.hosts.remote.transfer_host as transfer_host
from tasks.hosts.remote.commands import (
    _LIST_FILES_SCRIPT,
    _SHA256_PY,
    _SHA256_SCRIPT,
    MISSING,
    _sh,
    shell_command,
)
from tasks.hosts.remote.errors import (
    CommandFailed,
    ConnectionLost,
    DownloadVerifyError,
    RemoteError,
    UploadVerifyError,
)
from tasks.hosts.remote.log import logger

PROGRESS_EVERY_S = 5.0
T = TypeVar("T")
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
# Sent as `python -I -S -c HOST_PROGRAM ...`: the host needs only its python, nothing installed;
# -I -S: no PYTHON* variables, no site packages (a quick start, the standard library as shipped).
HOST_PROGRAM = Path(transfer_host.__file__).read_text()
# How long a `receive` waits for an earlier one (cut off, still draining its pipe into the
# `.part`) to let go before it starts a new `.part` instead (transfer_host.py).
LOCK_WAIT_S = 15.0

Progress = Callable[[str, int, int], None]


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
    restarted: bool = False  # the first attempt failed verification and the file was sent again from zero
    transfer_seconds: float = 0.0  # streaming the bytes, both sides hashing them on the way
    verify_seconds: float = 0.0  # what streaming could not hide: the kept prefix hashed, then the host's verdict

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
    transfer_seconds: float = 0.0  # streaming the bytes into `<local>.part`, both sides hashing them on the way
    verify_seconds: float = 0.0  # both sides hashing their copies when the local file has the host's size (the skip)

    @property
    def mb_per_s(self) -> float:
        return self.bytes_received / 1e6 / max(self.seconds, 1e-9)


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


class _HostProcess(Protocol):
    """A command on the host whose stdin and stdout carry one transfer (an exec channel, a subprocess).

    `write` raises BrokenPipeError once the command stopped reading (it ended) and ConnectionLost
    when the connection dropped; `read` gives what arrived on stdout, b"" once it ended; `wait`
    gives the exit status and stderr after that.
    """

    write_size: int  # one efficient write

    def write(self, data: bytes) -> None: ...
    def close_stdin(self) -> None: ...
    def read(self) -> bytes: ...
    def wait(self) -> tuple[int, str]: ...
    def close(self) -> None: ...


class _HostExchange:
    """The client's end of transfer_host.py over one `_HostProcess`: lines, and framed bytes on stdout."""

    def __init__(self, process: _HostProcess, host: str, argv: list[str]):
        self.process, self.host, self.argv = process, host, argv
        self._pending = b""  # stdout that arrived past what was asked for

    def send(self, data: bytes) -> None:
        try:
            self.process.write(data)
        except BrokenPipeError:
            raise self.ended() from None

    def say(self, line: str) -> None:
        self.send(line.encode("ascii") + b"\n")

    def hear(self) -> list[str]:
        """The host's next non-blank line (blank ones are keepalives), split into words."""
        while True:
            while b"\n" not in self._pending:
                data = self.process.read()
                if not data:
                    raise self.ended()
                self._pending += data
            line, _, self._pending = self._pending.partition(b"\n")
            if line.strip():
                return line.decode("ascii", "replace").split()

    def stdout_bytes(self, count: int) -> Iterator[bytes]:
        """Exactly the next `count` bytes of stdout, in the pieces they arrive in."""
        left = count
        while left:
            if self._pending:
                data, self._pending = self._pending, b""
            else:
                data = self.process.read()
            if not data:
                raise self.ended()
            if len(data) > left:  # the host's last line came with the last bytes
                data, self._pending = data[:left], data[left:]
            left -= len(data)
            yield data

    def finish(self) -> None:
        """Close stdin and wait for the command, which must exit 0."""
        self.process.close_stdin()
        status, stderr = self.process.wait()
        if status != 0:
            raise CommandFailed(self.host, shlex.join(self.argv), self.argv, status, "", stderr)

    def ended(self) -> RemoteError:
        """The error for a command that stopped before the exchange was done: its status and stderr."""
        status, stderr = self.process.wait()
        if status == 0:
            return RemoteError(f"[{self.host}] {shlex.join(self.argv)} ended before the transfer was done")
        return CommandFailed(self.host, shlex.join(self.argv), self.argv, status, "", stderr)


@dataclass
class _UploadAttempt:
    """One exchange with `receive`: the client's sha256 and the host's (equal: renamed into place)."""

    sha256: str
    host_sha256: str
    sent: int = 0
    resumed_from: int = 0
    skipped: bool = False
    transfer_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def verified(self) -> bool:
        return self.sha256 == self.host_sha256


def _hash_prefix(f: BinaryIO, count: int) -> hashlib._Hash:
    """The sha256 of the first `count` bytes of `f` (the bytes a resume keeps on the host), read from `f`."""
    digest, left = hashlib.sha256(), count
    while left:
        block = f.read(min(1 << 20, left))
        if not block:
            raise UploadVerifyError(f"{f.name} is shorter than the {count} bytes kept on the host")
        digest.update(block)
        left -= len(block)
    return digest


def _verdict(words: list[str], host: str, what: str) -> str:
    """The host's sha256 from its last line, `ok <sha256>` or `mismatch <sha256>`."""
    if len(words) != 2 or words[0] not in ("ok", "mismatch") or not SHA256_HEX.match(words[1]):
        raise RemoteError(f"[{host}] {what}: unexpected answer {' '.join(words)!r}")
    return words[1]


class _VerifiedTransfers(abc.ABC):
    """Uploads and downloads for the executor base (`_ExecutorBase`), built on its `run` and
    `expand_path`, on `name` and `python`, and on the byte streams below."""

    # -- subclass hooks
    @abc.abstractmethod
    def _open_process(self, command: str) -> _HostProcess:
        """`command` (one shell line) started on the host, its stdin and stdout streamed."""

    def _recover(self) -> None:
        """Make the next call usable after a ConnectionLost (SSH: reconnect)."""

    @contextlib.contextmanager
    def _host_program(self, *args: object) -> Iterator[_HostExchange]:
        """transfer_host.py running on the host with `args`; closed (killed if still running) on exit."""
        words = [str(a) for a in args]
        process = self._open_process(shell_command([self.python, "-I", "-S", "-c", HOST_PROGRAM, *words]))
        try:
            yield _HostExchange(process, self.name, ["transfer_host.py", *words])
        finally:
            process.close()

    # -- files on the host
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

    # -- uploads
    def upload_file(self, local: str | Path, remote: str, progress: Progress | None = None, *,
                    reconnects: int = 2) -> UploadResult:
        """Copy `local` to `remote` on the host: skipped if equal, resumable, verified, atomic.

        One command on the host per attempt (transfer_host.py `receive`): bytes go to
        `<remote>.part` (continuing from its size if one exists), both sides hash them as they
        pass, and the host renames the `.part` only when its sha256 equals the client's. An
        attempt that fails verification is sent again once from zero. After a dropped connection
        the upload reconnects and resumes, at most `reconnects` times.
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
        started = time.monotonic()
        first = self._upload_attempt(local, remote, progress, resume=True)
        attempts = [first]
        if not first.verified:
            logger().warning("[%s] %s.part: sha256 %s != local %s (kept %d bytes already on the host); sending "
                             "again from zero", self.name, remote, first.host_sha256, first.sha256, first.resumed_from)
            attempts.append(self._upload_attempt(local, remote, progress, resume=False))
            if not attempts[-1].verified:
                raise UploadVerifyError(f"[{self.name}] upload {local} -> {remote}: sha256 mismatch after sending "
                                        f"from zero: local {attempts[-1].sha256}, remote {attempts[-1].host_sha256}")
        return self._upload_result(local, remote, attempts, time.monotonic() - started)

    def _upload_result(self, local: Path, remote: str, attempts: list[_UploadAttempt],
                       seconds: float) -> UploadResult:
        first, last = attempts[0], attempts[-1]
        result = UploadResult(
            str(local), remote, local.stat().st_size, last.sha256, sum(a.sent for a in attempts), seconds,
            skipped=first.skipped, resumed_from=first.resumed_from, restarted=len(attempts) > 1,
            transfer_seconds=sum(a.transfer_seconds for a in attempts),
            verify_seconds=sum(a.verify_seconds for a in attempts))
        if result.skipped:
            logger().info("[%s] %s already has sha256 %s; upload skipped", self.name, remote, result.sha256[:12])
            return result
        logger().info("[%s] uploaded %s -> %s: %.1f MB in %.1f s (%.1f MB/s; streaming and hashing %.1f s, "
                      "verifying %.1f s)%s", self.name, local, remote, result.bytes_sent / 1e6, seconds,
                      result.mb_per_s, result.transfer_seconds, result.verify_seconds,
                      f", resumed from byte {result.resumed_from}" if result.resumed_from else "")
        return result

    def _upload_attempt(self, local: Path, remote: str, progress: Progress, resume: bool) -> _UploadAttempt:
        """One `receive` exchange: skip if the host's file hashes equal, else send from the resume point on."""
        size, part = local.stat().st_size, remote + ".part"
        with self._host_program("receive", part, remote, size, LOCK_WAIT_S) as host:
            have, dest_sha256 = host.hear()
            if dest_sha256 != "-" and dest_sha256 == sha256_file(local):
                host.finish()
                return _UploadAttempt(dest_sha256, dest_sha256, skipped=True)
            offset = int(have) if resume and int(have) <= size else 0  # a longer `.part` is some other file's
            host.say(str(offset))
            with open(local, "rb", buffering=0) as f:
                waited = time.monotonic()
                digest = _hash_prefix(f, offset)  # while the host hashes its copy of the prefix
                if host.hear() != ["ready"]:
                    raise RemoteError(f"[{self.name}] upload {local} -> {remote}: the host did not get ready")
                streaming = time.monotonic()
                sent = self._send_rest(f, host, digest, offset, size, progress)
            verdict_wait = time.monotonic()
            host.say(digest.hexdigest())
            host.process.close_stdin()  # the end of input also ends a host still waiting for lost bytes
            host_sha256 = _verdict(host.hear(), self.name, f"upload {local} -> {remote}")
            host.finish()
            done = time.monotonic()
        return _UploadAttempt(digest.hexdigest(), host_sha256, sent, resumed_from=offset,
                              transfer_seconds=verdict_wait - streaming,
                              verify_seconds=(streaming - waited) + (done - verdict_wait))

    @staticmethod
    def _send_rest(f: BinaryIO, host: _HostExchange, digest: hashlib._Hash, offset: int, size: int,
                   progress: Progress) -> int:
        """Send `f` from `offset` to `size` (where it stands), hashing into `digest`; the bytes sent."""
        name, left = Path(f.name).name, size - offset
        while left:
            chunk = f.read(min(host.process.write_size, left))
            if not chunk:
                raise UploadVerifyError(f"{f.name} shrank to {size - left} bytes while it was sent ({size} expected)")
            digest.update(chunk)
            host.send(chunk)
            left -= len(chunk)
            progress(name, size - left, size)
        progress(name, size, size)
        return size - offset

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

        One command on the host (transfer_host.py `send`) reads `remote` once, sending and hashing
        it; the client hashes the bytes while it writes them to `<local>.part` and renames that
        only if both digests are equal. When `local` already has the host's size, both sides hash
        their copies first and equal ones skip the transfer. A failed attempt leaves `local` as it
        was and no `.part`. After a dropped connection it reconnects and starts again from zero,
        at most `reconnects` times (checkpoints are fetched once, at the end of a run: resuming
        is not worth a second code path).
        `progress(what, done_bytes, total_bytes)` is called per chunk (it rate-limits itself).
        """
        remote, local = self.expand_path(remote), Path(local)
        progress = progress or ByteProgress(f"[{self.name}] download")
        return self._reconnecting(lambda: self._download_once(remote, local, progress), reconnects,
                                  f"download of {remote}", "start again")

    def _download_once(self, remote: str, local: Path, progress: Progress) -> DownloadResult:
        started = time.monotonic()
        local_size = local.stat().st_size if local.is_file() else -1
        with self._host_program("send", remote, local_size) as host:
            size, known = self._download_header(host, remote)
            same = known != "-" and sha256_file(local) == known  # the host hashed its copy before it answered
            verify_s = time.monotonic() - started if known != "-" else 0.0
            if same:
                host.finish()
                logger().info("[%s] %s already has sha256 %s; download skipped", self.name, local, known[:12])
                return DownloadResult(remote, str(local), size, known, 0, time.monotonic() - started, skipped=True,
                                      verify_seconds=verify_s)
            if known != "-":
                host.say("send")
            phase = time.monotonic()
            sha256 = self._receive(host, remote, local, size, progress)
        result = DownloadResult(remote, str(local), size, sha256, size, time.monotonic() - started,
                                transfer_seconds=time.monotonic() - phase, verify_seconds=verify_s)
        logger().info("[%s] downloaded %s -> %s: %.1f MB in %.1f s (%.1f MB/s)", self.name, remote, local,
                      size / 1e6, result.seconds, result.mb_per_s)
        return result

    def _download_header(self, host: _HostExchange, remote: str) -> tuple[int, str]:
        """The host's first line: the file's size, and its sha256 when it may equal the local copy."""
        try:
            size, known = host.hear()
        except CommandFailed as err:
            if err.exit_status == MISSING:
                raise FileNotFoundError(f"[{self.name}] {remote}: no such file to download") from None
            raise
        return int(size), known

    def _receive(self, host: _HostExchange, remote: str, local: Path, size: int, progress: Progress) -> str:
        """Stream `size` bytes into `<local>.part`, rename it to `local` if it hashes to the host's sha256.

        Returns that sha256. Any failure removes the `.part`: a download starts from zero.
        """
        part, name = local.with_name(local.name + ".part"), posixpath.basename(remote)
        local.parent.mkdir(parents=True, exist_ok=True)
        digest, received = hashlib.sha256(), 0
        try:
            with open(part, "wb") as f:
                for chunk in host.stdout_bytes(size):
                    digest.update(chunk)
                    f.write(chunk)
                    received += len(chunk)
                    progress(name, received, size)
            progress(name, received, size)
            expected = host.hear()[0]
            host.finish()
            if digest.hexdigest() != expected:
                raise DownloadVerifyError(f"[{self.name}] download {remote} -> {local}: sha256 mismatch: remote "
                                          f"{expected}, received {digest.hexdigest()} ({received} of {size} bytes)")
            os.replace(part, local)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        return expected

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
