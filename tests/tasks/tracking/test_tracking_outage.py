"""A run survives an MLflow outage and loses nothing: a real `mlflow server` on 127.0.0.1, stopped
and started for real, the real experiment flow (environment stage + report) under the Prefect
harness, and `eagleops sync` through typer's CliRunner.

(a) server down from the start: the run completes offline, one warning names the URI, the only
    connection made to the dead port is the health probe; after the server starts, sync uploads
    the parent and child runs with params, metrics (original timestamps), tags, artifacts and
    statuses, rewrites the manifest's ids, and a second sync changes nothing.
(b) server stopped mid-run, at a stage boundary (a log handler stops it when the environment
    stage reports completion, in the flow's own thread, so the rest of the run is offline);
    after a restart + sync, every stage attempt in the manifest has its run and metrics.
(c) eagleops experiments carry mlflow.experimentKind = custom_model_development.
(d) the whole pipeline (data, training, export with a registered model, deploy, benchmark) with the server
    down from the start, then a resume of deploy + benchmark on the same folder with the server stopped right
    before run_benchmark: both complete, and after `eagleops sync` the server holds every stage's
    run with its metrics, tags, artifacts, the benchmark's comparison table (readable by MLflow's
    own load_table) and plots, the model version the export registered (its number in the manifest), and the
    system metrics `tracking.log_system_metrics` sampled
    (absent from the runs of (a) and (b), where the field is off).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from flows.cli import app
from flows.experiment import eagle3_experiment
from tasks.tracking import HTTP_RETRY_DEFAULTS
from tasks.tracking.journal import JOURNAL_FILE, STATE_FILE, is_placeholder, journal_path
from tasks.tracking.outage import check_tracking_server
from tasks.tracking.run_logger import RunLogger
from tasks.tracking.views import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG
from tests.helpers import TEST_TARGET_YAML, free_port

CONFIG = """\
experiment: {name}
runs_root: {runs}
target:
  kind: tiny
tracking:
  uri: {uri}
"""
RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs", "eagleops")


class CountingListener:
    """A TCP port that accepts and counts connections and closes them unanswered: a dead server."""

    def __init__(self, port: int):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


class Captured(logging.Handler):
    """Records the run's log lines; `on_message(text, action)` runs `action` in the logging thread."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.triggers: list[tuple[str, callable]] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        self.lines.append(text)
        for needle, action in list(self.triggers):
            if needle in text:
                self.triggers.remove((needle, action))
                action()


@pytest.fixture
def captured():
    handler = Captured()
    for name in RUN_LOGGERS:
        logging.getLogger(name).addHandler(handler)
    yield handler
    for name in RUN_LOGGERS:
        logging.getLogger(name).removeHandler(handler)


def write_config(folder: Path, name: str, uri: str) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(CONFIG.format(name=name, runs=folder / "runs", uri=uri))
    return path


def manifest_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def sync(run_dir: Path, *args: str):
    return CliRunner().invoke(app, ["sync", str(run_dir), *args])


def stage_attempts(manifest: dict) -> list[tuple[str, dict]]:
    return [(name, a) for name, entry in manifest["stages"].items() for a in entry.get("attempts", [])]


def artifact_paths(client: MlflowClient, run_id: str, folder: str | None = None) -> set[str]:
    found = set()
    for item in client.list_artifacts(run_id, folder):
        found |= artifact_paths(client, run_id, item.path) if item.is_dir else {item.path}
    return found


