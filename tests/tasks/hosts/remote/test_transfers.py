"""tasks/hosts/remote/transfers.py (and transfer_host.py on the host) through both executors: uploads and
downloads that are hashed on both sides while they stream, verified and atomic.

Connections are cut for real (the transport's socket is shut down mid-transfer), and a cut
upload resumes from its `.part`. Streams are altered below both sides' hashing (between the
client's hash and the executor's byte stream), and every verdict is checked against the
source's sha256 computed here, independently of the code under test.
"""

from __future__ import annotations

import fcntl
import hashlib
import socket
import subprocess
import sys
import threading
import time

import paramiko
import pytest

from tasks.hosts.remote import (
    CommandFailed,
    ConnectionLost,
    DownloadVerifyError,
    UploadVerifyError,
    transfers,
)
from tests.tasks.hosts.remote.helpers import SIZE, no_fileno, random_file, sha256

DIGEST_LINE = 65  # the client's "<sha256>\n" after an upload's bytes


def wire_bytes(offset: int) -> int:
    """What one complete upload attempt writes to the channel: the resume point line, the bytes, the digest line."""
    return len(f"{offset}\n") + SIZE - offset + DIGEST_LINE


# --------------------------------------------------------------------------- altering a stream


def flip_one_byte(data: bytes) -> bytes:
    return data[:100] + bytes([data[100] ^ 0x01]) + data[101:]


class Tamper:
    """Routes each transfer's stdin and stdout through `alter_write` / `alter_read`, per exchange.

    It wraps `executor._open_process`, the byte stream under transfers.py: the client has
    hashed what it sends before `write`, and hashes what it receives after `read`, so whatever
    is altered here is what the other side hashes and stores. `after` records, as each exchange
    closes, whether `watched` paths exist (what was renamed into place at that moment).
    """

    def __init__(self, monkeypatch, executor, alter_write=None, alter_read=None, watched=()):
        self.exchanges, self.after, self.watched = 0, [], watched
        original = executor._open_process

        def open_process(command):
            process, number = original(command), self.exchanges
            self.exchanges += 1
            self._wrap(process, number, alter_write, alter_read)
            return process

        monkeypatch.setattr(executor, "_open_process", open_process)

    def _wrap(self, process, number, alter_write, alter_read):
        write, read, close = process.write, process.read, process.close
        if alter_write:
            process.write = lambda data: write(alter_write(number, data))
        if alter_read:
            process.read = lambda: alter_read(number, read())

        def recording_close():
            close()
            self.after.append([path.exists() for path in self.watched])

        process.close = recording_close


def in_exchanges(numbers, change):
    """Apply `change` to the first data chunk (not a protocol line) of the given exchanges."""
    done = set()

    def alter(number, data):
        if number in numbers and number not in done and len(data) > 1000:
            done.add(number)
            return change(data)
        return data

    return alter


# --------------------------------------------------------------------------- the host's side


def test_the_host_program_needs_only_the_standard_library(tmp_path):
    """As the host runs it: its text under -I -S, where nothing of this project can be imported."""
    result = subprocess.run([sys.executable, "-I", "-S", "-c", transfers.HOST_PROGRAM, "send", str(tmp_path / "no"),
                             "-1"], cwd=tmp_path, capture_output=True, timeout=60)
    assert (result.returncode, result.stderr) == (3, f"{tmp_path / 'no'}: no such file\n".encode())


def test_ssh_connections_send_small_messages_at_once(ssh):
    # Each transfer starts with a channel open and an exec request: with Nagle's algorithm they
    # wait on delayed ACKs (~40 ms per channel open measured on loopback).
    assert ssh._client.get_transport().sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


# --------------------------------------------------------------------------- uploads


