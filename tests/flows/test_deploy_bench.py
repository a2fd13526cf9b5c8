"""deploy_server and run_benchmark through the flow, against the reference server: locally and over a
real sshd on 127.0.0.1. The seed's two failures are reproduced: the preflight stops each one, and
run anyway on purpose (adjustments allowed; preflight in warn mode) the diagnosis names each as its
top cause. A healthy run gets no misdiagnosis. No server survives a run (checked with ps).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from typer.testing import CliRunner

from flows.cli import app
from flows.experiment import eagle3_experiment
from tasks.pipeline import StageFailed
from tests.helpers import TEST_TARGET_YAML, free_port, reference_servers_alive

CONFIG = """\
experiment: deploybench
runs_root: {runs}
{target}data:
  num_samples: 48
  max_length: 160
  validation_fraction: 0.25
  regenerate: {{max_new_tokens: 32}}
  draft_vocab_size: 64
train: {{ttt_steps: 3, epochs: 40, max_steps: 150, batch_size: 4, lr: 0.003, eval_every: 75, checkpoint_every: 75}}
export: {{formats: [sglang], dtype: float32}}
deploy:
  host: {host}
  server: reference
  port: {port}
  speculative: {speculative}
  preflight: {preflight}
  startup_timeout_s: 240
  extra_args: {extra_args}
bench: {{prompts: {prompts}, num_prompts: 3, max_new_tokens: 24, warmup_runs: 1, timed_runs: 2, sweep: {sweep}}}
{hosts}
"""
HEALTHY = "{num_steps: 3, eagle_topk: 1, num_draft_tokens: 4}"
SEED = "{num_steps: 1, eagle_topk: 1, num_draft_tokens: 16}"
SEED_ALLOWED = "{num_steps: 1, eagle_topk: 1, num_draft_tokens: 16, allow_adjustments: true}"




@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("deploybench")
    prompts = ["Write a function that adds two numbers.", "What does a for loop do?", "Name a Python keyword."]
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return folder


def write_config(workdir: Path, name: str, *, speculative: str = HEALTHY, preflight: str = "enforce",
                 host: str = "local", hosts: str = "", extra_args: str = "[]", port: int | None = None,
                 sweep: str = "[]") -> Path:
    path = workdir / f"{name}.yaml"
    path.write_text(CONFIG.format(
        target=TEST_TARGET_YAML, runs=workdir / "runs", host=host, port=port or free_port(), speculative=speculative,
                                  preflight=preflight, hosts=hosts, extra_args=extra_args,
                                  prompts=workdir / "prompts.jsonl", sweep=sweep))
    return path




def manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def bench_summary(run_dir: Path) -> dict:
    return manifest(run_dir)["stages"]["run_benchmark"]["summary"]


@pytest.fixture(scope="module")
def trained_run(prefect_harness, workdir) -> Path:
    """Data, training and export once; every test deploys this run's draft."""
    config = write_config(workdir, "base")
    result = eagle3_experiment(str(config), stages=["generate_data", "train_draft", "export_checkpoint"])
    return Path(result["run_dir"])


def deploy_and_bench(config: Path, run_dir: Path) -> dict:
    return eagle3_experiment(str(config), run_dir=str(run_dir), stages=["deploy_server", "run_benchmark"])


