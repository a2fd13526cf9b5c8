"""One run at a time per run folder (tasks/run_lock.py), with real processes and threads: a second process and a
second thread of one process are refused, naming the holder; a holder killed with SIGKILL leaves the folder free
and its record is reported stale (pid gone, or a pid reused by another process); a nightly's scope keeps the
folders its subflow took; a Prefect hook of a refused Retry leaves the live attempt's servers alone."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tasks.run_lock import (
    HOLDER_FILE,
    RunFolderHeld,
    acquire_run_folder,
    holder_of,
    keeping_run_folders,
    process_start_time,
    refuse_if_held,
)

REPO = Path(__file__).resolve().parents[2]
HOLD = """\
import sys, time
from tasks.run_lock import acquire_run_folder
lock = acquire_run_folder(sys.argv[1], "flow-run-of-the-holder")
print("held", flush=True)
time.sleep(600)
"""


def hold_in_process(run_dir: Path) -> subprocess.Popen:
    """Another process holding `run_dir`, once it said so."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_process_is_refused_at_once_naming_the_holder(tmp_path):
    holder = hold_in_process(tmp_path)
    try:
        started = time.monotonic()
        with pytest.raises(RunFolderHeld) as refused:
            acquire_run_folder(tmp_path, "another-flow-run")
        assert time.monotonic() - started < 1.0
        message = str(refused.value)
        assert f"pid {holder.pid} on host {socket.gethostname()}, Prefect flow run flow-run-of-the-holder, since " \
               in message and f"kill {holder.pid}" in message and "\n" not in message
        with pytest.raises(RunFolderHeld):
            refuse_if_held(tmp_path)  # the CLI's check names the same holder
        assert holder_of(tmp_path)["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait()


def test_a_holder_killed_with_sigkill_is_taken_over_and_said_so(tmp_path):
    holder = hold_in_process(tmp_path)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert json.loads((tmp_path / HOLDER_FILE).read_text())["pid"] == holder.pid  # nobody could remove it
    assert holder_of(tmp_path) is None
    refuse_if_held(tmp_path)  # free: no refusal
    lock = acquire_run_folder(tmp_path, "next")
    assert lock.takeover_line().startswith(f"run folder {tmp_path}: taking it over from pid {holder.pid} on host ")
    assert lock.takeover_line().endswith(": its process is gone")
    assert holder_of(tmp_path)["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / HOLDER_FILE).exists() and holder_of(tmp_path) is None


FORK_AND_HOLD = HOLD.replace('print("held"', "\n".join([
    "import os",
    "if os.fork() == 0:  # a DataLoader worker's way: a forked child that outlives its parent for a while",
    "    time.sleep(60)",
    "    os._exit(0)",
    'print("held"']))


def test_a_forked_child_of_a_killed_holder_does_not_keep_the_folder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", FORK_AND_HOLD, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline().strip() == "held"
    [child] = psutil.Process(holder.pid).children()
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    try:
        assert child.is_running()
        lock = acquire_run_folder(tmp_path, "next")  # at once: the child's copy was closed when it was forked
        assert lock.takeover_line().endswith(": its process is gone")
        lock.release()
    finally:
        child.kill()


def test_a_recorded_pid_now_running_another_process_is_stale(tmp_path):
    (tmp_path / HOLDER_FILE).write_text(json.dumps({
        "pid": os.getpid(), "start_time": process_start_time(os.getpid()) - 1, "host": socket.gethostname(),
        "flow_run_id": "old", "since": "2026-01-01T00:00:00+00:00"}))
    lock = acquire_run_folder(tmp_path, "new")
    assert lock.takeover_line().endswith(f"pid {os.getpid()} is another process now (start time differs)")
    lock.release()


def test_threads_of_one_process_exclude_each_other(tmp_path):
    lock = acquire_run_folder(tmp_path, "first")
    refused = []

    def second() -> None:
        try:
            acquire_run_folder(tmp_path, "second").release()
        except RunFolderHeld as err:
            refused.append(str(err))

    thread = threading.Thread(target=second)
    thread.start()
    thread.join(10)
    assert refused and f"pid {os.getpid()}" in refused[0] and "flow run first" in refused[0]
    lock.release()
    acquire_run_folder(tmp_path, "third").release()  # free again


def test_a_nightly_keeps_the_folder_its_subflow_took_until_its_block_ends(tmp_path):
    with keeping_run_folders():
        lock = acquire_run_folder(tmp_path, "subflow")
        lock.release()  # the subflow's end: kept for the nightly's gate
        holder = hold_or_refusal(tmp_path)
        assert isinstance(holder, RunFolderHeld)
    assert holder_of(tmp_path) is None
    acquire_run_folder(tmp_path, "later").release()


def hold_or_refusal(run_dir: Path):
    """What another process gets: 'held' or the refusal."""
    probe = subprocess.run([sys.executable, "-c", "import sys\nfrom tasks.run_lock import refuse_if_held\n"
                            "refuse_if_held(sys.argv[1])\nprint('free')", str(run_dir)],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
    return RunFolderHeld(run_dir, None) if "RunFolderHeld" in probe.stderr else probe.stdout.strip()


def test_a_refused_retry_hook_leaves_the_running_attempts_servers_alone(tmp_path):
    """A UI Retry while attempt 1 still runs: attempt 2 (same flow run id) is refused, and its failure hook
    (teardown_for_flow_run) must not stop attempt 1's servers; once attempt 1 is dead, the same call does."""
    from tasks.hosts.remote import LocalExecutor
    from tasks.hosts.server_registry import record_server
    from tasks.hosts.servers import ServerHandle
    from tasks.hosts.teardown import teardown_for_flow_run, unstopped_servers
    from tests.helpers import TEST_TARGET_YAML, free_port

    config = tmp_path / "retry.yaml"
    config.write_text(f"experiment: retry\nruns_root: {tmp_path / 'runs'}\n{TEST_TARGET_YAML}"
                      "data: {draft_vocab_size: 64}\n")
    run_dir = tmp_path / "runs" / "retry" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "manifest.json").write_text(json.dumps({"experiment": "retry", "run_id": "r1", "stages": {},
                                                       "prefect_flow_run_ids": ["flow-run-of-the-holder"]}))
    local, mark = LocalExecutor(), f"run-lock-{os.getpid()}-{time.time_ns()}"
    argv = ["sh", "-c", f"exec sleep 600 # {mark}"]
    pid = local.start_detached(argv, log_file=str(run_dir / "s.log"), pid_file=str(run_dir / "s.pid"))
    handle = ServerHandle("baseline", "local", pid, free_port(), str(run_dir / "s.log"), "", argv, False,
                          identity=local.process_identity(pid) or "")
    record_server(run_dir, f"local:{handle.port}:{pid}", {**handle.to_dict(), "status": "live"})
    attempt_1 = hold_in_process(run_dir)
    try:
        with pytest.raises(RunFolderHeld):
            acquire_run_folder(run_dir, "flow-run-of-the-holder")  # attempt 2 of the same flow run
        parameters = {"config_path": str(config), "run_dir": str(run_dir)}
        assert teardown_for_flow_run(parameters, "flow-run-of-the-holder") == []
        assert local.process_identity(pid) and unstopped_servers(run_dir)
        attempt_1.kill()
        attempt_1.wait()
        assert teardown_for_flow_run(parameters, "flow-run-of-the-holder") == [f"baseline (pid {pid} on local)"]
        assert not unstopped_servers(run_dir)
    finally:
        attempt_1.kill()
        local.kill_group(pid)
