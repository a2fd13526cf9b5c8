"""Model-registry writes survive an MLflow outage like run writes: journaled in the run folder, made by
`eagleops sync RUN_DIR` in order, and safe to replay (a real `mlflow server` on 127.0.0.1, stopped and started).

(a) the nightly gate's decision (lineage and decision tags, the champion/previous move, the parent run's
    tags) made while the server is down is journaled instead of failing the nightly; sync applies it once;
    a replay of every entry again registers nothing twice and flips nothing; and a replay after another
    champion was promoted meanwhile leaves that champion alone, refused in one line.
(b) the export's registration made while the server is down: the challenger has no version number yet,
    so the gate stops in one line naming the resume; sync registers it once and writes its number into
    the manifest, where the resumed nightly reads it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tasks.tracking.journal import JOURNAL_FILE, STATE_FILE, Journal, is_placeholder, journal_path
from tasks.tracking.outage import check_tracking_server
from tasks.tracking.registry import GATE_TAG, RegistryUnavailable, challenger_version, promote_or_keep
from tasks.tracking.registry_ops import APPLIED_TAG
from tasks.tracking.run_logger import RunLogger, create_run, start_child_run
from tests.tasks.tracking.test_tracking_outage import captured, manifest_of, sync  # noqa: F401  (fixture)


@pytest.fixture
def online(mlflow_server, tmp_path):
    """A run folder whose experiment parent run was created online (its journal registered for the run id)."""
    mlflow_server.start()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    journal = journal_path(run_dir)
    assert check_tracking_server(mlflow_server.uri, journal)
    parent = create_run(mlflow_server.uri, journal, "nightly", {"eagleops.kind": "experiment"},
                        experiment=f"registry-outage-{tmp_path.name}")
    (run_dir / "manifest.json").write_text(json.dumps(
        {"config_path": "configs/nightly.yaml", "mlflow": {"tracking_uri": mlflow_server.uri,
                                                           "parent_run_id": parent.run_id}}))
    yield run_dir, parent
    mlflow_server.start()
    check_tracking_server(mlflow_server.uri, None)  # this process's record of the outage ends with the test


def exported(parent: RunLogger, tmp_path: Path, model: str, label: str) -> str:
    """One export stage's run: its checkpoint folder logged and registered (a version, or a placeholder offline)."""
    child = start_child_run(parent, "export_checkpoint", {})
    folder = tmp_path / f"ckpt-{label}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"label": label}))
    child.log_artifact(folder, "checkpoint/sglang")
    return child.register_version(model, "checkpoint/sglang", {"format": "sglang"})


def aliases(client: MlflowClient, model: str) -> dict[str, str]:
    return dict(client.get_registered_model(model).aliases)


def replay_everything_again(run_dir: Path) -> None:
    """As after a sync killed between its calls and its state writes: every entry is replayed once more."""
    state = json.loads((run_dir / STATE_FILE).read_text())
    (run_dir / STATE_FILE).write_text(json.dumps({**state, "done": 0, "refused": []}))


