"""Shared fixtures for tests/tasks/hosts/remote: an executor of each kind, and an SSH executor.

tasks/remote/ runs against a real sshd on 127.0.0.1 (tests/sshd.py, the session `sshd` fixture)
and against this machine. Behaviour both executors must share runs parametrised over `local`
and `ssh` (the `executor` fixture).
"""

from __future__ import annotations

import pytest

from tasks.hosts.remote import LocalExecutor, connect


@pytest.fixture(params=["local", "ssh"])
def executor(request, sshd):
    ex = LocalExecutor() if request.param == "local" else connect(sshd.host_config())
    yield ex
    ex.close()


@pytest.fixture
def ssh(sshd):
    ex = connect(sshd.host_config())
    yield ex
    ex.close()
