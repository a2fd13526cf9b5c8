"""GPU-hours through the real flows on a test-size target, MLflow in a local store: every stage's child run
records what it held, the parent the sum of this flow run's stages, a resume charges its reused stages 0
(their figure kept apart), and the nightly's report holds the night against a full retrain's.

The machine is declared to have 2 GPUs (nvidia-smi's answer is replaced; nothing else is faked), so the
data stage's capture and training count 1 GPU each for their wall time; the reference server computes
on the CPU and holds none. Expected figures are worked out here from what the manifest and MLflow
recorded (devices x measured wall time), never by the code under test.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.experiment import eagle3_experiment
from flows.nightly import nightly_retrain
from tasks.hosts import gpus
from tasks.rundir import RunDirectory
from tests.mlflow_server import free_port

CONFIG = """\
experiment: gpuhours
runs_root: {runs}
target:
  kind: tiny
  dtype: float32
  tiny: {{vocab_size: 300, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 7, num_attention_heads: 2,
          num_key_value_heads: 1, max_position_embeddings: 256, corpus_max_bytes: 60000, train_steps: 10,
          batch_size: 4, seq_len: 64, eval_tokens: 1024, num_threads: 1}}
data:
  num_samples: 12
  max_length: 256
  validation_fraction: 0.25
  regenerate: {{max_new_tokens: 16}}
  draft_vocab_size: 64
train: {{ttt_steps: 3, max_steps: 4, batch_size: 4, lr: 0.001, eval_every: 1000, checkpoint_every: 1000}}
export: {{formats: [sglang], dtype: float32, registered_model: gpuhours-draft}}
deploy:
  server: reference
  port: {port}
  speculative: {{num_steps: 3, eagle_topk: 1, num_draft_tokens: 4}}
  startup_timeout_s: 240
bench: {{prompts: {prompts}, num_prompts: 2, max_new_tokens: 8, warmup_runs: 1, timed_runs: 1}}
nightly: {{min_tok_s_gain: -0.95, min_accept_length: 1.0, rounds: 2}}
"""
OWN_DEVICES = {"generate_data", "train_draft"}  # the stages whose own processes hold GPUs (1 each here)


@pytest.fixture(scope="module")
def runs(prefect_harness, tmp_path_factory):
    """A full run, its resume, then a nightly, on a machine that says it has 2 GPUs."""
    folder = tmp_path_factory.mktemp("gpuhours")
    prompts = ["Write a function that adds two numbers.", "What does a for loop do?"]
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    config = folder / "gpuhours.yaml"
    config.write_text(CONFIG.format(runs=folder / "runs", port=free_port(), prompts=folder / "prompts.jsonl"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gpus, "_known", {})
        patch.setattr(gpus, "_count_gpus", lambda executor: 2)
        first = eagle3_experiment(str(config))
        resumed = eagle3_experiment(str(config), run_dir=first["run_dir"])
        night = nightly_retrain(str(config))
    store = f"sqlite:///{folder / 'runs' / 'mlflow.db'}"
    return {"first": first, "resumed": resumed, "night": night, "client": MlflowClient(store)}


def current_attempt(manifest: dict, stage: str) -> dict:
    entry = manifest["stages"][stage]
    return next(a for a in entry["attempts"] if a["attempt"] == entry["current_attempt"])


def expected_gpu_hours(client: MlflowClient, attempt: dict) -> float:
    """The GPUs the stage's run records (param gpus.local) x the wall time the manifest measured."""
    params = client.get_run(attempt["mlflow_run_id"]).data.params
    return int(params.get("gpus.local", 0)) * attempt["wall_time_s"] / 3600


@pytest.mark.slow
def test_every_stage_records_gpus_x_wall_time_and_the_parent_their_sum(runs):
    client, first = runs["client"], runs["first"]
    manifest = RunDirectory.open(first["run_dir"]).manifest
    recorded = {}
    for stage, status in first["stages"].items():
        assert status == "completed", stage
        attempt = current_attempt(manifest, stage)
        child = client.get_run(attempt["mlflow_run_id"]).data
        recorded[stage] = child.metrics["gpu_hours"]
        assert recorded[stage] == pytest.approx(expected_gpu_hours(client, attempt), rel=1e-6, abs=1e-12), stage
        assert ("gpus.local" in child.params) == (stage in OWN_DEVICES), stage
        summary = json.loads((Path(attempt["dir"]) / "summary.json").read_text())
        assert summary["gpu_hours"] == pytest.approx(recorded[stage]), stage
    assert all(recorded[s] > 0 for s in OWN_DEVICES)
    assert recorded["deploy_server"] == recorded["run_benchmark"] == 0  # the reference server holds no GPU
    # the resume reopened this parent run and logged its own total since: the first flow run's is the first value
    totals = sorted(client.get_metric_history(first["mlflow_run_id"], "gpu_hours_total"), key=lambda m: m.timestamp)
    assert totals[0].value == pytest.approx(sum(recorded.values()))
    assert first["gpu_hours"]["total"] == pytest.approx(sum(recorded.values()))
    assert first["gpu_hours"]["reused_total"] == 0
    report = (Path(first["run_dir"]) / "report" / "attempt-1" / "report.md").read_text()
    assert "| GPU-h |" in report and f"| train_draft | completed | " in report


