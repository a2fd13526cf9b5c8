"""train_draft on torchrun nodes (`train.nodes`), through the flow: on this machine (gloo on CPU)
and over a real sshd on 127.0.0.1, one node and two nodes (static rendezvous). Every way of
spreading the same global batch gives the single process's loss at every step; a rank killed
mid-run fails the stage naming the node, host and rank with its log tail, leaves nothing running,
and the next run resumes from node 0's last checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from flows.experiment import eagle3_experiment
from tasks.rundir import RunDirectory
from tasks.runner.stages import StageFailed
from tests.helpers import TEST_TARGET_YAML, free_port

pytestmark = pytest.mark.slow

CONFIG = """\
experiment: trainnodes
runs_root: {runs}
{target}data:
  num_samples: 40
  max_length: 96
  validation_fraction: 0.2
  regenerate: {{max_new_tokens: 24}}
  draft_vocab_size: 64
train: {{ttt_steps: 3, max_steps: {steps}, epochs: 1000, batch_size: {batch}, devices: {devices}, nodes: {nodes},
         rendezvous: "127.0.0.1:{port}", strategy: {strategy}, lr: 0.01, warmup_ratio: 0.0, log_every: 1,
         eval_every: {steps}, checkpoint_every: {every}, num_workers: 0}}
hosts:
  - {{name: node-a, address: 127.0.0.1, port: {ssh_port}, user: {user}, key_file: {key}, known_hosts: {known},
      workdir: {remote}, python: {python}}}
  - {{name: node-b, address: 127.0.0.1, port: {ssh_port}, user: {user}, key_file: {key}, known_hosts: {known},
      workdir: {remote}, python: {python}}}
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("trainnodes")


def write_config(workdir: Path, sshd, name: str, *, nodes: str = "[]", devices: int = 1, batch: int = 4,
                 steps: int = 4, every: int = 2, strategy: str = "ddp") -> Path:
    host = sshd.host_config()
    path = workdir / f"{name}.yaml"
    path.write_text(CONFIG.format(
        runs=workdir / "runs", target=TEST_TARGET_YAML, steps=steps, batch=batch, devices=devices, nodes=nodes,
        port=free_port(), strategy=strategy, every=every, ssh_port=host.port, user=host.user, key=host.key_file,
        known=host.known_hosts, remote=workdir / "remote", python=sys.executable))
    return path


@pytest.fixture(scope="module")
def data_run(prefect_harness, workdir, sshd) -> Path:
    """The dataset once, and the single-process training every other layout is compared with."""
    result = eagle3_experiment(str(write_config(workdir, sshd, "single")), stages=["generate_data", "train_draft"])
    return Path(result["run_dir"])


def train(config: Path, run_dir: Path) -> dict:
    eagle3_experiment(str(config), run_dir=str(run_dir), stages=["train_draft"])
    return RunDirectory.open(run_dir).manifest["stages"]["train_draft"]


