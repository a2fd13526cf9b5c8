"""The training data as an MLflow dataset input (tasks.stages.train.dataset_input + RunLogger.log_dataset): what
it records for prompts on this machine and for served traffic on a data host (its window), then against the
session's real `mlflow server`: runs found by the dataset (MLflow's `dataset.name` / `dataset.digest` search,
what the runs table filters and groups on), logging it again adds nothing, and a journaled one replays."""

from __future__ import annotations

import json

from mlflow.tracking import MlflowClient

from tasks.config.schema import ExperimentConfig
from tasks.stages.train.dataset_input import training_dataset
from tasks.tracking.journal import journal_path
from tasks.tracking.outage import check_tracking_server
from tasks.tracking.run_logger import create_run
from tasks.tracking.sync import sync_journal
from tests.helpers import free_port

DIGEST = "3f1c9a0b7d2e4f65"
# As the data summary counts them (eagle3.data.generate), and as the profile shows them.
FIGURES = {"num_samples": {"train": 9, "validation": 3}, "num_tokens": {"train": 1350, "validation": 450},
           "num_assistant_tokens": 600, "hidden_states": "offline"}
PROFILE = {"samples": 12, "samples_train": 9, "samples_validation": 3, "tokens": 1800, "tokens_train": 1350,
           "tokens_validation": 450, "assistant_tokens": 600, "hidden_states": "offline"}


def config(train: dict | None = None, **data) -> ExperimentConfig:
    return ExperimentConfig.model_validate({"experiment": "ds", "target": {"kind": "tiny"}, "data": data,
                                            "train": train or {},
                                            "hosts": [{"name": "gpu_1", "address": "10.0.0.1", "user": "eagle"}]})


def test_prompts_on_this_machine(tmp_path):
    data = {**FIGURES, "outputs": {"dataset_dir": str(tmp_path / "dataset")}}
    dataset = training_dataset(config(prompts="/data/chat.jsonl"), data, DIGEST)
    assert dataset["name"] == "prompts:chat.jsonl" and dataset["digest"] == DIGEST
    assert dataset["source_type"] == "local"
    assert json.loads(dataset["source"]) == {"uri": (tmp_path / "dataset").as_uri(), "prompts": "/data/chat.jsonl"}
    assert json.loads(dataset["profile"]) == {**PROFILE, "digest": DIGEST, "source": "prompts"}


def test_served_traffic_on_a_data_host_carries_its_window():
    window = {"since": "2026-12-01T00:00:00+00:00", "until": "2026-12-04T00:00:00+00:00"}
    data = {**FIGURES, "served": {"dumps": "/srv/dumps", "window": window},
            "outputs": {"host": "gpu_1", "host_dataset_dir": "/work/data/ds/run/generate_data/1/dataset",
                        "dataset_dir": "/tmp/local-copy"}}
    dataset = training_dataset(config({"nodes": ["gpu_1"]}, source="served", served={"dumps": "/srv/dumps"},
                                host="gpu_1"), data, DIGEST)
    assert dataset["name"] == "served:dumps" and dataset["source_type"] == "ssh"
    assert json.loads(dataset["source"]) == {"uri": "ssh://gpu_1/work/data/ds/run/generate_data/1/dataset",
                                             "served_dumps": "/srv/dumps", "window": window}
    profile = json.loads(dataset["profile"])
    assert profile["window_since"] == window["since"] and profile["window_until"] == window["until"]
    assert profile["source"] == "served" and profile["samples"] == 12 and profile["tokens_validation"] == 450


def dataset(name: str, digest: str) -> dict[str, str]:
    return {"name": name, "digest": digest, "source_type": "local", "source": json.dumps({"uri": "file:///d"}),
            "profile": json.dumps({"num_samples": 12})}


def test_runs_are_found_by_their_training_data(mlflow_server, tmp_path):
    mlflow_server.start()
    journal = journal_path(tmp_path)
    assert check_tracking_server(mlflow_server.uri, journal)
    runs = [create_run(mlflow_server.uri, journal, f"draft-{i}", {}, experiment="dataset-inputs") for i in range(3)]
    for run, digest in zip(runs, ("aaaa000011112222", "aaaa000011112222", "bbbb000011112222")):
        run.log_dataset(dataset("prompts:chat.jsonl", digest))
    runs[0].log_dataset(dataset("prompts:chat.jsonl", "aaaa000011112222"))  # a resume logs it again
    client = MlflowClient(mlflow_server.uri)
    (first,) = client.get_run(runs[0].run_id).inputs.dataset_inputs
    assert first.dataset.digest == "aaaa000011112222" and first.dataset.source_type == "local"
    assert [(t.key, t.value) for t in first.tags] == [("mlflow.data.context", "training")]
    experiment = client.get_experiment_by_name("dataset-inputs").experiment_id
    found = client.search_runs([experiment], "dataset.digest = 'aaaa000011112222'")
    assert {r.info.run_id for r in found} == {runs[0].run_id, runs[1].run_id}
    assert len(client.search_runs([experiment], "dataset.name = 'prompts:chat.jsonl'")) == 3


def test_a_journaled_dataset_input_replays(mlflow_server, tmp_path):
    mlflow_server.start()
    journal = journal_path(tmp_path)
    dead = f"http://127.0.0.1:{free_port()}"
    assert not check_tracking_server(dead, journal)
    run = create_run(dead, journal, "offline-draft", {}, experiment="dataset-inputs-offline")
    run.log_dataset(dataset("served:dumps", "cccc000011112222"))
    result = sync_journal(tmp_path, mlflow_server.uri)
    assert result.refused == []
    (replayed,) = MlflowClient(mlflow_server.uri).get_run(result.created[run.run_id]).inputs.dataset_inputs
    assert (replayed.dataset.name, replayed.dataset.digest) == ("served:dumps", "cccc000011112222")
