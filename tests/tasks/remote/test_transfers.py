"""tasks/remote/transfers.py through both executors: uploads and downloads that are verified and atomic.

Connections are cut for real (the transport's socket is shut down mid-transfer), and a cut
upload resumes from its `.part`.
"""

from __future__ import annotations

import hashlib
import socket

import paramiko
import pytest

from tasks.remote import ConnectionLost, DownloadVerifyError, UploadVerifyError
from tests.tasks.remote.helpers import SIZE, no_fileno, random_file, sha256

# --------------------------------------------------------------------------- uploads


def test_upload_dir_keeps_layout_then_skips_equal_files(executor, tmp_path):
    src = tmp_path / "ckpt"
    (src / "sub dir").mkdir(parents=True)
    (src / "empty").mkdir()
    random_file(src / "model.safetensors", 300_000, seed=1)
    random_file(src / "sub dir" / "config.json", 1_000, seed=2)
    dest = tmp_path / "remote $(touch pwned)"
    results = executor.upload_dir(src, str(dest))
    assert sorted((r.remote, r.skipped) for r in results) == [
        (f"{dest}/model.safetensors", False), (f"{dest}/sub dir/config.json", False)]
    assert sha256(dest / "model.safetensors") == sha256(src / "model.safetensors")
    assert (dest / "sub dir" / "config.json").read_bytes() == (src / "sub dir" / "config.json").read_bytes()
    assert (dest / "empty").is_dir() and not list(dest.rglob("*.part")) and not (tmp_path / "pwned").exists()
    again = executor.upload_dir(src, str(dest))
    assert all(r.skipped and r.bytes_sent == 0 for r in again)


def test_upload_replaces_a_different_file(executor, tmp_path):
    src = random_file(tmp_path / "w.bin", 50_000, seed=3)
    dest = random_file(tmp_path / "dest.bin", 50_000, seed=4)
    result = executor.upload_file(src, str(dest))
    assert not result.skipped and result.bytes_sent == 50_000 and dest.read_bytes() == src.read_bytes()


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


CUT_AT = 4_000_000  # past sshd's 2 MiB window, so the host has written part of the file


def _cut_upload(ssh, monkeypatch, src, dest):
    cutter = CutAfter(monkeypatch, cut_at=CUT_AT)
    with pytest.raises(ConnectionLost):
        ssh.upload_file(src, str(dest), reconnects=0)
    assert cutter.cuts == 1 and not dest.exists()
    part = dest.with_name(dest.name + ".part")
    assert 0 < part.stat().st_size < SIZE
    return part


def test_upload_resumes_after_a_cut_connection(ssh, monkeypatch, tmp_path):
    src, dest = random_file(tmp_path / "big.bin", SIZE), tmp_path / "out" / "big.bin"
    _cut_upload(ssh, monkeypatch, src, dest)
    counter = CutAfter(monkeypatch, cut_at=None)
    result = ssh.upload_file(src, str(dest))  # the same executor reconnects by itself
    assert result.resumed_from > 0 and not result.restarted
    assert counter.sent == SIZE - result.resumed_from == result.bytes_sent
    assert sha256(dest) == sha256(src) == result.sha256 and not dest.with_name("big.bin.part").exists()


def test_upload_survives_a_cut_in_one_call(ssh, monkeypatch, tmp_path):
    src, dest = random_file(tmp_path / "big.bin", SIZE), tmp_path / "big.bin.copy"
    counter = CutAfter(monkeypatch, cut_at=CUT_AT)
    result = ssh.upload_file(src, str(dest))
    assert counter.cuts == 1 and result.resumed_from > 0 and sha256(dest) == sha256(src)
    assert counter.sent == counter.sent_at_cut + SIZE - result.resumed_from  # resumed, not sent again


def test_a_corrupted_part_is_detected_and_sent_again_from_zero(ssh, monkeypatch, tmp_path):
    src, dest = random_file(tmp_path / "big.bin", SIZE), tmp_path / "big.out"
    part = _cut_upload(ssh, monkeypatch, src, dest)
    with open(part, "r+b") as f:
        f.write(b"\0" * 100)
    counter = CutAfter(monkeypatch, cut_at=None)
    result = ssh.upload_file(src, str(dest))
    assert result.restarted and counter.sent == (SIZE - result.resumed_from) + SIZE
    assert sha256(dest) == sha256(src)


