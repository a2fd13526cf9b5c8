"""Trusting a host: the key it presents now, read before any authentication, and recording it in known_hosts.

`host_key_fingerprint` shows the key for a person to compare; `trust_host` (`eagleops hosts
trust NAME`, after that person confirmed it) is the only code that writes a known_hosts file.
"""

from __future__ import annotations

import socket
from typing import Sequence

import paramiko

from tasks.config.schema import HostConfig
from tasks.hosts.remote.channels import _open_direct_tcpip
from tasks.hosts.remote.errors import ConnectError
from tasks.hosts.remote.host_keys import (
    _known_hosts_line_matches,
    fingerprint,
    host_key_name,
    known_hosts_path,
)
from tasks.hosts.remote.log import logger
from tasks.hosts.remote.ssh import SSHExecutor, resolve_jump_host


def _fetch_host_key(host: HostConfig, inventory: Sequence[HostConfig]) -> paramiko.PKey:
    """The key the host presents, read during key exchange, before any authentication."""
    jump_config = resolve_jump_host(host, inventory)
    jump = SSHExecutor(jump_config, inventory) if jump_config else None
    try:
        if jump:
            sock = _open_direct_tcpip(jump._transport(), host.address, host.port, host.connect_timeout_s)
        else:
            sock = socket.create_connection((host.address, host.port), timeout=host.connect_timeout_s)
        transport = paramiko.Transport(sock)
        try:
            transport.start_client(timeout=host.connect_timeout_s)
            return transport.get_remote_server_key()
        finally:
            transport.close()
    except (OSError, EOFError, paramiko.SSHException) as err:
        raise ConnectError(f"[{host.name}] could not read the host key of {host_key_name(host)}: {err}") from err
    finally:
        if jump:
            jump.close()


def host_key_fingerprint(host: HostConfig, inventory: Sequence[HostConfig] = ()) -> tuple[str, str]:
    """(key type, "SHA256:...") of the key `host` presents now, for a person to compare."""
    key = _fetch_host_key(host, inventory)
    return key.get_name(), fingerprint(key)


def trust_host(host: HostConfig, inventory: Sequence[HostConfig] = ()) -> str:
    """Record the key `host` presents now in its known_hosts file, replacing older entries for it.

    Only for a person who has checked the fingerprint (`eagleops hosts trust NAME`); returns
    a one-line description of what was recorded.
    """
    key = _fetch_host_key(host, inventory)
    path, name = known_hosts_path(host), host_key_name(host)
    kept = [line for line in (path.read_text().splitlines() if path.exists() else [])
            if not _known_hosts_line_matches(line, name)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([*kept, f"{name} {key.get_name()} {key.get_base64()}"]) + "\n")
    message = f"recorded {key.get_name()} {fingerprint(key)} for {name} ({host.name}) in {path}"
    logger().info(message)
    return message
