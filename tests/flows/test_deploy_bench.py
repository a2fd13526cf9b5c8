"""deploy_server and run_benchmark through the flow, against the reference server: locally and over a
real sshd on 127.0.0.1. The seed's two failures are reproduced: the preflight stops each one, and
run anyway on purpose (adjustments allowed; preflight in warn mode) the diagnosis names each as its
top cause -- from what the server reports and loaded, which the tests make differ from what the
preflight checked (a launch flag the preflight is not told about, a draft path in deploy.extra_args).
The online accept length is checked against a figure computed apart from the serving engine. A
healthy run gets no misdiagnosis. bench.min_speedup and deploy.baseline do what they say. No server
survives a run (checked with ps).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from eagle3.data.served_dumps import load_dump, read_served_dumps
from flows.cli import app
from flows.experiment import eagle3_experiment
from tasks.config.load import ConfigError, load_experiment
from tasks.hosts.remote.warm_start import SWITCH
from tasks.rundir import RunDirectory
from tasks.runner.stages import StageFailed
from tasks.stages.bench.stage import bench_prompts, request_inputs
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
  baseline: {baseline}
  dump_requests: {dump_requests}
bench: {{prompts: {prompts}, num_prompts: 3, max_new_tokens: 24, warmup_runs: 1, timed_runs: 2, sweep: {sweep},
         min_speedup: {min_speedup}}}
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
                 sweep: str = "[]", baseline: str = "true", min_speedup: str = "null",
                 dump_requests: str = "{enabled: false}") -> Path:
    path = workdir / f"{name}.yaml"
    path.write_text(CONFIG.format(
        target=TEST_TARGET_YAML, runs=workdir / "runs", host=host, port=port or free_port(), speculative=speculative,
                                  preflight=preflight, hosts=hosts, extra_args=extra_args,
                                  prompts=workdir / "prompts.jsonl", sweep=sweep, baseline=baseline,
                                  min_speedup=min_speedup, dump_requests=dump_requests))
    return path




def manifest(run_dir: Path) -> dict:
    return RunDirectory.open(run_dir).manifest  # paths located where the folder is


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


def independent_accept_length(target_dir: Path, draft_dir: Path, prompts: list[str], num_steps: int,
                              max_new_tokens: int) -> float:
    """Tokens per verify of a greedy chain draft, computed apart from the serving engine (eagle3.serving).

    The target's greedy continuation by argmax over full forwards (transformers, no cache); the draft's
    guess at every position and depth from its training-time unroll over that continuation (teacher-forced:
    a depth-k guess only counts while the k before it were right, and then its inputs are those tokens);
    then SGLang's accounting: the prefill yields a token, each verify yields the accepted guesses plus one,
    until max_new_tokens (ignore_eos). Entry e of the unroll pairs the target's hidden state e with token
    e + 1; with n tokens committed, entry n - 2 guesses token n at depth 1, n + 1 at depth 2, ...
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3.draft.model import TTTCache
    from eagle3.export import load_exported

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = load_exported(draft_dir, target.get_input_embeddings().weight).float().eval()
    hf_indices = sorted(json.loads((draft_dir / "eagleops_training.json").read_text())["hf_indices"])
    tokens = verifies = 0
    with torch.no_grad():
        for prompt in prompts:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
            seq = tokenizer(text, add_special_tokens=False)["input_ids"]
            prompt_len = len(seq)
            for _ in range(max_new_tokens + num_steps + 1):
                seq.append(int(target(torch.tensor([seq])).logits[0, -1].argmax()))
            x = torch.tensor([seq])
            states = target(x, output_hidden_states=True).hidden_states
            hidden, cache, guesses = draft.project(torch.cat([states[i] for i in hf_indices], dim=-1)), TTTCache(), []
            positions = torch.arange(x.shape[1])[None]
            for k in range(num_steps):
                shifted = torch.nn.functional.pad(x[:, k + 1:], (0, k + 1))
                hidden, normed = draft.ttt_step(shifted, hidden, positions + k, cache, return_normed=True)
                guesses.append(draft.draft_to_target(draft.lm_head(normed)[0].argmax(-1)).tolist())
            committed, produced = prompt_len + 1, 1
            while produced < max_new_tokens:
                accepted = 0
                while accepted < num_steps and guesses[accepted][committed - 2] == seq[committed + accepted]:
                    accepted += 1
                produced, committed, verifies = produced + accepted + 1, committed + accepted + 1, verifies + 1
            tokens += max_new_tokens
    return tokens / verifies


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
    # The online accept length (the server's completion tokens / verifies) agrees with a figure computed apart
    # from the serving engine, on the same prompts; so does the in-process reference decoder's.
    exported = manifest(trained_run)["stages"]["export_checkpoint"]["outputs"]
    prompts = [json.loads(line)["prompt"] for line in (workdir / "prompts.jsonl").read_text().splitlines()]
    expected = independent_accept_length(Path(exported["target_dir"]), Path(exported["sglang_dir"]), prompts, 3, 24)
    assert spec["accept_length"] == pytest.approx(expected, rel=0.02)
    reference = bench["offline"]["per_setting"]["speculative 3/1/4"]["reference_decoder_accept_length"]
    assert reference == pytest.approx(expected, rel=0.02)
    verdict = bench["verdict"]
    healthy = "speculative 3/1/4"
    assert not [a for s in verdict["settings"] if s["setting"] == healthy for a in s["alarms"] if "accept length" in a]
    assert {c["cause"] for c in verdict["causes"] if c["setting"] == healthy} <= {"cost"}  # only CPU speed, if any
    # The sweep's 2/1/8 asked for 8 draft tokens and the server reports 3: recorded under that label; opted
    # into (every sweep setting is), it is never a fault -- at most the explanation of an alarm.
    swept = next(s for s in verdict["settings"] if s["setting"] == "speculative 2/1/3")
    assert swept["rewritten"] == {"num_draft_tokens": [8, 3]} and swept["settings_source"] == "/server_info"
    assert all(c["kind"] == "explanation" for c in verdict["causes"] if c["cause"] == "settings_rewritten")

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