def test_upload_dir_keeps_layout_then_skips_equal_files(executor, tmp_path):
    src = tmp_path / "ckpt"
    (src / "sub dir").mkdir(parents=True)
    (src / "empty").mkdir()
    random_file(src / "model.safetensors", 300_000, seed=1)
    random_file(src / "sub dir" / "config.json", 1_000, seed=2)
    (src / "zero.bin").write_bytes(b"")
    dest = tmp_path / "remote $(touch pwned)"
    results = executor.upload_dir(src, str(dest))
    assert sorted((r.remote, r.skipped) for r in results) == [
        (f"{dest}/model.safetensors", False), (f"{dest}/sub dir/config.json", False), (f"{dest}/zero.bin", False)]
    assert sha256(dest / "model.safetensors") == sha256(src / "model.safetensors")
    assert (dest / "sub dir" / "config.json").read_bytes() == (src / "sub dir" / "config.json").read_bytes()
    assert (dest / "zero.bin").read_bytes() == b""
    assert all(r.sha256 == sha256(src / r.remote[len(str(dest)) + 1:]) for r in results)
    assert (dest / "empty").is_dir() and not list(dest.rglob("*.part")) and not (tmp_path / "pwned").exists()
    again = executor.upload_dir(src, str(dest))
    assert all(r.skipped and r.bytes_sent == 0 for r in again)
    assert not list(dest.rglob("*.part"))


def test_upload_replaces_a_different_file_of_the_same_size(executor, tmp_path):
    src = random_file(tmp_path / "w.bin", 50_000, seed=3)
    dest = random_file(tmp_path / "dest.bin", 50_000, seed=4)
    result = executor.upload_file(src, str(dest))
    assert not result.skipped and result.bytes_sent == 50_000 and dest.read_bytes() == src.read_bytes()


def test_an_altered_stream_is_refused_then_sent_again_from_zero(executor, monkeypatch, tmp_path):
    src, dest = random_file(tmp_path / "big.bin", SIZE), tmp_path / "big.out"
    part = tmp_path / "big.out.part"
    tamper = Tamper(monkeypatch, executor, alter_write=in_exchanges({0}, flip_one_byte), watched=(dest, part))
    result = executor.upload_file(src, str(dest))
    assert tamper.after[0] == [False, False]  # the altered copy was neither renamed nor kept to resume from
    assert result.restarted and result.bytes_sent == 2 * SIZE and result.sha256 == sha256(src)
    assert sha256(dest) == sha256(src) and not part.exists()


def test_a_stream_altered_every_time_fails_with_both_hashes_and_renames_nothing(executor, monkeypatch, tmp_path):
    src = random_file(tmp_path / "big.bin", SIZE)
    dest = random_file(tmp_path / "big.out", 1_000, seed=7)  # the previous version stays as it was
    Tamper(monkeypatch, executor, alter_write=in_exchanges({0, 1}, flip_one_byte))
    with pytest.raises(UploadVerifyError) as caught:
        executor.upload_file(src, str(dest))
    message = str(caught.value)
    flipped = bytearray(src.read_bytes())
    flipped[100] ^= 0x01
    assert f"local {sha256(src)}, remote {hashlib.sha256(flipped).hexdigest()}" in message and "from zero" in message
    assert dest.read_bytes() == hashlib.shake_256(b"seed7").digest(1_000)
    assert not (tmp_path / "big.out.part").exists()


def test_a_short_stream_is_refused_and_the_next_upload_repairs_it(executor, monkeypatch, tmp_path):
    src, dest = random_file(tmp_path / "big.bin", SIZE), tmp_path / "big.out"
    tamper = Tamper(monkeypatch, executor, alter_write=in_exchanges({0}, lambda data: b""))  # one chunk lost
    with pytest.raises(CommandFailed, match="client stopped after"):
        executor.upload_file(src, str(dest))
    assert not dest.exists() and tamper.exchanges == 1
    result = executor.upload_file(src, str(dest))  # resumes from that `.part`, whose tail is wrong
    assert result.resumed_from > 0 and result.restarted and sha256(dest) == sha256(src)