def test_gate_decision_in_an_outage_is_journaled_and_made_once_by_sync(online, mlflow_server, tmp_path):
    run_dir, parent = online
    model = f"registry-outage-{tmp_path.name}"
    uri = mlflow_server.uri
    v1 = exported(parent, tmp_path, model, "v1")
    promote_or_keep.fn(uri, model, v1, None, True, "promoted: first champion", {}, parent.run_id)
    v2 = exported(parent, tmp_path, model, "v2")
    client = MlflowClient(uri)
    assert aliases(client, model) == {"champion": v1}

    mlflow_server.stop()  # the gate measured v2 against v1; the registry stops answering before the decision
    lineage = {"eagleops.data_hash": "data-digest", "eagleops.init_from": f"models:/{model}/{v1}"}
    outcome = promote_or_keep.fn(uri, model, v2, v1, True, "promoted: v2 beats v1", lineage, parent.run_id)
    assert outcome["promoted"] and outcome["journaled"] == str(run_dir / JOURNAL_FILE)
    ops = [e["op"] for e in Journal(run_dir / JOURNAL_FILE).entries()]
    assert ops == ["set_version_tags", "move_champion", "log_batch"]

    mlflow_server.start()
    first = sync(run_dir)
    assert first.exit_code == 0, first.output
    assert aliases(client, model) == {"champion": v2, "previous": v1}
    tags = client.get_model_version(model, v2).tags
    assert tags[GATE_TAG] == "promoted: v2 beats v1" and tags["eagleops.data_hash"] == "data-digest"
    assert client.get_run(parent.run_id).data.tags["eagleops.gate.decision"] == "promoted"
    assert "nothing to sync" in sync(run_dir).output

    replay_everything_again(run_dir)
    again = sync(run_dir)
    assert again.exit_code == 0, again.output
    assert aliases(client, model) == {"champion": v2, "previous": v1}
    assert len(client.search_model_versions(f"name = '{model}'")) == 2

    # Another nightly promotes v3 over v2 meanwhile; a replay of the v2-over-v1 decision must leave v3 champion.
    other_dir = tmp_path / "other-run"
    other_dir.mkdir()
    assert check_tracking_server(uri, journal_path(other_dir))  # a new run starts with the probe
    other = create_run(uri, journal_path(other_dir), "nightly", {}, experiment=f"registry-outage-{tmp_path.name}")
    v3 = exported(other, tmp_path, model, "v3")
    promote_or_keep.fn(uri, model, v3, v2, True, "promoted: v3 beats v2", {}, other.run_id)
    replay_everything_again(run_dir)
    late = sync(run_dir)
    assert late.exit_code == 1, late.output
    (line,) = [line for line in late.output.splitlines() if "refused" in line]
    assert f"not promoting version {v2}: the champion is version {v3} now, not version {v1}" in line
    assert aliases(client, model) == {"champion": v3, "previous": v2}
    assert client.get_model_version(model, v2).tags[APPLIED_TAG].startswith(f"no: {model}: not promoting version {v2}")


def test_export_registered_in_an_outage_gets_its_number_from_sync(online, mlflow_server, tmp_path):
    run_dir, parent = online
    model = f"registry-outage-{tmp_path.name}"
    mlflow_server.stop()
    pending = exported(parent, tmp_path, model, "offline")
    assert is_placeholder(pending)
    manifest = manifest_of(run_dir)
    outputs = {"registered_model_version": f"{model}/{pending}"}
    manifest["stages"] = {"export_checkpoint": {"outputs": outputs}}
    (run_dir / "manifest.json").write_text(json.dumps(manifest))

    # the nightly's gate cannot gate a version without a number: one line, what is kept, how to resume
    cfg = type("Cfg", (), {"export": type("Export", (), {"registered_model": model})()})()
    experiment = {"run_dir": str(run_dir), "results": {"export_checkpoint": {"outputs": outputs}}}
    with pytest.raises(RegistryUnavailable) as refused:
        challenger_version(cfg, experiment)
    assert "\n" not in str(refused.value)
    assert f"resume with: eagleops nightly configs/nightly.yaml --run-dir {run_dir}" in str(refused.value)

    mlflow_server.start()
    synced = sync(run_dir)
    assert synced.exit_code == 0, synced.output
    client = MlflowClient(mlflow_server.uri)
    (version,) = client.search_model_versions(f"name = '{model}'")
    recorded = manifest_of(run_dir)["stages"]["export_checkpoint"]["outputs"]["registered_model_version"]
    assert recorded == f"{model}/{version.version}"
    assert challenger_version(cfg, {"run_dir": str(run_dir), "results": manifest_of(run_dir)["stages"]}) == version.version

    replay_everything_again(run_dir)
    assert sync(run_dir).exit_code == 0
    assert len(client.search_model_versions(f"name = '{model}'")) == 1


# --------------------------------------------------------------------------- (c) the nightly flow itself