def test_seed_setting_fails_preflight_with_sglangs_explanation(trained_run, workdir):
    config = write_config(workdir, "seed", speculative=SEED)
    before = json.loads((trained_run / "servers.json").read_text()) if (trained_run / "servers.json").exists() else {}
    # refused before any stage (tasks/stages/preflight.py), with SGLang's own words, at the line that asks for it
    with pytest.raises(ConfigError, match=r"num_draft_tokens: asked 16, SGLang runs 2 .*speculative_num_draft_tokens "
                                          r"is adjusted to speculative_num_steps \+ 1 when speculative_eagle_topk == 1"):
        deploy_and_bench(config, trained_run)
    after = json.loads((trained_run / "servers.json").read_text()) if (trained_run / "servers.json").exists() else {}
    assert after == before  # nothing was launched


@pytest.mark.slow
def test_seed_setting_with_adjustments_runs_as_2_the_diagnosis_names_the_rewrite_and_min_speedup_fails_it(
        trained_run, workdir):
    # bench.min_speedup 50 cannot be met: the benchmark stage fails, naming the figure and the field, once the
    # benchmark and its diagnosis are recorded.
    config = write_config(workdir, "seed-allowed", speculative=SEED_ALLOWED, min_speedup="50")
    with pytest.raises(StageFailed, match=r"run_benchmark failed: bench.min_speedup 50: the best setting, "
                                          r"speculative 1/1/2, reached \d+\.\d\dx the baseline") as failure:
        deploy_and_bench(config, trained_run)
    deploy = manifest(trained_run)["stages"]["deploy_server"]["summary"]
    # SGLang's rule (topk 1: num_draft_tokens = num_steps + 1 = 2), and the server's own report says so.
    assert deploy["asked"]["num_draft_tokens"] == 16 and deploy["effective"]["num_draft_tokens"] == 1 + 1
    assert deploy["settings_source"] == "/server_info"
    assert deploy["server"]["server_info"]["speculative_num_draft_tokens"] == 2
    assert deploy["adjusted"] == {"num_draft_tokens": 16}
    attempt = manifest(trained_run)["stages"]["run_benchmark"]["attempts"][-1]
    assert attempt["status"] == "failed" and Path(attempt["dir"], "bench.md").is_file()
    bench = json.loads(Path(attempt["dir"], "bench.json").read_text())
    spec, baseline = bench["rows"][0], bench["rows"][1]
    shown = float(str(failure.value).split("reached ")[1].split("x")[0])
    assert shown == pytest.approx(spec["tok_s_median"] / baseline["tok_s_median"], abs=0.005)
    run = MlflowClient(f"sqlite:///{workdir / 'runs' / 'mlflow.db'}").get_run(attempt["mlflow_run_id"])
    assert run.info.status == "FAILED" and run.data.metrics["speedup"] == pytest.approx(bench["metrics"]["speedup"])
    assert spec["setting"] == "speculative 1/1/2"  # reported under what ran, never the asked 16
    causes = bench["verdict"]["causes"]
    assert causes and causes[0]["cause"] == "settings_rewritten"
    assert "asked num_draft_tokens 16, the server runs 2" in causes[0]["summary"]
    assert causes[0]["evidence"]["reported_by"] == "/server_info"
    assert causes[0]["evidence"]["served"]["num_draft_tokens"] == 2
    assert reference_servers_alive(str(trained_run)) == []  # the failed stage left no server behind


