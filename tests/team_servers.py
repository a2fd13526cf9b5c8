"""The team setup on 127.0.0.1, started once per test session through the infra/ scripts.

`team_servers`: a Prefect server (API + UI) and an MLflow server (artifact proxying), both on
the machine's PostgreSQL, each on a fresh database named with a random suffix and dropped at
the end. `deployed`: `eagleops deploy-flows` run against that Prefect server. `cpu_worker`:
infra/prefect-worker.sh cpu, polling every second. Everything runs in its own process group and
is stopped by group; tests skip (with the reason) where PostgreSQL is not reachable.
"""

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.helpers import stop_group

REPO = Path(__file__).resolve().parents[1]
PG = ["-h", "127.0.0.1", "-p", "5432", "-U", "postgres"]
NIGHTLY_FLOW = REPO / "flows" / "nightly.py"


@dataclass
class TeamServers:
    prefect_api: str
    prefect_ui: str
    mlflow: str
    env: dict[str, str]  # what the infra scripts and the CLI need to reach these servers
    state_dir: Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def script_env(**extra: str) -> dict[str, str]:
    """This process's environment minus any server URL of the test session, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "MLFLOW_TRACKING"))}
    env.update(extra)
    return env


def _postgres_ready() -> str | None:
    if not shutil.which("psql"):
        return "psql is not installed"
    probe = subprocess.run(["psql", *PG, "-d", "postgres", "-tAc", "SELECT 1"], capture_output=True, text=True, timeout=30)
    return None if probe.returncode == 0 else f"PostgreSQL on 127.0.0.1:5432 refused: {probe.stderr.strip()}"


def _drop_database(name: str) -> None:
    subprocess.run(["dropdb", *PG, "--if-exists", "--force", name], capture_output=True, timeout=60)


@pytest.fixture(scope="session")
def team_servers(tmp_path_factory):
    reason = _postgres_ready()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("team")
    suffix = secrets.token_hex(4)
    databases = {"EAGLEOPS_PREFECT_DB": f"eagleops_test_prefect_{suffix}", "EAGLEOPS_MLFLOW_DB": f"eagleops_test_mlflow_{suffix}"}
    env = script_env(
        EAGLEOPS_PROJECT_DIR=str(REPO), EAGLEOPS_VENV=str(Path(sys.executable).parent.parent),
        EAGLEOPS_STATE_DIR=str(root / "state"), PREFECT_HOME=str(root / "prefect-home"),
        EAGLEOPS_MLFLOW_ARTIFACTS=str(root / "mlflow-artifacts"), **databases,
    )
    prefect_port, mlflow_port = free_port(), free_port()
    # Both cold starts at once: about 15 s together instead of one after the other.
    starts = [subprocess.Popen(["bash", str(REPO / f"infra/{name}.sh"), "start", str(port)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for name, port in (("prefect-server", prefect_port), ("mlflow-server", mlflow_port))]
    try:
        for start in starts:
            output, _ = start.communicate(timeout=240)
            assert start.returncode == 0, output
        env["PREFECT_API_URL"] = f"http://127.0.0.1:{prefect_port}/api"
        yield TeamServers(env["PREFECT_API_URL"], f"http://127.0.0.1:{prefect_port}",
                          f"http://127.0.0.1:{mlflow_port}", env, root / "state")
    finally:
        pids = [int(f.read_text()) for f in (root / "state").glob("*-server.pid")]
        for pid in pids:  # both stop at once, then each is waited for (and escalated if needed)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)
        for pid in pids:
            stop_group(pid)
        for name in databases.values():
            _drop_database(name)


@pytest.fixture(scope="session")
def deployed(team_servers) -> dict:
    """`eagleops deploy-flows` (flows/nightly.py:nightly_retrain only once that module exists); its output."""
    names = [] if NIGHTLY_FLOW.is_file() else ["tiny", "environment-check", "data-train", "deploy-benchmark", "spec-sweep"]
    command = [sys.executable, "-m", "flows.cli", "deploy-flows", *[arg for n in names for arg in ("--only", n)]]
    # The credentials infra/prefect.yaml's gpu deployments take from Secret blocks: saved from these (no SSH
    # key passphrase: an empty value, as a team without one exports it)
    credentials = {"HF_TOKEN": f"hf_test_{uuid.uuid4().hex}", "EAGLEOPS_SSH_KEY_PASSPHRASE": ""}
    done = subprocess.run(command, cwd=REPO, env={**team_servers.env, **credentials}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return {"output": done.stdout, "nightly_deployed": not names, "credentials": credentials}


@pytest.fixture(scope="session")
def cpu_worker(team_servers, deployed, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("worker") / "worker.log"
    env = {**team_servers.env, "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "1"}
    with open(log_path, "w") as log:
        worker = subprocess.Popen(["bash", str(REPO / "infra/prefect-worker.sh"), "cpu"], env=env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield log_path
    finally:
        stop_group(worker.pid, grace_s=5, leader=worker)  # the first signal only asks; the second stops it


def wait_for_run(api: str, run_id: str, worker_log: Path, timeout_s: float = 300) -> dict:
    """Poll a flow run until it reaches a final state; the worker log's tail on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = httpx.get(f"{api}/flow_runs/{run_id}", timeout=10).json()
        if run["state"]["type"] in {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}:
            return run
        time.sleep(1)
    raise AssertionError(f"flow run {run_id} did not finish in {timeout_s}s; worker log:\n{worker_log.read_text()[-3000:]}")
