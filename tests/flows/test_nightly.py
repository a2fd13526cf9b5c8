"""The nightly retrain against a real MLflow server on PostgreSQL and the reference server on loopback.

Three nightlies in a row on the same data, each a real flow run (data -> train -> export -> gate):
1. a weak draft (3 optimizer steps: accept length ~1) with no champion yet -> first champion (v1);
2. a trained draft, started from the champion's weights -> beats v1 -> champion v2, v1 kept as previous;
3. a draft left at its random init (1 step at lr 1e-7) -> accept length collapses -> refused, v2 stays.
"Better" and "worse" come from accept length, which greedy decoding makes deterministic. The tok/s
margin is set to -0.95 (a challenger may be up to 95% slower) so CPU timing noise on the shared box
cannot flip a decision; the tok/s rule itself is covered by the `decide` tests below. The first
champion's floor is 1.0 here (any draft that serves), since draft 1 is deliberately weak.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from mlflow.artifacts import download_artifacts
from mlflow.tracking import MlflowClient

from eagle3.export import read_target_config, validate_sglang_checkpoint
from flows.nightly import nightly_retrain
from tasks.config import NightlyConfig, load_experiment
from tasks.gate import decide, training_config
from tasks.rundir import digest_paths, file_sha256
from tests.mlflow_server import MlflowServer, free_port
from tests.helpers import reference_servers_alive

MODEL = "nightly-draft"
CONFIG = """\
experiment: nightly
runs_root: {runs}
target:
  kind: tiny
  dtype: float32
  tiny: {{vocab_size: 300, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 7, num_attention_heads: 2,
          num_key_value_heads: 1, max_position_embeddings: 256, corpus_max_bytes: 60000, train_steps: 10,
          batch_size: 4, seq_len: 64, eval_tokens: 1024, num_threads: 1}}
data:
  num_samples: 64
  max_length: 256
  validation_fraction: 0.25
  regenerate: {{max_new_tokens: 48}}
  draft_vocab_size: 64
train: {{ttt_steps: 3, epochs: 20, max_steps: {steps}, batch_size: 4, lr: {lr}, eval_every: 1000,
         checkpoint_every: 1000}}
export: {{formats: [sglang], dtype: float32, registered_model: {model}}}
deploy:
  server: reference
  port: {port}
  speculative: {{num_steps: 3, eagle_topk: 1, num_draft_tokens: 4}}
  startup_timeout_s: 240
bench: {{prompts: {prompts}, num_prompts: 2, max_new_tokens: 10, warmup_runs: 1, timed_runs: 1}}
tracking: {{uri: {tracking}}}
nightly: {{start_from: {start_from}, min_tok_s_gain: -0.95, accept_length_tolerance: 0.0, min_accept_length: 1.0}}
"""
# (name, train.max_steps, train.lr, nightly.start_from)
NIGHTLIES = [("weak", 3, 0.003, "scratch"), ("trained", 150, 0.003, "champion"), ("random", 1, 1e-7, "scratch")]


class PostgresMlflowServer(MlflowServer):
    """tests/mlflow_server.py's server with a PostgreSQL backend store (a fresh database per module)."""

    def __init__(self, root: Path, database: str):
        super().__init__(root)
        self.database = database

    def start(self) -> None:
        # SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3; the driver installed is psycopg2.
        command = [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", f"postgresql+psycopg2://postgres@127.0.0.1:5432/{self.database}",
            "--artifacts-destination", str(self.root / "mlartifacts"),
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
        ]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
        with (self.root / "server.log").open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root,
                                            start_new_session=True)
        self._wait_healthy()


@pytest.fixture(scope="module")
def postgres_mlflow(tmp_path_factory):
    database = f"eagleops_nightly_{uuid.uuid4().hex[:12]}"
    created = subprocess.run(["createdb", "-h", "127.0.0.1", "-U", "postgres", database], capture_output=True,
                             text=True, timeout=60)
    if created.returncode != 0:
        pytest.skip(f"no PostgreSQL on 127.0.0.1:5432 for the registry tests: {created.stderr.strip()}")
    server = PostgresMlflowServer(tmp_path_factory.mktemp("mlflow-pg"), database)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        subprocess.run(["dropdb", "-h", "127.0.0.1", "-U", "postgres", "--if-exists", database], timeout=60, check=True)


