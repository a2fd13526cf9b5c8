"""tasks/hosts/remote/host_keys.py and trust.py: unknown and changed host keys are refused with their
fingerprints, and `trust_host` records a key; the keys are real OpenSSH keys."""

from __future__ import annotations

import logging
import subprocess

import pytest

from tasks.hosts.remote import HostKeyError, connect, host_key_fingerprint, trust_host

# --------------------------------------------------------------------------- host keys


def _fingerprint_from_ssh_keygen(pub_path) -> str:
    out = subprocess.run(["ssh-keygen", "-lf", str(pub_path)], capture_output=True, text=True, check=True).stdout
    return out.split()[1]


def test_unknown_host_key_is_rejected_with_its_fingerprint(sshd, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="eagleops.remote")
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(HostKeyError) as caught:
        connect(sshd.host_config(known_hosts=str(empty)))
    message = str(caught.value)
    assert _fingerprint_from_ssh_keygen(f"{sshd.host_key}.pub") in message
    assert str(empty) in message and "eagleops hosts trust testhost" in message
    assert "retry" not in caplog.text  # a host-key refusal is final


def test_changed_host_key_is_rejected_and_trust_host_replaces_it(sshd, tmp_path):
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True, capture_output=True)
    known = tmp_path / "known_hosts"
    other_pub = (tmp_path / "other_key.pub").read_text().split()
    known.write_text(f"# keep me\n[127.0.0.1]:{sshd.port} {other_pub[0]} {other_pub[1]}\nelsewhere {other_pub[0]} "
                     f"{other_pub[1]}\n")
    host = sshd.host_config(known_hosts=str(known))
    with pytest.raises(HostKeyError, match="CHANGED") as caught:
        connect(host)
    assert _fingerprint_from_ssh_keygen(f"{sshd.host_key}.pub") in str(caught.value)
    assert _fingerprint_from_ssh_keygen(tmp_path / "other_key.pub") in str(caught.value)

    assert host_key_fingerprint(host) == ("ssh-ed25519", _fingerprint_from_ssh_keygen(f"{sshd.host_key}.pub"))
    message = trust_host(host)
    assert _fingerprint_from_ssh_keygen(f"{sshd.host_key}.pub") in message
    lines = known.read_text().splitlines()
    assert lines[0] == "# keep me" and lines[1].startswith("elsewhere ") and len(lines) == 3
    with connect(host) as ex:
        assert ex.run(["echo", "trusted"]).stdout == "trusted\n"


def test_trust_host_records_an_unknown_host(sshd, tmp_path):
    known = tmp_path / "new" / "known_hosts"
    host = sshd.host_config(known_hosts=str(known))
    trust_host(host)
    with connect(host) as ex:
        assert ex.run(["true"]).exit_status == 0
