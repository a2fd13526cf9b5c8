"""The run's teardown (tasks/hosts/teardown.py `teardown_run`, tasks/hosts/servers.py `stop`) and its registry (tasks/hosts/server_registry.py),
in-process, with real processes: a server group recorded live, a recorded pid that now belongs to another
process, a group already gone, a host that no longer answers, an SSH host over the session's real sshd.

Checked: every server that can be stopped is (ps), nothing else is killed, the teardown never raises
and names what it left, a signal during it waits for its end (and an error already unwinding stays the
error), the SSH connections it and the deploy opened are closed (sshd's per-connection processes), and
threads recording servers at once never lose an entry.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from tasks.config.load import load_experiment
from tasks.hosts.remote import LocalExecutor, connect
from tasks.hosts.server_registry import read_servers, record_server
from tasks.hosts.servers import ServerHandle, open_executor, stop
from tasks.hosts.teardown import teardown_run, unstopped_servers
from tests.helpers import TEST_TARGET_YAML, free_port
from tests.tasks.hosts.remote.helpers import live_processes

CONFIG = """\
experiment: teardown-unit
runs_root: {runs}
{target}data: {{draft_vocab_size: 64}}
hosts:
  - {{name: gone-host, address: 127.0.0.1, port: {dead_port}, user: nobody, connect_timeout_s: 2,
      connect_retries: 5}}
{ssh}deploy: {{host: {deploy_host}}}
"""
SSH_HOST = """\
  - {{name: testhost, address: 127.0.0.1, port: {port}, user: {user}, key_file: {key}, known_hosts: {known},
      workdir: {workdir}}}
