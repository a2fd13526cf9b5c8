"""Warm starts (tasks/hosts/remote/warm_start.py, eagle3/forkserver.py) through `LocalExecutor.start_detached`, the
path every local server and job takes: the child is the command a cold start would be (its own session, log,
environment, command line, exit status, no descriptor of the server), a group kill reaches what ignores SIGTERM,
a crash at start reads as the cold one's, and the switch turns it all off. The oracle is the cold path (the
detach script, another mechanism) or the kernel's view in /proc, never the fork server's own account.

CPU (this module): ~25 CPU-s, most of it four fork servers' preloads (~3.5 each) and two eagle3.serve starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tasks.hosts.remote import LocalExecutor, warm_start
from tasks.hosts.servers import ServerFailed, ServerHandle, wait_healthy
from tests.helpers import free_port

MODULES = {
    # ignores SIGTERM, and so does the child it starts
    "stubborn_cmd": """
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                  "signal.SIG_IGN); time.sleep(600)"])
        print("ready", child.pid, flush=True)
        time.sleep(600)
    """,
    # what it is: argv, cwd, environment, descriptors, seeds; then it waits
    "report_cmd": """
        import json, os, random, sys, time
        import numpy
        print(json.dumps({"argv": sys.argv, "orig_argv": sys.orig_argv, "cwd": os.getcwd(), "mark": os.environ.get("MARK"),
                          "room": "EAGLEOPS_FORKSERVER_ROOM" in os.environ, "openblas": os.environ.get("OPENBLAS_NUM_THREADS"),
                          "random": random.random(), "numpy": float(numpy.random.random()), "main": __name__}), flush=True)
        time.sleep(float(sys.argv[1]))
        sys.exit(int(sys.argv[2]))
    """,
    # its signal dispositions, as Python sees them; then it waits
    "signals_cmd": """
        import signal, time
        print(*(str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGHUP)),
              flush=True)
        time.sleep(600)
    """,
    "crash_cmd": """
        raise RuntimeError("the model folder is not there")
    """,
}


@pytest.fixture
def warm(tmp_path, monkeypatch):
    """A LocalExecutor whose warm set includes this module's commands (written into the child's cwd, where `python -m`
    finds them); stops what the test started."""
    for name, source in MODULES.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.setattr(warm_start, "WARM_MODULES", warm_start.WARM_MODULES | set(MODULES))
    monkeypatch.setenv(warm_start.SWITCH, "1")
    executor, started = LocalExecutor(), []

    def start(module: str, *args: str, env: dict | None = None, name: str = "job") -> int:
        pid = executor.start_detached([sys.executable, "-m", module, *args], env=env, cwd=str(tmp_path),
                                      log_file=str(tmp_path / "logs" / f"{name}.log"),
                                      pid_file=str(tmp_path / "logs" / f"{name}.pid"))
        started.append(pid)
        return pid

    yield executor, start
    for pid in started:
        executor.kill_group(pid, timeout=2)


def fork_server_pids() -> set[int]:
    return {s.proc.pid for s in warm_start._SERVERS.values() if s is not None and s.alive()}


def wait_for(predicate, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def log_json(path: Path) -> dict:
    return wait_for(lambda: path.exists() and path.read_text().strip() and json.loads(path.read_text().splitlines()[0]),
                    what=f"{path} to report")


def group_members(pgid: int) -> list[int]:
    found = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return found


def test_a_child_that_ignores_sigterm_is_killed_with_its_group(warm, tmp_path):
    executor, start = warm
    pid = start("stubborn_cmd", name="stubborn")
    line = wait_for(lambda: (tmp_path / "logs" / "stubborn.log").read_text().strip(), what="the child to start")
    grandchild = int(line.split()[1])
    assert psutil.Process(pid).ppid() in fork_server_pids()  # it was forked warm, not started by the detach script
    assert os.getpgid(pid) == pid == os.getsid(pid) and os.getpgid(grandchild) == pid
    assert executor.kill_group(pid, timeout=2)  # SIGTERM ignored by both: SIGKILL after 2 s
    assert group_members(pid) == []
    assert not executor.is_alive(pid) and not executor.is_alive(grandchild)


def test_the_child_is_the_command_with_its_own_environment_and_no_descriptor_of_the_server(warm, tmp_path):
    executor, start = warm
    first = start("report_cmd", "600", "0", env={"MARK": "m1", "API_KEY": "hush-1"}, name="first")
    second = start("report_cmd", "0.2", "3", env={"MARK": "m2"}, name="second")
    seen = log_json(tmp_path / "logs" / "first.log")
    other = log_json(tmp_path / "logs" / "second.log")
    assert seen["argv"] == [str(tmp_path / "report_cmd.py"), "600", "0"] and seen["main"] == "__main__"
    assert seen["orig_argv"] == [sys.executable, "-m", "report_cmd", "600", "0"]
    assert seen["cwd"] == str(tmp_path) and (seen["mark"], other["mark"]) == ("m1", "m2")
    assert not seen["room"] and seen["openblas"] == os.environ.get("OPENBLAS_NUM_THREADS")
    assert seen["random"] != other["random"] and seen["numpy"] != other["numpy"]  # seeded per child
    # the kernel's view: what ps, pgrep -f and psutil read
    words = [w for w in psutil.Process(first).cmdline() if w]
    assert words == [sys.executable, "-m", "report_cmd", "600", "0"]
    environ = open(f"/proc/{first}/environ", "rb").read().split(b"\0")
    assert b"API_KEY=hush-1" in environ and b"MARK=m1" in environ
    assert not any(e.startswith(b"EAGLEOPS_FORKSERVER_ROOM") for e in environ)
    # descriptors: the log on 1 and 2, /dev/null on 0, nothing else (the server's socket, pipes, log)
    fds = {int(fd): os.readlink(f"/proc/{first}/fd/{fd}") for fd in os.listdir(f"/proc/{first}/fd")}
    assert fds == {0: "/dev/null", 1: str(tmp_path / "logs" / "first.log"), 2: str(tmp_path / "logs" / "first.log")}
    [server] = [p for p in fork_server_pids() if p == psutil.Process(first).ppid()]
    server_fds = {os.readlink(f"/proc/{server}/fd/{fd}") for fd in os.listdir(f"/proc/{server}/fd")}
    assert not server_fds & set(fds.values()) - {"/dev/null"}
    # its exit status is its own: sys.exit(3)
    assert wait_for(lambda: warm_start.exit_status(second) is not None, what="the second child to end") is True
    assert warm_start.exit_status(second) == 3
    assert warm_start.exit_status(first) is None and executor.is_alive(first)


@pytest.mark.parametrize("switch", ["1", "0"])
def test_a_crash_at_start_reaches_the_log_and_the_error_as_a_cold_one_does(warm, tmp_path, monkeypatch, switch):
    executor, start = warm
    monkeypatch.setenv(warm_start.SWITCH, switch)
    pid = start("crash_cmd", name=f"crash-{switch}")
    wait_for(lambda: not executor.is_alive(pid), what="the crash")
    log = (tmp_path / "logs" / f"crash-{switch}.log").read_text()
    assert log.splitlines()[0] == "Traceback (most recent call last):"
    assert log.splitlines()[-1] == "RuntimeError: the model folder is not there"
    assert warm_start.exit_status(pid) == (1 if switch == "1" else None)  # the cold path keeps no status


def test_a_reference_server_that_fails_at_start_fails_wait_healthy_with_the_cold_line(warm, tmp_path, monkeypatch):
    """The real command: eagle3.serve on a model folder that is not there, warm then cold; ServerFailed carries the
    same error line from both logs."""
    executor, start = warm
    failures = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(warm_start.SWITCH, switch)
        port = free_port()
        argv = [sys.executable, "-m", "eagle3.serve", "--model-path", str(tmp_path / "missing"), "--port", str(port)]
        log, pid_file = tmp_path / f"serve-{switch}.log", tmp_path / f"serve-{switch}.pid"
        pid = executor.start_detached(argv, cwd=str(tmp_path), log_file=str(log), pid_file=str(pid_file))
        handle = ServerHandle("baseline", "local", pid, port, str(log), str(pid_file), argv, False,
                              local_url=f"http://127.0.0.1:{port}")
        with pytest.raises(ServerFailed) as failure:
            wait_healthy(executor, handle, 120)
        failures[switch] = [line for line in str(failure.value).splitlines() if "missing" in line]
    assert failures["1"] and [line.split(" ", 2)[-1] for line in failures["1"]] == \
        [line.split(" ", 2)[-1] for line in failures["0"]]


def test_without_a_cwd_the_child_runs_where_this_process_does(warm, tmp_path, monkeypatch):
    """As the detach script's child does: it inherits this process's working directory."""
    executor, _ = warm
    here = tmp_path / "here"
    here.mkdir()
    (here / "report_cmd.py").write_text(textwrap.dedent(MODULES["report_cmd"]))
    monkeypatch.chdir(here)
    pid = executor.start_detached([sys.executable, "-m", "report_cmd", "600", "0"], log_file=str(tmp_path / "nocwd.log"),
                                  pid_file=str(tmp_path / "nocwd.pid"))
    try:
        assert psutil.Process(pid).ppid() in fork_server_pids()
        assert log_json(tmp_path / "nocwd.log")["cwd"] == str(here)
    finally:
        executor.kill_group(pid, timeout=2)


def signal_masks(pid: int) -> dict[str, str]:
    return {line.split(":")[0]: line.split(":")[1].strip() for line in open(f"/proc/{pid}/status")
            if line.startswith(("SigIgn", "SigCgt", "SigBlk"))}


@pytest.mark.parametrize("ignored", ["none", "SIGHUP", "SIGUSR2"])
def test_the_child_has_the_signal_dispositions_of_a_cold_start(warm, tmp_path, monkeypatch, ignored):
    """The kernel's masks (ignored, caught, blocked) and Python's handlers of a warm child equal a cold start's,
    whatever this process ignores at the launch and its fork server ignored when it started (in a CI run under
    nohup, the server ignored SIGHUP and the worker no longer did): the detach script's `&` starts the command with
    SIGINT and SIGQUIT ignored (neither may raise KeyboardInterrupt), `timeout` hands it SIGHUP at its default,
    and another signal this process ignores (SIGUSR2) stays ignored."""
    executor, start = warm
    sig = getattr(signal, ignored, signal.SIGUSR2)
    before = signal.signal(sig, signal.SIG_IGN if ignored != "none" else signal.SIG_DFL)
    seen = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(warm_start.SWITCH, switch)
        pid = start("signals_cmd", name=f"signals-{switch}")
        log = tmp_path / "logs" / f"signals-{switch}.log"
        handlers = wait_for(lambda: log.exists() and log.read_text().strip(), what="the handlers")
        seen[switch] = (handlers, signal_masks(pid), psutil.Process(pid).ppid() in fork_server_pids())
    signal.signal(sig, before)
    assert (seen["0"][2], seen["1"][2]) == (False, True)
    assert seen["1"][:2] == seen["0"][:2]
    usr2_ignored = int(seen["0"][1]["SigIgn"], 16) >> (signal.SIGUSR2 - 1) & 1
    assert seen["0"][0].split()[:2] == ["1", "1"] and usr2_ignored == (ignored == "SIGUSR2")


def test_switched_off_a_command_starts_cold(warm, tmp_path, monkeypatch):
    executor, start = warm
    monkeypatch.setenv(warm_start.SWITCH, "0")
    pid = start("report_cmd", "600", "0", name="cold")
    log_json(tmp_path / "logs" / "cold.log")
    assert psutil.Process(pid).ppid() not in fork_server_pids()
    assert psutil.Process(pid).cmdline() == [sys.executable, "-m", "report_cmd", "600", "0"]


def test_an_import_time_environment_of_its_own_gets_a_server_of_its_own(warm, tmp_path):
    executor, start = warm
    plain = start("report_cmd", "600", "0", name="plain")
    threads = start("report_cmd", "600", "0", env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}, name="threads")
    log_json(tmp_path / "logs" / "plain.log")
    log_json(tmp_path / "logs" / "threads.log")
    parents = {psutil.Process(plain).ppid(), psutil.Process(threads).ppid()}
    assert len(parents) == 2 and parents <= fork_server_pids()
    server = next(s for s in warm_start._SERVERS.values() if s is not None and s.proc.pid == psutil.Process(threads).ppid())
    assert ("OMP_NUM_THREADS", "1") in server.import_env
    assert b"OMP_NUM_THREADS=1" in open(f"/proc/{server.proc.pid}/environ", "rb").read().split(b"\0")


CLIENT_PY = """
import sys, time
sys.path.insert(0, sys.argv[1])
from tasks.hosts.remote import LocalExecutor, warm_start
warm_start.WARM_MODULES = warm_start.WARM_MODULES | {"report_cmd"}
pid = LocalExecutor().start_detached([sys.executable, "-m", "report_cmd", "600", "0"], cwd=sys.argv[2],
                                     log_file=sys.argv[2] + "/orphan.log", pid_file=sys.argv[2] + "/orphan.pid")