@pytest.mark.slow
def test_healthy_setting_deploys_benchmarks_and_tears_down(trained_run, workdir):
    # The sweep's 2/1/8 is rewritten by SGLang's rule to 2/1/3, and its duplicate 3/1/4 is measured once.
    sweep = "[{num_steps: 2, eagle_topk: 1, num_draft_tokens: 8}, {num_steps: 3, eagle_topk: 1, num_draft_tokens: 4}]"
    config = write_config(workdir, "healthy", sweep=sweep)
    deploy_and_bench(config, trained_run)
    stages = manifest(trained_run)["stages"]
    deploy = stages["deploy_server"]["summary"]
    assert deploy["adjusted"] == {}
    assert deploy["effective"]["num_draft_tokens"] == 4 and deploy["draft_dtype_served"] == "float16"
    bench = bench_summary(trained_run)
    assert [r["setting"] for r in bench["rows"]] == ["speculative 3/1/4", "baseline", "speculative 2/1/3"]
    assert bench["rows"][2]["asked"]["num_draft_tokens"] == 8 and bench["rows"][2]["effective"]["num_draft_tokens"] == 3
    spec = bench["rows"][0]
    assert spec["accept_length"] > 1.0 and spec["disagreements"] == []
    # The online accept length agrees with the reference decoder run in-process on the same prompts.
    reference = bench["offline"]["per_setting"]["speculative 3/1/4"]["reference_decoder_accept_length"]
    assert spec["accept_length"] == pytest.approx(reference, rel=0.05)
    verdict = bench["verdict"]
    healthy = "speculative 3/1/4"
    assert not [a for s in verdict["settings"] if s["setting"] == healthy for a in s["alarms"] if "accept length" in a]
    assert {c["cause"] for c in verdict["causes"] if c["setting"] == healthy} <= {"cost"}  # only CPU speed, if any
    # The sweep's 2/1/8 asked for 8 draft tokens and got 3: that rewrite is named, under its effective label.
    assert {(c["cause"], c["setting"]) for c in verdict["causes"]} >= {("settings_rewritten", "speculative 2/1/3")}

    client = MlflowClient(f"sqlite:///{workdir / 'runs' / 'mlflow.db'}")
    deploy_run = client.get_run(stages["deploy_server"]["mlflow_run_id"])
    assert "eagle3.serve" in deploy_run.data.params["launch_command"]
    assert deploy_run.data.params["effective.num_draft_tokens"] == "4"
    info = json.loads(Path(client.download_artifacts(deploy_run.info.run_id, "server/server_info.json")).read_text())
    assert info["speculative_num_draft_tokens"] == 4
    bench_run = client.get_run(stages["run_benchmark"]["mlflow_run_id"])
    assert "spec_3_1_4.c1.tok_s" in bench_run.data.metrics and "baseline.c1.tok_s" in bench_run.data.metrics
    assert "plots/benchmark.png" in [a.path for a in client.list_artifacts(bench_run.info.run_id, "plots")]
    servers = json.loads((trained_run / "servers.json").read_text())
    assert servers and all(s["status"] == "stopped" for s in servers.values())
    assert reference_servers_alive(str(trained_run)) == []

    compared = CliRunner().invoke(app, ["compare", str(trained_run)], env={"COLUMNS": "300"})
    assert compared.exit_code == 0, compared.output
    best = next(line for line in compared.output.splitlines() if "run_benchmark.best_tok_s" in line)
    assert float(best.split("│")[2]) == pytest.approx(bench["metrics"]["best_tok_s"], rel=1e-3)
    assert "3/1/4" in compared.output  # the speculative setting tag


@pytest.mark.slow
def test_seed_setting_fails_preflight_with_sglangs_explanation(trained_run, workdir):
    config = write_config(workdir, "seed", speculative=SEED)
    before = json.loads((trained_run / "servers.json").read_text()) if (trained_run / "servers.json").exists() else {}
    with pytest.raises(StageFailed, match=r"num_draft_tokens: asked 16, SGLang runs 2 .*speculative_num_draft_tokens "
                                          r"is adjusted to speculative_num_steps \+ 1 when speculative_eagle_topk == 1"):
        deploy_and_bench(config, trained_run)
    after = json.loads((trained_run / "servers.json").read_text()) if (trained_run / "servers.json").exists() else {}
    assert after == before  # nothing was launched