"""


def write_config(tmp_path: Path, sshd=None) -> Path:
    ssh = ""
    if sshd is not None:
        host = sshd.host_config()
        ssh = SSH_HOST.format(port=host.port, user=host.user, key=host.key_file, known=host.known_hosts,
                              workdir=tmp_path / "remote")
    path = tmp_path / "teardown.yaml"
    path.write_text(CONFIG.format(runs=tmp_path / "runs", target=TEST_TARGET_YAML, dead_port=free_port(), ssh=ssh,
                                  deploy_host="testhost" if sshd else "local"))
    return path


def start_server(executor, tmp_path: Path, mark: str, host: str = "local", label: str = "baseline",
                 identity: str | None = None) -> ServerHandle:
    """A real process group (a shell and its child), recorded as a live server, with its launch identity."""
    log, pid_file = tmp_path / f"{mark}.log", tmp_path / f"{mark}.pid"
    argv = ["sh", "-c", f"sleep {mark}1 & exec sleep {mark}2"]
    pid = executor.start_detached(argv, log_file=str(log), pid_file=str(pid_file))
    wait_for(lambda: len(live_processes(f"sleep {mark}")) == 2)
    return ServerHandle(label, host, pid, free_port(), str(log), str(pid_file), argv, False,
                        identity=identity if identity is not None else executor.process_identity(pid))


def record(run_dir: Path, handle: ServerHandle, status: str = "live") -> None:
    record_server(run_dir, f"{handle.host}:{handle.port}:{handle.pid}", {**handle.to_dict(), "status": status})


def wait_for(condition, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def statuses(run_dir: Path) -> dict[str, str]:
    return {entry["label"]: entry["status"] for entry in read_servers(run_dir).values()}


def test_threads_recording_at_once_never_lose_an_entry(tmp_path):
    def writer(t: int) -> None:
        for i in range(25):
            record_server(tmp_path, f"local:{t}:{i}", {"label": f"{t}-{i}", "status": "live"})

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(read_servers(tmp_path)) == sorted(f"local:{t}:{i}" for t in range(8) for i in range(25))
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_teardown_goes_past_a_dead_host_and_a_gone_group_and_spares_a_reused_pid(tmp_path, caplog):
    cfg = load_experiment(write_config(tmp_path))
    run_dir, local = tmp_path / "run", LocalExecutor()
    run_dir.mkdir()
    # recorded first, so a teardown that stops at the first failure would stop nothing else
    unreachable = ServerHandle("speculative 3/1/4", "gone-host", 4242, 30000, "/x.log", "/x.pid", ["x"], True,
                               identity="boot:1")
    record(run_dir, unreachable)
    gone = start_server(local, tmp_path, "311", label="gone")
    local.kill_group(gone.pid)
    record(run_dir, gone)
    earlier = start_server(local, tmp_path, "312", label="earlier")  # its identity is what a reused pid's record holds
    local.kill_group(earlier.pid)
    stranger = start_server(local, tmp_path, "313", label="reused", identity=earlier.identity)
    record(run_dir, stranger)
    ours = start_server(local, tmp_path, "314", label="ours")
    record(run_dir, ours)
    try:
        started = time.monotonic()
        with caplog.at_level(logging.INFO):
            stopped = teardown_run(run_dir, cfg)  # never raises
        took = time.monotonic() - started
        assert len(live_processes("sleep 313")) == 2, "a process that took a recorded pid was killed"
    finally:
        local.kill_group(stranger.pid)
    assert live_processes("sleep 314") == []
    assert stopped == [f"gone (pid {gone.pid} on local)", f"reused (pid {stranger.pid} on local)",
                       f"ours (pid {ours.pid} on local)"]
    assert statuses(run_dir) == {"speculative 3/1/4": "live", "gone": "stopped", "reused": "stopped", "ours": "stopped"}
    assert unstopped_servers(run_dir) == ["speculative 3/1/4 (pid 4242 on gone-host)"]
    assert f"pid {stranger.pid} on local is another process now" in caplog.text
    assert "speculative 3/1/4: pid 4242 on gone-host left running: cannot reach host gone-host" in caplog.text
    assert took < 20  # one connect and one retry to the dead host (its connect_retries: 5 would add ~30 s of backoff)


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler (KeyboardInterrupt) for the test: the held signal is delivered to the handler
    that was there before the teardown, and a library run in-process by an earlier test of the session may have
    left another one (the full suite failed here once on CI, passing alone)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_signal_during_the_teardown_waits_for_its_end(tmp_path, python_sigint):
    """SIGINT while the first server's port is still busy: the second is stopped too, then the signal lands
    (KeyboardInterrupt); inside an error's unwinding, that error stays the error."""
    for unwinding in (False, True):
        run_dir, local = tmp_path / f"run-{unwinding}", LocalExecutor()
        run_dir.mkdir()
        first, second = start_server(local, tmp_path, "321", label="first"), start_server(local, tmp_path, "322")
        busy = socket.create_server(("127.0.0.1", 0))
        first.port = busy.getsockname()[1]  # stop() waits for it to be free
        record(run_dir, first)
        record(run_dir, second)

        def interrupt_then_free_the_port() -> None:
            wait_for(lambda: live_processes("sleep 321") == [])
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
            busy.close()

        helper = threading.Thread(target=interrupt_then_free_the_port)
        helper.start()
        if unwinding:
            with pytest.raises(RuntimeError, match="the stage's own error"):
                try:
                    raise RuntimeError("the stage's own error")
                finally:
                    teardown_run(run_dir)
        else:
            with pytest.raises(KeyboardInterrupt):
                teardown_run(run_dir)
        helper.join()
        assert live_processes("sleep 322") == []
        assert set(statuses(run_dir).values()) == {"stopped"}


def test_teardown_closes_the_ssh_connections_of_the_run(tmp_path, sshd):
    """The deploy's executor (held for the run's servers) and the one the teardown opens for a recorded
    server on the SSH host: both closed when it ends (sshd's per-connection processes are gone)."""
    cfg = load_experiment(write_config(tmp_path, sshd))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    before = set(sshd.connection_pids())
    with connect(sshd.host_config()) as ssh:
        remote = start_server(ssh, tmp_path, "331", host="testhost")
    record(run_dir, remote)
    deploy_executor = open_executor(cfg, run_dir)
    deploy_executor.run(["true"])
    assert set(sshd.connection_pids()) - before  # the deploy's connection is open
    assert teardown_run(run_dir, cfg) == [f"baseline (pid {remote.pid} on testhost)"]
    assert live_processes("sleep 331") == []
    wait_for(lambda: set(sshd.connection_pids()) <= before)


def test_stop_never_raises_and_leaves_the_entry_for_the_next_teardown(tmp_path):
    """A stop that fails half-way (here the run folder is gone, so the record cannot be written) is logged,
    returns False and raises nothing: the caller's own error, on its way out, stays the error."""
    local = LocalExecutor()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    handle = start_server(local, tmp_path, "341")
    record(run_dir, handle)
    for leftover in run_dir.iterdir():
        leftover.unlink()
    run_dir.rmdir()
    assert stop(run_dir, handle, local) is False
    assert live_processes("sleep 341") == []  # the kill itself happened