def test_a_part_left_behind_is_resumed_and_a_damaged_one_sent_again(executor, tmp_path):
    src, dest = random_file(tmp_path / "big.bin", SIZE), tmp_path / "big.out"
    part = tmp_path / "big.out.part"
    part.write_bytes(src.read_bytes()[:1_234_567])
    result = executor.upload_file(src, str(dest))
    assert (result.resumed_from, result.bytes_sent, result.restarted) == (1_234_567, SIZE - 1_234_567, False)
    assert sha256(dest) == sha256(src)
    dest.unlink()
    damaged = bytearray(src.read_bytes()[:1_234_567])
    damaged[5] ^= 0x01
    part.write_bytes(bytes(damaged))
    result = executor.upload_file(src, str(dest))
    assert (result.resumed_from, result.bytes_sent, result.restarted) == (1_234_567, 2 * SIZE - 1_234_567, True)
    assert sha256(dest) == sha256(src) and not part.exists()


def hold_lock(path, seconds: float | None):
    """Open `path` and flock it as a cut-off `receive` still draining into it would; released after `seconds`."""
    f = open(path, "r+b")
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    if seconds is not None:
        threading.Timer(seconds, f.close).start()
    return f


def test_a_resume_waits_for_an_earlier_writer_to_let_go(executor, tmp_path):
    src, dest = random_file(tmp_path / "big.bin", SIZE), tmp_path / "big.out"
    part = tmp_path / "big.out.part"
    part.write_bytes(src.read_bytes()[:2_000_000])
    hold_lock(part, seconds=1.0)
    started = time.monotonic()
    result = executor.upload_file(src, str(dest))
    assert time.monotonic() - started >= 1.0 and result.resumed_from == 2_000_000 and sha256(dest) == sha256(src)


def test_a_writer_that_never_lets_go_keeps_its_file_and_the_upload_starts_a_new_one(executor, monkeypatch, tmp_path):
    monkeypatch.setattr(transfers, "LOCK_WAIT_S", 0.5)
    src, dest = random_file(tmp_path / "big.bin", SIZE), tmp_path / "big.out"
    part = tmp_path / "big.out.part"
    part.write_bytes(src.read_bytes()[:2_000_000])
    held = hold_lock(part, seconds=None)
    try:
        result = executor.upload_file(src, str(dest))
        held.seek(0)
        assert held.read() == src.read_bytes()[:2_000_000]  # the old writer's file, untouched
    finally:
        held.close()
    assert result.resumed_from == 0 and result.bytes_sent == SIZE and sha256(dest) == sha256(src)


class CutAfter:
    """Counts bytes handed to `Channel.sendall`; shuts the connection's socket once past `cut_at`."""

    def __init__(self, monkeypatch, cut_at: int | None):
        self.sent, self.cut_at, self.cuts, self.sent_at_cut = 0, cut_at, 0, 0
        original = paramiko.Channel.sendall

        def counting_sendall(channel, data):
            if self.cut_at is not None and self.sent >= self.cut_at:
                self.cut_at = None
                self.cuts += 1
                self.sent_at_cut = self.sent
                channel.get_transport().sock.shutdown(socket.SHUT_RDWR)  # a real cut, not a mock
            original(channel, data)
            self.sent += len(data)

        monkeypatch.setattr(paramiko.Channel, "sendall", counting_sendall)
        monkeypatch.setattr(paramiko.Channel, "fileno", no_fileno)


CUT_AT = 4_000_000  # past sshd's 2 MiB window, so the host has written part of the file


def _cut_upload(ssh, monkeypatch, src, dest):
    cutter = CutAfter(monkeypatch, cut_at=CUT_AT)
    with pytest.raises(ConnectionLost):
        ssh.upload_file(src, str(dest), reconnects=0)
    assert cutter.cuts == 1 and not dest.exists()
    part = dest.with_name(dest.name + ".part")
    # the host's writer may still be draining what sshd had received when the client saw the cut (seen under
    # load in CI: 0 bytes at first); it writes them and exits without a reader
    deadline = time.monotonic() + 10
    while part.stat().st_size == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert 0 < part.stat().st_size < SIZE
    return part


