"""tasks/hosts/remote/ssh.py against a real sshd on 127.0.0.1: ciphers, server rekeys, bounded connect
retries, key files, jump hosts, reconnecting after a dropped connection."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import threading

import pytest

from tasks.hosts.remote import ConnectError, connect
from tests.sshd import free_port, start_sshd
from tests.tasks.hosts.remote.helpers import SIZE, random_file, sha256


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


def test_connection_refused_gives_up_after_bounded_retries(caplog):
    caplog.set_level(logging.WARNING, logger="eagleops.remote")
    host = unreachable_host(free_port())
    with pytest.raises(ConnectError, match="after 3 attempts"):
        connect(host, retry_backoff_s=0.05)
    assert caplog.text.count("retry") == 2


def unreachable_host(port: int):
    from tasks.config.schema import HostConfig

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


def test_commands_after_a_dropped_connection_reconnect(ssh):
    ssh._client.get_transport().sock.shutdown(socket.SHUT_RDWR)
    for _ in range(100):  # the transport notices the cut on its reader thread
        if not ssh._client.get_transport().is_active():
            break
        threading.Event().wait(0.05)
    assert ssh.run(["echo", "back"]).stdout == "back\n"
