"""`_Tunnel`: the local end of `SSHExecutor.forward`, a listener on 127.0.0.1 whose connections
reach the host's loopback port through direct-tcpip channels, one thread per direction."""

from __future__ import annotations

import socket
import threading
from typing import Callable

import paramiko

from tasks.hosts.remote.channels import _close_quietly
from tasks.hosts.remote.errors import RemoteError
from tasks.hosts.remote.log import logger

TUNNEL_POLL_S = 0.5  # how often a tunnel's blocked reads look at stop()


class _Tunnel:
    """A listener on 127.0.0.1:0 whose connections are piped through direct-tcpip channels."""

    def __init__(self, name: str, transport: Callable[[], paramiko.Transport], connect_timeout_s: float,
                 remote_port: int):
        """`transport()`: the SSH connection's transport, reconnected when it dropped (`SSHExecutor._transport`)."""
        self.name, self._transport, self.remote_port = name, transport, remote_port
        self._timeout_s = connect_timeout_s
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.5)
        self.local_port = self._listener.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept_loop)
        logger().info("[%s] tunnel 127.0.0.1:%d -> %s:127.0.0.1:%d", name, self.local_port, name,
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
                return self._transport().open_channel(
                    "direct-tcpip", ("127.0.0.1", self.remote_port), peer, timeout=self._timeout_s)
            except (OSError, EOFError, paramiko.SSHException, RemoteError) as err:
                logger().warning("[%s] tunnel to port %d refused%s: %r", self.name, self.remote_port,
                                 "; trying again" if attempt == 1 else "", err)
        return None

    def _pipe(self, conn: socket.socket, channel: paramiko.Channel) -> None:
        """One thread per direction with blocking reads (never select() on the channel, see channels._pump).

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