NIGHTLY_CONFIG = """\
experiment: registry-outage-nightly
runs_root: {runs}
{target}data:
  num_samples: 64
  max_length: 256
  validation_fraction: 0.25
  regenerate: {{max_new_tokens: 48}}
  draft_vocab_size: 64
train: {{ttt_steps: 3, epochs: 20, max_steps: {steps}, batch_size: 4, lr: 0.003, eval_every: 1000,
         checkpoint_every: 1000}}
export: {{formats: [sglang], dtype: float32, registered_model: {model}}}
deploy:
  server: reference
  port: {port}
  speculative: {{num_steps: 3, eagle_topk: 1, num_draft_tokens: 4}}
  startup_timeout_s: 240
bench: {{prompts: {prompts}, num_prompts: 2, max_new_tokens: 10, warmup_runs: 1, timed_runs: 1}}
tracking: {{uri: "{uri}"}}
nightly: {{start_from: champion, min_tok_s_gain: -0.95, accept_length_tolerance: 0.0, min_accept_length: 1.0,
           rounds: 2}}
"""


@pytest.mark.slow
def test_nightly_whose_registry_stops_before_the_gate_completes_and_sync_applies_its_decision(
        prefect_harness, mlflow_server, tmp_path, captured):
    """A first nightly makes v1 champion; the second trains v2 from it, and the MLflow server stops as its experiment
    subflow ends (v2 registered online): the gate measures anyway, the nightly completes with its decision journaled
    (champion untouched), and `eagleops sync` then applies exactly that decision."""
    from flows.nightly import nightly_retrain
    from tests.helpers import TEST_TARGET_YAML, free_port

    mlflow_server.start()
    model = f"registry-outage-nightly-{tmp_path.name[-8:]}"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Write a function that adds two numbers.",
                                                                          "What does a for loop do?")))

    def config(name: str, steps: int) -> Path:
        path = tmp_path / f"{name}.yaml"
        path.write_text(NIGHTLY_CONFIG.format(runs=tmp_path / "runs", target=TEST_TARGET_YAML, steps=steps, model=model,
                                              port=free_port(), prompts=prompts, uri=mlflow_server.uri))
        return path

    first = nightly_retrain(str(config("first", 3)))
    client = MlflowClient(mlflow_server.uri)
    assert first["promoted"] and aliases(client, model) == {"champion": "1"}

    captured.triggers.append(("report: completed", mlflow_server.stop))  # the subflow's last stage
    started = time.time()
    try:
        second = nightly_retrain(str(config("second", 150)))
    finally:
        mlflow_server.start()
    run_dir = Path(second["run_dir"])
    assert second["challenger"] == "2" and second["champion_before"] == "1"
    assert second["journaled"] == str(run_dir / JOURNAL_FILE) and second["aliases"] == {}
    assert second["rows"], "the gate measured both drafts while the registry was down"
    assert len([line for line in captured.lines if "is not usable" in line]) == 1
    assert aliases(client, model) == {"champion": "1"}  # nothing moved while the server was down
    assert "Aliases not moved yet" in (run_dir / "nightly_gate" / "report.md").read_text()
    # the decision's event (what the on-call notification reads) says the aliases have not moved yet
    from tasks.watch.events import KEPT, PROMOTED
    from tests.flows.test_watch import events_named

    decision = PROMOTED if second["promoted"] else KEPT
    decided = [e for e in events_named(decision, started, at_least=1) if e["resource"]["eagleops.model"] == model]
    assert [e["payload"]["aliases_moved"] for e in decided] == [False], decided
    assert "aliases not moved yet: journaled in" in decided[0]["payload"]["reason"]

    synced = sync(run_dir)
    assert synced.exit_code == 0, synced.output
    assert aliases(client, model) == ({"champion": "2", "previous": "1"} if second["promoted"] else {"champion": "1"})
    tags = client.get_model_version(model, "2").tags
    assert tags[GATE_TAG] == second["reason"] and "eagleops.gate.evidence" in tags
    parent = client.get_run(manifest_of(run_dir)["mlflow"]["parent_run_id"]).data.tags
    assert parent["eagleops.gate.decision"] == ("promoted" if second["promoted"] else "refused")
    assert parent["eagleops.gate.model_version"] == f"{model}/2"
    print(f"second nightly: {second['reason']}")
