"""The experiment flow end to end on the environment stage, under a real (harness) Prefect API
and a real local MLflow store, checked through MlflowClient; resume; secrets; failure."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from flows.cli import app
from flows.experiment import eagle3_experiment
from tasks.runner.stages import StageFailed

SECRET = "sk-eagleops-test-5e3c7a91d2"
CONFIG = """\
experiment: {name}
runs_root: {runs}
target:
  kind: tiny
data:
  num_samples: 8
  regenerate:
    backend: http
    endpoint: http://127.0.0.1:9/v1
    api_key: ${{EAGLEOPS_TEST_API_KEY}}
train:
  ttt_steps: {ttt}
hosts:
  - name: gpu-1
    address: 127.0.0.1
    user: tester
    key_passphrase: ${{EAGLEOPS_TEST_API_KEY}}
"""


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


def write_config(folder: Path, name: str, runs_root: Path, ttt: int = 7) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(CONFIG.format(name=name, runs=runs_root, ttt=ttt))
    return path


def mlflow_client(runs_root: Path) -> MlflowClient:
    return MlflowClient(f"sqlite:///{runs_root / 'mlflow.db'}")


def children(client: MlflowClient, parent_id: str) -> dict[str, object]:
    parent = client.get_run(parent_id)
    runs = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    return {r.info.run_name: r for r in runs}


@pytest.fixture(scope="module")
def first_run(prefect_harness, runs_root, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("EAGLEOPS_TEST_API_KEY", SECRET)
    config = write_config(tmp_path_factory.mktemp("cfg"), "envflow", runs_root)
    result = eagle3_experiment(str(config), stages=["check_environment"])
    return config, result


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_environment_stage_end_to_end(first_run, runs_root):
    _, result = first_run
    run_dir = Path(result["run_dir"])
    assert run_dir.parent == runs_root / "envflow"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    stages = manifest["stages"]
    assert stages["check_environment"]["status"] == "completed"
    assert stages["generate_data"] == {"status": "skipped", "reason": "not selected with --stages"}
    assert stages["report"]["status"] == "completed"
    attempt = run_dir / "check_environment" / "attempt-1"
    assert stages["check_environment"]["dir"] == "./check_environment/attempt-1"  # relative: the folder can move
    assert (attempt / "environment.json").is_file()
    assert (attempt / "summary.json").is_file()

    client = mlflow_client(runs_root)
    parent = client.get_run(result["mlflow_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.params["train.ttt_steps"] == "7"
    assert parent.data.params["data.regenerate.api_key"] == "**********"
    tags = parent.data.tags
    assert len(tags["prefect.flow_run_id"]) == 36
    assert tags["eagleops.config_hash"] == manifest["config_hash"]
    assert tags["eagleops.version"] and tags["mlflow.source.git.commit"]
    assert "config/experiment.yaml" in [a.path for a in client.list_artifacts(parent.info.run_id, "config")]

    kids = children(client, parent.info.run_id)
    assert set(kids) == {"check_environment", "report"}
    env_run = kids["check_environment"]
    assert env_run.info.run_id == stages["check_environment"]["mlflow_run_id"]
    assert env_run.data.params["env.python"].startswith("ok: Python 3.")
    report = json.loads(Path(client.download_artifacts(env_run.info.run_id, "environment/report.json")).read_text())
    assert {c["name"] for c in report["checks"]} >= {"python", "torch", "gpus", "nvcc", "flash_attn", "sglang", "disk"}


def test_prefect_flow_run_has_the_environment_artifact(first_run, runs_root):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    _, result = first_run
    flow_run_id = mlflow_client(runs_root).get_run(result["mlflow_run_id"]).data.tags["prefect.flow_run_id"]

    async def read():
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["environment-report"])))

    artifacts = [a for a in asyncio.run(read()) if str(a.flow_run_id) == flow_run_id]
    assert artifacts and "| python | ok |" in artifacts[0].data


def test_secret_never_reaches_logs_mlflow_or_run_dir(first_run, runs_root):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    _, result = first_run
    run_dir = Path(result["run_dir"])
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert SECRET not in path.read_text(errors="ignore"), path
    client = mlflow_client(runs_root)
    parent = client.get_run(result["mlflow_run_id"])
    for run in [parent, *children(client, parent.info.run_id).values()]:
        assert SECRET not in json.dumps(run.data.params) + json.dumps(run.data.tags)
        if not client.list_artifacts(run.info.run_id):
            continue
        local = Path(client.download_artifacts(run.info.run_id, ""))
        for path in local.rglob("*"):
            if path.is_file():
                assert SECRET not in path.read_text(errors="ignore"), path
    flow_run_id = parent.data.tags["prefect.flow_run_id"]

    async def read_logs():
        async with get_client() as prefect:
            return await prefect.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))

    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)  # the run's logs reach the API in the background: send them first
    logs = asyncio.run(read_logs())
    assert logs and not any(SECRET in log.message for log in logs)


def test_validate_masks_the_secret(first_run):
    config, _ = first_run
    result = CliRunner().invoke(app, ["validate", str(config)])
    assert result.exit_code == 0 and SECRET not in result.output and "**********" in result.output


def test_resume_with_the_same_config_reuses_the_parent_run_and_rechecks_the_machine(first_run, runs_root):
    config, result = first_run
    run_dir = Path(result["run_dir"])
    again = eagle3_experiment(str(config), run_dir=str(run_dir), stages=["check_environment"])
    after = json.loads((run_dir / "manifest.json").read_text())
    env = after["stages"]["check_environment"]
    # The environment check is a reading of the machine now: it runs again, in a new attempt folder.
    assert [a["attempt"] for a in env["attempts"]] == [1, 2] and env["current_attempt"] == 2
    assert (run_dir / "check_environment" / "attempt-1" / "environment.json").is_file()
    assert again["mlflow_run_id"] == result["mlflow_run_id"]  # same config: same parent run
    assert len(after["prefect_flow_run_ids"]) == 2


def test_failing_check_stops_the_flow_and_exits_1(prefect_harness, runs_root, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLEOPS_TEST_API_KEY", SECRET)
    config = write_config(tmp_path, "envfail", runs_root)
    # 100M samples x 1M tokens of offline hidden states: no disk has that.
    config.write_text(config.read_text().replace("num_samples: 8", "num_samples: 100000000\n  max_length: 1048576"))
    with pytest.raises(StageFailed, match="disk"):
        eagle3_experiment(str(config))
    run_dir = next((runs_root / "envfail").iterdir())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["stages"]["check_environment"]["status"] == "failed"
    assert "generate_data" not in manifest["stages"]
    parent = mlflow_client(runs_root).get_run(manifest["mlflow"]["parent_run_id"])
    assert parent.info.status == "FAILED"

    result = CliRunner().invoke(app, ["run", str(config), "--stages", "check_environment"])
    assert result.exit_code == 1, result.output


def test_runs_lists_the_experiment_run(first_run, runs_root):
    _, result = first_run
    uri = f"sqlite:///{runs_root / 'mlflow.db'}"
    listed = CliRunner().invoke(app, ["runs", "--tracking-uri", uri, "--experiment", "envflow", "--json"])
    assert listed.exit_code == 0, listed.output
    rows = [json.loads(line) for line in listed.output.splitlines()]
    assert result["mlflow_run_id"] in {r["run_id"] for r in rows}
    assert all(r["experiment"] == "envflow" for r in rows)
    table = CliRunner().invoke(app, ["runs", "--tracking-uri", uri], env={"COLUMNS": "250"})
    assert table.exit_code == 0 and "envflow" in table.output


def test_the_flow_run_is_named_after_the_experiment_and_setting_and_links_to_its_mlflow_run(first_run, runs_root):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    _, result = first_run
    parent = mlflow_client(runs_root).get_run(result["mlflow_run_id"])
    flow_run_id = parent.data.tags["prefect.flow_run_id"]

    async def read():
        async with get_client() as client:
            flow_run = await client.read_flow_run(flow_run_id)
            artifacts = await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["envflow-mlflow-run"])))
            return flow_run, [a for a in artifacts if str(a.flow_run_id) == flow_run_id]

    flow_run, artifacts = asyncio.run(read())
    assert flow_run.name == "envflow auto/auto/auto"  # the config asks for no speculative setting: SGLang's choice
    # a local store: the artifact says how to serve it and links the run in model-training mode
    assert artifacts and parent.info.run_id in artifacts[0].data
    assert "mlflow ui --backend-store-uri" in artifacts[0].data and "workflowType=machine_learning" in artifacts[0].data
    assert f"Run folder: {result['run_dir']}" in parent.data.tags["mlflow.note.content"]
