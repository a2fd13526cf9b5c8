"""`SSHExecutor`: an inventory host over SSH (paramiko), reconnecting on the next call after a drop.

Owns connecting (bounded retries, key files, jump hosts, a fast cipher, the client's rekey
threshold, no Nagle delay), commands on exec channels, and the byte streams uploads and
downloads use: transfer_host.py on an exec channel, its stdin written and its stdout read.
Host keys are checked as host_keys.py says; tunnels are tunnel.py.

Risk, and what guards it:
- Transfer speed: paramiko's SFTP `put` runs at ~0.36x scp; streaming over an exec channel
  with aes128-gcm, packet-sized writes and reads larger than the channel window runs at scp's
  speed or better (see /work/shared/reference/transfer-and-serving-perf.md, Part 1, and
  tests/benchmarks/NOTES_upload.md).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from typing import Iterator, Sequence

import paramiko

from tasks.config.schema import HostConfig
from tasks.hosts.remote.channels import _close_quietly, _open_direct_tcpip, _pump
from tasks.hosts.remote.commands import _OutputStream
from tasks.hosts.remote.errors import ConnectError, ConnectionLost, RemoteError
from tasks.hosts.remote.executor import _ExecutorBase
from tasks.hosts.remote.host_keys import (
    _changed_key_error,
    _RejectUnknownHost,
    known_hosts_path,
)
from tasks.hosts.remote.log import logger
from tasks.hosts.remote.transfers import _HostProcess
from tasks.hosts.remote.tunnel import _Tunnel

FAST_CIPHER = "aes128-gcm@openssh.com"
KEEPALIVE_S = 30
# paramiko starts a rekey itself after 512 MiB. If the server closes a channel just then (as
# it does when `cat` ends an upload), paramiko's transport thread blocks on its own rekey and
# the connection dies after 30 s (paramiko #822, open; seen here at the end of a 1 GiB
# upload). OpenSSH servers rekey on their own (sshd_config RekeyLimit: "between 1G and 4G,
# depending on the cipher"), a server-started rekey does not hit that bug, so paramiko's own
# threshold is set far above the server's.
CLIENT_REKEY_BYTES = 2**37
# One read of a transfer's stdout takes up to this much: more than paramiko's 2 MiB channel
# window (see _ChannelProcess).
READ_BYTES = 1 << 22
# A blocked send or a silent peer for this long means the connection is gone.
CHANNEL_IO_TIMEOUT_S = 120.0


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


# A command given no stdin reads /dev/null on the host, as LocalExecutor's does, instead of the channel closed by
# an EOF from here. That EOF races paramiko: shutdown_write builds the EOF under the channel's lock and sends it
# after letting go, so a command that ended at once (the host closed the channel, paramiko answered CLOSE) can get
# it after the CLOSE; OpenSSH then drops the whole connection ("ieof packet referred to nonexistent channel"),
# and every command and tunnel on it. Seen under load with a host shell that starts fast: 3 in 16 runs of
# test_tunnel_and_commands_never_drop_the_connection, 0 in 16 with the shell's ~/.bashrc making each command slow.
_NO_STDIN = "exec </dev/null; "


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
        _no_nagle(client.get_transport().sock)
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
                if stdin:
                    channel.exec_command(command)
                    channel.sendall(stdin)
                    channel.shutdown_write()  # the command reads its stdin to the end: it is still there
                else:
                    channel.exec_command(_NO_STDIN + command)
                status = _pump(channel, out, err, deadline)
            except (OSError, EOFError, paramiko.SSHException) as error:
                raise ConnectionLost(f"[{self.name}] connection lost while running a command: {error}") from error
            if status == -1 and not channel.get_transport().is_active():
                raise ConnectionLost(f"[{self.name}] connection lost while running a command")
            return status
        finally:
            _close_quietly(channel)

    def _open_process(self, command: str) -> _HostProcess:
        return _ChannelProcess(self, command)

    @contextlib.contextmanager
    def forward(self, remote_port: int) -> Iterator[int]:
        """A local port whose connections reach the host's 127.0.0.1:`remote_port` (direct-tcpip)."""
        tunnel = _Tunnel(self.name, self._transport, self.host.connect_timeout_s, int(remote_port))
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