def test_a_local_file_changed_between_attempts_is_sent_again(ssh, monkeypatch, tmp_path):
    src, dest = random_file(tmp_path / "big.bin", SIZE), tmp_path / "big.out"
    _cut_upload(ssh, monkeypatch, src, dest)
    random_file(src, SIZE, seed=9)
    result = ssh.upload_file(src, str(dest))
    assert result.restarted and sha256(dest) == sha256(src)


def test_a_mismatch_after_sending_from_zero_fails_with_both_hashes(executor, tmp_path):
    src, dest = random_file(tmp_path / "big.bin", SIZE), tmp_path / "big.out"
    part = tmp_path / "big.out.part"
    attempts = []

    def corrupt_the_part(what, done, total):
        # The last progress call of an attempt comes after the host closed the file: bytes
        # "flipped" on its disk then stay flipped, in both attempts.
        if done == total:
            with open(part, "r+b") as f:
                f.write(b"\xff" * 64)
            attempts.append(done)

    with pytest.raises(UploadVerifyError) as caught:
        executor.upload_file(src, str(dest), progress=corrupt_the_part)
    message = str(caught.value)
    assert sha256(src) in message and "remote " in message and "from zero" in message
    assert len(attempts) >= 4  # two attempts, each with a last chunk and a final call
    assert not part.exists() and not dest.exists()


# --------------------------------------------------------------------------- downloads


def checkpoint_dir(root):
    """A training result: nested files, names a shell would misread, bytes of every value."""
    (root / "sub dir" / "deeper").mkdir(parents=True)
    (root / "empty").mkdir()
    random_file(root / "model.safetensors", 3_000_000, seed=5)  # > the 2 MiB channel window
    (root / "sub dir" / "deeper" / "optimizer $(touch pwned).pt").write_bytes(bytes(range(256)) * 40 + b"\r\n\0")
    (root / "history.jsonl").write_text('{"step": 1}\n')
    return root


def test_download_dir_round_trip_then_skips(executor, tmp_path, monkeypatch):
    monkeypatch.setattr(paramiko.Channel, "fileno", no_fileno)
    src = checkpoint_dir(tmp_path / "remote ckpt")
    dest = tmp_path / "local" / "ckpt"
    calls = []
    results = executor.download_dir(str(src), dest, progress=lambda *call: calls.append(call))
    names = ["history.jsonl", "model.safetensors", "sub dir/deeper/optimizer $(touch pwned).pt"]
    assert [(r.remote, r.local, r.skipped) for r in results] == [
        (f"{src}/{n}", str(dest / n), False) for n in names]
    for name, result in zip(names, results):
        assert (dest / name).read_bytes() == (src / name).read_bytes()
        size = (src / name).stat().st_size
        assert result.sha256 == sha256(src / name) and result.bytes_received == result.size == size
    assert ("model.safetensors", 3_000_000, 3_000_000) in calls
    assert not list(tmp_path.rglob("*.part")) and not list(tmp_path.rglob("pwned"))
    again = executor.download_dir(str(src), dest)
    assert [(r.skipped, r.bytes_received) for r in again] == [(True, 0)] * 3
    assert not list(dest.rglob("*.part"))


def test_download_replaces_a_different_local_file(executor, tmp_path):
    src, dest = random_file(tmp_path / "w.bin", 50_000, seed=6), random_file(tmp_path / "w.local", 50_000, seed=7)
    result = executor.download_file(str(src), dest)
    assert not result.skipped and result.bytes_received == 50_000 and dest.read_bytes() == src.read_bytes()


def test_a_download_that_fails_verification_leaves_nothing(executor, tmp_path, monkeypatch):
    src = random_file(tmp_path / "w.bin", 3_000_000, seed=8)
    monkeypatch.setattr(executor, "sha256", lambda path: "0" * 64)
    fresh = tmp_path / "fresh" / "w.bin"
    with pytest.raises(DownloadVerifyError, match=f"remote {'0' * 64}, received {sha256(src)}"):
        executor.download_file(str(src), fresh)
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
