"""What a user does to a running `eagleops run`: Ctrl-C (SIGINT to the process group, as a
terminal sends it), `kill PID` (SIGTERM to the process alone, as a scheduler does) and kill -9.

Each run is a real CLI subprocess with its own temporary Prefect server. Checked: exit code and
the one-line message (no traceback), the stage recorded as interrupted in the manifest and
KILLED in MLflow, no server left behind (ps), and the run resumable from where it stopped.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient
from tests.helpers import TEST_TARGET_YAML

CONFIG = """\
experiment: interrupts
runs_root: {runs}
{target}data:
  num_samples: 24
  max_length: 128
  regenerate: {{max_new_tokens: 16}}
  draft_vocab_size: 64
train:
  ttt_steps: 2
  max_steps: {max_steps}
  epochs: 10000
  batch_size: 4
  checkpoint_every: 10
  log_every: 10
export:
  formats: [sglang]
  dtype: float32
"""
SERVER_MARK = "prefect.server.api.server:create_app"
ML_STAGES = "check_environment,generate_data,train_draft,export_checkpoint"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("interrupts")


def write_config(workdir: Path, max_steps: int) -> Path:
    path = workdir / f"interrupts-{max_steps}.yaml"
    path.write_text(CONFIG.format(target=TEST_TARGET_YAML, runs=workdir / "runs", max_steps=max_steps))
    return path


# Every CLI this module starts (and so every server those start) carries this in its environment,
# so servers of other test sessions on the same machine are not mistaken for ours.
RUN_MARK = f"interrupts-{os.getpid()}-{time.time_ns()}"


def prefect_servers() -> set[int]:
    """Temporary Prefect servers started by this module's CLIs (even orphaned ones)."""
    found = set()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if SERVER_MARK not in " ".join(proc.info["cmdline"] or []):
            continue
        try:
            if proc.environ().get("EAGLEOPS_TEST_RUN") == RUN_MARK:
                found.add(proc.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def start_cli(args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """`eagleops ...` in its own process group with SIGINT at its default (a terminal's job)."""
    env = {**os.environ, **(env or {}), "EAGLEOPS_TEST_RUN": RUN_MARK}
    env.pop("PREFECT_API_URL", None)  # its own temporary server, as a user's first run has
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for_line(log: Path, pattern: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(pattern, log.read_text(errors="replace")):
            return
        assert proc.poll() is None, f"exited {proc.returncode} before {pattern!r}:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"no {pattern!r} within {timeout}s:\n{log.read_text()[-3000:]}")


def run_dir_of(workdir: Path) -> Path:
    return max((workdir / "runs" / "interrupts").iterdir(), key=lambda p: p.stat().st_mtime)


def mlflow_status(workdir: Path, run_id: str) -> str:
    return MlflowClient(f"sqlite:///{workdir / 'runs' / 'mlflow.db'}").get_run(run_id).info.status


def assert_no_new_server(before: set[int], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while (left := prefect_servers() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"temporary Prefect server(s) left running: {left}"


def resume(config: Path, run_dir: Path, workdir: Path, tag: str) -> tuple[int, str]:
    log = workdir / f"resume-{tag}.log"
    proc = start_cli(["run", str(config), "--run-dir", str(run_dir), "--stages", ML_STAGES], log)
    return proc.wait(timeout=600), log.read_text()


@pytest.mark.slow
def test_ctrl_c_stops_within_seconds_with_one_line_and_resumes(workdir):
    config = write_config(workdir, max_steps=120)
    log = workdir / "sigint.log"
    before = prefect_servers()
    proc = start_cli(["run", str(config), "--stages", ML_STAGES], log)
    wait_for_line(log, r"step 20/120", proc)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    output = log.read_text()
    assert "Traceback" not in output and "Error logging to API" not in output
    run_dir = run_dir_of(workdir)
    assert output.rstrip().splitlines()[-1] == (
        f"interrupted (Ctrl-C) during train_draft; resume with: eagleops run {config} --run-dir {run_dir}")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    train = manifest["stages"]["train_draft"]
    assert train["status"] == "interrupted" and manifest["status"] == "killed"
    assert mlflow_status(workdir, train["mlflow_run_id"]) == "KILLED"
    assert mlflow_status(workdir, manifest["mlflow"]["parent_run_id"]) == "KILLED"
    assert_no_new_server(before)

    code, output = resume(config, run_dir, workdir, "sigint")
    assert code == 0, output[-3000:]
    assert "generate_data: completed earlier with the same inputs" in output
    assert "train_draft: resuming attempt 1" in output
    assert re.search(r"resumed from .*step_\d+ at step [1-9]\d*", output)
    final = json.loads((run_dir / "manifest.json").read_text())["stages"]["train_draft"]
    assert final["status"] == "completed" and len(final["attempts"]) == 1 and final["summary"]["steps"] == 120
    assert_no_new_server(before)


@pytest.mark.slow
def test_sigterm_to_the_process_alone_is_handled_like_ctrl_c(workdir):
    config = write_config(workdir, max_steps=100000)
    log = workdir / "sigterm.log"
    before = prefect_servers()
    proc = start_cli(["run", str(config)], log)
    wait_for_line(log, r"step 10/\d+", proc)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    output = log.read_text()
    assert "Traceback" not in output
    assert output.rstrip().splitlines()[-1].startswith("interrupted (SIGTERM) during train_draft; resume with:")
    train = json.loads((run_dir_of(workdir) / "manifest.json").read_text())["stages"]["train_draft"]
    assert train["status"] == "interrupted"
    assert mlflow_status(workdir, train["mlflow_run_id"]) == "KILLED"
    assert_no_new_server(before)


@pytest.mark.slow
def test_kill_9_leaves_no_server_and_the_next_run_marks_the_attempt_killed(workdir):
    config = write_config(workdir, max_steps=100000)
    log = workdir / "sigkill.log"
    before = prefect_servers()
    proc = start_cli(["run", str(config)], log)
    wait_for_line(log, r"step 10/\d+", proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert_no_new_server(before)  # the server dies with its parent (PR_SET_PDEATHSIG)
    run_dir = run_dir_of(workdir)
    stale = json.loads((run_dir / "manifest.json").read_text())["stages"]["train_draft"]
    assert stale["status"] == "running"  # nobody could record anything
    assert mlflow_status(workdir, stale["mlflow_run_id"]) == "RUNNING"

    # The next run on the folder (here it only re-checks the machine) closes the dead attempt.
    code, output = resume_env_only(config, run_dir, workdir)
    assert code == 0, output[-3000:]
    assert "train_draft: attempt 1 was interrupted (its process died)" in output
    closed = json.loads((run_dir / "manifest.json").read_text())["stages"]["train_draft"]
    assert closed["status"] == "interrupted" and closed["error"] == "the process running it died"
    assert mlflow_status(workdir, stale["mlflow_run_id"]) == "KILLED"
    assert_no_new_server(before)


def resume_env_only(config: Path, run_dir: Path, workdir: Path) -> tuple[int, str]:
    log = workdir / "resume-env.log"
    proc = start_cli(["run", str(config), "--run-dir", str(run_dir), "--stages", "check_environment"], log)
    return proc.wait(timeout=300), log.read_text()


@pytest.mark.slow
def test_a_cancelled_run_leaves_no_model_server(workdir):
    """SIGTERM (what Prefect's runner sends when a run is cancelled from the UI) while the benchmark
    runs against a live reference server: the flow's teardown stops it, nothing is left (ps)."""
    from tests.helpers import free_port, reference_servers_alive

    config = workdir / "cancel.yaml"
    config.write_text(CONFIG.format(target=TEST_TARGET_YAML, runs=workdir / "runs", max_steps=20) + f"""\
deploy: {{host: local, server: reference, port: {free_port()}, speculative: {{num_steps: 2, eagle_topk: 1,
         num_draft_tokens: 3}}, startup_timeout_s: 240}}
bench: {{prompts: {workdir / 'cancel-prompts.jsonl'}, num_prompts: 1, max_new_tokens: 16, warmup_runs: 100,
        timed_runs: 1000}}
""")
    (workdir / "cancel-prompts.jsonl").write_text('{"prompt": "Say hello."}\n')
    log = workdir / "cancel.log"
    proc = start_cli(["run", str(config)], log)
    wait_for_line(log, r"speculative 2/1/3: serving on local", proc)
    wait_for_line(log, r"Task run 'run_benchmark", proc)
    run_dir = run_dir_of(workdir)
    servers = json.loads((run_dir / "servers.json").read_text())
    live = [s["pid"] for s in servers.values() if s["status"] == "live"]
    assert live and all(psutil.pid_exists(pid) for pid in live)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    servers = json.loads((run_dir / "servers.json").read_text())
    assert all(s["status"] == "stopped" for s in servers.values()), servers
    assert reference_servers_alive(str(run_dir)) == []
    assert json.loads((run_dir / "manifest.json").read_text())["stages"]["run_benchmark"]["status"] == "interrupted"