def test_upload_resumes_after_a_cut_connection(ssh, monkeypatch, tmp_path):
    src, dest = random_file(tmp_path / "big.bin", SIZE), tmp_path / "out" / "big.bin"
    _cut_upload(ssh, monkeypatch, src, dest)
    counter = CutAfter(monkeypatch, cut_at=None)
    result = ssh.upload_file(src, str(dest))  # the same executor reconnects by itself
    assert result.resumed_from > 0 and not result.restarted
    assert counter.sent == wire_bytes(result.resumed_from) and result.bytes_sent == SIZE - result.resumed_from
    assert sha256(dest) == sha256(src) == result.sha256 and not dest.with_name("big.bin.part").exists()


def test_upload_survives_a_cut_in_one_call(ssh, monkeypatch, tmp_path):
    src, dest = random_file(tmp_path / "big.bin", SIZE), tmp_path / "big.bin.copy"
    counter = CutAfter(monkeypatch, cut_at=CUT_AT)
    result = ssh.upload_file(src, str(dest))
    assert counter.cuts == 1 and result.resumed_from > 0 and sha256(dest) == sha256(src)
    assert counter.sent == counter.sent_at_cut + wire_bytes(result.resumed_from)  # resumed, not sent again


def test_a_corrupted_part_is_detected_and_sent_again_from_zero(ssh, monkeypatch, tmp_path):
    src, dest = random_file(tmp_path / "big.bin", SIZE), tmp_path / "big.out"
    part = _cut_upload(ssh, monkeypatch, src, dest)
    with open(part, "r+b") as f:
        f.write(b"\0" * 100)
    counter = CutAfter(monkeypatch, cut_at=None)
    result = ssh.upload_file(src, str(dest))
    assert result.restarted and counter.sent == wire_bytes(result.resumed_from) + wire_bytes(0)
    assert sha256(dest) == sha256(src)


def test_a_local_file_changed_between_attempts_is_sent_again(ssh, monkeypatch, tmp_path):
    src, dest = random_file(tmp_path / "big.bin", SIZE), tmp_path / "big.out"
    _cut_upload(ssh, monkeypatch, src, dest)
    random_file(src, SIZE, seed=9)
    result = ssh.upload_file(src, str(dest))
    assert result.restarted and sha256(dest) == sha256(src)


# --------------------------------------------------------------------------- downloads


def checkpoint_dir(root):
    """A training result: nested files, names a shell would misread, bytes of every value."""
    (root / "sub dir" / "deeper").mkdir(parents=True)
    (root / "empty").mkdir()
    random_file(root / "model.safetensors", 3_000_000, seed=5)  # > the 2 MiB channel window
    (root / "sub dir" / "deeper" / "optimizer $(touch pwned).pt").write_bytes(bytes(range(256)) * 40 + b"\r\n\0")
    (root / "history.jsonl").write_text('{"step": 1}\n')
    (root / "zero.bin").write_bytes(b"")
    return root


def test_download_dir_round_trip_then_skips(executor, tmp_path, monkeypatch):
    monkeypatch.setattr(paramiko.Channel, "fileno", no_fileno)
    src = checkpoint_dir(tmp_path / "remote ckpt")
    dest = tmp_path / "local" / "ckpt"
    calls = []
    results = executor.download_dir(str(src), dest, progress=lambda *call: calls.append(call))
    names = ["history.jsonl", "model.safetensors", "sub dir/deeper/optimizer $(touch pwned).pt", "zero.bin"]
    assert [(r.remote, r.local, r.skipped) for r in results] == [
        (f"{src}/{n}", str(dest / n), False) for n in names]
    for name, result in zip(names, results):
        assert (dest / name).read_bytes() == (src / name).read_bytes()
        size = (src / name).stat().st_size
        assert result.sha256 == sha256(src / name) and result.bytes_received == result.size == size
    assert ("model.safetensors", 3_000_000, 3_000_000) in calls
    assert not list(tmp_path.rglob("*.part")) and not list(tmp_path.rglob("pwned"))
    again = executor.download_dir(str(src), dest)
    assert [(r.skipped, r.bytes_received) for r in again] == [(True, 0)] * 4
    assert not list(dest.rglob("*.part"))


