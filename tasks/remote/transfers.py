"""Verified transfers: uploads that are resumable, verified and atomic, downloads that are verified and atomic.

Owns `_VerifiedTransfers`, the upload and download half of the executor base (built on its
`run` and `expand_path`, and on the `_open_sink` / `_open_source` byte streams each executor
implements), the host's sha256 and size of a file, the result types, `sha256_file`,
`ByteProgress` and the local file sink.

Risk, and what guards it:
- An upload cut halfway must never leave a truncated file under the final name. Data lands in
  `<dest>.part`, is renamed only after its sha256 equals the local one, and a later upload
  continues from the `.part` size (the final hash decides whether that was safe). Downloads
  likewise land in `<local>.part` and are renamed only if they hash to the host's sha256.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import os
import posixpath
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol, TypeVar

from tasks.remote.commands import (
    _LIST_FILES_SCRIPT,
    _SHA256_PY,
    _SHA256_SCRIPT,
    _SIZE_SCRIPT,
    _UPLOAD_COMMIT_SCRIPT,
    _UPLOAD_PROBE_SCRIPT,
    MISSING,
    _sh,
)
from tasks.remote.errors import (
    CommandFailed,
    ConnectionLost,
    DownloadVerifyError,
    RemoteError,
    UploadVerifyError,
)
from tasks.remote.log import logger

PROGRESS_EVERY_S = 5.0
T = TypeVar("T")
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")

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


class _VerifiedTransfers(abc.ABC):
    """Uploads and downloads for the executor base (`_ExecutorBase`), built on its `run` and
    `expand_path`, on `name` and `python`, and on the byte streams below."""

    # -- subclass hooks
    @abc.abstractmethod
    def _open_sink(self, path: str, append: bool) -> _Sink:
        """A writable stream into `path` on the host."""

    @abc.abstractmethod
    def _open_source(self, path: str) -> Iterator[bytes]:
        """The bytes of `path` on the host, in chunks; raises at the end if the stream broke.

        A generator: closing it early (the caller failed) releases the file or channel.
        """

    def _recover(self) -> None:
        """Make the next call usable after a ConnectionLost (SSH: reconnect)."""

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