def assert_uploaded(client: MlflowClient, run_dir: Path, stages: set[str] = frozenset({"check_environment", "report"}),
                    system_metrics: bool = False) -> None:
    """Everything the run folder records is in MLflow: parent + one run per stage attempt, with metrics
    (system/* metrics in every stage run exactly when tracking.log_system_metrics is on)."""
    manifest = manifest_of(run_dir)
    parent_id = manifest["mlflow"]["parent_run_id"]
    assert "offline-" not in json.dumps(manifest)
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["eagleops.kind"] == "experiment"
    assert parent.data.params["target.kind"] == "tiny"
    assert {"config/experiment.yaml", "report.md"} <= artifact_paths(client, parent_id)
    attempts = stage_attempts(manifest)
    assert {name for name, _ in attempts} == set(stages)
    for name, attempt in attempts:
        child = client.get_run(attempt["mlflow_run_id"])
        assert child.info.run_name == name
        assert child.info.status == "FINISHED"
        assert child.data.tags["mlflow.parentRunId"] == parent_id
        assert child.data.tags["eagleops.stage"] == name
        assert child.data.metrics["wall_time_s"] == pytest.approx(attempt["wall_time_s"])
        assert child.data.metrics["gpu_hours"] == pytest.approx(attempt["gpu_hours"])  # journaled like the rest
        for key, value in attempt["summary"]["metrics"].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                assert child.data.metrics[key] == pytest.approx(value)
        sampled = {k for k in child.data.metrics if k.startswith("system/")}
        if system_metrics:
            assert {"system/cpu_utilization_percentage", "system/system_memory_usage_percentage"} <= sampled, name
            assert 0 < child.data.metrics["system/system_memory_usage_percentage"] <= 100
        else:
            assert not sampled, name
    latest = {name: entry for name, entry in manifest["stages"].items() if entry.get("attempts")}
    for name, entry in latest.items():  # the parent's headline metrics are the latest attempt's
        for key, value in entry["summary"]["metrics"].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                assert parent.data.metrics[f"{name}.{key}"] == pytest.approx(value)
    assert parent.data.metrics["gpu_hours_total"] == pytest.approx(manifest["gpu_hours"]["total"])
    env_id = manifest["stages"]["check_environment"]["mlflow_run_id"]
    assert "env.hostname" in client.get_run(env_id).data.params
    assert "environment/report.json" in artifact_paths(client, env_id)
    assert client.get_experiment(parent.info.experiment_id).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND


def snapshot(client: MlflowClient, run_dir: Path) -> dict:
    """Runs of the experiment with their metric histories, params and tags, for a before/after compare."""
    experiment_id = client.get_run(manifest_of(run_dir)["mlflow"]["parent_run_id"]).info.experiment_id
    runs = client.search_runs([experiment_id])
    return {
        r.info.run_id: (r.info.status, r.data.params, r.data.tags,
                        {k: [(m.value, m.timestamp, m.step) for m in client.get_metric_history(r.info.run_id, k)]
                         for k in r.data.metrics})
        for r in runs
    }


def test_run_with_server_down_from_the_start_then_sync(prefect_harness, mlflow_server, tmp_path, captured):
    mlflow_server.stop()
    dead = CountingListener(mlflow_server.port)
    try:
        config = write_config(tmp_path, "outage-start", mlflow_server.uri)
        result = eagle3_experiment(str(config), stages=["check_environment"])
    finally:
        dead.close()
    run_dir = Path(result["run_dir"])
    assert result["status"] == "FINISHED"
    assert result["stages"]["check_environment"] == "completed"
    # Found by the probe alone: MLflow's client (with its retries) never dialled the dead port.
    assert dead.connections == 1
    warnings = [line for line in captured.lines if "is not usable" in line]
    assert len(warnings) == 1
    assert mlflow_server.uri in warnings[0] and f"eagleops sync {run_dir}" in warnings[0]
    assert "tracking.uri: null" in warnings[0]
    manifest = manifest_of(run_dir)
    assert manifest["mlflow"]["parent_run_id"].startswith("offline-")
    assert all(a["mlflow_run_id"].startswith("offline-") for _, a in stage_attempts(manifest))
    assert (run_dir / JOURNAL_FILE).is_file()

    mlflow_server.start()
    before_sync_ms = int(time.time() * 1000)
    first = sync(run_dir)
    assert first.exit_code == 0, first.output
    assert "3 runs created" in first.output
    client = MlflowClient(mlflow_server.uri)
    assert_uploaded(client, run_dir)
    parent_id = manifest_of(run_dir)["mlflow"]["parent_run_id"]
    (point,) = client.get_metric_history(parent_id, "check_environment.wall_time_s")
    assert point.timestamp < before_sync_ms  # the time it was measured, not the time of the upload
    assert client.get_run(parent_id).info.start_time < before_sync_ms

    before = snapshot(client, run_dir)
    second = sync(run_dir)
    assert second.exit_code == 0, second.output
    assert "nothing to sync" in second.output
    assert snapshot(client, run_dir) == before


