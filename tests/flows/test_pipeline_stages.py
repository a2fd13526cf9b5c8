"""The ML stages through the flow on a test-size target: data -> train -> export, with the
stage summaries on disk, the metrics/artifacts in MLflow, and resume by real inputs: a table of
single-field changes mapped to the exact stages that run again (manifest and MLflow agree)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from flows.cli import app
from flows.experiment import eagle3_experiment
from tasks.rundir import RunDirectory, file_sha256

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
        assert (run_dir / stage / "attempt-1" / "summary.json").is_file()
    train = json.loads((run_dir / "train_draft" / "attempt-1" / "summary.json").read_text())
    assert 1.0 <= train["metrics"]["simulated_accept_length"] <= 4.0
    # a summary's paths are relative to the run folder: inside it ./..., the runs root's cache ../../cache/...
    assert train["outputs"]["target_dir"].startswith("../../cache/targets/tiny-target-")
    assert (run_dir / train["outputs"]["target_dir"] / "config.json").is_file()
    exported = json.loads((run_dir / "export_checkpoint" / "attempt-1" / "summary.json").read_text())
    assert exported["outputs"]["sglang_dir"] == "./export_checkpoint/attempt-1/sglang"
    sglang_config = json.loads((run_dir / exported["outputs"]["sglang_dir"] / "config.json").read_text())
    assert sglang_config["architectures"] == ["LlamaForCausalLMEagle3"]
    data = json.loads((run_dir / "generate_data" / "attempt-1" / "summary.json").read_text())
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


ML_STAGES = ("generate_data", "train_draft", "export_checkpoint")

# One field changed at a time (relative to CONFIG) -> the ML stages that must run again.
SINGLE_FIELD_CHANGES = [
    ("nothing", None, set()),
    ("target", ("target:\n  kind: tiny", "target:\n  kind: tiny\n  aux_layer_ids: [0, 2, 4]"), set(ML_STAGES)),
    ("data", ("  num_samples: 12", "  num_samples: 16"), set(ML_STAGES)),
    ("data, operational", ("    max_new_tokens: 16", "    max_new_tokens: 16\n    concurrency: 3"), set()),
    ("data, secret", ("    max_new_tokens: 16", "    max_new_tokens: 16\n    api_key: rotated-key-123"), set()),
    ("train", ("  lr: 0.001", "  lr: 0.002"), {"train_draft", "export_checkpoint"}),
    ("train, logging only", ("  log_every: 1", "  log_every: 2"), set()),
    ("export", ("  formats: [sglang, speculators]", "  formats: [sglang]"), {"export_checkpoint"}),
    ("deploy", ("export:", "deploy:\n  port: 31001\nexport:"), set()),
    ("bench", ("export:", "bench:\n  num_prompts: 3\nexport:"), set()),
    ("hosts", ("export:", "hosts:\n  - {name: gpu-9, address: 127.0.0.1, user: x}\nexport:"), set()),
    ("description", ("experiment: stages", "experiment: stages\ndescription: another note"), set()),
]


def children_of(client: MlflowClient, parent_id: str) -> dict[str, list]:
    parent = client.get_run(parent_id)
    runs = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    found: dict[str, list] = {}
    for run in runs:
        found.setdefault(run.info.run_name, []).append(run)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("label, edit, expected", SINGLE_FIELD_CHANGES, ids=[c[0] for c in SINGLE_FIELD_CHANGES])
def test_single_field_change_reruns_exactly_what_depends_on_it(stage_run, tmp_path, label, edit, expected):
    config, runs, result = stage_run
    run_dir = Path(result["run_dir"])
    text = config.read_text()
    if edit:
        assert edit[0] in text
        text = text.replace(edit[0], edit[1], 1)
    changed = tmp_path / "changed.yaml"
    changed.write_text(text)
    before = RunDirectory.open(run_dir).manifest["stages"]
    again = eagle3_experiment(str(changed), run_dir=str(run_dir), stages=["check_environment", *ML_STAGES])
    after = RunDirectory.open(run_dir).manifest["stages"]  # paths located where the folder is

    rerun = {s for s in ML_STAGES if len(after[s]["attempts"]) > len(before[s]["attempts"])}
    assert rerun == expected
    for stage in ML_STAGES:
        assert after[stage]["status"] == "completed"
        if stage not in expected:  # reused: the current attempt has this config's inputs, no new work
            assert Path(after[stage]["dir"]).is_dir()
    for stage in expected:  # a new attempt folder; the earlier ones are kept
        assert after[stage]["dir"].endswith(f"attempt-{len(after[stage]['attempts'])}")
        assert all(Path(a["dir"]).is_dir() for a in after[stage]["attempts"])
    # MLflow agrees: this flow run's parent has a child exactly for the stages that ran.
    client = MlflowClient(f"sqlite:///{runs / 'mlflow.db'}")
    kids = children_of(client, again["mlflow_run_id"])
    ran_now = {name for name in kids if name in ML_STAGES and any(
        r.info.run_id == after[name]["mlflow_run_id"] and r.info.status == "FINISHED" for r in kids[name])}
    if again["mlflow_run_id"] != result["mlflow_run_id"]:  # a changed config gets its own parent run
        assert ran_now == expected
    # Changing the field back reuses the first attempts: nothing trains twice for the same inputs.
    eagle3_experiment(str(config), run_dir=str(run_dir), stages=list(ML_STAGES))
    restored = json.loads((run_dir / "manifest.json").read_text())["stages"]
    for stage in ML_STAGES:
        assert restored[stage]["current_attempt"] == 1
        assert len(restored[stage]["attempts"]) == len(after[stage]["attempts"])


def test_a_stage_without_its_upstream_outputs_says_which_stage_to_add(prefect_harness, tmp_path):
    from tasks.runner.stages import SelectionError

    config = tmp_path / "fresh.yaml"
    config.write_text(CONFIG.format(runs=tmp_path / "runs"))
    with pytest.raises(SelectionError, match="train_draft needs the outputs of generate_data.*add generate_data to --stages"):
        eagle3_experiment(str(config), stages=["train_draft"])
    run_dir = next((tmp_path / "runs" / "stages").iterdir())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["stages"] == {}  # nothing ran, nothing was half-recorded



# ------------------------------------------------------------------ run folders that move


def snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file under `folder` with its bytes' sha256 and its mtime: what "never touched" compares."""
    return {str(p.relative_to(folder)): (file_sha256(p), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def copy_runs_root(runs: Path, to: Path) -> Path:
    shutil.copytree(runs, to, symlinks=True)  # cp -a
    return to


def resume_ml_stages(config: Path, run_dir: Path, stages: tuple[str, ...] = ML_STAGES) -> tuple[dict, dict]:
    """Resume `run_dir` on `stages` (and the environment check, which always runs): manifests before, after."""
    before = RunDirectory.open(run_dir).manifest
    eagle3_experiment(str(config), run_dir=str(run_dir), stages=["check_environment", *stages])
    return before, RunDirectory.open(run_dir).manifest


def assert_nothing_rerun(before: dict, after: dict, run_dir: Path) -> None:
    for stage in ML_STAGES:  # the same attempts, the current one reused where the folder is now
        assert len(after["stages"][stage]["attempts"]) == len(before["stages"][stage]["attempts"]), stage
        assert after["stages"][stage]["current_attempt"] == before["stages"][stage]["current_attempt"], stage
        assert Path(after["stages"][stage]["dir"]).parent.parent == run_dir
    assert after["mlflow"]["parent_run_id"] == before["mlflow"]["parent_run_id"]  # the same MLflow parent, reopened


def recorded_paths(run_dir: Path) -> str:
    """The manifest as written, minus stage inputs (kept as recorded): every attempt's dir, outputs, summary."""
    on_disk = json.loads((run_dir / "manifest.json").read_text())
    return json.dumps([{k: v for k, v in a.items() if k != "inputs"}
                       for entry in on_disk["stages"].values() for a in entry.get("attempts", [])])


def artifact_uri(tracking_uri: str, run_id: str) -> str:
    return MlflowClient(tracking_uri).get_run(run_id).info.artifact_uri


@pytest.mark.slow
def test_a_copied_runs_root_resumes_in_the_copy_and_never_touches_the_original(stage_run, tmp_path, monkeypatch):
    config, runs, result = stage_run
    original = snapshot(runs)  # run folder, mlflow.db, mlartifacts, tiny-target cache
    copy_root = copy_runs_root(runs, tmp_path / "shared" / "runs")
    run_dir = copy_root / "stages" / Path(result["run_dir"]).name
    monkeypatch.chdir(tmp_path)  # another working directory
    before, after = resume_ml_stages(config, run_dir)

    assert_nothing_rerun(before, after, run_dir)
    assert snapshot(runs) == original
    store = after["mlflow"]["tracking_uri"]
    assert store == f"sqlite:///{copy_root / 'mlflow.db'}"  # the copy's own store ...
    copied_artifacts = (copy_root / "mlartifacts").as_uri() + "/"  # ... whose artifacts land in the copy
    assert artifact_uri(store, after["stages"]["check_environment"]["mlflow_run_id"]).startswith(copied_artifacts)
    assert artifact_uri(store, after["mlflow"]["parent_run_id"]).startswith(copied_artifacts)
    assert str(tmp_path) not in recorded_paths(run_dir) and str(runs) not in recorded_paths(run_dir)


@pytest.mark.slow
def test_a_renamed_runs_root_resumes_and_compares_from_another_directory(stage_run, tmp_path, monkeypatch):
    config, runs, result = stage_run
    old_root = copy_runs_root(runs, tmp_path / "runs")
    moved_config = tmp_path / "stages.yaml"  # the config as it was, naming the old root
    moved_config.write_text(CONFIG.format(runs=old_root))
    renamed = old_root.rename(tmp_path / "runs-renamed")  # mv runs runs-renamed
    run_dir = renamed / "stages" / Path(result["run_dir"]).name
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    # Only the last ML stage: its upstreams must be found reusable where the folder is now (they were
    # not: "export_checkpoint needs the outputs of train_draft, but train_draft's inputs changed").
    before, after = resume_ml_stages(moved_config, run_dir, stages=("export_checkpoint",))

    assert_nothing_rerun(before, after, run_dir)
    assert not old_root.exists()  # nothing (an MLflow artifact, the tiny target) recreated the old place
    assert after["mlflow"]["tracking_uri"] == f"sqlite:///{renamed / 'mlflow.db'}"
    report_run = after["stages"]["report"]["mlflow_run_id"]
    assert artifact_uri(after["mlflow"]["tracking_uri"], report_run).startswith((renamed / "mlartifacts").as_uri())

    name = f"stages-{Path(result['run_dir']).name}"
    for where, shown in ((elsewhere, os.path.relpath(run_dir, elsewhere)), (renamed, f"stages/{run_dir.name}")):
        monkeypatch.chdir(where)
        compared = CliRunner().invoke(app, ["compare", shown])
        assert compared.exit_code == 0, compared.output
        assert name in compared.output and "FINISHED" in compared.output


@pytest.mark.slow
def test_a_moved_runs_root_reuses_its_cached_tiny_target(stage_run, tmp_path):
    config, runs, result = stage_run
    old_root = copy_runs_root(runs, tmp_path / "runs")
    renamed = old_root.rename(tmp_path / "runs-renamed")
    cache = renamed / "cache" / "targets"
    cached = snapshot(cache)
    changed = tmp_path / "fewer-samples.yaml"  # the data stage runs again, so it needs the target again
    changed.write_text(CONFIG.format(runs=old_root).replace("  num_samples: 12", "  num_samples: 10"))
    run_dir = renamed / "stages" / Path(result["run_dir"]).name
    before = RunDirectory.open(run_dir).manifest["stages"]["generate_data"]
    eagle3_experiment(str(changed), run_dir=str(run_dir), stages=["generate_data"])

    data = RunDirectory.open(run_dir).manifest["stages"]["generate_data"]
    assert data["status"] == "completed" and len(data["attempts"]) == len(before["attempts"]) + 1
    assert Path(data["outputs"]["target_dir"]) == Path(before["outputs"]["target_dir"])  # the same target ...
    assert Path(data["outputs"]["target_dir"]).parent == cache  # ... found in the moved root's cache
    assert snapshot(cache) == cached  # reused as it was: not trained again, nothing added
    assert not old_root.exists()


def test_the_light_stage_list_is_the_runners():
    """`eagleops run` checks --stages against tasks.runner.stages (no Prefect/MLflow/torch import before its server
    starts); the runner's specs must name the same stages in the same order."""
    from tasks.runner.specs import STAGE_SPECS
    from tasks.runner.stages import STAGES

    assert list(STAGE_SPECS) == STAGES