def launched_with(monkeypatch, *flags: str) -> None:
    """Every speculative server starts with `flags` appended, which the preflight is never told about (as a
    wrapper script or another SGLang build would): what it runs is then known only from its own report."""
    import tasks.hosts.servers

    real = tasks.hosts.servers.server_command

    def with_flags(cfg, python, args):
        argv = real(cfg, python, args)
        return [*argv, *flags] if "--speculative-algorithm" in args else argv

    monkeypatch.setattr(tasks.hosts.servers, "server_command", with_flags)


@pytest.mark.slow
def test_a_rewrite_the_preflight_did_not_predict_is_judged_by_the_servers_report(trained_run, workdir, monkeypatch):
    # Asked 2/1/16: the preflight resolves 2/1/3 (steps + 1); the server, given --speculative-num-steps 1 behind
    # the preflight's back, runs 1/1/2 -- the seed's 16 -> 2 -- and says so in /server_info.
    launched_with(monkeypatch, "--speculative-num-steps", "1")
    asked = "{num_steps: 2, eagle_topk: 1, num_draft_tokens: 16, allow_adjustments: true}"
    with pytest.raises(StageFailed, match=r"/server_info reports speculative_num_steps=1 \(the preflight predicted "
                                          r"2\), speculative_num_draft_tokens=2 \(the preflight predicted 3\)"):
        deploy_and_bench(write_config(workdir, "seed-hidden", speculative=asked), trained_run)
    deploy_and_bench(write_config(workdir, "seed-hidden-warn", speculative=asked, preflight="warn"), trained_run)
    deploy = manifest(trained_run)["stages"]["deploy_server"]["summary"]
    assert deploy["predicted"]["num_draft_tokens"] == 3
    assert (deploy["effective"]["num_steps"], deploy["effective"]["num_draft_tokens"]) == (1, 2)
    bench = bench_summary(trained_run)
    assert bench["rows"][0]["setting"] == "speculative 1/1/2"
    top = bench["verdict"]["causes"][0]
    assert (top["cause"], top["kind"]) == ("settings_rewritten", "fault")
    assert "asked num_draft_tokens 16, the server runs 2" in top["summary"]
    assert top["evidence"]["reported_by"] == "/server_info" and top["evidence"]["predicted"]["num_draft_tokens"] == 3


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