def _no_nagle(sock) -> None:
    """TCP_NODELAY on the connection's socket (a jump host's channel has none to set).

    Opening a channel and starting a command are small request/reply messages; with Nagle on,
    each waits for the peer's delayed ACK (~40 ms per channel open measured on loopback), which
    every command and every transfer pays. Bulk data goes in whole packets either way.
    """
    if isinstance(sock, socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _ChannelProcess:
    """SSHExecutor: a command on an exec channel; stdin in packet-sized writes, stdout by blocking recv.

    `Channel.sendall` re-slices its whole buffer after every packet (paramiko #2659), so handing
    it more than one packet costs CPU; `out_max_packet_size - 64` leaves room for the packet
    header. Reads ask for more than the channel window (2 MiB) so each takes the whole buffer:
    paramiko drops a partial read from the front of its buffer (`del buf[:n]`), a copy of what
    is left per read (256 MiB on loopback streamed at ~190 MB/s with 64 KiB reads, ~270 MB/s
    with 4 MiB). Stderr is drained on the way so it can never hold the channel's window. Never
    select() on the channel (channels.py says why).
    """

    def __init__(self, executor: SSHExecutor, command: str):
        self.name = executor.name
        self.channel = executor._open_channel()
        self._stderr = _OutputStream(f"{executor.name} stderr", log_lines=False)
        try:
            self.channel.exec_command(command)
        except (OSError, EOFError, paramiko.SSHException) as err:
            _close_quietly(self.channel)
            raise ConnectionLost(f"[{self.name}] could not start a transfer: {err}") from err
        self.write_size = self.channel.out_max_packet_size - 64

    def write(self, data: bytes) -> None:
        try:
            self.channel.sendall(data)
        except (OSError, EOFError, paramiko.SSHException) as err:
            if self._command_ended():
                raise BrokenPipeError(f"[{self.name}] the command on the host ended") from err
            raise ConnectionLost(f"[{self.name}] transfer cut: {err}") from err

    def close_stdin(self) -> None:
        try:
            self.channel.shutdown_write()
        except (OSError, EOFError, paramiko.SSHException) as err:
            raise ConnectionLost(f"[{self.name}] transfer cut: {err}") from err

    def read(self) -> bytes:
        try:  # a silent host times out (CHANNEL_IO_TIMEOUT_S): OSError
            data = self.channel.recv(READ_BYTES)
            if self.channel.recv_stderr_ready():
                self._stderr.feed(self.channel.recv_stderr(1 << 16))
        except (OSError, EOFError, paramiko.SSHException) as err:
            raise ConnectionLost(f"[{self.name}] transfer cut: {err}") from err
        return data

    def wait(self) -> tuple[int, str]:
        leftover = _OutputStream(f"{self.name} stdout", log_lines=False)
        try:
            status = _pump(self.channel, leftover, self._stderr, time.monotonic() + CHANNEL_IO_TIMEOUT_S)
        except (OSError, EOFError, paramiko.SSHException) as err:
            raise ConnectionLost(f"[{self.name}] transfer cut: {err}") from err
        self._stderr.close()
        # A cut connection closes the channel without an exit status and without EOF (and paramiko
        # unlinks channels before it marks the transport inactive, so is_active() can still say True).
        if status is None or (status == -1 and not self.channel.eof_received):
            raise ConnectionLost(f"[{self.name}] the channel closed before the command on the host ended")
        return status, self._stderr.text

    def close(self) -> None:
        _close_quietly(self.channel)

    def _command_ended(self) -> bool:
        """Whether the host's command exited (its status arrived), as opposed to the connection dropping."""
        return self.channel.exit_status_ready() and self.channel.recv_exit_status() != -1
