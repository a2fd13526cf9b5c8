"""`hosts[].ssh_config` and the system's known hosts, against the local sshd: a host written as an OpenSSH
alias connects as `ssh ALIAS` would, YAML fields win, ProxyJump becomes the jump host, what eagleops cannot
follow is refused naming the option; a host key known only to ~/.ssh/known_hosts is accepted, one that differs
there is refused as changed, one known nowhere is refused naming every file read."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tasks.config.schema import HostConfig
from tasks.hosts.remote import connect
from tasks.hosts.remote.errors import HostKeyError
REPO = Path(__file__).resolve().parents[4]


def ssh_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ssh_config"
    path.write_text(text)
    return path


def alias_block(sshd, alias: str = "gpu-box", **extra: str) -> str:
    lines = [f"Host {alias}", "  HostName 127.0.0.1", f"  Port {sshd.port}", f"  User {sshd.user}",
             f"  IdentityFile {sshd.user_key}", f"  UserKnownHostsFile {sshd.known_hosts}"]
    lines += [f"  {key} {value}" for key, value in extra.items()]
    return "\n".join(lines) + "\n"


def test_a_host_written_as_an_ssh_alias_connects_as_ssh_would(sshd, tmp_path):
    # the identity ssh would not find first: a missing file, then the real key
    config = ssh_config(tmp_path, alias_block(sshd).replace(
        "  IdentityFile", f"  IdentityFile {tmp_path / 'no_such_key'}\n  IdentityFile"))
    host = HostConfig(name="gpu", address="gpu-box", ssh_config=str(config))
    assert (host.address, host.port, host.user) == ("127.0.0.1", sshd.port, sshd.user)
    assert (host.key_file, host.known_hosts) == (str(sshd.user_key), str(sshd.known_hosts))
    with connect(host) as ex:
        assert ex.run(["echo", "via ssh_config"]).stdout == "via ssh_config\n"


def test_fields_the_yaml_sets_win_over_ssh_config(sshd, tmp_path):
    config = ssh_config(tmp_path, alias_block(sshd).replace(f"Port {sshd.port}", "Port 1").replace(
        f"User {sshd.user}", "User nobody-here"))
    host = HostConfig(name="gpu", address="gpu-box", port=sshd.port, user=sshd.user, ssh_config=str(config))
    assert (host.port, host.user) == (sshd.port, sshd.user)
    with connect(host) as ex:
        assert ex.run(["echo", "ok"]).stdout == "ok\n"


def test_proxy_jump_becomes_the_jump_host_looked_up_in_the_same_config(sshd, tmp_path):
    bastion = f"Host bastion\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User {sshd.user}\n"
    config = ssh_config(tmp_path, alias_block(sshd, ProxyJump="bastion") + bastion)
    host = HostConfig(name="gpu", address="gpu-box", ssh_config=str(config))
    assert host.jump_host == f"{sshd.user}@127.0.0.1:{sshd.port}"
    with connect(host) as ex:
        assert ex._jump is not None and ex.run(["echo", "hop"]).stdout == "hop\n"


CONFIG_YAML = """\
experiment: sshcfg
target: {{kind: tiny}}
hosts:
  - name: gpu
    address: gpu-box
    ssh_config: {path}
deploy: {{host: gpu}}
"""


@pytest.mark.parametrize(("extra", "expected"), [
    ({"ProxyCommand": "nc %h %p"}, "ProxyCommand, which eagleops does not run"),
    ({"ProxyJump": "a@one,b@two"}, "ProxyJump a@one,b@two has several hops"),
    (None, "does not exist"),
])
def test_what_eagleops_cannot_follow_is_one_line_naming_the_host(sshd, tmp_path, extra, expected):
    path = ssh_config(tmp_path, alias_block(sshd, **extra)) if extra else tmp_path / "missing_config"
    yaml_file = tmp_path / "exp.yaml"
    yaml_file.write_text(CONFIG_YAML.format(path=path))
    done = subprocess.run([sys.executable, "-m", "flows.cli", "validate", str(yaml_file)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    out = (done.stdout + done.stderr).strip()
    assert done.returncode == 2 and "Traceback" not in out, out
    line = next(line for line in out.splitlines() if expected in line)
    assert f"{yaml_file}:6: hosts.0.ssh_config: " in line, out  # the line that sets ssh_config


# ------------------------------------------------------------------ the system's known hosts


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A HOME of this test's own: its ~/.ssh/known_hosts is the system file ssh would read."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home" / ".ssh").mkdir(parents=True)
    return tmp_path / "home"


def other_ed25519_key(tmp_path: Path) -> str:
    key = tmp_path / "other_host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    return " ".join(key.with_suffix(".pub").read_text().split()[:2])


def test_a_host_key_known_only_to_the_system_file_is_accepted(sshd, tmp_path, home):
    own = tmp_path / "own_known_hosts"
    own.write_text("")
    (home / ".ssh" / "known_hosts").write_text(sshd.known_hosts.read_text())
    with connect(sshd.host_config(known_hosts=str(own))) as ex:
        assert ex.run(["echo", "ok"]).stdout == "ok\n"
    assert own.read_text() == ""  # nothing written: the system file vouched for it


def test_a_host_key_that_differs_in_the_system_file_is_refused_as_changed(sshd, tmp_path, home):
    own = tmp_path / "own_known_hosts"
    own.write_text("")
    system = home / ".ssh" / "known_hosts"
    system.write_text(f"[127.0.0.1]:{sshd.port} {other_ed25519_key(tmp_path)}\n")
    with pytest.raises(HostKeyError, match=f"CHANGED.*known_hosts file {system}"):
        connect(sshd.host_config(known_hosts=str(own), connect_retries=0))


def test_the_hosts_own_file_decides_before_the_system_file(sshd, tmp_path, home):
    (home / ".ssh" / "known_hosts").write_text(f"[127.0.0.1]:{sshd.port} {other_ed25519_key(tmp_path)}\n")
    with connect(sshd.host_config()) as ex:  # its own known_hosts holds the right key
        assert ex.run(["echo", "ok"]).stdout == "ok\n"


def test_a_host_key_known_nowhere_names_every_file_read(sshd, tmp_path, home):
    own = tmp_path / "own_known_hosts"
    own.write_text("")
    (home / ".ssh" / "known_hosts").write_text("")
    with pytest.raises(HostKeyError, match=f"is not known.*{own}, {home / '.ssh' / 'known_hosts'}"):
        connect(sshd.host_config(known_hosts=str(own), connect_retries=0))
