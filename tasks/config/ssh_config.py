"""`hosts[].ssh_config`: an inventory host filled from OpenSSH's client config, as `ssh ADDRESS` would see it.

With `ssh_config: true` (~/.ssh/config) or a path, `address` is looked up as `ssh` looks up its argument
(Host / Match blocks, first value wins) and the fields the YAML leaves unset are filled from what it finds:
HostName -> address, User -> user, Port -> port, the first IdentityFile that exists -> key_file,
UserKnownHostsFile -> known_hosts, ProxyJump -> jump_host (one hop, itself looked up in the same file, as ssh
does). A field the YAML sets wins, as ssh's command line wins over its config. What eagleops cannot honour is
refused naming the option rather than ignored, since ignoring it would connect some other way than `ssh`
does: a ProxyCommand, a ProxyJump of several hops.

Read when the config is validated (on the machine that connects), so every later reader (the executor,
`hosts trust`, the recorded config) sees the address and user actually used.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import paramiko

DEFAULT_PATH = "~/.ssh/config"


class SshConfigProblem(str):
    """Why a host's ssh_config lookup failed, carried to the field's own validator so the error names its line."""


def ssh_config_path(setting: bool | str) -> Path:
    return Path(os.path.expanduser(DEFAULT_PATH if setting is True else str(setting)))


def fill_from_ssh_config(entry: dict[str, Any]) -> dict[str, Any]:
    """`entry` (one hosts[] mapping as written) with its unset fields taken from its ssh_config lookup."""
    setting = entry.get("ssh_config")
    if setting in (None, False) or not isinstance(entry.get("address"), str):
        return entry
    config = _read(ssh_config_path(setting))
    found = config.lookup(entry["address"])
    if "proxycommand" in found:
        raise ValueError(f"ssh_config: {entry['address']} has a ProxyCommand, which eagleops does not run; use "
                         "ProxyJump there or hosts[].jump_host")
    filled = dict(entry)
    filled["address"] = found.get("hostname", entry["address"])
    _fill(filled, "user", found.get("user"))
    _fill(filled, "port", int(found["port"]) if "port" in found else None)
    _fill(filled, "key_file", _first_existing(found.get("identityfile", [])))
    _fill(filled, "known_hosts", (found.get("userknownhostsfile") or "").split()[0] if
          found.get("userknownhostsfile") else None)
    _fill(filled, "jump_host", _jump_spec(config, found.get("proxyjump"), filled.get("user")))
    return filled


def _read(path: Path) -> paramiko.SSHConfig:
    try:
        return paramiko.SSHConfig.from_path(str(path))
    except FileNotFoundError:
        raise ValueError(f"ssh_config: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"ssh_config: cannot read {path}: {err}") from None
    except Exception as err:  # paramiko's parser raises ConfigParseError / bare Exception subclasses on bad lines
        raise ValueError(f"ssh_config: {path} is not an OpenSSH client config: {err}") from None


def _fill(entry: dict[str, Any], field: str, value: Any) -> None:
    if entry.get(field) is None and value is not None:
        entry[field] = value


def _first_existing(identity_files: list[str]) -> str | None:
    """The first IdentityFile on disk (ssh tries each in turn; the executor loads one key)."""
    for name in identity_files:
        path = os.path.expanduser(name)
        if os.path.isfile(path):
            return path
    return None


def _jump_spec(config: paramiko.SSHConfig, proxy_jump: str | None, user: str | None) -> str | None:
    """ProxyJump `[user@]host[:port]` as jump_host's `user@address:port`, the hop looked up in the same config."""
    if not proxy_jump or proxy_jump.lower() == "none":
        return None
    if "," in proxy_jump:
        raise ValueError(f"ssh_config: ProxyJump {proxy_jump} has several hops; eagleops follows one (name the "
                         "first hop as its own hosts[] entry with its jump_host)")
    spec = proxy_jump.removeprefix("ssh://")
    hop_user, _, rest = spec.rpartition("@")
    alias, _, port = rest.partition(":")
    hop = config.lookup(alias)
    hop_user = hop_user or hop.get("user") or user
    if not hop_user:
        raise ValueError(f"ssh_config: ProxyJump {proxy_jump} names no user and the config gives none for {alias}")
    return f"{hop_user}@{hop.get('hostname', alias)}:{port or hop.get('port', 22)}"