@pytest.fixture(scope="module")
def nightlies(prefect_harness, postgres_mlflow, tmp_path_factory):
    """Run the three nightlies once; per nightly: its result and the registry's aliases right after it."""
    folder = tmp_path_factory.mktemp("nightly")
    prompts = ["Write a function that adds two numbers.", "What does a for loop do?"]
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    client = MlflowClient(postgres_mlflow.uri)
    done = {}
    for name, steps, lr, start_from in NIGHTLIES:
        config = folder / f"{name}.yaml"
        config.write_text(CONFIG.format(runs=folder / "runs", steps=steps, lr=lr, model=MODEL, port=free_port(),
                                        prompts=folder / "prompts.jsonl", tracking=postgres_mlflow.uri,
                                        start_from=start_from))
        result = nightly_retrain(str(config))
        done[name] = {"result": result, "aliases": dict(client.get_registered_model(MODEL).aliases),
                      "config": config}
    return done


def manifest(run_dir: str | Path) -> dict:
    return json.loads((Path(run_dir) / "manifest.json").read_text())


# ------------------------------------------------------------------ the flow, end to end


@pytest.mark.slow
def test_first_draft_becomes_champion(nightlies):
    first = nightlies["weak"]
    assert first["result"]["promoted"] and first["result"]["challenger"] == "1"
    assert first["result"]["reason"].startswith("promoted: first champion (there was none)")
    assert first["aliases"] == {"champion": "1"}
    assert list(first["result"]["rows"]) == ["challenger v1"]  # nothing to compare with


@pytest.mark.slow
def test_better_draft_is_promoted_and_the_old_champion_kept_as_previous(nightlies, postgres_mlflow):
    second = nightlies["trained"]["result"]
    assert second["promoted"], second["reason"]
    assert nightlies["trained"]["aliases"] == {"champion": "2", "previous": "1"}
    # Both drafts measured alike, one after the other, with the same setting and prompts.
    assert list(second["rows"]) == ["champion v1", "challenger v2"]
    champion_row, challenger_row = second["rows"]["champion v1"][0], second["rows"]["challenger v2"][0]
    assert champion_row["effective"] == challenger_row["effective"]
    assert challenger_row["accept_length"] > champion_row["accept_length"] + 0.5

    client = MlflowClient(postgres_mlflow.uri)
    version = client.get_model_version(MODEL, "2")
    assert version.tags["eagleops.gate"] == second["reason"] and version.tags["eagleops.gate"].startswith("promoted: ")
    # Training started from the champion's weights: the train stage's recorded input is the download.
    assert version.tags["eagleops.init_from"] == f"models:/{MODEL}/1"
    run_dir = Path(second["run_dir"])
    data = manifest(run_dir)["stages"]["generate_data"]
    assert version.tags["eagleops.data_hash"] == data["output_digest"]
    assert version.tags["eagleops.vocab_map_hash"] == digest_paths([data["outputs"]["vocab"]])
    assert version.tags["eagleops.layer_ids"] == ",".join(map(str, data["summary"]["aux_layer_ids"]))
    assert version.tags["eagleops.target"] == "tiny"
    assert version.tags["eagleops.config_hash"] == manifest(run_dir)["config_hash"]
    bench_run = client.get_run(version.tags["eagleops.benchmark_run_id"])
    assert bench_run.data.tags["mlflow.parentRunId"] == second["mlflow_run_id"]
    assert bench_run.data.metrics["challenger.c1.accept_length"] == challenger_row["accept_length"]
    assert bench_run.data.metrics["champion.c1.accept_length"] == champion_row["accept_length"]
    parent = client.get_run(second["mlflow_run_id"])
    assert parent.data.tags["eagleops.gate.decision"] == "promoted"


