"""A Prefect worker killed with SIGKILL during a deployment run, then the run retried from the UI.

The team setup on 127.0.0.1 (tests/team_servers.py: Prefect and MLflow servers on PostgreSQL, the deployments of
infra/prefect.yaml) and a cpu worker of this test's own (infra/prefect-worker.sh cpu). The `tiny` deployment is
run as the UI's Quick run starts it (no run folder given) with the deploy stage serving the reference server on a
real sshd host (tests/sshd.py); while its benchmark runs, the worker and the flow-run process under it are killed
with SIGKILL, as a host's OOM killer or power cut does: no hook, no `finally`, the server on the SSH host lives on.
The UI's Retry (the flow run set to AwaitingRetry) is then picked up by a new worker: attempt 2 of the same flow
run resumes the folder attempt 1 wrote (data, training and export reused), takes the run folder over in one line,
stops attempt 1's server over SSH in one line before it deploys its own, and completes; nothing is left running.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.helpers import TEST_TARGET_YAML, free_port, reference_servers_alive, stop_group
from tests.team_servers import REPO, wait_for_run

pytestmark = pytest.mark.slow

CONFIG = """\
experiment: worker-killed
runs_root: {runs}
{target}data:
  num_samples: 24
  max_length: 128
  regenerate: {{max_new_tokens: 16}}
  draft_vocab_size: 64
train: {{ttt_steps: 2, max_steps: 20, batch_size: 4, checkpoint_every: 10, log_every: 10}}
export: {{formats: [sglang], dtype: float32}}
hosts:
  - {{name: gpu-ssh, address: {address}, port: {ssh_port}, user: {user}, key_file: {key_file},
      known_hosts: {known_hosts}, workdir: {remote}, python: {python}}}
deploy: {{host: gpu-ssh, server: reference, port: {port}, speculative: {{num_steps: 2, eagle_topk: 1,
         num_draft_tokens: 3}}, startup_timeout_s: 240}}