@pytest.mark.slow
def test_a_resumed_run_charges_its_reused_stages_nothing_and_keeps_their_figure_apart(runs):
    client, first, resumed = runs["client"], runs["first"], runs["resumed"]
    before = {s: current_attempt(RunDirectory.open(first["run_dir"]).manifest, s)["gpu_hours"]
              for s in ("generate_data", "train_draft", "export_checkpoint")}
    block = resumed["gpu_hours"]
    assert block["reused"] == pytest.approx(before)
    assert set(block["stages"]) == {"check_environment", "deploy_server", "run_benchmark", "report"}
    parent = client.get_run(resumed["mlflow_run_id"])
    assert parent.info.run_id == first["mlflow_run_id"]  # the same parent run, reopened
    for stage, hours in before.items():
        assert parent.data.metrics[f"{stage}.gpu_hours"] == 0
        assert parent.data.metrics[f"{stage}.gpu_hours_reused"] == pytest.approx(hours)
    executed = [current_attempt(RunDirectory.open(resumed["run_dir"]).manifest, s) for s in block["stages"]]
    this_run = sum(client.get_run(a["mlflow_run_id"]).data.metrics["gpu_hours"] for a in executed)
    assert parent.data.metrics["gpu_hours_total"] == pytest.approx(this_run)
    assert parent.data.metrics["gpu_hours_reused"] == pytest.approx(sum(before.values()))
    assert parent.data.metrics["gpu_hours_total"] < sum(before.values())  # reused GPU-hours are not this run's
    # the first flow run's full retrain stays on record: its figure is the one later nights are held against
    assert parent.data.tags["eagleops.full_retrain"] == "true"
    assert parent.data.metrics["gpu_hours_retrain"] == pytest.approx(sum(before.values()))


@pytest.mark.slow
def test_the_nightly_report_shows_the_nights_gpu_hours_against_a_full_retrain(runs):
    client, night = runs["client"], runs["night"]
    run_dir = Path(night["run_dir"])
    manifest = RunDirectory.open(run_dir).manifest
    children = client.search_runs([client.get_run(night["mlflow_run_id"]).info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{night['mlflow_run_id']}'")
    held = {r.info.run_name: r.data.metrics["gpu_hours"] for r in children}
    assert "nightly_gate" in held and held["train_draft"] > 0
    parent = client.get_run(night["mlflow_run_id"]).data.metrics
    assert parent["gpu_hours_total"] == pytest.approx(sum(held.values()))  # the gate's servers included
    report = (run_dir / "nightly_gate" / "report.md").read_text()
    line = next(line for line in report.splitlines() if "GPU-hours this night" in line)
    shown = float(re.search(r"GPU-hours this night: ([0-9.e-]+)", line).group(1))
    assert shown == pytest.approx(sum(held.values()), rel=1e-3)
    # this nightly regenerated, captured and trained on every prompt: it is the newest full retrain itself
    retrain = sum(held[s] for s in ("generate_data", "train_draft", "export_checkpoint"))
    assert manifest["gpu_hours"]["full_retrain_estimate"]["gpu_hours"] == pytest.approx(retrain)
    assert "against a full retrain's" in line and "this night itself" in line


@pytest.mark.slow
def test_the_resumed_flow_run_shows_its_reused_stages_as_cached_with_links_to_their_runs(runs):
    """What the Prefect UI reads for the resumed flow run: a task run per reused stage, Completed as `Cached`,
    naming the attempt, with a link artifact to that attempt's MLflow run; the stages that ran as they ran."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterTaskRunId, FlowRunFilter, FlowRunFilterId

    manifest = RunDirectory.open(runs["resumed"]["run_dir"]).manifest
    flow_run_id = manifest["prefect_flow_run_ids"][-1]
    shown_stages = {"generate_data", "train_draft", "export_checkpoint", "deploy_server", "run_benchmark"}
    with get_client(sync_client=True) as client:
        # Prefect 3 records task runs from the events their states emit, which its server persists a little
        # after the flow ends (seconds under load): read until every stage is there
        deadline = time.monotonic() + 60
        while True:
            task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            by_stage = {t.name.split(" (")[0].rsplit("-", 1)[0]: t for t in task_runs}
            settled = all(by_stage.get(s) and by_stage[s].state and by_stage[s].state.is_final() for s in shown_stages)
            if settled or time.monotonic() > deadline:
                break
            time.sleep(1)
        for stage in ("generate_data", "train_draft", "export_checkpoint"):
            attempt = current_attempt(manifest, stage)
            shown = by_stage[stage]
            assert (shown.state.type.value, shown.state.name) == ("COMPLETED", "Cached"), shown.state
            assert f"reused attempt {attempt['attempt']}" in shown.state.message
            links = client.read_artifacts(artifact_filter=ArtifactFilter(task_run_id=ArtifactFilterTaskRunId(
                any_=[shown.id])))
            assert len(links) == 1 and links[0].data.startswith("[MLflow run "), links  # Prefect's link artifact
            assert f"/runs/{attempt['mlflow_run_id']}" in links[0].data
        for stage in ("deploy_server", "run_benchmark"):  # ran in this flow run
            assert (by_stage[stage].state.type.value, by_stage[stage].state.name) == ("COMPLETED", "Completed")
