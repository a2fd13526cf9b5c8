"""`eagleops hosts trust NAME`: shows the key the host presents, records it only after confirmation."""

from __future__ import annotations

from typer.testing import CliRunner

from flows.cli import app
from tasks.hosts.remote import connect


def write_config(tmp_path, sshd, known_hosts) -> str:
    host = sshd.host_config()
    config = tmp_path / "hosts.yaml"
    config.write_text(f"""\
experiment: hosts
hosts:
  - {{name: gpu-1, address: 127.0.0.1, port: {host.port}, user: {host.user}, key_file: {host.key_file},
      known_hosts: {known_hosts}}}
""")
    return str(config)


def test_trust_shows_the_fingerprint_and_records_only_after_yes(sshd, tmp_path):
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("")
    config = write_config(tmp_path, sshd, known_hosts)

    refused = CliRunner().invoke(app, ["hosts", "trust", "gpu-1", "--config", config], input="n\n")
    assert refused.exit_code == 2 and "SHA256:" in refused.output
    assert known_hosts.read_text() == ""

    trusted = CliRunner().invoke(app, ["hosts", "trust", "gpu-1", "--config", config], input="y\n")
    assert trusted.exit_code == 0, trusted.output
    fingerprint = next(w for w in refused.output.split() if w.startswith("SHA256:"))
    assert fingerprint in trusted.output and known_hosts.read_text().count("\n") == 1
    with connect(sshd.host_config(known_hosts=str(known_hosts))) as host:
        assert host.run(["echo", "trusted"]).stdout == "trusted\n"


def test_trust_names_an_unknown_host(sshd, tmp_path):
    config = write_config(tmp_path, sshd, tmp_path / "known_hosts")
    result = CliRunner().invoke(app, ["hosts", "trust", "gpu-9", "--config", config])
    assert result.exit_code == 2 and "no hosts[] entry named 'gpu-9'" in result.output
