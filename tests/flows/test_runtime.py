"""The run's temporary Prefect server (flows/runtime.py) when it cannot start: the error carries its log."""

from __future__ import annotations

import sys

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

import flows.runtime as runtime


def test_a_server_that_exits_at_start_is_reported_with_its_log_and_leaves_no_file(monkeypatch, tmp_path):
    monkeypatch.setattr(runtime, "_server_command", lambda port: [
        sys.executable, "-c", "import sys; print('starting'); print(f'port {sys.argv[1]} is taken'); sys.exit(3)",
        str(port)])
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(runtime.tempfile, "tempdir", None)  # re-read TMPDIR
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        with runtime.temporary_server() as server, pytest.raises(RuntimeError) as failed:
            assert list(tmp_path.iterdir()) == []  # the log has no name to leave behind
            with runtime.prefect_api(server):
                pass
    assert "the temporary Prefect server exited with 3 before it was ready" in str(failed.value)
    port = server.url.removeprefix("http://127.0.0.1:").removesuffix("/api")
    assert str(failed.value).endswith(f"starting\nport {port} is taken\n")
    assert server.proc.poll() == 3 and server.log.closed
