"""Stage fingerprints that cannot go stale, and a schema with no field nothing reads.

One run of every stage through the flow, under the recording view (tasks/config/reads.py): the
data stage regenerating through a server it starts, training, both export formats, a deploy and a
benchmark (with a bench.sweep setting) and a serving plan over a real sshd on 127.0.0.1. The pipeline records each
attempt's reads in the manifest and, with EAGLEOPS_STRICT_STAGE_READS (set for the whole suite in
tests/conftest.py), fails a stage that read a field its StageSpec neither takes as input nor lists
as operational; here the same check is asserted per stage, and shown to catch every declared field
taken out of its spec. Every field of the schema must be read: by a stage of this run, by the run
itself (loading and validating the file, the runner, teardown), or -- for what only runs elsewhere
-- by the stage code a GPU config takes (the environment check and the run's tags on the shipped
GPU configs) and the nightly gate's decision.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from flows.experiment import eagle3_experiment
from tasks.config.load import load_experiment
from tasks.config.reads import covered, recording_reads
from tasks.config.schema import ExperimentConfig, NightlyConfig
from tasks.rundir import RunDirectory
from tasks.runner.specs import (
    STAGE_SPECS,
    Reads,
    StageSpec,
    stage_inputs,
    undeclared_reads,
)
from tasks.runner.stages import STAGES
from tests.helpers import TEST_TARGET_YAML, free_port

REPO = Path(__file__).resolve().parents[2]

CONFIG = """\
experiment: reads
description: every stage through the recording view
runs_root: {runs}
{target}data:
  num_samples: 12
  max_length: 160
  validation_fraction: 0.25
  draft_vocab_size: 64
  hidden_states_dtype: float32
  regenerate: {{backend: sglang, deploy: {{host: local, servers: 1}}, concurrency: 2, max_new_tokens: 16}}
train: {{ttt_steps: 3, max_steps: 4, batch_size: 4, lr: 0.003, eval_every: 2, checkpoint_every: 2, log_every: 1,
         num_workers: 0}}
export: {{formats: [sglang, speculators], dtype: float32, registered_model: reads-draft}}
deploy:
  host: gpu-ssh
  server: reference
  port: {port}
  speculative: {{num_steps: 3, eagle_topk: 1, num_draft_tokens: 4}}
  startup_timeout_s: 240
  baseline: true   # bench.plan predicts against it
bench: {{num_prompts: 2, max_new_tokens: 16, warmup_runs: 0, timed_runs: 1, offline_reference: false,
         sweep: [{{num_steps: 2, eagle_topk: 1, num_draft_tokens: 3}}], sla: {{itl_ms_p99: 5000}}, plan_tolerance: 0.5,
         plan: {{num_steps: [1, 2, 3], eagle_topk: [1], num_draft_tokens: [4], check_top: 1, held_out: 1}}}}
tracking: {{uri: "sqlite:///{runs}/mlflow.db", experiment_name: reads-test}}
hosts:
  - {{name: gpu-ssh, address: {address}, port: {ssh_port}, user: {user}, key_file: {key_file},
      known_hosts: {known_hosts}, workdir: {remote}, python: {python}}}