@pytest.mark.slow
def test_worse_draft_is_refused_and_the_champion_unchanged(nightlies, postgres_mlflow):
    third = nightlies["random"]["result"]
    assert not third["promoted"] and third["challenger"] == "3"
    assert nightlies["random"]["aliases"] == {"champion": "2", "previous": "1"}
    assert third["reason"].startswith("refused: ") and "nightly.accept_length_tolerance" in third["reason"]
    client = MlflowClient(postgres_mlflow.uri)
    assert client.get_model_version(MODEL, "3").tags["eagleops.gate"] == third["reason"]
    assert client.get_model_version(MODEL, "3").tags["eagleops.init_from"] == "scratch"
    parent = client.get_run(third["mlflow_run_id"])
    assert parent.data.tags["eagleops.gate"] == third["reason"]
    assert parent.data.tags["eagleops.gate.decision"] == "refused"
    assert manifest(third["run_dir"])["nightly"]["reason"] == third["reason"]

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def read():
        async with get_client() as prefect:
            return await prefect.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["nightly-nightly-gate"])))

    markdown = [a.data for a in asyncio.run(read())]
    assert any("version 3 **refused** (champion kept)" in m and "| champion v2 | 1 |" in m for m in markdown)
    assert any("version 2 **promoted**" in m for m in markdown)


@pytest.mark.slow
def test_champion_downloads_as_a_directory_sglang_loads(nightlies, postgres_mlflow, tmp_path, monkeypatch):
    # models:/ URIs resolve through the default tracking/registry store, not download_artifacts' tracking_uri
    # argument: without this, MLflow 3.17 creates ./mlflow.db and answers "Registered Model ... not found".
    monkeypatch.setenv("MLFLOW_TRACKING_URI", postgres_mlflow.uri)
    local = Path(download_artifacts(artifact_uri=f"models:/{MODEL}@champion", dst_path=str(tmp_path),
                                    tracking_uri=postgres_mlflow.uri))
    assert (local / "config.json").is_file() and (local / "model.safetensors").is_file()
    run_dir = nightlies["trained"]["result"]["run_dir"]
    exported = manifest(run_dir)["stages"]["export_checkpoint"]["outputs"]
    assert file_sha256(local / "model.safetensors") == file_sha256(Path(exported["sglang_dir"], "model.safetensors"))
    problems = validate_sglang_checkpoint(local, read_target_config(Path(exported["target_dir"])))
    assert [p for p in problems if p.severity == "error"] == []


@pytest.mark.slow
def test_no_server_outlives_the_nightlies(nightlies):
    runs = {str(Path(n["result"]["run_dir"])) for n in nightlies.values()}
    assert [pid for run_dir in runs for pid in reference_servers_alive(run_dir)] == []
    for run_dir in runs:
        servers = json.loads((Path(run_dir) / "servers.json").read_text())
        assert servers and all(s["status"] == "stopped" for s in servers.values())


@pytest.mark.slow
def test_resumed_nightly_reapplies_its_recorded_decision_without_measuring_again(nightlies, postgres_mlflow):
    third = nightlies["random"]
    again = nightly_retrain(str(third["config"]), run_dir=third["result"]["run_dir"])
    assert again["reason"] == third["result"]["reason"] and not again["promoted"]
    assert again["rows"] == {} and again["challenger"] == "3"  # the export was reused: no new version
    assert again["bench_run_id"] == third["result"]["bench_run_id"]  # the measurement that decided it
    client = MlflowClient(postgres_mlflow.uri)
    assert sorted(v.version for v in client.search_model_versions(f"name = '{MODEL}'")) == ["1", "2", "3"]
    assert dict(client.get_registered_model(MODEL).aliases) == {"champion": "2", "previous": "1"}
    stages = manifest(third["result"]["run_dir"])["stages"]
    assert [a["attempt"] for a in stages["train_draft"]["attempts"]] == [1]


# ------------------------------------------------------------------ the decision alone


