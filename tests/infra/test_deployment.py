"""The experiment flow as users run it: a Prefect deployment picked up by a worker against a
real Prefect server, triggered like the UI's Custom run, logging to a real MLflow server."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from mlflow.tracking import MlflowClient


REPO = Path(__file__).resolve().parents[2]
CONFIG = """\
experiment: deployed
runs_root: {runs}
target:
  kind: tiny
data:
  num_samples: 8
tracking:
  uri: {mlflow}
  experiment_name: eagleops-deployed
"""


def wait_for_run(api: str, run_id: str, timeout_s: float = 240) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = httpx.get(f"{api}/flow_runs/{run_id}", timeout=10).json()
        if run["state"]["type"] in {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}:
            return run
        time.sleep(1)
    raise AssertionError(f"flow run {run_id} did not finish in {timeout_s}s")


@pytest.mark.slow
def test_ui_style_run_of_a_deployment_logs_to_the_mlflow_server(prefect_server, mlflow_server, server_env, tmp_path):
    api = prefect_server["api_url"]
    env = server_env(
        PREFECT_HOME=str(prefect_server["home"]),
        PREFECT_API_URL=api,
        PREFECT_WORKER_QUERY_SECONDS="1",
        EAGLEOPS_PROJECT_DIR=str(REPO),
    )
    log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen(["bash", str(REPO / "infra/prefect-worker.sh")], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deployment = _wait_for_deployment(api, "eagle3-experiment", "tiny", worker, tmp_path)
        nightly = _wait_for_deployment(api, "eagle3-experiment", "nightly-llama-3.1-8b", worker, tmp_path)
        assert nightly["schedules"][0]["schedule"]["cron"] == "0 2 * * *"
        assert "config_path" in deployment["parameter_openapi_schema"]["properties"]

        config = tmp_path / "deployed.yaml"
        config.write_text(CONFIG.format(runs=tmp_path / "runs", mlflow=mlflow_server))
        # What the UI's "Custom run" button posts.
        created = httpx.post(
            f"{api}/deployments/{deployment['id']}/create_flow_run",
            json={"state": {"type": "SCHEDULED", "message": "Run from the Prefect UI"},
                  "parameters": {"config_path": str(config), "stages": ["check_environment"]}},
            timeout=30,
        )
        assert created.status_code == 201, created.text
        run = wait_for_run(api, created.json()["id"])
        assert run["state"]["type"] == "COMPLETED", (tmp_path / "worker.log").read_text()[-3000:]
    finally:
        os.killpg(worker.pid, 15)
        worker.wait(timeout=30)
        log.close()

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("eagleops-deployed")
    parents = client.search_runs([experiment.experiment_id], "tags.`eagleops.kind` = 'experiment'")
    assert len(parents) == 1 and parents[0].data.tags["prefect.flow_run_id"] == run["id"]
    assert parents[0].info.artifact_uri.startswith("mlflow-artifacts:")  # served over HTTP, not a local path
    children = client.search_runs([experiment.experiment_id], f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'")
    env_child = next(c for c in children if c.info.run_name == "check_environment")
    assert [a.path for a in client.list_artifacts(env_child.info.run_id, "environment")] == ["environment/report.json"]


def _wait_for_deployment(api: str, flow: str, name: str, worker: subprocess.Popen, tmp_path) -> dict:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = httpx.get(f"{api}/deployments/name/{flow}/{name}", timeout=10)
        if found.status_code == 200:
            return found.json()
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
        time.sleep(1)
    raise AssertionError(f"deployment {flow}/{name} was not registered")
