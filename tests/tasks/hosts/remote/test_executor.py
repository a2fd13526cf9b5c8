"""tasks/hosts/remote/executor.py through both executors: detached servers in their own process group,
killing a group, files, paths and ports on the host; `connect()` for this machine."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import threading
import time

import pytest

from tasks.hosts.remote import LocalExecutor, connect, expand_remote_path
from tests.tasks.hosts.remote.helpers import live_processes, random_file, sha256

# --------------------------------------------------------------------------- processes and files


def test_start_detached_is_alive_and_kill_group(executor, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="eagleops.remote")
    log, pid_file = tmp_path / "logs" / "server.log", tmp_path / "server.pid"
    pid = executor.start_detached(["sh", "-c", 'echo "started $MARK"; sleep 3041 & exec sleep 3042'],
                                  env={"MARK": "m1", "API_KEY": "hush-123"}, log_file=str(log), pid_file=str(pid_file))
    try:
        assert executor.is_alive(pid) and int(pid_file.read_text()) == pid
        assert b"API_KEY=hush-123" in open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        assert "hush-123" not in caplog.text and "API_KEY=****" in caplog.text
        assert os.getpgid(pid) == pid and os.getsid(pid) == pid  # its own session and group
        for _ in range(200):  # the command forks its background child after the pid file is written
            if len(live_processes("sleep 304")) == 2:
                break
            threading.Event().wait(0.05)
        assert len(live_processes("sleep 304")) == 2
        assert executor.read_file(str(log)) == "started m1\n"
    finally:
        executor.kill_group(pid, timeout=10)
    assert not executor.is_alive(pid)
    assert live_processes("sleep 304") == []
    executor.kill_group(pid)  # idempotent


def test_a_process_reaped_between_the_two_looks_is_not_alive(tmp_path, monkeypatch):
    """is_alive looks twice (kill -0, then ps for a zombie); a process reaped in between (a subreaper or init reaps
    at once) leaves ps printing nothing, which must read as gone. A `ps` on PATH holds the second look until this
    process has reaped its zombie child; without the re-check, the reaped process read as alive."""
    child = subprocess.Popen(["sleep", "600"])
    child.kill()
    wait_for_zombie(child.pid)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ps").write_text(f'#!/bin/sh\ntouch {tmp_path}/asked\nwhile [ ! -e {tmp_path}/reaped ]; do sleep 0.05; done\n')
    (fake / "ps").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")

    def reap_when_asked() -> None:
        while not (tmp_path / "asked").exists():
            time.sleep(0.02)
        child.wait()
        (tmp_path / "reaped").touch()

    reaper = threading.Thread(target=reap_when_asked)
    reaper.start()
    try:
        assert LocalExecutor().is_alive(child.pid) is False
    finally:
        (tmp_path / "asked").touch()
        reaper.join(timeout=30)
    monkeypatch.undo()
    assert LocalExecutor().is_alive(os.getpid()) is True  # the real ps: a live process


def wait_for_zombie(pid: int) -> None:
    for _ in range(200):
        if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
            return
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} never became a zombie")


def test_a_command_reads_the_stdin_given_and_an_empty_one_otherwise(executor):
    """Without stdin a command reading it ends at once (an empty input, not a wait for the timeout); with it, it
    reads every byte and then the end."""
    assert executor.run(["cat"], timeout=20).stdout == ""
    assert executor.run(["sh", "-c", "cat; echo end"], stdin=b"abc\n", timeout=20).stdout == "abc\nend\n"
    assert executor.run(["sh", "-c", "cat && echo $?"], timeout=20).stdout == "0\n"


def test_watch_log_reads_liveness_then_the_log_from_an_offset(executor, tmp_path):
    """A watch's poll in one command: whether the process runs, and its log after a byte offset, read after that
    check (a process that ended has all its lines in); no log yet reads as nothing, not an error."""
    log, pid_file, release = tmp_path / "job.log", tmp_path / "job.pid", tmp_path / "release"
    script = f'printf "one\\ntwo\\n"; while [ ! -e {release} ]; do sleep 0.05; done; printf "three\\nfour"'
    pid = executor.start_detached(["sh", "-c", script], log_file=str(log), pid_file=str(pid_file))
    try:
        for _ in range(200):
            if log.exists() and log.read_text() == "one\ntwo\n":
                break
            threading.Event().wait(0.05)
        assert executor.watch_log(pid, str(log), 0) == (True, "one\ntwo\n")
        assert executor.watch_log(pid, str(log), 4) == (True, "two\n")
        release.touch()
        for _ in range(200):
            alive, text = executor.watch_log(pid, str(log), 8)
            if not alive:
                break
            threading.Event().wait(0.05)
        assert (alive, text) == (False, "three\nfour")
        assert executor.watch_log(pid, str(tmp_path / "no-such.log"), 0) == (False, "")
    finally:
        executor.kill_group(pid, timeout=10)


def test_kill_group_escalates_to_sigkill(executor, tmp_path):
    pid = executor.start_detached(["sh", "-c", "trap '' TERM; sleep 3051"], log_file=str(tmp_path / "log"),
                                  pid_file=str(tmp_path / "pid"))
    executor.kill_group(pid, timeout=1)
    assert live_processes("sleep 3051") == []


def proc_identity(pid: int) -> str:
    """What the kernel says about `pid`, read here independently of the executor's script: boot id and start
    time in clock ticks (/proc/PID/stat field 22, after the command name in parentheses)."""
    boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    return f"{boot}:{open(f'/proc/{pid}/stat').read().rsplit(') ', 1)[1].split()[19]}"


def test_kill_group_spares_a_pid_that_is_another_process_now(executor, tmp_path):
    """PID reuse: a record names a pid with the identity of the process launched there; once that process is
    gone and the pid belongs to another (here: the record's identity is the first process's, its pid the
    second's), the kill signals nothing. With the right identity it kills."""
    first = executor.start_detached(["sleep", "3071"], log_file=str(tmp_path / "1.log"), pid_file=str(tmp_path / "1.pid"))
    recorded = executor.process_identity(first)
    assert recorded == proc_identity(first)
    assert executor.kill_group(first, identity=recorded) is True
    assert not executor.is_alive(first)
    second = executor.start_detached(["sleep", "3072"], log_file=str(tmp_path / "2.log"), pid_file=str(tmp_path / "2.pid"))
    try:
        assert executor.process_identity(second) != recorded
        assert executor.kill_group(second, identity=recorded) is False
        assert executor.is_alive(second) and len(live_processes("sleep 3072")) == 1
    finally:
        assert executor.kill_group(second, identity=proc_identity(second)) is True
    assert live_processes("sleep 3072") == []


def test_kill_group_reaches_a_stopped_group_at_once(executor, tmp_path):
    """A group stopped by SIGSTOP (a hung, suspended server) gets SIGCONT with its SIGTERM: no wait for SIGKILL."""
    import signal
    import time

    pid = executor.start_detached(["sh", "-c", "sleep 3081 & exec sleep 3082"], log_file=str(tmp_path / "log"),
                                  pid_file=str(tmp_path / "pid"))
    for _ in range(100):
        if len(live_processes("sleep 308")) == 2:
            break
        time.sleep(0.05)
    os.killpg(pid, signal.SIGSTOP)
    started = time.monotonic()
    executor.kill_group(pid, timeout=10)
    assert time.monotonic() - started < 5 and live_processes("sleep 308") == []


def test_files_read_exist_makedirs_sha256(executor, tmp_path):
    path = tmp_path / "a b" / "c"
    executor.makedirs(str(path))
    assert path.is_dir() and executor.path_exists(str(path)) and not executor.path_exists(str(tmp_path / "no"))
    text = tmp_path / "t.log"
    text.write_text("".join(f"line {i}\n" for i in range(10)))
    assert executor.read_file(str(text)) == text.read_text()
    assert executor.read_file(str(text), tail_lines=2) == "line 8\nline 9\n"
    assert executor.read_file(str(text), from_line=9) == "line 8\nline 9\n"  # 1-based: the 9th line on
    assert executor.read_file(str(text), from_line=11) == ""
    with pytest.raises(FileNotFoundError, match="no such file"):
        executor.read_file(str(tmp_path / "missing.log"))
    blob = random_file(tmp_path / "blob", 100_000)
    assert executor.sha256(str(blob)) == sha256(blob)
    assert executor.sha256(str(tmp_path / "missing")) is None


def test_expand_remote_path(executor):
    home = os.path.expanduser("~")
    assert expand_remote_path(executor, "~/eagleops/x") == f"{home}/eagleops/x"
    assert expand_remote_path(executor, "~") == home
    assert expand_remote_path(executor, "/abs/~/x") == "/abs/~/x"


def test_port_in_use(executor):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        assert executor.port_in_use(port)
    assert not executor.port_in_use(port)


def test_connect_local():
    assert isinstance(connect(None), LocalExecutor) and isinstance(connect("local"), LocalExecutor)