def rows(tok_s: float, accept: float, concurrency: int = 1) -> list[dict]:
    return [{"concurrency": concurrency, "tok_s_median": tok_s, "accept_length": accept}]


def test_decide_promotes_only_beyond_the_tok_s_margin():
    gate = NightlyConfig(min_tok_s_gain=0.05)
    assert decide(gate, rows(106.0, 3.0), rows(100.0, 3.0))["promote"]
    refused = decide(gate, rows(104.0, 3.0), rows(100.0, 3.0))
    assert not refused["promote"]
    assert refused["reason"] == ("refused: tok/s 104.0 vs champion 100.0 (+4.0%; nightly.min_tok_s_gain +5.0%) "
                                 "at concurrency 1")


def test_decide_refuses_a_faster_draft_that_loses_accept_length_beyond_the_tolerance():
    gate = NightlyConfig(min_tok_s_gain=0.0, accept_length_tolerance=0.05)
    assert decide(gate, rows(150.0, 2.9), rows(100.0, 3.0))["promote"]  # -3.3%: within 5%
    refused = decide(gate, rows(150.0, 2.8), rows(100.0, 3.0))
    assert not refused["promote"] and "accept length 2.80 vs champion 3.00 (-6.7%" in refused["reason"]


def test_decide_needs_every_concurrency_level_to_win():
    gate = NightlyConfig(min_tok_s_gain=0.0)
    champion = rows(100.0, 3.0, 1) + rows(300.0, 3.0, 8)
    refused = decide(gate, rows(120.0, 3.0, 1) + rows(290.0, 3.0, 8), champion)
    assert not refused["promote"] and refused["reason"].endswith("at concurrency 8")
    assert [c["concurrency"] for c in refused["comparisons"]] == [1, 8]


def test_first_draft_below_the_floor_does_not_become_champion():
    gate = NightlyConfig(min_accept_length=1.2)
    refused = decide(gate, rows(50.0, 1.05), None)
    assert refused == {"promote": False, "comparisons": [],
                       "reason": "refused: accept length 1.05 below nightly.min_accept_length 1.2 at concurrency 1"}
    assert decide(gate, rows(50.0, 1.3), None)["reason"].startswith("promoted: first champion")


# ------------------------------------------------------------------ where training starts


def write_plain_config(folder: Path, start_from: str) -> Path:
    config = folder / "nightly.yaml"
    config.write_text(CONFIG.format(runs=folder / "runs", steps=3, lr=0.003, model=MODEL, port=30000,
                                    prompts=folder / "prompts.jsonl", tracking="http://127.0.0.1:5000",
                                    start_from=start_from))
    return config


def test_training_starts_from_the_champion_through_an_overlay_of_the_config(tmp_path):
    config = write_plain_config(tmp_path, "champion")
    cfg = load_experiment(config)
    champion = {"version": "4", "dir": str(tmp_path / "champion-v4"), "uri": f"models:/{MODEL}/4"}
    assert training_config(cfg, str(config), None, None) == (str(config), None)  # no champion yet: scratch
    overlay, variant = training_config(cfg, str(config), champion, None)
    started = load_experiment(overlay, variant)
    assert started.train.init_checkpoint == champion["dir"]
    assert started.model_copy(update={"train": cfg.train}) == cfg  # nothing else differs
    # A resumed nightly keeps the overlay it started with (same starting weights), whatever the champion is now.
    run_dir = tmp_path / "runs" / "nightly" / "20260101-000000-abcdef"
    run_dir.mkdir(parents=True)
    (run_dir / "manifest.json").write_text(json.dumps({"config_path": overlay, "stages": {}}))
    assert training_config(cfg, str(config), {**champion, "version": "5"}, str(run_dir)) == (overlay, 0)


def test_scratch_ignores_the_champion(tmp_path):
    config = write_plain_config(tmp_path, "scratch")
    champion = {"version": "4", "dir": str(tmp_path / "champion-v4"), "uri": f"models:/{MODEL}/4"}
    assert training_config(load_experiment(config), str(config), champion, None) == (str(config), None)
