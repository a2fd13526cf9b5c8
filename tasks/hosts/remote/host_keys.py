"""Host keys: a host's known_hosts file and name, OpenSSH fingerprints, and the refusal of unknown or changed keys.

Risk, and what guards it:
- An unverified host key lets whoever sits in the path read checkpoints and run commands.
  Unknown or changed keys are refused (a `RejectPolicy`) with the fingerprint and the command
  that trusts it; nothing is ever added to known_hosts except by `trust_host` (trust.py).
- The system's known hosts (the user's ~/.ssh/known_hosts and /etc/ssh/ssh_known_hosts, as ssh
  reads them) are read beside `hosts[].known_hosts`, which is checked first: a key there decides,
  a key only in a system file is accepted, one that differs there is refused as changed.
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
        for path in system_known_hosts_paths(self.host):
            recorded = _recorded_key(path, hostname, key.get_name())
            if recorded is not None and recorded == key:
                return  # known to the system, as ssh would accept it
            if recorded is not None:
                raise HostKeyError(
                    f"host key of {self.host.name} ({hostname}) CHANGED: it offers {key.get_name()} "
                    f"{fingerprint(key)} but known_hosts file {path} records {fingerprint(recorded)}. This can be a "
                    f"man-in-the-middle; if the host was reinstalled, check the new fingerprint and run: eagleops "
                    f"hosts trust {self.host.name}")
        checked = [str(known_hosts_path(self.host)), *map(str, system_known_hosts_paths(self.host))]
        raise HostKeyError(
            f"host key of {self.host.name} ({hostname}) is not known: it offers {key.get_name()} {fingerprint(key)}, "
            f"which is not in known_hosts file(s) {', '.join(checked)}. If that fingerprint is the host's, "
            f"record it with: eagleops hosts trust {self.host.name}"
        )


SYSTEM_KNOWN_HOSTS = ("~/.ssh/known_hosts", "/etc/ssh/ssh_known_hosts")


def system_known_hosts_paths(host: HostConfig) -> list[Path]:
    """The system's known_hosts files that exist, other than the host's own file."""
    own = known_hosts_path(host).resolve()
    paths = [Path(os.path.expanduser(p)) for p in SYSTEM_KNOWN_HOSTS]
    return [p for p in paths if p.is_file() and p.resolve() != own]


def _recorded_key(path: Path, hostname: str, key_type: str) -> paramiko.PKey | None:
    try:
        keys = paramiko.HostKeys(str(path))
    except (OSError, paramiko.SSHException):  # unreadable: ssh skips it too
        return None
    return (keys.lookup(hostname) or {}).get(key_type)


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
