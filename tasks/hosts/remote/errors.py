"""The errors of tasks.hosts.remote: `RemoteError` and its subclasses, and the output tails they carry.

Every failure raised by an executor is a `RemoteError`; `CommandFailed` carries argv, exit status
and the last TAIL_LINES lines of stdout and stderr.
"""

from __future__ import annotations

TAIL_LINES = 20


class RemoteError(RuntimeError):
    """Base of every error raised here."""


class HostKeyError(RemoteError):
    """The host's key is not in known_hosts, or differs from the one recorded there."""

    one_line_in_logs = True  # a host that refuses: expected, its message says it all (tasks.log)


class ConnectError(RemoteError):
    """No SSH connection after the bounded retries (or authentication was refused)."""

    one_line_in_logs = True  # a host that refuses: expected, its message says it all (tasks.log)


class ConnectionLost(RemoteError):
    """The connection dropped during an operation; the executor's next call reconnects."""


class CommandTimeout(RemoteError):
    """A command ran past its timeout and was killed."""


class UploadVerifyError(RemoteError):
    """The uploaded bytes do not hash to the local file's sha256."""


class DownloadVerifyError(RemoteError):
    """The downloaded bytes do not hash to the remote file's sha256."""


def tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


class CommandFailed(RemoteError):
    """A command exited non-zero; carries argv, exit status and the tails of its output."""

    def __init__(self, host: str, shown: str, argv: list[str], exit_status: int, stdout: str, stderr: str):
        self.host, self.argv, self.exit_status = host, argv, exit_status
        self.stdout_tail, self.stderr_tail = tail(stdout), tail(stderr)
        message = f"[{host}] exit status {exit_status}: {shown}"
        if self.stderr_tail:
            message += f"\nstderr (last {TAIL_LINES} lines):\n{self.stderr_tail}"
        if self.stdout_tail:
            message += f"\nstdout (last {TAIL_LINES} lines):\n{self.stdout_tail}"
        super().__init__(message)
