"""tasks/hosts/remote/tunnel.py: `forward()` through both executors, and many tunnel connections and
commands at once on one SSH connection without dropping it."""

from __future__ import annotations

import http.client
import os
import socket
from concurrent.futures import ThreadPoolExecutor

import paramiko
import pytest

from tasks.hosts.remote import SSHExecutor
from tests.sshd import free_port
from tests.tasks.hosts.remote.helpers import PY, no_fileno


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
