"""What a user does to a running `eagleops run`: Ctrl-C (SIGINT to the process group, as a
terminal sends it), `kill PID` (SIGTERM to the process alone, as a scheduler does) and kill -9.

Each run is a real CLI subprocess with its own temporary Prefect server. Checked: exit code and
the one-line message (no traceback), the stage recorded as interrupted in the manifest and
KILLED in MLflow, no server left behind (ps), and the run resumable from where it stopped: in
place, and in a copy of the folder elsewhere (from another working directory), which never
touches the original. A teardown that itself fails (a host that no longer answers, a group already
gone) or gets a second signal still ends with the interrupt's or the failure's own line and exit code,
having stopped every server it could reach.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import psutil
import pytest
from mlflow.tracking import MlflowClient

from tasks.rundir import RunDirectory, file_sha256
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
# max_new_tokens within data.max_length (checked before any stage); the cancel test brings its own bench.
BENCH = "bench: {max_new_tokens: 16}\n"
SERVER_MARK = "prefect.server.api.server:create_app"
ML_STAGES = "check_environment,generate_data,train_draft,export_checkpoint"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("interrupts")


def write_config(workdir: Path, max_steps: int) -> Path:
    path = workdir / f"interrupts-{max_steps}.yaml"
    path.write_text(CONFIG.format(target=TEST_TARGET_YAML, runs=workdir / "runs", max_steps=max_steps) + BENCH)
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


def start_cli(args: list[str], log: Path, env: dict | None = None, cwd: Path | None = None,
              prefect_api: str | None = None) -> subprocess.Popen:
    """`eagleops ...` in its own process group with SIGINT at its default (a terminal's job); with `prefect_api` it
    reports there (the worker's server: `cli_prefect_api`), else to its own temporary server, as a user's first run."""
    env = {**os.environ, **(env or {}), "EAGLEOPS_TEST_RUN": RUN_MARK}
    env.pop("PREFECT_API_URL", None)
    if prefect_api:
        env["PREFECT_API_URL"] = prefect_api
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, env=env, cwd=cwd,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_until(done: Callable[[], bool], what: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Poll `done` until it holds; fail (and kill `proc`) if `proc` exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done():
            return
        assert proc.poll() is None, f"exited {proc.returncode} before {what}:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"not {what} within {timeout}s:\n{log.read_text()[-3000:]}")


def wait_for_line(log: Path, pattern: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    wait_until(lambda: re.search(pattern, log.read_text(errors="replace")) is not None, f"{pattern!r} logged",
               proc, log, timeout)


def wait_for_stage(run_dir: Path, stage: str, status: str, proc: subprocess.Popen, log: Path,
                   timeout: float = 120) -> None:
    """Until the run folder's manifest records `stage` with `status` (the manifest is written atomically)."""
    def recorded() -> bool:
        return json.loads((run_dir / "manifest.json").read_text())["stages"].get(stage, {}).get("status") == status

    wait_until(recorded, f"{stage} {status}", proc, log, timeout)


def served_requests(port: int) -> float:
    """Requests the reference server on `port` has finished (its /metrics, as SGLang's)."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sglang:e2e_request_latency_seconds_count"))


def wait_for_requests(port: int, count: float, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    wait_until(lambda: served_requests(port) >= count, f"{count:g} requests served", proc, log, timeout)


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


def snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file under `folder` with its bytes' sha256 and its mtime: what "never touched" compares."""
    return {str(p.relative_to(folder)): (file_sha256(p), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def resume_a_copy_elsewhere(config: Path, run_dir: Path, workdir: Path, prefect_api: str) -> None:
    """The interrupted folder copied alone into another runs root (rsync to shared storage: no tiny-target
    cache, no MLflow store there) resumes there, from another working directory, writing only into the
    copy: the original runs root (run folder, its store, the cache) is the same, byte for byte and mtime."""
    original = snapshot(workdir / "runs")
    copy = workdir / "shared" / "runs" / run_dir.parent.name / run_dir.name
    shutil.copytree(run_dir, copy, symlinks=True)
    elsewhere = workdir / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    log = workdir / "resume-copy.log"
    proc = start_cli(["run", str(config), "--run-dir", str(copy), "--stages", ML_STAGES], log, cwd=elsewhere,
                     prefect_api=prefect_api)
    code, output = proc.wait(timeout=600), log.read_text()
    assert code == 0, output[-3000:]
    assert "generate_data: completed earlier with the same inputs" in output
    assert "train_draft: resuming attempt 1" in output
    assert re.search(rf"resumed from {re.escape(str(copy))}/train_draft/attempt-1/\S*step_\d+ at step [1-9]", output)
    final = RunDirectory.open(copy).manifest["stages"]["train_draft"]
    assert final["status"] == "completed" and len(final["attempts"]) == 1 and final["summary"]["steps"] == 120
    assert final["dir"] == str(copy / "train_draft" / "attempt-1")
    assert snapshot(workdir / "runs") == original


@pytest.mark.slow
def test_ctrl_c_stops_within_seconds_with_one_line_and_resumes(workdir, cli_prefect_api):
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

    resume_a_copy_elsewhere(config, run_dir, workdir, cli_prefect_api)
    code, output = resume(config, run_dir, workdir, "sigint")
    assert code == 0, output[-3000:]
    assert "generate_data: completed earlier with the same inputs" in output
    assert "train_draft: resuming attempt 1" in output
    assert re.search(r"resumed from .*step_\d+ at step [1-9]\d*", output)
    final = json.loads((run_dir / "manifest.json").read_text())["stages"]["train_draft"]
    assert final["status"] == "completed" and len(final["attempts"]) == 1 and final["summary"]["steps"] == 120
    assert_no_new_server(before)


@pytest.mark.slow
def test_sigterm_to_the_process_alone_is_handled_like_ctrl_c(workdir, cli_prefect_api):
    config = write_config(workdir, max_steps=100000)
    log = workdir / "sigterm.log"
    before = prefect_servers()
    proc = start_cli(["run", str(config)], log, prefect_api=cli_prefect_api)
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
    tmp = workdir / "sigkill-tmp"  # the run's TMPDIR: what it leaves there, nobody removes
    tmp.mkdir()
    proc = start_cli(["run", str(config)], log, env={"TMPDIR": str(tmp)})
    wait_for_line(log, r"step 10/\d+", proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert_no_new_server(before)  # the server dies with its parent (PR_SET_PDEATHSIG)
    assert not list(tmp.glob("eagleops-*")), list(tmp.iterdir())  # the server's log had been left here, empty
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
def test_a_cancelled_run_leaves_no_model_server(workdir, cli_prefect_api):
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
    proc = start_cli(["run", str(config)], log, prefect_api=cli_prefect_api)
    wait_for_line(log, r"speculative 2/1/3: serving on local", proc)
    run_dir = run_dir_of(workdir)
    # run_benchmark logs its first line only after a whole setting's 1100 generations (~90 s here): wait for
    # the stage to be recorded as running instead, then for its generations to reach the live server.
    wait_for_stage(run_dir, "run_benchmark", "running", proc, log)
    servers = json.loads((run_dir / "servers.json").read_text())
    live = [s for s in servers.values() if s["status"] == "live"]
    assert live and all(psutil.pid_exists(s["pid"]) for s in live)
    wait_for_requests(live[0]["port"], served_requests(live[0]["port"]) + 3, proc, log)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    servers = json.loads((run_dir / "servers.json").read_text())
    assert all(s["status"] == "stopped" for s in servers.values()), servers
    assert reference_servers_alive(str(run_dir)) == []
    assert json.loads((run_dir / "manifest.json").read_text())["stages"]["run_benchmark"]["status"] == "interrupted"


FAULTS_CONFIG = """\
experiment: faults
runs_root: {runs}
{target}data:
  num_samples: {samples}
  max_length: 128
  regenerate: {{max_new_tokens: 48}}
  draft_vocab_size: 64
hosts:
  - {{name: gone-host, address: 127.0.0.1, port: {dead_port}, user: nobody, connect_timeout_s: 2, connect_retries: 0}}
"""


def record_test_server(run_dir: Path, label: str, host: str = "local", port: int | None = None,
                       gone: bool = False) -> int:
    """A real process group (a shell and its sleep) recorded in servers.json as a live server; `gone`: it
    exited before the teardown. -> its pid."""
    from tasks.hosts.remote import LocalExecutor
    from tasks.hosts.server_registry import record_server
    from tasks.hosts.servers import ServerHandle
    from tests.helpers import free_port

    local, mark = LocalExecutor(), f"{RUN_MARK}-{label}"
    argv = ["sh", "-c", f"sleep 600 & exec sleep 601 # {mark}"]
    pid = local.start_detached(argv, log_file=str(run_dir / f"{label}.log"), pid_file=str(run_dir / f"{label}.pid"))
    handle = ServerHandle(label, host, pid, port or free_port(), str(run_dir / f"{label}.log"), "", argv, False,
                          identity=local.process_identity(pid) or "")
    if gone:
        local.kill_group(pid)
    record_server(run_dir, f"{host}:{handle.port}:{pid}", {**handle.to_dict(), "status": "live"})
    return pid


def recorded_servers_alive() -> list[int]:
    """Live (not zombie) processes of the servers `record_test_server` started."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        line = " ".join(proc.info["cmdline"] or [])
        if f"# {RUN_MARK}-" in line and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc.info["pid"])
    return found


def server_statuses(run_dir: Path) -> dict[str, str]:
    return {s["label"]: s["status"] for s in json.loads((run_dir / "servers.json").read_text()).values()}


@pytest.mark.slow
def test_a_failing_teardown_never_hides_the_interrupt_or_the_failure(workdir, cli_prefect_api):
    """Recorded: a server on a host that no longer answers (first, so a teardown that stops at the first
    failure would stop nothing), a group already gone, and two live ones. SIGTERM, then a second signal
    (SIGINT) while the teardown waits for a port: exit 143 with the interrupt's one line, every server it
    can reach stopped, the dead host's named. Then a run on the same folder whose stage fails: exit 1 with
    the failure's one line, its live server stopped too."""
    from tests.helpers import free_port

    runs, before = workdir / "faults-runs", prefect_servers()
    config = workdir / "faults.yaml"
    config.write_text(FAULTS_CONFIG.format(runs=runs, target=TEST_TARGET_YAML, samples=2000, dead_port=free_port()))
    log = workdir / "faults-sigterm.log"
    proc = start_cli(["run", str(config), "--stages", "check_environment,generate_data"], log,
                     prefect_api=cli_prefect_api)
    wait_for_line(log, r"Task run 'generate_data[^']*' - tiny target", proc)  # ~30 s of the stage left
    run_dir = next((runs / "faults").iterdir())
    record_test_server(run_dir, "unreachable", host="gone-host", gone=True)  # its host is what matters
    record_test_server(run_dir, "gone", gone=True)
    busy = socket.create_server(("127.0.0.1", 0))  # the first live server's port stays busy: its stop waits
    slow = record_test_server(run_dir, "slow", port=busy.getsockname()[1])
    record_test_server(run_dir, "last")
    os.kill(proc.pid, signal.SIGTERM)
    wait_for_line(log, rf"process group {slow} stopped", proc, timeout=60)
    os.kill(proc.pid, signal.SIGINT)  # the second signal, mid-teardown
    time.sleep(1.0)
    busy.close()
    assert proc.wait(timeout=90) == 143
    output = log.read_text()
    assert "Traceback" not in output, output[-3000:]
    assert output.rstrip().splitlines()[-1].startswith("interrupted (SIGTERM) during generate_data; resume with:")
    assert "SIGINT received during the teardown of" in output
    assert "unreachable: pid" in output and "on gone-host left running: cannot reach host gone-host" in output
    assert recorded_servers_alive() == []
    assert server_statuses(run_dir) == {"unreachable": "live", "gone": "stopped", "slow": "stopped",
                                        "last": "stopped"}

    # the same folder, a config whose environment check fails (6.5 TB of hidden states on this disk)
    failing = workdir / "faults-fail.yaml"
    failing.write_text(config.read_text().replace("num_samples: 2000", "num_samples: 100000000"))
    record_test_server(run_dir, "again")
    log = workdir / "faults-fail.log"
    proc = start_cli(["run", str(failing), "--run-dir", str(run_dir), "--stages", "check_environment"], log,
                     prefect_api=cli_prefect_api)
    assert proc.wait(timeout=300) == 1
    output = log.read_text()
    # Prefect logs the stage's own traceback; none may come from the teardown
    assert not any(f'tasks/hosts/{room}.py", line' in output for room in ("teardown", "servers")), output[-3000:]
    assert "EnvironmentCheckFailed" in output, output[-3000:]
    assert output.rstrip().splitlines()[-1].startswith("stage failed check_environment failed: disk:"), output[-2000:]
    assert "on gone-host left running: cannot reach host gone-host" in output
    assert recorded_servers_alive() == []
    assert server_statuses(run_dir)["again"] == "stopped"
    assert_no_new_server(before)