def test_server_stopped_mid_run_then_sync(prefect_harness, mlflow_server, tmp_path, captured):
    mlflow_server.start()
    # In the flow's thread, right after the environment stage's child run was finished online:
    # the report stage, its child run and the parent's end are what the outage hits.
    captured.triggers.append(("check_environment: completed", mlflow_server.stop))
    config = write_config(tmp_path, "outage-mid", mlflow_server.uri)
    result = eagle3_experiment(str(config), stages=["check_environment"])
    assert not mlflow_server.running
    run_dir = Path(result["run_dir"])
    assert result["status"] == "FINISHED"
    manifest = manifest_of(run_dir)
    assert not manifest["mlflow"]["parent_run_id"].startswith("offline-")  # created before the stop
    assert manifest["stages"]["report"]["mlflow_run_id"].startswith("offline-")
    assert len([line for line in captured.lines if "is not usable" in line]) == 1

    mlflow_server.start()
    synced = sync(run_dir)
    assert synced.exit_code == 0, synced.output
    assert "1 runs created" in synced.output
    assert_uploaded(MlflowClient(mlflow_server.uri), run_dir)
    state = json.loads((run_dir / STATE_FILE).read_text())
    assert state["refused"] == []


def test_4xx_answer_raises_and_is_not_journaled(mlflow_server, tmp_path):
    """A 4xx is the caller's bug, never an outage: it raises, and nothing goes to the journal."""
    mlflow_server.start()
    # A run starts with the probe, which also ends an earlier outage of this URI in this process.
    assert check_tracking_server(mlflow_server.uri, journal_path(tmp_path))
    logger = RunLogger(mlflow_server.uri, "0" * 32, journal_path(tmp_path))
    with pytest.raises(MlflowException):
        logger.log_metrics({"loss": 1.0})
    assert not (tmp_path / JOURNAL_FILE).exists()


