"""The ML stages through the flow on a test-size target: data -> train -> export, with the
stage summaries on disk, the metrics/artifacts in MLflow and resume reusing finished stages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.experiment import eagle3_experiment

CONFIG = """\
experiment: stages
runs_root: {runs}
target:
  kind: tiny
  dtype: float32
  tiny:
    vocab_size: 300
    hidden_size: 32
    intermediate_size: 64
    num_hidden_layers: 7
    num_attention_heads: 2
    num_key_value_heads: 1
    max_position_embeddings: 256
    corpus_max_bytes: 60000
    train_steps: 10
    batch_size: 4
    seq_len: 64
    eval_tokens: 1024
    num_threads: 1
data:
  num_samples: 12
  max_length: 256
  validation_fraction: 0.25
  regenerate:
    max_new_tokens: 16
  draft_vocab_size: 64
  hidden_states_dtype: float32
train:
  ttt_steps: 3
  max_steps: 4
  batch_size: 4
  lr: 0.001
  eval_every: 2
  checkpoint_every: 2
  log_every: 1
export:
  formats: [sglang, speculators]
  dtype: float32
  registered_model: stages-draft
"""


@pytest.fixture(scope="module")
def stage_run(prefect_harness, tmp_path_factory):
    folder = tmp_path_factory.mktemp("stages")
    config = folder / "stages.yaml"
    config.write_text(CONFIG.format(runs=folder / "runs"))
    result = eagle3_experiment(str(config), stages=["generate_data", "train_draft", "export_checkpoint"])
    return config, folder / "runs", result


@pytest.mark.slow
def test_data_train_export_through_the_flow(stage_run):
    _, runs, result = stage_run
    run_dir = Path(result["run_dir"])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    for stage in ("generate_data", "train_draft", "export_checkpoint"):
        assert manifest["stages"][stage]["status"] == "completed", manifest["stages"][stage]
        assert (run_dir / stage / "summary.json").is_file()
    train = json.loads((run_dir / "train_draft" / "summary.json").read_text())
    assert 1.0 <= train["metrics"]["simulated_accept_length"] <= 4.0
    assert Path(train["outputs"]["target_dir"], "config.json").is_file()
    exported = json.loads((run_dir / "export_checkpoint" / "summary.json").read_text())
    sglang_config = json.loads(Path(exported["outputs"]["sglang_dir"], "config.json").read_text())
    assert sglang_config["architectures"] == ["LlamaForCausalLMEagle3"]
    data = json.loads((run_dir / "generate_data" / "summary.json").read_text())
    assert sglang_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == data["aux_layer_ids"] == [1, 2, 3]

    client = MlflowClient(f"sqlite:///{runs / 'mlflow.db'}")
    kids = {r.info.run_name: r for r in client.search_runs(
        [client.get_run(result["mlflow_run_id"]).info.experiment_id],
        f"tags.mlflow.parentRunId = '{result['mlflow_run_id']}'")}
    train_run = kids["train_draft"]
    history = client.get_metric_history(train_run.info.run_id, "train/loss")
    assert len(history) >= 2 and history[0].step < history[-1].step
    assert "plots/training_curves.png" in [a.path for a in client.list_artifacts(train_run.info.run_id, "plots")]
    assert kids["generate_data"].data.params["hf_hidden_state_indices"] == "[2, 3, 4]"
    assert [a.path for a in client.list_artifacts(kids["export_checkpoint"].info.run_id, "checkpoint")] >= ["checkpoint/sglang"]
    assert client.get_model_version("stages-draft", "1").run_id == kids["export_checkpoint"].info.run_id
    parent = client.get_run(result["mlflow_run_id"])
    assert "train_draft.simulated_accept_length" in parent.data.metrics


@pytest.mark.slow
def test_resume_reuses_finished_ml_stages(stage_run):
    config, _, result = stage_run
    run_dir = Path(result["run_dir"])
    before = json.loads((run_dir / "manifest.json").read_text())["stages"]
    eagle3_experiment(str(config), run_dir=str(run_dir), stages=["generate_data", "train_draft", "export_checkpoint"])
    after = json.loads((run_dir / "manifest.json").read_text())["stages"]
    for stage in ("generate_data", "train_draft", "export_checkpoint"):
        assert after[stage]["mlflow_run_id"] == before[stage]["mlflow_run_id"]
