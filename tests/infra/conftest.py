"""Real servers on 127.0.0.1, each started once per test session through the infra/ scripts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def script_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "MLFLOW_TRACKING"))}
    env.update(extra)
    return env


def stop(pid_file: Path) -> None:
    if not pid_file.is_file():
        return
    pid = int(pid_file.read_text())
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def server_env():
    """Environment for infra scripts: this process's, minus any API/tracking URI of the test session."""
    return script_env


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    store = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    env = script_env(MLFLOW_STORE_DIR=str(store), EAGLEOPS_PROJECT_DIR=str(REPO))
    subprocess.run(["bash", str(REPO / "infra/mlflow-server.sh"), str(port)], env=env, check=True, timeout=180)
    yield f"http://127.0.0.1:{port}"
    stop(store / "server.pid")


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    env = script_env(PREFECT_HOME=str(home), EAGLEOPS_PROJECT_DIR=str(REPO))
    subprocess.run(["bash", str(REPO / "infra/prefect-server.sh"), str(port)], env=env, check=True, timeout=240)
    yield {"api_url": f"http://127.0.0.1:{port}/api", "home": home}
    stop(home / "eagleops-server.pid")