@pytest.mark.slow
def test_seed_setting_with_adjustments_runs_as_2_and_the_diagnosis_names_the_rewrite(trained_run, workdir):
    config = write_config(workdir, "seed-allowed", speculative=SEED_ALLOWED)
    deploy_and_bench(config, trained_run)
    deploy = manifest(trained_run)["stages"]["deploy_server"]["summary"]
    assert deploy["asked"]["num_draft_tokens"] == 16 and deploy["effective"]["num_draft_tokens"] == 2
    assert deploy["adjusted"] == {"num_draft_tokens": 16}
    bench = bench_summary(trained_run)
    assert bench["rows"][0]["setting"] == "speculative 1/1/2"  # reported under what ran, never the asked 16
    causes = bench["verdict"]["causes"]
    assert causes and causes[0]["cause"] == "settings_rewritten"
    assert "asked num_draft_tokens 16, the server runs 2" in causes[0]["summary"]


@pytest.fixture
def draft_fed_other_layers(trained_run):
    """The exported draft's eagle_config ids changed after training: SGLang would feed other layers."""
    export_dir = Path(manifest(trained_run)["stages"]["export_checkpoint"]["outputs"]["sglang_dir"])
    config_file = export_dir / "config.json"
    original = config_file.read_text()
    config = json.loads(original)
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 2, 5]
    config_file.write_text(json.dumps(config))
    yield config_file
    config_file.write_text(original)


@pytest.mark.slow
def test_layer_mismatch_fails_preflight_naming_both_lists(trained_run, workdir, draft_fed_other_layers):
    config = write_config(workdir, "layers")
    with pytest.raises(StageFailed) as failure:
        deploy_and_bench(config, trained_run)
    message = str(failure.value)
    assert "wiring.layer_mismatch" in message
    assert "trained on ['layer 1', 'layer 2', 'layer 3']" in message
    assert "SGLang will feed ['layer 0', 'layer 2', 'layer 5']" in message


@pytest.mark.slow
def test_layer_mismatch_served_on_purpose_is_the_top_cause(trained_run, workdir, draft_fed_other_layers):
    config = write_config(workdir, "layers-warn", preflight="warn")
    deploy_and_bench(config, trained_run)
    causes = bench_summary(trained_run)["verdict"]["causes"]
    assert causes and causes[0]["cause"] == "layer_mismatch"
    assert causes[0]["evidence"]["trained_hf_indices"] == [2, 3, 4]
    assert causes[0]["evidence"]["served_hf_indices"] == [1, 3, 6]


@pytest.mark.slow
def test_a_server_that_crashes_at_start_is_reported_with_its_log_tail(trained_run, workdir):
    config = write_config(workdir, "crash", extra_args='["--tokenizer-path", "/nonexistent/tokenizer"]')
    with pytest.raises(StageFailed, match=r"exited during startup; last 50 log lines[\s\S]*nonexistent"):
        deploy_and_bench(config, trained_run)
    assert reference_servers_alive(str(trained_run)) == []


@pytest.mark.slow
def test_deploy_and_benchmark_over_ssh(trained_run, workdir, sshd, tmp_path):
    remote = tmp_path / "remote-workdir"
    host = sshd.host_config(python=sys.executable, workdir=str(remote))
    hosts = ("hosts:\n  - {" + f"name: gpu-ssh, address: {host.address}, port: {host.port}, user: {host.user}, "
             f"key_file: {host.key_file}, known_hosts: {host.known_hosts}, workdir: {remote}, "
             f"python: {sys.executable}" + "}")
    config = write_config(workdir, "ssh", host="gpu-ssh", hosts=hosts)
    deploy_and_bench(config, trained_run)
    deploy = manifest(trained_run)["stages"]["deploy_server"]["summary"]
    assert deploy["placement"]["host"] == "gpu-ssh"
    assert deploy["placement"]["draft_path"].startswith(str(remote))
    uploaded = Path(deploy["placement"]["draft_path"])
    assert (uploaded / "config.json").is_file() and (uploaded / "model.safetensors").is_file()
    assert Path(deploy["placement"]["model_path"], "config.json").is_file()  # the tiny target travelled too
    rows = bench_summary(trained_run)["rows"]
    assert {r["setting"] for r in rows} == {"speculative 3/1/4", "baseline"}
    assert reference_servers_alive(str(remote)) == []