def losses(stage: dict) -> list[float]:
    draft = Path(stage["summary"]["checkpoint"]).parents[1]
    rows = [json.loads(line) for line in (draft / "history.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "train/loss" in r]


def processes_under(root: Path) -> dict[int, list[str]]:
    """pid -> argv of every launcher, torchrun and rank whose command line mentions `root` (from /proc:
    ps truncates)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue
        if any(str(root) in a for a in argv) and ("eagle3.training.train" in argv or "eagle3.torchrun" in argv):
            found[int(entry.name)] = argv
    return found


def launcher_processes(root: Path) -> list[str]:
    return [" ".join(argv) for argv in processes_under(root).values()]


def test_two_ranks_and_two_nodes_match_one_process(data_run, workdir, sshd):
    single = RunDirectory.open(data_run).manifest["stages"]["train_draft"]
    want = losses(single)
    assert len(want) == 4
    layouts = {  # global batch 4 each time
        "local torchrun, 2 ranks": dict(devices=2, batch=2),
        "node-a over SSH, 2 ranks": dict(nodes="[node-a]", devices=2, batch=2),
        "node-a + node-b over SSH, 1 rank each": dict(nodes="[node-a, node-b]", devices=1, batch=2),
    }
    for label, layout in layouts.items():
        stage = train(write_config(workdir, sshd, label.split(",")[0].replace(" ", "-"), **layout), data_run)
        assert stage["status"] == "completed", label
        got = losses(stage)
        assert got == pytest.approx(want, rel=1e-5), label
        checkpoint = Path(stage["summary"]["checkpoint"])
        assert checkpoint.is_dir() and str(checkpoint).startswith(str(data_run)), label  # brought back here
    remote = workdir / "remote" / "train"
    assert len(list((remote / "inputs").iterdir())) == 1  # one upload of the dataset and target, reused
    assert launcher_processes(remote) == []


def test_a_node_over_ssh_is_sampled_under_its_name_and_its_run_names_the_data(data_run, workdir, sshd, monkeypatch):
    """tracking.log_system_metrics on: the training run gets node-a's system metrics over SSH as system/node-a/*
    beside this machine's system/*, the loss relayed from node 0 (handed off the relay loop) at every step, and
    the data stage's output as its dataset input, like the parent run."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
    config = write_config(workdir, sshd, "sampled", nodes="[node-a]", devices=1, batch=4)
    config.write_text(config.read_text() + "tracking: {log_system_metrics: true}\n")
    stage = train(config, data_run)
    assert stage["status"] == "completed"
    manifest = RunDirectory.open(data_run).manifest
    client = MlflowClient(manifest["mlflow"]["tracking_uri"])
    run_id = stage["attempts"][-1]["mlflow_run_id"]
    metrics = client.get_run(run_id).data.metrics
    assert {"system/node-a/cpu_utilization_percentage", "system/node-a/system_memory_usage_megabytes",
            "system/cpu_utilization_percentage"} <= set(metrics), sorted(metrics)
    assert [m.step for m in sorted(client.get_metric_history(run_id, "train/loss"), key=lambda m: m.step)] == [1, 2, 3, 4]
    digest = manifest["stages"]["generate_data"]["attempts"][-1]["output_digest"]
    for run in (run_id, manifest["mlflow"]["parent_run_id"]):
        (data_input,) = client.get_run(run).inputs.dataset_inputs
        assert (data_input.dataset.name, data_input.dataset.digest) == ("prompts:builtin", digest)


def test_unknown_node_is_a_config_error(workdir, sshd):
    from tasks.config.load import ConfigError, load_experiment

    with pytest.raises(ConfigError, match="train.nodes"):
        load_experiment(write_config(workdir, sshd, "unknown", nodes="[node-z]"))


def test_a_killed_rank_fails_the_stage_by_name_and_the_next_run_resumes(data_run, workdir, sshd):
    """FSDP (its resume loads a full state dict across ranks); DDP resumes in the Ctrl-C test."""
    config = write_config(workdir, sshd, "kill-fsdp", nodes="[node-a]", devices=2, batch=2, steps=100, every=5,
                          strategy="fsdp")
    remote = workdir / "remote" / "train"
    killed = _kill_a_rank_after_the_first_checkpoint(remote)
    with pytest.raises(StageFailed) as failure:
        train(config, data_run)
    victim = killed.result()
    message = str(failure.value)
    assert "training failed on node 0 (node-a)" in message, message
    # the killed rank is named as the cause, not rank 0, which only lost its peer
    assert "rank 1 died first: exit code -9 (Signal 9 (SIGKILL)" in message and "last lines of" in message, message
    assert launcher_processes(remote) == []
    stage = train(config, data_run)
    assert stage["status"] == "completed" and stage["summary"]["steps"] == 100 and stage["summary"]["finished"]
    history = Path(stage["summary"]["checkpoint"]).parents[1] / "history.jsonl"
    steps = [json.loads(line)["step"] for line in history.read_text().splitlines() if "train/loss" in line]
    assert steps == list(range(1, 101))  # resumed at a checkpoint >= 5: no step lost or repeated
    assert victim["step"] >= 5
    assert launcher_processes(remote) == []


class _Killer(threading.Thread):
    """SIGKILLs rank 1 of node 0 once a step checkpoint exists under `remote`; result() says when."""

    def __init__(self, remote: Path):
        super().__init__(daemon=True)
        self.remote, self.done = remote, {}

    def run(self) -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            ckpts = sorted(self.remote.glob("*/*/train_draft/attempt-*/node-0/draft/checkpoints/step_*"))
            ckpts = [c for c in ckpts if _mtime(c) > self.started]  # pruned ones read as 0
            pid = _rank_pid(self.remote, rank=1)
            if ckpts and pid:
                os.kill(pid, signal.SIGKILL)
                self.done = {"pid": pid, "step": int(ckpts[-1].name.split("_")[1])}
                return
            time.sleep(0.05)

    def start(self) -> None:
        self.started = time.time()
        super().start()

    def result(self) -> dict:
        self.join(timeout=60)
        assert self.done, "no rank was killed"
        return self.done


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _kill_a_rank_after_the_first_checkpoint(remote: Path) -> _Killer:
    killer = _Killer(remote)
    killer.start()
    return killer


def _rank_pid(remote: Path, rank: int) -> int | None:
    """A torchrun worker (`-m eagle3.training.train`, not the launcher or torchrun) whose RANK is `rank`."""
    for pid, argv in processes_under(remote).items():
        if "eagle3.training.train" not in argv or "torch.distributed.run" in argv:
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    return None


def test_ctrl_c_stops_every_node_and_the_next_run_resumes(data_run, workdir, sshd, cli_prefect_api):
    """SIGINT to `eagleops run`'s process group, as a terminal sends it: the remote launchers are in
    no local process group, so the stage itself must stop them before the CLI exits. Then the
    same command with --run-dir resumes the DDP run from node 0's last checkpoint."""
    from tests.flows.test_interrupts import start_cli, wait_for_line

    config = write_config(workdir, sshd, "ctrl-c", nodes="[node-a]", devices=2, batch=2, steps=400, every=5)
    command = ["run", str(config), "--run-dir", str(data_run), "--stages", "train_draft"]
    log = workdir / "ctrl-c.log"
    proc = start_cli(command, log, prefect_api=cli_prefect_api)
    wait_for_line(log, r"\[node 0 \(node-a\)\] .*step 20/400", proc)
    remote = workdir / "remote" / "train"
    assert launcher_processes(remote)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=90) == 130
    output = log.read_text()
    assert output.rstrip().splitlines()[-1].startswith("interrupted (Ctrl-C) during train_draft; resume with:")
    assert launcher_processes(remote) == [], output[-3000:]
    manifest = json.loads((data_run / "manifest.json").read_text())
    assert manifest["stages"]["train_draft"]["status"] == "interrupted"

    resumed = start_cli(command, workdir / "ctrl-c-resume.log", prefect_api=cli_prefect_api)
    assert resumed.wait(timeout=600) == 0, (workdir / "ctrl-c-resume.log").read_text()[-3000:]
    stage = RunDirectory.open(data_run).manifest["stages"]["train_draft"]
    assert stage["status"] == "completed" and stage["summary"]["steps"] == 400
    history = Path(stage["summary"]["checkpoint"]).parents[1] / "history.jsonl"
    steps = [json.loads(line)["step"] for line in history.read_text().splitlines() if "train/loss" in line]
    assert steps == list(range(1, 401))
    assert "resumed from" in (workdir / "ctrl-c-resume.log").read_text()
    assert launcher_processes(remote) == []
