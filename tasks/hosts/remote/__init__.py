"""Run commands on a host and move files to and from it: over SSH (paramiko) or on this machine.

Owns the one `Executor` interface that deploy, benchmark and training stages use for `host: local`
and for inventory hosts: argv commands, detached servers in their own process group, uploads
that are fast, resumable, verified and atomic, downloads that are verified and atomic, and
tunnels to a host's loopback ports. `connect()` gives the executor for a host.

Modules, each importing only those listed before it; each docstring names the risk it guards:
- log: the `eagleops.remote` logger (Prefect's run logger inside a run).
- errors: `RemoteError` and its subclasses.
- commands: argv as one quoted shell line, secret env values masked, output streams, the helper
  shell scripts.
- transfer_host: the host's half of transfers, sent to the host's python as its source (standard
  library only, imports nothing from this project).
- transfers: uploads and downloads hashed on both sides while they stream, verified and atomic (the
  executor base's half for files).
- warm_start: this machine's `python -m eagle3.serve` (and data / stream jobs) forked from a fork server that
  has imported them (eagle3.forkserver), where that is the same as a cold start.
- executor: the `Executor` protocol, the base both executors share, `LocalExecutor`.
- channels: paramiko channel primitives (never select() on a channel).
- host_keys: known_hosts files and names, fingerprints, refusing unknown or changed keys.
- tunnel: the local end of `SSHExecutor.forward` (it names SSHExecutor for type checkers only).
- ssh: `SSHExecutor` (connecting, jump hosts, key files, exec channels, `cat` streams).
- trust: reading a host's key and recording it in known_hosts (`eagleops hosts trust`).
"""

from __future__ import annotations

from typing import Sequence

from tasks.config.schema import HostConfig
from tasks.hosts.remote.commands import (
    CommandResult,
    describe_command,
    is_secret_env_key,
    quote_path,
    shell_command,
)
from tasks.hosts.remote.errors import (
    CommandFailed,
    CommandTimeout,
    ConnectError,
    ConnectionLost,
    DownloadVerifyError,
    HostKeyError,
    RemoteError,
    UploadVerifyError,
    tail,
)
from tasks.hosts.remote.executor import Executor, LocalExecutor
from tasks.hosts.remote.host_keys import fingerprint, host_key_name, known_hosts_path
from tasks.hosts.remote.log import logger
from tasks.hosts.remote.ssh import SSHExecutor, resolve_jump_host
from tasks.hosts.remote.transfers import (
    ByteProgress,
    DownloadResult,
    Progress,
    UploadResult,
    sha256_file,
)
from tasks.hosts.remote.trust import host_key_fingerprint, trust_host

__all__ = [
    "ByteProgress", "CommandFailed", "CommandResult", "CommandTimeout", "ConnectError", "ConnectionLost",
    "DownloadResult", "DownloadVerifyError", "Executor", "HostKeyError", "LocalExecutor", "Progress", "RemoteError",
    "SSHExecutor", "UploadResult", "UploadVerifyError", "connect", "describe_command", "expand_remote_path",
    "fingerprint", "host_key_fingerprint", "host_key_name", "is_secret_env_key", "known_hosts_path", "logger",
    "quote_path", "resolve_jump_host", "sha256_file", "shell_command", "tail", "trust_host",
]


def connect(host: HostConfig | str | None, inventory: Sequence[HostConfig] = (), *,
            retry_backoff_s: float = 1.0) -> LocalExecutor | SSHExecutor:
    """An executor for `host`: None or "local" -> this machine, else SSH (raises ConnectError, HostKeyError)."""
    if host is None or host == "local":
        return LocalExecutor()
    if isinstance(host, str):
        names = [h.name for h in inventory]
        if host not in names:
            raise ValueError(f"host '{host}' is neither 'local' nor one of hosts[].name {names}")
        host = next(h for h in inventory if h.name == host)
    return SSHExecutor(host, inventory, retry_backoff_s=retry_backoff_s)


def expand_remote_path(executor: Executor, path: str) -> str:
    """`path` with a leading `~` resolved to the home directory on the executor's host."""
    return executor.expand_path(path)