bench: {{prompts: {prompts}, num_prompts: 1, max_new_tokens: 16, warmup_runs: {warmup}, timed_runs: {timed}}}
tracking: {{uri: {mlflow}, experiment_name: eagleops-worker-killed}}
"""
STAGES = ["check_environment", "generate_data", "train_draft", "export_checkpoint", "deploy_server", "run_benchmark"]


def write_config(path: Path, team_servers, sshd, remote: Path, port: int, warmup: int, timed: int) -> None:
    host = sshd.host_config(python=sys.executable, workdir=str(remote))
    prompts = path.parent / "prompts.jsonl"
    prompts.write_text('{"prompt": "Say hello."}\n')
    path.write_text(CONFIG.format(
        runs=path.parent / "runs", target=TEST_TARGET_YAML, address=host.address, ssh_port=host.port, user=host.user,
        key_file=host.key_file, known_hosts=host.known_hosts, remote=remote, python=sys.executable, port=port,
        prompts=prompts, warmup=warmup, timed=timed, mlflow=team_servers.mlflow))


@contextlib.contextmanager
def cpu_worker(team_servers, log_path: Path):
    env = {**team_servers.env, "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "1"}
    with open(log_path, "w") as log:
        worker = subprocess.Popen(["bash", str(REPO / "infra/prefect-worker.sh"), "cpu"], env=env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield worker
    finally:
        if worker.poll() is None:
            stop_group(worker.pid, grace_s=5, leader=worker)


def kill_9(worker: subprocess.Popen) -> list[int]:
    """SIGKILL to the worker and every process under it (its flow run's): -> their pids."""
    tree = [worker.pid] + [p.pid for p in psutil.Process(worker.pid).children(recursive=True)]
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    worker.wait(timeout=30)
    return tree


def wait_for(done, what: str, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError, StopIteration):
            if done():
                return
        time.sleep(0.5)
    raise AssertionError(f"not {what} within {timeout}s; worker log:\n{log.read_text()[-3000:]}")


def live_servers(run_dir: Path) -> list[dict]:
    return [s for s in json.loads((run_dir / "servers.json").read_text()).values() if s["status"] == "live"]


def test_a_worker_killed_mid_deploy_run_leaves_its_server_to_the_retry(team_servers, deployed, sshd, tmp_path):
    api = team_servers.prefect_api
    remote, port = tmp_path / "remote", free_port()
    remote.mkdir()
    config = tmp_path / "worker-killed.yaml"
    write_config(config, team_servers, sshd, remote, port, warmup=100, timed=1000)
    tiny = httpx.get(f"{api}/deployments/name/eagle3-experiment/tiny", timeout=10).json()
    created = httpx.post(f"{api}/deployments/{tiny['id']}/create_flow_run", timeout=30, json={
        "state": {"type": "SCHEDULED", "message": "Run from the Prefect UI"},
        "parameters": {"config_path": str(config), "stages": STAGES}})
    assert created.status_code == 201, created.text
    flow_run_id = created.json()["id"]
    folder = tmp_path / "runs" / "worker-killed"
    try:
        log1 = tmp_path / "worker-1.log"
        with cpu_worker(team_servers, log1) as worker:
            wait_for(lambda: any(True for _ in folder.glob("*/manifest.json")), "run folder created", log1)
            run_dir = next(folder.glob("*/manifest.json")).parent
            wait_for(lambda: json.loads((run_dir / "manifest.json").read_text())["stages"]["run_benchmark"]["status"]
                     == "running", "run_benchmark running", log1, timeout=420)
            [server] = live_servers(run_dir)
            killed = kill_9(worker)
        print(f"killed worker and flow run process {killed}; server pid {server['pid']} on {server['host']} lives")
        assert server["host"] == "gpu-ssh" and psutil.pid_exists(server["pid"])
        assert httpx.get(f"{api}/flow_runs/{flow_run_id}", timeout=10).json()["state"]["type"] == "RUNNING"

        # the UI's Retry; attempt 2 reads the config file again: a short benchmark this time
        write_config(config, team_servers, sshd, remote, port, warmup=1, timed=2)
        retried = httpx.post(f"{api}/flow_runs/{flow_run_id}/set_state", timeout=10, json={
            "state": {"type": "SCHEDULED", "name": "AwaitingRetry", "message": "Retry from the UI"}, "force": True})
        assert retried.status_code == 201, retried.text
        log2 = tmp_path / "worker-2.log"
        started = time.monotonic()
        with cpu_worker(team_servers, log2):
            run = wait_for_run(api, flow_run_id, log2, timeout_s=420)
        output = log2.read_text()
        print(f"retry: {run['state']['type']} in {time.monotonic() - started:.0f} s, run_count {run['run_count']}")
        assert run["state"]["type"] == "COMPLETED", output[-3000:]
        assert run["run_count"] == 2
        assert f"run folder {run_dir}: taking it over from pid " in output and ": its process is gone" in output
        assert f"Prefect flow run {flow_run_id}, since " in output
        assert f"stopped {server['label']} (pid {server['pid']} on gpu-ssh), left running by an earlier run on " \
               f"{run_dir}" in output
        assert "generate_data: completed earlier with the same inputs" in output
        assert "run_benchmark: attempt 1 was interrupted (its process died)" in output
        manifest = json.loads((run_dir / "manifest.json").read_text())
        assert manifest["prefect_flow_run_ids"] == [flow_run_id, flow_run_id]
        assert [a["status"] for a in manifest["stages"]["run_benchmark"]["attempts"]] == ["interrupted", "completed"]
        assert live_servers(run_dir) == []
        assert reference_servers_alive(str(remote)) == []
        assert not psutil.pid_exists(server["pid"]) or psutil.Process(server["pid"]).status() == psutil.STATUS_ZOMBIE
        assert [p.name for p in folder.iterdir()] == [run_dir.name]  # the Retry wrote no second folder

        done = subprocess.run([sys.executable, "-m", "flows.cli", "teardown", str(run_dir)], cwd=REPO,
                              env=team_servers.env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "no running server recorded for this run" in done.stdout, done
    finally:
        for pid in reference_servers_alive(str(remote)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)



def test_a_deployment_run_on_a_folder_a_live_run_holds_is_refused_and_stops_nothing(team_servers, deployed, sshd,
                                                                                      tmp_path):
    """A hand run (`eagleops run`) benchmarks on the SSH host; a deployment run given its folder is picked up by a
    worker: the flow refuses at once (Failed, its state message naming the hand run's pid, host, flow run and
    since when), writes nothing and stops nothing. (Attempt 2 of the same flow run, a UI Retry while attempt 1
    runs, is refused alike: tests/tasks/test_run_lock.py; with a real process worker attempt 1 does not outlive
    its worker for long: its output pipe breaks and it ends through its own teardown.)"""
    from tests.flows.test_interrupts import start_cli

    api = team_servers.prefect_api
    remote, port = tmp_path / "remote", free_port()
    remote.mkdir()
    config = tmp_path / "worker-killed.yaml"
    write_config(config, team_servers, sshd, remote, port, warmup=100, timed=1000)
    folder = tmp_path / "runs" / "worker-killed"
    log1 = tmp_path / "hand-run.log"
    hand = start_cli(["run", str(config), "--stages", ",".join(STAGES)], log1)
    try:
        wait_for(lambda: any(True for _ in folder.glob("*/manifest.json")), "run folder created", log1)
        run_dir = next(folder.glob("*/manifest.json")).parent
        wait_for(lambda: json.loads((run_dir / "manifest.json").read_text())["stages"]["run_benchmark"]["status"]
                 == "running", "run_benchmark running", log1, timeout=420)
        [server] = live_servers(run_dir)
        holder = json.loads((run_dir / "holder.json").read_text())
        before = json.loads((run_dir / "manifest.json").read_text())
        tiny = httpx.get(f"{api}/deployments/name/eagle3-experiment/tiny", timeout=10).json()
        created = httpx.post(f"{api}/deployments/{tiny['id']}/create_flow_run", timeout=30, json={
            "state": {"type": "SCHEDULED", "message": "Run from the Prefect UI"},
            "parameters": {"config_path": str(config), "run_dir": str(run_dir),
                           "stages": ["deploy_server", "run_benchmark"]}})
        assert created.status_code == 201, created.text
        log2 = tmp_path / "worker.log"
        with cpu_worker(team_servers, log2):
            run = wait_for_run(api, created.json()["id"], log2, timeout_s=300)
        output = log2.read_text()
        print(f"deployment run on a held folder: {run['state']['type']}: {run['state']['message']}")
        assert run["state"]["type"] == "FAILED", (run["state"]["message"], output[-3000:])
        named = (f"run folder {run_dir} is held by another run: pid {hand.pid} on host {holder['host']}, "
                 f"Prefect flow run {holder['flow_run_id']}, since {holder['since']}")
        assert named in run["state"]["message"], run["state"]["message"]
        assert f"Encountered exception during execution: RunFolderHeld('{named}" in output  # one line, no traceback
        assert "Traceback" not in output, output[-3000:]
        assert hand.poll() is None and psutil.pid_exists(server["pid"]) and live_servers(run_dir) == [server]
        assert json.loads((run_dir / "manifest.json").read_text())["stages"] == before["stages"]
        assert "deploy_server" not in output.replace(str(run_dir), "")  # no stage of the refused run began
        hand.terminate()  # SIGTERM: the hand run's own teardown stops its server
        assert hand.wait(timeout=120) == 143
        assert live_servers(run_dir) == [] and reference_servers_alive(str(remote)) == []
    finally:
        if hand.poll() is None:
            hand.kill()
        for pid in reference_servers_alive(str(remote)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
