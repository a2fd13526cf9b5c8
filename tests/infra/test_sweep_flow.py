"""The whole sweep with one click (flows/sweep.py) on the team setup (tests/team_servers.py): a finished run's
export served at each grid point of a two-point spec sweep, each a child run of a grid-point deployment started
by the sweep flow through the real cpu worker, one after another (they share the run folder), then one
comparison artifact whose figures are the grid points' own MLflow runs'."""

import json
import os
import subprocess
import sys
from datetime import datetime

import httpx
import pytest
from mlflow.tracking import MlflowClient

from tests.helpers import TEST_TARGET_YAML, free_port
from tests.team_servers import REPO, wait_for_run

pytestmark = pytest.mark.slow

BASE = """\
experiment: sweeptest
runs_root: {runs}
{target}data:
  num_samples: 12
  max_length: 256
  validation_fraction: 0.25
  regenerate: {{max_new_tokens: 16}}
  draft_vocab_size: 64
train: {{ttt_steps: 3, max_steps: 4, batch_size: 4, lr: 0.001, eval_every: 1000, checkpoint_every: 1000}}
export: {{formats: [sglang], dtype: float32}}
deploy:
  server: reference
  port: {port}
  speculative: {{num_steps: 3, eagle_topk: 1, num_draft_tokens: 4}}
  startup_timeout_s: 240
bench: {{prompts: {prompts}, num_prompts: 2, max_new_tokens: 8, warmup_runs: 1, timed_runs: 1}}
tracking: {{uri: {mlflow}}}
"""
SWEEP = """\
sweep:
  base: base.yaml
  name: spec
  grid:
    - {deploy.speculative: {num_steps: 2, eagle_topk: 1, num_draft_tokens: 3}}
    - {deploy.speculative: {num_steps: 3, eagle_topk: 1, num_draft_tokens: 4}}
"""
CHILD = "sweep-grid-point-test"
SERVE_STAGES = ["deploy_server", "run_benchmark"]


def seconds(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def test_one_click_runs_every_grid_point_as_a_child_and_compares_them(team_servers, deployed, cpu_worker, tmp_path):
    api = team_servers.prefect_api
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Write a function that adds two numbers.",
                                                                          "What does a for loop do?")))
    (tmp_path / "base.yaml").write_text(BASE.format(runs=tmp_path / "runs", target=TEST_TARGET_YAML, port=free_port(),
                                                    prompts=prompts, mlflow=team_servers.mlflow))
    (tmp_path / "sweep.yaml").write_text(SWEEP)
    # the finished run every grid point serves: data, training and export once
    env = {k: v for k, v in team_servers.env.items() if k != "PREFECT_API_URL"}
    trained = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(tmp_path / "base.yaml"), "--stages",
                              "generate_data,train_draft,export_checkpoint"], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=600)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    run_dir = next((tmp_path / "runs" / "sweeptest").iterdir())
    # a grid-point deployment as infra/prefect.yaml's spec-sweep, on the cpu pool this test's worker polls
    real = httpx.get(f"{api}/deployments/name/eagle3-experiment/spec-sweep", timeout=10).json()
    created = httpx.post(f"{api}/deployments/", timeout=10, json={
        "name": CHILD, "flow_id": real["flow_id"], "entrypoint": real["entrypoint"], "pull_steps": real["pull_steps"],
        "parameter_openapi_schema": real["parameter_openapi_schema"], "enforce_parameter_schema": True,
        "parameters": {}, "work_pool_name": "cpu", "work_queue_name": "default"})
    assert created.status_code in (200, 201), created.text
    # one click: a run of the registered `sweep` deployment (infra/prefect.yaml), run by the cpu worker
    sweep = httpx.get(f"{api}/deployments/name/eagle3-sweep/sweep", timeout=10).json()
    clicked = httpx.post(f"{api}/deployments/{sweep['id']}/create_flow_run", timeout=10, json={"parameters": {
        "config_path": str(tmp_path / "sweep.yaml"), "run_dir": str(run_dir), "stages": SERVE_STAGES,
        "deployment": f"eagle3-experiment/{CHILD}"}}).json()
    ended = wait_for_run(api, clicked["id"], cpu_worker, timeout_s=600)
    assert ended["state"]["type"] == "COMPLETED", (ended["state"], cpu_worker.read_text()[-3000:])
    children = httpx.post(f"{api}/flow_runs/filter", timeout=10, json={
        "deployments": {"id": {"any_": [created.json()["id"]]}}, "sort": "START_TIME_ASC"}).json()
    assert [c["parameters"]["variant"] for c in children] == [0, 1], children
    assert all(c["state"]["type"] == "COMPLETED" and c["parameters"]["run_dir"] == str(run_dir) for c in children)
    # subflows of the sweep's flow run (listed under it in the UI), one at a time since they share the run folder
    assert all(httpx.get(f"{api}/task_runs/{c['parent_task_run_id']}", timeout=10).json()["flow_run_id"]
               == clicked["id"] for c in children)
    assert seconds(children[1]["start_time"]) >= seconds(children[0]["end_time"])
    artifact = httpx.post(f"{api}/artifacts/filter", timeout=10, json={
        "artifacts": {"key": {"any_": ["sweeptest-sweep"]}, "flow_run_id": {"any_": [clicked["id"]]}}}).json()
    assert len(artifact) == 1
    table = artifact[0]["data"]
    # the comparison's figures are each grid point's MLflow experiment run's, read here directly
    client = MlflowClient(team_servers.mlflow)
    experiment = client.get_experiment_by_name("sweeptest").experiment_id
    for setting, child in zip(("2/1/3", "3/1/4"), children):
        found = [run for run in client.search_runs([experiment], f"tags.`prefect.flow_run_id` = '{child['id']}'")
                 if "mlflow.parentRunId" not in run.data.tags]  # the experiment run, not a stage's
        assert len(found) == 1
        tok_s = found[0].data.metrics["run_benchmark.best_tok_s"]
        row = next(line for line in table.splitlines() if f"| {setting} | Completed | " in line)
        assert f"{tok_s:.1f}" in row and found[0].info.run_id[:8] in row, (row, tok_s)
    assert "Best: " in table
