"""paramiko channel primitives shared by SSH commands, transfers, tunnels and host-key reads.

Owns opening a direct-tcpip channel, closing a channel whose connection may be gone, and
pumping a command's stdout/stderr until it ends.

Risk, and what guards it:
- `Channel.fileno()` is a pipe paramiko's transport thread writes to while another thread may
  be closing it; a write that loses the race drops the whole SSH connection (and every tunnel
  and command on it). Nothing in tasks.hosts.remote select()s on a channel: `_pump` polls with a
  short backoff, tunnels and downloads use blocking reads with timeouts.
"""

from __future__ import annotations

import contextlib
import time

import paramiko

from tasks.hosts.remote.commands import _OutputStream


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