def test_mlflow_retries_are_bounded():
    for key, value in HTTP_RETRY_DEFAULTS.items():
        assert os.environ[key] == value
    assert int(HTTP_RETRY_DEFAULTS["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]) <= 3


def test_resume_syncs_the_journal_first_and_continues_the_same_parent(prefect_harness, mlflow_server, tmp_path):
    """`eagleops run --run-dir` after an outage: the journal is replayed before anything else, and
    the resumed run reopens the parent that the replay created (not a second parent)."""
    mlflow_server.stop()
    config = write_config(tmp_path, "outage-resume", mlflow_server.uri)
    first = eagle3_experiment(str(config), stages=["check_environment"])
    run_dir = Path(first["run_dir"])
    placeholder = first["mlflow_run_id"]
    assert placeholder.startswith("offline-")

    mlflow_server.start()
    second = eagle3_experiment(str(config), stages=["check_environment"], run_dir=str(run_dir))
    client = MlflowClient(mlflow_server.uri)
    parent = client.get_run(second["mlflow_run_id"])
    assert parent.data.tags["eagleops.offline_id"] == placeholder
    assert parent.info.status == "FINISHED"
    manifest = manifest_of(run_dir)
    assert manifest["mlflow"]["parent_run_id"] == parent.info.run_id
    assert len(manifest["prefect_flow_run_ids"]) == 2
    # Both attempts of the environment stage (one journaled, one online) are runs under that parent.
    attempts = manifest["stages"]["check_environment"]["attempts"]
    assert len(attempts) == 2
    for attempt in attempts:
        assert client.get_run(attempt["mlflow_run_id"]).data.tags["mlflow.parentRunId"] == parent.info.run_id
    state = json.loads((run_dir / STATE_FILE).read_text())
    assert state["done"] == len((run_dir / JOURNAL_FILE).read_text().splitlines())


def test_offline_artifacts_and_model_version_replay_later(mlflow_server, tmp_path):
    """Journaled writes keep the file as it was when logged and replay into a server given at sync time."""
    from mlflow_server import free_port

    from tasks.tracking.run_logger import create_run
    from tasks.tracking.sync import sync_journal

    mlflow_server.start()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "manifest.json").write_text("{}")
    journal = journal_path(run_dir)
    dead_uri = f"http://127.0.0.1:{free_port()}"
    assert not check_tracking_server(dead_uri, journal)
    parent = create_run(dead_uri, journal, "offline-parent", {"eagleops.kind": "experiment"}, experiment="outage-unit")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text('{"v": 1}')
    parent.log_artifact(checkpoint, "checkpoint/sglang")
    assert is_placeholder(parent.register_version("outage-unit-draft", "checkpoint/sglang", {"format": "sglang"}))
    (checkpoint / "config.json").unlink()  # the stage cleans up; the journal still holds the file

    result = sync_journal(run_dir, mlflow_server.uri)
    assert result.refused == []
    client = MlflowClient(mlflow_server.uri)
    real_id = result.created[parent.run_id]
    assert artifact_paths(client, real_id) == {"checkpoint/sglang/config.json"}
    (version,) = client.search_model_versions("name = 'outage-unit-draft'")
    assert version.run_id == real_id and version.tags["format"] == "sglang"
    assert version.source.endswith("/checkpoint/sglang")


# --------------------------------------------------------------------------- (d) the whole pipeline

PIPELINE_CONFIG = """\
experiment: {name}
runs_root: {runs}
{target}data:
  num_samples: 12
  max_length: 160
  validation_fraction: 0.25
  draft_vocab_size: 64
  regenerate: {{max_new_tokens: 16}}
train: {{ttt_steps: 2, epochs: 3, max_steps: 6, batch_size: 4, log_every: 1}}
export: {{formats: [sglang], dtype: float32, registered_model: {name}-draft}}
deploy:
  server: reference
  port: {port}
  speculative: {{num_steps: 2, eagle_topk: 1, num_draft_tokens: 3}}
  startup_timeout_s: 240
bench: {{prompts: {prompts}, num_prompts: 2, max_new_tokens: 8, warmup_runs: 0, timed_runs: 1}}
tracking: {{uri: "{uri}", log_system_metrics: true}}
"""
ALL_STAGES = {"check_environment", "generate_data", "train_draft", "export_checkpoint", "deploy_server",
              "run_benchmark", "report"}
# The settings the config asks for, as report_bench names their metrics (written out here, not computed).
BENCH_METRIC_PREFIXES = {"speculative 2/1/3": "spec_2_1_3.c1", "baseline": "baseline.c1"}


@pytest.fixture(scope="module")
def offline_pipeline(prefect_harness, mlflow_server, tmp_path_factory):
    """The whole pipeline run with the tracking server down from the start (system metrics sampled every
    second); yields (config, result, the run's warning lines)."""
    folder = tmp_path_factory.mktemp("outage-pipeline")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Say hello.", "Count to three.")))
    config = folder / "outage-pipeline.yaml"
    config.write_text(PIPELINE_CONFIG.format(name="outage-pipeline", runs=folder / "runs", target=TEST_TARGET_YAML,
                                             port=free_port(), prompts=prompts, uri=mlflow_server.uri))
    handler = Captured()
    for name in RUN_LOGGERS:
        logging.getLogger(name).addHandler(handler)
    mlflow_server.stop()
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
            result = eagle3_experiment(str(config))
    finally:
        for name in RUN_LOGGERS:
            logging.getLogger(name).removeHandler(handler)
    return config, result, handler.lines


def latest_attempt(run_dir: Path, stage: str) -> dict:
    return manifest_of(run_dir)["stages"][stage]["attempts"][-1]


def assert_benchmark_uploaded(client: MlflowClient, run_dir: Path) -> None:
    """The latest benchmark attempt's run holds its table (MLflow reads it back), plots, metrics and tags."""
    attempt = latest_attempt(run_dir, "run_benchmark")
    rows = attempt["summary"]["rows"]
    assert {r["setting"] for r in rows} == set(BENCH_METRIC_PREFIXES)
    run = client.get_run(attempt["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert {"bench/comparison.json", "bench/verdict.json", "bench/results.json", "plots/benchmark.png"} \
        <= artifact_paths(client, run.info.run_id)
    assert {"path": "bench/comparison.json", "type": "table"} in json.loads(run.data.tags["mlflow.loggedArtifacts"])
    with pytest.MonkeyPatch.context() as env:  # load_table searches runs through MLflow's default URI
        env.setenv("MLFLOW_TRACKING_URI", client.tracking_uri)
        table = client.load_table(run.info.experiment_id, "bench/comparison.json", run_ids=[run.info.run_id])
    assert sorted(table["setting"]) == sorted(r["setting"] for r in rows)
    for r in rows:
        line = table[table["setting"] == r["setting"]].iloc[0]
        assert line["tok_s_median"] == pytest.approx(r["tok_s_median"], abs=0.05)  # rounded as shown (1 decimal)
        assert line["concurrency"] == r["concurrency"] == 1
        assert run.data.metrics[f"{BENCH_METRIC_PREFIXES[r['setting']]}.tok_s"] == pytest.approx(r["tok_s_median"], abs=0.05)
    spec = next(r for r in rows if r["speculative"])
    assert run.data.metrics["spec_2_1_3.c1.accept_length"] == pytest.approx(spec["decode_accept_length"], abs=0.005)
    assert run.data.metrics["spec_2_1_3.speedup"] == pytest.approx(attempt["summary"]["verdict"]["settings"][0]["speedup"],
                                                                   abs=0.005)


@pytest.mark.slow
def test_whole_pipeline_with_server_down_from_the_start_then_sync(offline_pipeline, mlflow_server, tmp_path):
    _, result, lines = offline_pipeline
    run_dir = Path(result["run_dir"])
    assert result["status"] == "FINISHED"
    assert set(result["stages"].values()) == {"completed"}
    assert len([line for line in lines if "is not usable" in line]) == 1
    manifest = manifest_of(run_dir)
    assert all(a["mlflow_run_id"].startswith("offline-") for _, a in stage_attempts(manifest))

    mlflow_server.start()
    synced = sync(run_dir)
    assert synced.exit_code == 0, synced.output
    assert "8 runs created" in synced.output  # the parent and one run per stage
    client = MlflowClient(mlflow_server.uri)
    assert_uploaded(client, run_dir, ALL_STAGES, system_metrics=True)
    assert_benchmark_uploaded(client, run_dir)
    train = latest_attempt(run_dir, "train_draft")
    # The loss curve journaled step by step is the one training wrote into its own history.jsonl.
    (history,) = (run_dir / train["dir"]).rglob("history.jsonl")  # the manifest records it relative to the folder
    written = [(r["step"], r["train/loss"]) for r in map(json.loads, history.read_text().splitlines()) if "train/loss" in r]
    assert len(written) >= 2
    uploaded = sorted((m.step, m.value) for m in client.get_metric_history(train["mlflow_run_id"], "train/loss"))
    assert [step for step, _ in uploaded] == [step for step, _ in written]
    assert [loss for _, loss in uploaded] == pytest.approx([loss for _, loss in written])
    # The training data as a dataset input of the training run and the parent (journaled, then replayed).
    digest = latest_attempt(run_dir, "generate_data")["output_digest"]
    for run_id in (train["mlflow_run_id"], manifest_of(run_dir)["mlflow"]["parent_run_id"]):
        (data_input,) = client.get_run(run_id).inputs.dataset_inputs
        assert (data_input.dataset.name, data_input.dataset.digest) == ("prompts:builtin", digest)
        assert [(t.key, t.value) for t in data_input.tags] == [("mlflow.data.context", "training")]
        profile = json.loads(data_input.dataset.profile)
        summary = latest_attempt(run_dir, "generate_data")["summary"]
        assert profile["samples"] == sum(summary["num_samples"].values()) > 0 and profile["digest"] == digest
    # Several system samples (1 s apart) over the benchmark (two server launches), at steps 0, 1, 2, ...
    bench = latest_attempt(run_dir, "run_benchmark")
    cpu = client.get_metric_history(bench["mlflow_run_id"], "system/cpu_utilization_percentage")
    assert sorted(m.step for m in cpu) == list(range(len(cpu))) and len(cpu) >= 2
    export = latest_attempt(run_dir, "export_checkpoint")
    assert any(p.startswith("checkpoint/sglang/") for p in artifact_paths(client, export["mlflow_run_id"]))
    # Registered offline too: sync registered it once, from the export's run, and wrote its number into the manifest.
    (version,) = client.search_model_versions("name = 'outage-pipeline-draft'")
    assert version.run_id == export["mlflow_run_id"] and version.source.endswith("/checkpoint/sglang")
    assert export["outputs"]["registered_model_version"] == f"outage-pipeline-draft/{version.version}"


@pytest.mark.slow
def test_server_stopped_just_before_the_benchmark_then_sync(offline_pipeline, mlflow_server, captured):
    config, result, _ = offline_pipeline
    run_dir = Path(result["run_dir"])
    mlflow_server.start()
    captured.triggers.append(("deploy_server: completed", mlflow_server.stop))
    resumed = eagle3_experiment(str(config), stages=["deploy_server", "run_benchmark"], run_dir=str(run_dir))
    assert not mlflow_server.running
    assert resumed["status"] == "FINISHED"
    assert resumed["stages"]["run_benchmark"] == "completed"
    assert latest_attempt(run_dir, "run_benchmark")["mlflow_run_id"].startswith("offline-")
    assert not latest_attempt(run_dir, "deploy_server")["mlflow_run_id"].startswith("offline-")
    assert len([line for line in captured.lines if "is not usable" in line]) == 1

    mlflow_server.start()
    synced = sync(run_dir)
    assert synced.exit_code == 0, synced.output
    assert json.loads((run_dir / STATE_FILE).read_text())["refused"] == []
    client = MlflowClient(mlflow_server.uri)
    assert_benchmark_uploaded(client, run_dir)
    bench = client.get_run(latest_attempt(run_dir, "run_benchmark")["mlflow_run_id"])
    parent_id = manifest_of(run_dir)["mlflow"]["parent_run_id"]
    assert bench.data.tags["mlflow.parentRunId"] == parent_id
    assert "system/cpu_utilization_percentage" in bench.data.metrics
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["run_benchmark.best_tok_s"] == pytest.approx(
        latest_attempt(run_dir, "run_benchmark")["summary"]["metrics"]["best_tok_s"])


def test_log_table_online_is_mlflows_table_and_a_replay_does_not_double_it(mlflow_server, tmp_path):
    """RunLogger.log_table writes what MlflowClient.log_table writes (load_table reads it back), but a
    second identical write, as a replayed journal entry would be, replaces the rows instead of appending."""
    from tasks.tracking.run_logger import create_run

    mlflow_server.start()
    assert check_tracking_server(mlflow_server.uri, journal_path(tmp_path))
    run = create_run(mlflow_server.uri, journal_path(tmp_path), "table", {}, experiment="outage-table")
    table = {"setting": ["speculative 3/1/4", "baseline"], "tok_s_median": [120.5, 80.25]}
    run.log_table(table, "bench/comparison.json")
    run.log_table(table, "bench/comparison.json")
    client = MlflowClient(mlflow_server.uri)
    with pytest.MonkeyPatch.context() as env:  # load_table searches runs through MLflow's default URI
        env.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
        loaded = client.load_table(client.get_run(run.run_id).info.experiment_id, "bench/comparison.json",
                                   run_ids=[run.run_id])
    assert loaded.to_dict(orient="list") == table
    assert json.loads(client.get_run(run.run_id).data.tags["mlflow.loggedArtifacts"]) == [
        {"path": "bench/comparison.json", "type": "table"}]
    assert not (tmp_path / JOURNAL_FILE).exists()