def test_download_replaces_a_different_local_file_of_the_same_size(executor, tmp_path):
    src, dest = random_file(tmp_path / "w.bin", 50_000, seed=6), random_file(tmp_path / "w.local", 50_000, seed=7)
    result = executor.download_file(str(src), dest)
    assert not result.skipped and result.bytes_received == 50_000 and dest.read_bytes() == src.read_bytes()


class FlipStdoutByte:
    """alter_read: flips the byte at stdout position `at` in the given exchanges, wherever the pieces split."""

    def __init__(self, at: int, exchanges: set[int]):
        self.at, self.exchanges, self.seen = at, exchanges, {}

    def __call__(self, number: int, data: bytes) -> bytes:
        start = self.seen.get(number, 0)
        self.seen[number] = start + len(data)
        if number not in self.exchanges or not start <= self.at < start + len(data):
            return data
        i = self.at - start
        return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]


def test_an_altered_download_is_refused_and_leaves_nothing(executor, tmp_path, monkeypatch):
    src = random_file(tmp_path / "w.bin", 3_000_000, seed=8)
    header = len("3000000 -\n")  # the host's first line: size, and no sha256 (no local copy of that size)
    Tamper(monkeypatch, executor, alter_read=FlipStdoutByte(header + 100, {0, 1}))
    flipped = bytearray(src.read_bytes())
    flipped[100] ^= 0x01
    fresh = tmp_path / "fresh" / "w.bin"
    with pytest.raises(DownloadVerifyError) as caught:
        executor.download_file(str(src), fresh)
    assert f"remote {sha256(src)}, received {hashlib.sha256(flipped).hexdigest()}" in str(caught.value)
    old = random_file(tmp_path / "old.bin", 1_000, seed=9)
    with pytest.raises(DownloadVerifyError):
        executor.download_file(str(src), old)
    assert not fresh.exists() and old.read_bytes() == hashlib.shake_256(b"seed9").digest(1_000)
    assert not list(tmp_path.rglob("*.part"))


def test_downloading_a_missing_path_names_host_and_path(executor, tmp_path):
    missing, empty = tmp_path / "no such.bin", tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=rf"\[{executor.name}\] {missing}: no such file"):
        executor.download_file(str(missing), tmp_path / "out.bin")
    with pytest.raises(FileNotFoundError, match=rf"\[{executor.name}\] {missing}: no such directory"):
        executor.download_dir(str(missing), tmp_path / "out")
    with pytest.raises(FileNotFoundError, match=rf"\[{executor.name}\] {empty}: no files"):
        executor.download_dir(str(empty), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def cut_once_at(ssh, at: int):
    """A progress callback that shuts the SSH connection's socket the first time `at` bytes arrived."""
    cuts = []

    def progress(what, done, total):
        if done >= at and not cuts:
            cuts.append(done)
            ssh._client.get_transport().sock.shutdown(socket.SHUT_RDWR)  # a real cut, not a mock
    return progress, cuts


def test_a_cut_download_leaves_nothing_and_then_starts_again(ssh, tmp_path):
    src, dest = random_file(tmp_path / "big.bin", SIZE), tmp_path / "big.out"
    progress, cuts = cut_once_at(ssh, 1)
    with pytest.raises(ConnectionLost):
        ssh.download_file(str(src), dest, progress=progress, reconnects=0)
    assert cuts and cuts[0] < SIZE and not dest.exists() and not dest.with_name("big.out.part").exists()
    progress, cuts = cut_once_at(ssh, 1)
    result = ssh.download_file(str(src), dest, progress=progress)  # the same executor reconnects by itself
    assert cuts and result.bytes_received == SIZE and sha256(dest) == sha256(src)
    assert not dest.with_name("big.out.part").exists()
