"""Host keys: a host's known_hosts file and name, OpenSSH fingerprints, and the refusal of unknown or changed keys.

Risk, and what guards it:
- An unverified host key lets whoever sits in the path read checkpoints and run commands.
  Unknown or changed keys are refused (a `RejectPolicy`) with the fingerprint and the command
  that trusts it; nothing is ever added to known_hosts except by `trust_host` (trust.py).
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

import paramiko

from tasks.config.schema import HostConfig
from tasks.hosts.remote.errors import HostKeyError


def known_hosts_path(host: HostConfig) -> Path:
    return Path(os.path.expanduser(host.known_hosts or "~/.ssh/known_hosts"))


def host_key_name(host: HostConfig) -> str:
    """The name known_hosts files use: `addr`, or `[addr]:port` off port 22."""
    return host.address if host.port == 22 else f"[{host.address}]:{host.port}"


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's `SHA256:...` fingerprint, as `ssh-keygen -lf` prints it."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


class _RejectUnknownHost(paramiko.RejectPolicy):
    """RejectPolicy whose error shows the fingerprint, the known_hosts file and the trust command."""

    def __init__(self, host: HostConfig):
        self.host = host

    def missing_host_key(self, client, hostname, key):
        raise HostKeyError(
            f"host key of {self.host.name} ({hostname}) is not known: it offers {key.get_name()} {fingerprint(key)}, "
            f"which is not in known_hosts file {known_hosts_path(self.host)}. If that fingerprint is the host's, "
            f"record it with: eagleops hosts trust {self.host.name}"
        )


def _changed_key_error(host: HostConfig, err: paramiko.BadHostKeyException) -> HostKeyError:
    return HostKeyError(
        f"host key of {host.name} ({host_key_name(host)}) CHANGED: it offers {err.key.get_name()} "
        f"{fingerprint(err.key)} but known_hosts file {known_hosts_path(host)} records "
        f"{err.expected_key.get_name()} {fingerprint(err.expected_key)}. This can be a man-in-the-middle; if the "
        f"host was reinstalled, check the new fingerprint and run: eagleops hosts trust {host.name}"
    )


def _known_hosts_line_matches(line: str, name: str) -> bool:
    if not line.strip() or line.lstrip().startswith("#"):
        return False
    fields = line.split()
    for pattern in fields[0].split(","):
        if pattern.startswith("|1|"):
            if paramiko.HostKeys.hash_host(name, pattern) == pattern:
                return True
        elif pattern == name:
            return True
    return False