@pytest.fixture
def other_draft(trained_run, tmp_path) -> Path:
    """A copy of the exported draft whose eagle_config ids were changed; the export itself stays as trained."""
    export_dir = Path(manifest(trained_run)["stages"]["export_checkpoint"]["outputs"]["sglang_dir"])
    copy = Path(shutil.copytree(export_dir, tmp_path / "other-draft"))
    config = json.loads((copy / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 2, 5]
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.slow
def test_a_draft_served_instead_of_the_export_is_judged_by_what_the_server_loaded(trained_run, workdir, other_draft):
    # deploy.extra_args points the server at another draft (SGLang: the last flag wins); this run's export, the
    # one the preflight would otherwise check, is fine. The preflight refuses the override ...
    extra = f'["--speculative-draft-model-path", "{other_draft}"]'
    with pytest.raises(StageFailed, match="wiring.draft_override: the launch flags"):
        deploy_and_bench(write_config(workdir, "override", extra_args=extra), trained_run)
    # ... and served anyway, the diagnosis reads the draft the server says it loaded (/server_info) on its host.
    deploy_and_bench(write_config(workdir, "override-warn", extra_args=extra, preflight="warn"), trained_run)
    causes = bench_summary(trained_run)["verdict"]["causes"]
    assert causes and causes[0]["cause"] == "layer_mismatch"
    assert causes[0]["evidence"]["trained_hf_indices"] == [2, 3, 4]
    assert causes[0]["evidence"]["served_hf_indices"] == [1, 3, 6]  # Llama: config ids + 1
    assert causes[0]["evidence"]["served_draft"] == f"local:{other_draft}"


@pytest.mark.slow
def test_without_a_baseline_the_speedup_is_unknown_and_the_deployed_server_dumps_what_it_serves(
        trained_run, workdir):
    """One deploy + benchmark with deploy.baseline: false (one server, no baseline) and deploy.dump_requests on
    (two tests before, each its own run; dumping does not touch the verdict). deploy.baseline: false: the speedup
    is unknown. deploy.dump_requests: dumping goes on through the server's own /configure_logging once it is
    healthy, the run records where (manifest and MLflow), and the files hold the prompt ids the benchmark sent with
    the target's own output ids. The benchmark asks for exactly max_new_tokens, so the served-traffic reader counts every one of its
    answers as cut by the length limit, not as a training sample."""
    config = write_config(workdir, "no-baseline", baseline="false", dump_requests="{enabled: true, threshold: 2}")
    deploy_and_bench(config, trained_run)
    bench = bench_summary(trained_run)
    assert [r["setting"] for r in bench["rows"]] == ["speculative 3/1/4"]  # no baseline server was started
    assert bench["verdict"]["status"] == "no_baseline" and bench["verdict"]["best"]["speedup"] is None
    assert "speedup" not in bench["metrics"] and "baseline_tok_s" not in bench["metrics"]
    assert bench["verdict"]["summary"] == ("best speculative 3/1/4: speedup unknown: no baseline was measured "
                                           "(deploy.baseline: false)")
    report = Path(manifest(trained_run)["stages"]["run_benchmark"]["outputs"]["report"]).read_text()
    assert "| speculative 3/1/4 | 1 |" in report and "| unknown |" in report

    stages = manifest(trained_run)["stages"]
    dumps = stages["deploy_server"]["summary"]["dump_requests"]
    assert dumps["host"] == "local" and dumps["threshold"] == 2
    folder = Path(dumps["folder"])
    assert folder.is_absolute() and folder.name == "request-dumps"
    # 1 warm-up + 2 timed runs of 3 prompts: 9 finished requests, 4 files of 2, one left in the server's memory
    files = sorted(folder.glob("*.pkl"))
    entries = [entry for path in files for entry in load_dump(path)["requests"]]
    assert len(files) == 4 and len(entries) == 8
    cfg = load_experiment(config)
    target_dir = Path(stages["export_checkpoint"]["outputs"]["target_dir"])
    _, sent = request_inputs(cfg, bench_prompts(cfg, None), target_dir)
    assert [entry[0].fields()["input_ids"] for entry in entries] == [*sent, *sent, *sent][:8]
    assert {len(entry[1]["output_ids"]) for entry in entries} == {24}
    served = read_served_dumps(folder, max_length=cfg.data.max_length)
    assert served.samples == [] and served.excluded["length"] == 8

    client = MlflowClient(f"sqlite:///{workdir / 'runs' / 'mlflow.db'}")
    params = client.get_run(stages["deploy_server"]["mlflow_run_id"]).data.params
    assert params["dump_requests.folder"] == str(folder) and params["dump_requests.threshold"] == "2"


@pytest.mark.slow
def test_a_server_that_crashes_at_start_is_reported_with_its_log_tail(trained_run, workdir, monkeypatch):
    monkeypatch.setenv(SWITCH, "0")  # the cold start: a launch's own failure (tests/tasks/hosts/remote/test_warm_start.py)
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


TEARDOWN_CONFIG = """\
experiment: teardown
runs_root: runs
{target}data: {{draft_vocab_size: 64}}
hosts:
  - {{name: gpu-ssh, address: 127.0.0.1, port: {port}, user: {user}, key_file: {key_file},
      known_hosts: {known_hosts}, workdir: {workdir}}}
"""


def leave_a_server_running(run_dir: Path, executor, remote: Path) -> int:
    """What a killed run leaves behind: a process on the SSH host that servers.json records as live."""
    from tasks.hosts.server_registry import SERVERS_FILE
    from tasks.hosts.servers import ServerHandle

    log, pid_file = f"{remote}/sleep.log", f"{remote}/sleep.pid"
    pid = executor.start_detached(["sleep", "600"], log_file=log, pid_file=pid_file)
    handle = ServerHandle("baseline", "gpu-ssh", pid, free_port(), log, pid_file, ["sleep", "600"], False)
    registry = run_dir / SERVERS_FILE
    servers = json.loads(registry.read_text()) if registry.is_file() else {}
    servers[f"gpu-ssh:{handle.port}:{pid}"] = {**handle.to_dict(), "status": "live"}
    registry.write_text(json.dumps(servers))
    return pid


def process_gone(pid: int, timeout: float = 15) -> bool:
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_teardown_of_a_moved_run_folder_from_another_directory(prefect_harness, sshd, tmp_path, monkeypatch):
    """The hosts inventory survives a moved folder and another working directory: the config file the run
    started with (recorded absolute, though it was given relative), else the run folder's own config.yaml."""
    from tasks.hosts.remote import connect

    team, remote, elsewhere = tmp_path / "team", tmp_path / "remote", tmp_path / "elsewhere"
    for folder in (team, remote, elsewhere):
        folder.mkdir()
    host = sshd.host_config(workdir=str(remote))
    (team / "teardown.yaml").write_text(TEARDOWN_CONFIG.format(
        target=TEST_TARGET_YAML, port=host.port, user=host.user, key_file=host.key_file,
        known_hosts=host.known_hosts, workdir=remote))
    monkeypatch.chdir(team)
    result = eagle3_experiment("teardown.yaml", stages=["check_environment"])  # config and runs_root relative
    moved = (team / "runs").rename(tmp_path / "runs-moved") / "teardown" / Path(result["run_dir"]).name
    monkeypatch.chdir(elsewhere)
    executor = connect(host)
    try:
        for config_file_there in (True, False):
            if not config_file_there:  # the config moved too: the run folder's config.yaml has the inventory
                (team / "teardown.yaml").rename(tmp_path / "teardown-elsewhere.yaml")
            pid = leave_a_server_running(moved, executor, remote)
            done = CliRunner().invoke(app, ["teardown", os.path.relpath(moved, elsewhere)])
            assert done.exit_code == 0, done.output
            assert f"stopped baseline (pid {pid} on gpu-ssh)" in done.output
            assert process_gone(pid)
            assert all(s["status"] == "stopped" for s in json.loads((moved / "servers.json").read_text()).values())
    finally:
        executor.close()


# plan_serving (issue 36): the plan predicted from the benchmark's rows, its picks and a held-out setting
# served and measured, each checked point with its error; files, MLflow and picks where the README says.
PLAN = ("min_speedup: null, concurrency: [1, 2], sla: {itl_ms_p99: 5000}, plan_tolerance: 0.5, "
        "plan: {num_steps: [1, 2, 3], eagle_topk: [1, 2], num_draft_tokens: [4], check_top: 1, held_out: 1}}")


def test_the_plan_stage_predicts_checks_and_records_its_picks(trained_run, workdir):
    config = write_config(workdir, "plan")
    text = config.read_text()
    assert "min_speedup: null}" in text
    config.write_text(text.replace("min_speedup: null}", PLAN))
    eagle3_experiment(str(config), run_dir=str(trained_run),
                      stages=["deploy_server", "run_benchmark", "plan_serving"])
    run = RunDirectory.open(trained_run)
    stage = run.manifest["stages"]["plan_serving"]
    assert stage["status"] == "completed"
    summary = stage["summary"]
    bench_rows = run.manifest["stages"]["run_benchmark"]["summary"]["rows"]
    assert all(r["step_costs"]["source"] == "server" for r in bench_rows)
    # grid as SGLang runs it: chains 1/1/2, 2/1/3, 3/1/4 and the trees 2/2/4, 3/2/4 (1/2/4 cannot run)
    assert sorted(summary["grid"]) == ["1/1/2", "2/1/3", "2/2/4", "3/1/4", "3/2/4"]
    assert [c["concurrency"] for c in summary["choices"]] == [1, 2]
    checked = [p for p in summary["check"] if p["kind"] == "checked"]
    assert checked and {p["concurrency"] for p in checked} == {1, 2}
    for point in summary["check"]:
        assert point["measured_tok_s"] > 0
        assert point["error"] == (point["predicted_tok_s"] - point["measured_tok_s"]) / point["measured_tok_s"]
    for choice in summary["choices"]:
        assert choice["check"].startswith(("measured", "prediction off", "not measured"))
    folder = Path(stage["dir"])
    assert (folder / "plan.md").read_text().startswith("# Serving plan: deploybench")
    assert json.loads((folder / "plan.json").read_text())["launch"]["load"] == 2
    assert (folder / "plan_frontier.png").stat().st_size > 10_000
    client = MlflowClient(f"sqlite:///{workdir / 'runs' / 'mlflow.db'}")
    mlflow_run = client.get_run(stage["mlflow_run_id"])
    assert "c1.tok_s_predicted" in mlflow_run.data.metrics and "held_out_mae" in mlflow_run.data.metrics
    artifacts = {a.path for top in ("plan", "plots") for a in client.list_artifacts(mlflow_run.info.run_id, top)}
    assert {"plan/plan.json", "plan/predictions.json", "plots/plan_frontier.png"} <= artifacts
    assert reference_servers_alive(str(trained_run)) == []