"""


@pytest.fixture(scope="module")
def recorded(prefect_harness, sshd, tmp_path_factory):
    """(config, each stage's recorded reads, every read of the run as a whole)."""
    folder = tmp_path_factory.mktemp("reads")
    host = sshd.host_config()
    config = folder / "reads.yaml"
    config.write_text(CONFIG.format(target=TEST_TARGET_YAML, runs=folder / "runs", port=free_port(),
                                    address=host.address, ssh_port=host.port, user=host.user, key_file=host.key_file,
                                    known_hosts=host.known_hosts, remote=folder / "remote", python=sys.executable))
    with recording_reads() as everything:  # loading and validating the file, the runner, the stages, teardown
        result = eagle3_experiment(str(config))
    stages = RunDirectory.open(result["run_dir"]).manifest["stages"]
    assert {name: s["status"] for name, s in stages.items()} == {name: "completed" for name in STAGES}
    return load_experiment(config), {name: set(s["config_reads"]) for name, s in stages.items()}, set(everything)


@pytest.mark.slow
def test_every_stage_reads_only_fields_its_spec_declares(recorded):
    cfg, reads, _ = recorded
    for name in STAGES:
        assert reads[name], f"{name}: nothing recorded: the view did not see the stage's config"
        assert undeclared_reads(name, cfg, reads[name]) == [], name
    # what the README's resume promises rest on, seen in the reads themselves
    assert {"deploy.server", "deploy.model_path", "deploy.port"} <= reads["generate_data"]  # its servers
    assert {"deploy.model_path", "target.model_path"} <= reads["export_checkpoint"]  # the speculators verifier
    assert "data.regenerate.concurrency" in reads["generate_data"] and "train.log_every" in reads["train_draft"]


def without(spec: StageSpec, field: str) -> StageSpec:
    """The spec with one declared field taken out, wherever it is declared."""
    def drop(fields: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(f for f in fields if f != field)

    return replace(spec, config=drop(spec.config), operational=drop(spec.operational),
                   when=tuple(Reads(r.when, drop(r.config), drop(r.operational)) for r in spec.when))


@pytest.mark.slow
def test_taking_any_declared_field_out_of_a_spec_is_caught(recorded):
    cfg, reads, _ = recorded
    checked = 0
    for name in STAGES:
        spec = STAGE_SPECS[name]
        declared = spec.inputs(cfg) + spec.operational_fields(cfg)
        for field in dict.fromkeys(declared):
            under = {r for r in reads[name] if covered(r, (field,))}
            rest = tuple(d for d in declared if d != field)
            expected = sorted(r for r in under if not covered(r, rest))
            if not expected:
                continue  # nothing this run read depends on that declaration alone
            assert undeclared_reads(name, cfg, reads[name], without(spec, field)) == expected, (name, field)
            checked += 1
    assert checked >= 25, checked


def test_inputs_keep_the_readmes_resume_promises():
    """deploy/bench re-run neither data, training nor export (but for the fields the data stage's servers serve
    and the speculators export names); train never re-runs data; operational fields re-run nothing."""
    served = {"deploy.server", "deploy.model_path", "deploy.extra_args"}
    for path in sorted((REPO / "configs").glob("*.yaml")):
        cfg = load_experiment(path)
        inputs = {name: set(stage_inputs(cfg, name, {}, "v")["config"]) for name in STAGES}
        for name in ("generate_data", "train_draft", "export_checkpoint"):
            assert not {k for k in inputs[name] if k.startswith("bench.")}, (path.name, name)
            assert {k for k in inputs[name] if k.startswith("deploy.")} <= served, (path.name, name)
        assert not {k for k in inputs["generate_data"] if k.startswith("train.")}, path.name
        for field in ("data.regenerate.concurrency", "data.regenerate.api_key", "train.log_every", "runs_root",
                      "target.tiny.num_threads"):
            assert not [name for name in STAGES if not STAGE_SPECS[name].always_run and field in inputs[name]], field


def schema_fields() -> set[str]:
    """Every leaf field of ExperimentConfig as a recorded read names it (list items without their index)."""
    from tests.tasks.config.test_config_mutations import schema_leaves

    return {".".join(p for p in path if not isinstance(p, int)) for path, _ in schema_leaves(ExperimentConfig)}


def gate_rows(tok_s: float, accept: float) -> list[dict]:
    samples = [tok_s * 0.99, tok_s, tok_s * 1.01]
    return [{"concurrency": 1, "tok_s_samples": samples, "tok_s_median": tok_s, "accept_length": accept,
             "accept_length_samples": [accept] * 3, "accepted_by_position": [0.9, 0.8]}]


def reads_elsewhere(tmp_path: Path) -> set[str]:
    """What runs only on a GPU machine or at night, read by the very code that runs there: loading the shipped
    GPU configs (validation holds data.max_length and data.draft_vocab_size to the declared target shape), the
    environment check on them (the data stage on this machine) and the run's tags, and the nightly gate's
    decision and evidence."""
    from tasks.stages.environment import needs_for
    from tasks.stages.gate.nightly import decide, gate_evidence, training_config
    from tasks.tracking.runs import run_tags

    found: set[str] = set()
    for name in ("llama-3.1-8b.yaml", "kimi-k2.5-int4.yaml"):
        with recording_reads() as reads:  # loading validates the declared shape against the data section
            shipped = load_experiment(REPO / "configs" / name)
            here = shipped.model_copy(update={"data": shipped.data.model_copy(update={"host": "local"}),
                                              "train": shipped.train.model_copy(update={"nodes": []})})
            needs_for(here)
            run_tags(shipped)
        found |= reads
    cfg = load_experiment(REPO / "configs" / "tiny.yaml")
    cfg = cfg.model_copy(update={"nightly": NightlyConfig(start_from="champion"), "runs_root": str(tmp_path)})
    with recording_reads(cfg) as reads:
        training_config(cfg, str(REPO / "configs" / "tiny.yaml"), None, None)
        decision = decide(cfg.nightly, gate_rows(108.0, 3.0), gate_rows(100.0, 3.0))
        gate_evidence(cfg.nightly, {"champion": "a", "challenger": "b"}, {"a": [1, 2], "b": [1, 2]}, decision,
                      {"a": {"weights": "x"}, "b": {"weights": "y"}})
    return found | reads


@pytest.mark.slow
def test_every_schema_field_is_read_by_something_that_runs(recorded, tmp_path):
    _, reads, everything = recorded
    read = set().union(*reads.values()) | everything | reads_elsewhere(tmp_path)
    unread = sorted(schema_fields() - read)  # a leaf itself: an optional section read as None is not its fields
    assert unread == [], f"schema fields nothing reads (use them or remove them): {unread}"