server = next(s for s in warm_start._SERVERS.values() if s)
print(pid, server.proc.pid, flush=True)
time.sleep(600)
"""


def test_the_fork_server_ends_with_the_process_that_started_it_and_its_children_live_on(warm, tmp_path):
    """kill -9 of the process that started the server: the server is gone within a few seconds, a child it forked
    runs on (a session of its own, as a cold start's), and stops with its group."""
    executor, _ = warm
    client = subprocess.Popen([sys.executable, "-c", CLIENT_PY, str(Path(__file__).resolve().parents[4]), str(tmp_path)],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, warm_start.SWITCH: "1"})
    try:
        child, server = (int(v) for v in client.stdout.readline().split())
        client.kill()
        client.wait()
        wait_for(lambda: not psutil.pid_exists(server) or psutil.Process(server).status() == psutil.STATUS_ZOMBIE,
                 timeout=10, what="the fork server to exit")
        assert executor.is_alive(child)
    finally:
        client.kill()
        executor.kill_group(child, timeout=2)
    assert group_members(child) == []


def test_stop_all_stops_the_servers_and_the_next_warm_start_starts_one(warm, tmp_path):
    executor, start = warm
    start("report_cmd", "600", "0", name="before")
    servers = [s for s in warm_start._SERVERS.values() if s is not None]
    warm_start.stop_all()
    assert servers and all(s.proc.poll() is not None for s in servers)
    for server in servers:  # its abstract socket went with it
        with pytest.raises(ConnectionRefusedError):
            server._ask({"op": "ping"})
    pid = start("report_cmd", "600", "0", name="after")
    assert psutil.Process(pid).ppid() in fork_server_pids()


def test_the_server_answers_only_the_process_that_started_it(warm, tmp_path):
    """An abstract socket has no file permissions: another process (here a child of this one) is hung up on."""
    executor, start = warm
    start("report_cmd", "600", "0", name="owner")
    server = next(s for s in warm_start._SERVERS.values() if s is not None and s.alive())
    probe = textwrap.dedent("""
        import socket, sys
        s = socket.socket(socket.AF_UNIX)
        s.connect("\\0" + sys.argv[1])
        try:
            s.sendall(b'{"op": "ping"}\\n')
            print("answered" if s.recv(100) else "hung up")
        except ConnectionError:  # reset, or a broken pipe when the server closed first
            print("hung up")
    """)
    answer = subprocess.run([sys.executable, "-c", probe, server.name], capture_output=True, text=True, timeout=30)
    assert answer.stdout.strip() == "hung up", answer
    assert server._ask({"op": "ping"}) == {"ok": True}
