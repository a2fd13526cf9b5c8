"""tasks/remote.py against a real sshd on 127.0.0.1 (tests/sshd.py) and against this machine.

Behaviour both executors must share runs parametrised over `local` and `ssh`. Connections are
cut for real (the transport's socket is shut down mid-upload), host keys are real OpenSSH
keys, and "nothing left running" is checked with `ps`.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import paramiko
import pytest

from tasks.remote import (
    CommandFailed,
    CommandTimeout,
    ConnectError,
    ConnectionLost,
    DownloadVerifyError,
    HostKeyError,
    LocalExecutor,
    SSHExecutor,
    UploadVerifyError,
    connect,
    expand_remote_path,
    host_key_fingerprint,
    shell_command,
    trust_host,
)
from tests.sshd import free_port, start_sshd

PY = sys.executable
ECHO_ARGV = "import json, sys; print(json.dumps(sys.argv[1:]))"
HOSTILE = ["x; touch pwned", "$(touch pwned)", "`touch pwned`", "a'b\"c", "line1\nline2", "$HOME", "*", " spaced ", "",
           "--flag=1 && touch pwned", "| touch pwned", "\\"]


@pytest.fixture(params=["local", "ssh"])
def executor(request, sshd):
    ex = LocalExecutor() if request.param == "local" else connect(sshd.host_config())
    yield ex
    ex.close()


@pytest.fixture
def ssh(sshd):
    ex = connect(sshd.host_config())
    yield ex
    ex.close()


def live_processes(pattern: str) -> list[str]:
    """`ps` lines (zombies excluded: PID 1 here may not reap) whose command line contains `pattern`."""
    lines = subprocess.run(["ps", "-e", "-o", "pid=,stat=,args="], capture_output=True, text=True, check=True).stdout
    return [line for line in lines.splitlines() if pattern in line and line.split()[1][0] != "Z"]


def random_file(path, size: int, seed: int = 0):
    path.write_bytes(hashlib.shake_256(f"seed{seed}".encode()).digest(size))
    return path


def sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def no_fileno(channel):
    raise AssertionError("Channel.fileno() creates paramiko's racy pipe")


# --------------------------------------------------------------------------- commands


def test_hostile_arguments_reach_the_program_literally(executor, tmp_path):
    result = executor.run([PY, "-c", ECHO_ARGV, *HOSTILE], cwd=str(tmp_path))
    assert json.loads(result.stdout) == HOSTILE
    assert not any(os.path.exists(os.path.join(d, "pwned")) for d in (tmp_path, ".", os.path.expanduser("~")))


def test_hostile_env_value_and_cwd_are_literal(executor, tmp_path):
    workdir = tmp_path / "d; touch pwned $(id)"
    workdir.mkdir()
    result = executor.run([PY, "-c", "import os; print(os.getcwd()); print(os.environ['ODD'])"],
                          env={"ODD": "$(touch pwned); `id` 'q'"}, cwd=str(workdir))
    assert result.stdout.splitlines() == [str(workdir), "$(touch pwned); `id` 'q'"]
    assert list(tmp_path.iterdir()) == [workdir] and list(workdir.iterdir()) == []


def test_bad_env_name_is_refused_before_running(executor):
    with pytest.raises(ValueError, match="env: 'A;B'"):
        executor.run(["true"], env={"A;B": "1"})


def test_exit_status_and_stderr_tail(executor):
    script = "import sys\nfor i in range(30): print(f'err{i}', file=sys.stderr)\nprint('out')\nsys.exit(3)"
    result = executor.run([PY, "-c", script], check=False)
    assert result.exit_status == 3 and result.stdout == "out\n" and "err29" in result.stderr
    with pytest.raises(CommandFailed) as caught:
        executor.run([PY, "-c", script])
    err = caught.value
    assert err.exit_status == 3 and err.argv[0] == PY
    assert err.stderr_tail.splitlines() == [f"err{i}" for i in range(10, 30)]
    assert "exit status 3" in str(err) and "err29" in str(err) and "err9\n" not in str(err)


def test_a_failed_command_is_not_retried(executor, tmp_path):
    counter = tmp_path / "runs"
    with pytest.raises(CommandFailed):
        executor.run(["sh", "-c", 'echo run >> "$1"; exit 1', "sh", str(counter)])
    assert counter.read_text() == "run\n"


def test_timeout_kills_the_command_and_its_children(executor):
    # The shell, its background child and its foreground child must all be gone.
    with pytest.raises(CommandTimeout, match="timed out after 1"):
        executor.run(["sh", "-c", "sleep 3031 & sleep 3032; wait"], timeout=1)
    assert live_processes("sleep 303") == []


def test_env_cwd_and_stdin(executor, tmp_path):
    result = executor.run(["sh", "-c", 'pwd; echo "$GREETING"; cat'], env={"GREETING": "hi there"}, cwd=str(tmp_path),
                          stdin=b"from stdin\n")
    assert result.stdout == f"{tmp_path}\nhi there\nfrom stdin\n"


def test_secret_env_values_are_masked_in_logs(executor, caplog):
    caplog.set_level(logging.DEBUG, logger="eagleops.remote")
    result = executor.run(["sh", "-c", 'echo "${HF_TOKEN#s3}" "$PLAIN"'],
                          env={"HF_TOKEN": "s3cr3t-value", "PLAIN": "visible"})
    assert result.stdout == "cr3t-value visible\n"  # the program got the real value
    logged = caplog.text
    assert "s3cr3t-value" not in logged and "HF_TOKEN=****" in logged and "PLAIN=visible" in logged


def test_output_is_logged_while_the_command_runs(executor, tmp_path):
    # The command waits for a file the log handler creates when it sees "ready": if output were
    # only logged at the end, the command would never finish and would time out.
    go = tmp_path / "go"

    class Opener(logging.Handler):
        def emit(self, record):
            if record.getMessage().endswith("] ready"):
                go.touch()

    handler = Opener()
    remote_logger = logging.getLogger("eagleops.remote")
    remote_logger.addHandler(handler)
    remote_logger.setLevel(logging.INFO)
    try:
        script = f"import os, time\nprint('ready', flush=True)\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)"
        executor.run([PY, "-c", script], timeout=60)
    finally:
        remote_logger.removeHandler(handler)
    assert go.exists()


def test_shell_command_shape():
    line = shell_command(["echo", "a b"], env={"K": "v w"}, cwd="~/work dir", timeout=2)
    assert line == "cd \"$HOME\"/'work dir' && timeout -k 5 2.000 env 'K=v w' echo 'a b'"


# --------------------------------------------------------------------------- processes and files


def test_start_detached_is_alive_and_kill_group(executor, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="eagleops.remote")
    log, pid_file = tmp_path / "logs" / "server.log", tmp_path / "server.pid"
    pid = executor.start_detached(["sh", "-c", 'echo "started $MARK"; sleep 3041 & exec sleep 3042'],
                                  env={"MARK": "m1", "API_KEY": "hush-123"}, log_file=str(log), pid_file=str(pid_file))
    try:
        assert executor.is_alive(pid) and int(pid_file.read_text()) == pid
        assert b"API_KEY=hush-123" in open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        assert "hush-123" not in caplog.text and "API_KEY=****" in caplog.text
        assert os.getpgid(pid) == pid and os.getsid(pid) == pid  # its own session and group
        for _ in range(200):  # the command forks its background child after the pid file is written
            if len(live_processes("sleep 304")) == 2:
                break
            threading.Event().wait(0.05)
        assert len(live_processes("sleep 304")) == 2
        assert executor.read_file(str(log)) == "started m1\n"
    finally:
        executor.kill_group(pid, timeout=10)
    assert not executor.is_alive(pid)
    assert live_processes("sleep 304") == []
    executor.kill_group(pid)  # idempotent


def test_kill_group_escalates_to_sigkill(executor, tmp_path):
    pid = executor.start_detached(["sh", "-c", "trap '' TERM; sleep 3051"], log_file=str(tmp_path / "log"),
                                  pid_file=str(tmp_path / "pid"))
    executor.kill_group(pid, timeout=1)
    assert live_processes("sleep 3051") == []


def test_files_read_exist_makedirs_sha256(executor, tmp_path):
    path = tmp_path / "a b" / "c"
    executor.makedirs(str(path))
    assert path.is_dir() and executor.path_exists(str(path)) and not executor.path_exists(str(tmp_path / "no"))
    text = tmp_path / "t.log"
    text.write_text("".join(f"line {i}\n" for i in range(10)))
    assert executor.read_file(str(text)) == text.read_text()
    assert executor.read_file(str(text), tail_lines=2) == "line 8\nline 9\n"
    with pytest.raises(FileNotFoundError, match="no such file"):
        executor.read_file(str(tmp_path / "missing.log"))
    blob = random_file(tmp_path / "blob", 100_000)
    assert executor.sha256(str(blob)) == sha256(blob)
    assert executor.sha256(str(tmp_path / "missing")) is None


def test_expand_remote_path(executor):
    home = os.path.expanduser("~")
    assert expand_remote_path(executor, "~/eagleops/x") == f"{home}/eagleops/x"
    assert expand_remote_path(executor, "~") == home
    assert expand_remote_path(executor, "/abs/~/x") == "/abs/~/x"


def test_port_in_use(executor):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        assert executor.port_in_use(port)
    assert not executor.port_in_use(port)


def test_forward_reaches_a_server_on_the_host(executor, tmp_path):
    (tmp_path / "hello.txt").write_text("hello through the tunnel")
    port = free_port()
    pid = executor.start_detached([PY, "-m", "http.server", "--bind", "127.0.0.1", str(port)], cwd=str(tmp_path),
                                  log_file=str(tmp_path / "http.log"), pid_file=str(tmp_path / "http.pid"))
    try:
        _wait_until_listening(executor, port)
        with executor.forward(port) as local_port:
            for _ in range(2):  # two connections through one tunnel
                conn = http.client.HTTPConnection("127.0.0.1", local_port, timeout=30)
                conn.request("GET", "/hello.txt")
                response = conn.getresponse()
                assert (response.status, response.read()) == (200, b"hello through the tunnel")
                conn.close()
        if isinstance(executor, SSHExecutor):
            assert local_port != port
            with pytest.raises(OSError):
                socket.create_connection(("127.0.0.1", local_port), timeout=5).close()
    finally:
        executor.kill_group(pid)


def test_tunnel_and_commands_never_drop_the_connection(ssh, tmp_path, monkeypatch):
    """Many short tunnel connections and commands at once on one SSH connection.

    paramiko's `Channel.fileno()` is a pipe its transport thread writes to while another thread
    may be closing it; a lost race kills the transport (EPIPE/EBADF) and, with it, requests in
    flight through the tunnel (CI saw "Connection reset by peer" mid-benchmark). The executor
    must never touch that pipe, and the connection must survive the load.
    """
    monkeypatch.setattr(paramiko.Channel, "fileno", no_fileno)
    (tmp_path / "page.txt").write_bytes(os.urandom(200_000))
    port = free_port()
    pid = ssh.start_detached([PY, "-m", "http.server", "--bind", "127.0.0.1", str(port)], cwd=str(tmp_path),
                             log_file=str(tmp_path / "http.log"), pid_file=str(tmp_path / "http.pid"))
    try:
        _wait_until_listening(ssh, port)
        transport = ssh._transport()
        with ssh.forward(port) as local_port:
            def fetch(_):
                conn = http.client.HTTPConnection("127.0.0.1", local_port, timeout=30)
                conn.request("GET", "/page.txt")
                body = conn.getresponse().read()
                conn.close()
                return len(body)

            def command(i):
                return ssh.run(["echo", str(i)], log_output=False, timeout=30).stdout.strip()

            with ThreadPoolExecutor(max_workers=6) as pool:
                sizes = list(pool.map(fetch, range(120)))
                echoed = list(pool.map(command, range(30)))
        assert sizes == [200_000] * 120
        assert echoed == [str(i) for i in range(30)]
        assert ssh._transport() is transport, "the SSH connection was dropped and re-made under load"
    finally:
        ssh.kill_group(pid)


def _wait_until_listening(executor, port: int) -> None:
    for _ in range(300):
        if executor.port_in_use(port):
            return
    raise AssertionError(f"nothing listens on port {port}")


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


SIZE = 6_000_000
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


# --------------------------------------------------------------------------- connecting


def _fingerprint_from_ssh_keygen(pub_path) -> str:
    out = subprocess.run(["ssh-keygen", "-lf", str(pub_path)], capture_output=True, text=True, check=True).stdout
    return out.split()[1]


def test_fast_cipher_is_used(ssh):
    assert ssh.cipher == "aes128-gcm@openssh.com"


def test_cipher_falls_back_when_the_server_refuses_gcm(tmp_path):
    server = start_sshd(tmp_path / "sshd", extra_config=["Ciphers aes128-ctr"])
    try:
        with connect(server.host_config()) as ex:
            assert ex.cipher == "aes128-ctr" and ex.run(["echo", "ok"]).stdout == "ok\n"
    finally:
        server.stop()


def test_uploads_survive_server_rekeys(tmp_path):
    # sshd renegotiates keys every 256 KiB here: many rekeys land mid-stream and around channel
    # closes. Only the server starts them (paramiko's own rekey would hit paramiko #822).
    server = start_sshd(tmp_path / "sshd", extra_config=["RekeyLimit 256K"])
    try:
        src = random_file(tmp_path / "big.bin", SIZE)
        with connect(server.host_config()) as ex:
            assert ex._client.get_transport().packetizer.REKEY_BYTES > 2**36
            for name in ("a.bin", "b.bin"):
                result = ex.upload_file(src, str(tmp_path / name))
                assert result.resumed_from == 0 and sha256(tmp_path / name) == sha256(src)
    finally:
        server.stop()


def test_unknown_host_key_is_rejected_with_its_fingerprint(sshd, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="eagleops.remote")
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(HostKeyError) as caught:
        connect(sshd.host_config(known_hosts=str(empty)))
    message = str(caught.value)
    assert _fingerprint_from_ssh_keygen(f"{sshd.host_key}.pub") in message
    assert str(empty) in message and "eagleops hosts trust testhost" in message
    assert "retry" not in caplog.text  # a host-key refusal is final


def test_changed_host_key_is_rejected_and_trust_host_replaces_it(sshd, tmp_path):
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True, capture_output=True)
    known = tmp_path / "known_hosts"
    other_pub = (tmp_path / "other_key.pub").read_text().split()
    known.write_text(f"# keep me\n[127.0.0.1]:{sshd.port} {other_pub[0]} {other_pub[1]}\nelsewhere {other_pub[0]} "
                     f"{other_pub[1]}\n")
    host = sshd.host_config(known_hosts=str(known))
    with pytest.raises(HostKeyError, match="CHANGED") as caught:
        connect(host)
    assert _fingerprint_from_ssh_keygen(f"{sshd.host_key}.pub") in str(caught.value)
    assert _fingerprint_from_ssh_keygen(tmp_path / "other_key.pub") in str(caught.value)

    assert host_key_fingerprint(host) == ("ssh-ed25519", _fingerprint_from_ssh_keygen(f"{sshd.host_key}.pub"))
    message = trust_host(host)
    assert _fingerprint_from_ssh_keygen(f"{sshd.host_key}.pub") in message
    lines = known.read_text().splitlines()
    assert lines[0] == "# keep me" and lines[1].startswith("elsewhere ") and len(lines) == 3
    with connect(host) as ex:
        assert ex.run(["echo", "trusted"]).stdout == "trusted\n"


def test_trust_host_records_an_unknown_host(sshd, tmp_path):
    known = tmp_path / "new" / "known_hosts"
    host = sshd.host_config(known_hosts=str(known))
    trust_host(host)
    with connect(host) as ex:
        assert ex.run(["true"]).exit_status == 0


def test_connection_refused_gives_up_after_bounded_retries(caplog):
    caplog.set_level(logging.WARNING, logger="eagleops.remote")
    host = unreachable_host(free_port())
    with pytest.raises(ConnectError, match="after 3 attempts"):
        connect(host, retry_backoff_s=0.05)
    assert caplog.text.count("retry") == 2


def unreachable_host(port: int):
    from tasks.config import HostConfig

    return HostConfig(name="nothing", address="127.0.0.1", port=port, user="root", connect_retries=2,
                      connect_timeout_s=5, known_hosts=os.devnull)


def test_refused_authentication_is_not_retried(sshd, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="eagleops.remote")
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True,
                   capture_output=True)
    with pytest.raises(ConnectError, match="authentication refused"):
        connect(sshd.host_config(key_file=str(stranger)), retry_backoff_s=0.05)
    assert "retry" not in caplog.text


def test_encrypted_key_with_passphrase(sshd, tmp_path):
    key = tmp_path / "locked"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "pass phrase", "-f", str(key)], check=True,
                   capture_output=True)
    authorized = sshd.directory / "authorized_keys"
    original = authorized.read_text()
    authorized.write_text(original + (tmp_path / "locked.pub").read_text())
    try:
        with pytest.raises(ConnectError, match="key_passphrase"):
            connect(sshd.host_config(key_file=str(key)))
        with pytest.raises(ConnectError, match="key_file: cannot load"):
            connect(sshd.host_config(key_file=str(key), key_passphrase="wrong"))
        with connect(sshd.host_config(key_file=str(key), key_passphrase="pass phrase")) as ex:
            assert ex.run(["echo", "in"]).stdout == "in\n"
    finally:
        authorized.write_text(original)


@pytest.mark.parametrize("style", ["user@host:port", "inventory name"])
def test_jump_host(sshd, style):
    # The same sshd serves as jump host and target: the target is reached through a
    # direct-tcpip channel of the jump connection.
    bastion = sshd.host_config(name="bastion")
    jump = f"{sshd.user}@127.0.0.1:{sshd.port}" if style == "user@host:port" else "bastion"
    target = sshd.host_config(name="gpu", jump_host=jump)
    with connect(target, inventory=[bastion, target]) as ex:
        assert ex._jump is not None and ex.run(["echo", "via jump"]).stdout == "via jump\n"


def test_unknown_jump_host_name_names_the_field(sshd):
    with pytest.raises(ValueError, match=r"hosts\[gpu\].jump_host: 'nowhere'"):
        connect(sshd.host_config(name="gpu", jump_host="nowhere"))


def test_connect_local():
    assert isinstance(connect(None), LocalExecutor) and isinstance(connect("local"), LocalExecutor)


def test_commands_after_a_dropped_connection_reconnect(ssh):
    ssh._client.get_transport().sock.shutdown(socket.SHUT_RDWR)
    for _ in range(100):  # the transport notices the cut on its reader thread
        if not ssh._client.get_transport().is_active():
            break
        threading.Event().wait(0.05)
    assert ssh.run(["echo", "back"]).stdout == "back\n"
