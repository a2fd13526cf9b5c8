"""`python -m eagle3.forkserver NAME --preload MODULE...`: start `python -m MODULE ...` commands from an
interpreter that has already imported them (a warm start).

A `python -m eagle3.serve` spends most of its start importing torch, transformers and FastAPI (~4-5 CPU-s on
a 2-core machine) before it serves a tiny model's few requests. The fork server imports the preloaded module
once, then forks one child per request. The child becomes the command:
- its own session and process group (pid == pgid), as `setsid` gives the cold start;
- the asked working directory, environment (os.environ and C's environ), stdin from /dev/null, stdout and
  stderr to the log file, no other file descriptor of the server;
- the command line and environment in /proc/PID/cmdline and /proc/PID/environ (written over the server's own,
  which were started with room to spare), so `ps`, `pgrep -f` and psutil see the command, not the server
  (followed by NUL padding: empty trailing words);
- the signal dispositions the caller asks for, those a cold start would have: the request's `ignored` ignored,
  every other one default (SIGPIPE and SIGXFSZ stay ignored, as Python ignores them at any start);
- fresh random seeds (Python's random reseeds itself at fork; numpy's legacy generator is reseeded here),
  collection on;
- the module run as `python -m` runs it (`runpy`), its exit status its own (the server reaps it and answers
  `status` requests with it).

Protocol: one JSON request per connection on the abstract Unix socket NAME (no file to leave behind, even on
kill -9), from the process that started the server only (SO_PEERCRED: its pid and uid); one JSON answer line.
  {"op": "ping"}                              -> {"ok": true}
  {"op": "spawn", "argv", "env", "cwd", "log_file", "pid_file", "ignored"}
                                              -> {"pid": N} | {"refused": "why"} (the caller starts it cold)
  {"op": "status", "pid": N}                  -> {"exit": code | null} (null: running, or not a child of ours)

Fork safety: OpenMP's thread pool (libgomp) and CPython's thread state do not survive a fork made while other
threads run (gh-112275). The server runs no torch operation, so torch's pool never starts, and it refuses a
spawn whenever /proc/self/task shows a second thread. numpy's OpenBLAS starts a pool at import, so the server
is started with OPENBLAS_NUM_THREADS=1 (the caller sets it; children get their own environment back, but
numpy's BLAS in a child runs on one thread).

The server exits when the process that started it is gone (checked twice a second) or on SIGTERM / SIGINT;
its children are sessions of their own and live on, as cold-started ones do.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import json
import os
import select
import signal
import socket
import struct
import sys

if __name__ == "__main__":
    gc.disable()  # the preload allocates ~a million objects that live as long as the server: never walk them

LOOP_S = 0.5
READY_TIMEOUT_S = 10.0  # a forked child that has not become its own session by then is killed
MAX_REQUEST = 1 << 22
_KEPT_STATUSES = 4096
PYTHON_IGNORES = (signal.SIGPIPE, signal.SIGXFSZ)  # Python ignores these at any start, cold or warm


class Refused(Exception):
    """This request cannot be forked safely here; the caller starts the command cold."""


# ------------------------------------------------------------------ the server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="eagle3.forkserver")
    parser.add_argument("name", help="the abstract Unix socket's name (Linux)")
    parser.add_argument("--preload", action="append", default=[])
    parser.add_argument("--room", default="", help="padding: room for a child's command line in this one's")
    args = parser.parse_args(argv)
    for module in args.preload:
        importlib.import_module(module)
    gc.freeze()
    request = _serve(args.name)
    if request is not None:  # only a child returns here, in a process of its own
        _run_as_main(request)


def _serve(name: str) -> dict | None:
    """Answer requests until the parent is gone; in a forked child, return its request."""
    parent, server_pid = os.getppid(), os.getpid()
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)  # bound only once the preload is done: a client's connect is its readiness check
    listener.listen(16)
    statuses: dict[int, int] = {}
    while not stop and os.getppid() == parent:
        _reap(statuses)
        try:
            ready, _, _ = select.select([listener], [], [], LOOP_S)
        except InterruptedError:
            continue
        if not ready:
            continue
        conn, _ = listener.accept()
        if not _from(conn, parent):
            conn.close()
            continue
        request = _answer(conn, listener, statuses)
        if os.getpid() != server_pid:
            return request
    listener.close()
    return None


def _from(conn: socket.socket, parent: int) -> bool:
    """Whether the peer is the process that started this server (an abstract socket has no file permissions)."""
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid == parent and uid == os.getuid()


def _reap(statuses: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        statuses[pid] = os.waitstatus_to_exitcode(status)
        if len(statuses) > _KEPT_STATUSES:
            statuses.pop(next(iter(statuses)))


def _answer(conn: socket.socket, listener: socket.socket, statuses: dict[int, int]) -> dict | None:
    """One request; in the child of a spawn, its request (the child answers nothing)."""
    with conn:
        conn.settimeout(30)
        try:
            request = _read_request(conn)
        except (OSError, ValueError) as err:
            return _reply(conn, {"error": f"bad request: {err}"})
        op = request.get("op")
        if op == "ping":
            return _reply(conn, {"ok": True})
        if op == "status":
            _reap(statuses)
            return _reply(conn, {"exit": statuses.get(int(request["pid"]))})
        if op != "spawn":
            return _reply(conn, {"error": f"unknown op {op!r}"})
        try:
            pid = _spawn(request, [conn, listener])
        except (Refused, OSError, KeyError, TypeError) as why:  # no fork (memory, pids) or a malformed request
            return _reply(conn, {"refused": str(why) if isinstance(why, Refused) else f"{type(why).__name__}: {why}"})
        if pid == 0:
            return request
        return _reply(conn, {"pid": pid})


def _read_request(conn: socket.socket) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        block = conn.recv(1 << 16)
        if not block:
            break
        data += block
        if len(data) > MAX_REQUEST:
            raise ValueError("request too large")
    request = json.loads(data)
    if not isinstance(request, dict):
        raise ValueError("not a JSON object")
    return request


def _reply(conn: socket.socket, answer: dict) -> None:
    try:
        conn.sendall(json.dumps(answer).encode() + b"\n")
    except OSError:
        pass  # the client went away; nothing to tell
    return None


def _spawn(request: dict, server_sockets: list[socket.socket]) -> int:
    """Fork the child of `request`; its pid here, once it leads its own session; 0 in the child."""
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        raise Refused(f"the fork server runs {threads} threads: a fork is not safe")
    cmdline = _nul_joined(request["argv"])
    environ = _nul_joined(f"{k}={v}" for k, v in request["env"].items())
    arg_room, env_room = _proc_rooms()
    if len(cmdline) > arg_room or len(environ) > env_room:
        raise Refused(f"the command line ({len(cmdline)} B) or environment ({len(environ)} B) does not fit the "
                      f"server's ({arg_room} B, {env_room} B)")
    sys.stdout.flush()
    sys.stderr.flush()
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_read)
        try:
            _become(request, server_sockets, ready_write, cmdline, environ)
        except BaseException as err:  # the child could not be set up: tell its log, never run the server's loop
            _die(request, err)
        return 0
    os.close(ready_write)
    try:
        ok = select.select([ready_read], [], [], READY_TIMEOUT_S)[0] and os.read(ready_read, 1) == b"1"
    finally:
        os.close(ready_read)
    if not ok:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        raise Refused(f"the forked child (pid {pid}) did not start within {READY_TIMEOUT_S:.0f} s")
    return pid


def _nul_joined(words) -> bytes:
    return b"".join(os.fsencode(w) + b"\0" for w in words)


def _proc_stat_fields() -> list[str]:
    raw = open("/proc/self/stat").read()
    return raw[raw.rindex(")") + 2:].split()  # fields from the 3rd (state) on


def _proc_rooms() -> tuple[int, int]:
    """Bytes of this process's argv and environ areas (/proc/PID/stat fields 48-51)."""
    arg_start, arg_end, env_start, env_end = (int(v) for v in _proc_stat_fields()[45:49])
    return arg_end - arg_start, env_end - env_start


# ------------------------------------------------------------------ the child


def _become(request: dict, server_sockets: list[socket.socket], ready: int, cmdline: bytes, environ: bytes) -> None:
    """Turn this forked process into `python -m MODULE ARGS` as a cold start would run it."""
    for sock in server_sockets:
        sock.close()
    os.setsid()
    _set_dispositions(set(request["ignored"]))
    _redirect(request["log_file"])
    if request.get("cwd"):
        os.chdir(request["cwd"])
    os.environ.clear()  # unsetenv each: C's environ no longer points into the area written below
    os.environ.update(request["env"])
    _write_proc_area(45, cmdline)
    _write_proc_area(47, environ)
    _write_pid_file(request["pid_file"])
    _close_other_fds(keep={ready})
    os.write(ready, b"1")
    os.close(ready)


def _set_dispositions(ignored: set[int]) -> None:
    """Each catchable signal ignored if in `ignored`, else default (Python's own SIGPIPE and SIGXFSZ stay ignored)."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP) or sig in PYTHON_IGNORES or sig >= signal.SIGRTMIN:
            continue
        signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)


def _redirect(log_file: str) -> None:
    os.makedirs(os.path.dirname(log_file) or ".", exist_ok=True)
    log = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)


def _write_proc_area(start_field: int, content: bytes) -> None:
    """Write `content` over this process's argv (field 48) or environ (field 50) area, NUL-padded to its end: what
    /proc/PID/cmdline and /proc/PID/environ show. The area's end stays the server's (moving it takes prctl PR_SET_MM
    and CAP_SYS_RESOURCE), so the padding reads as empty trailing words."""
    fields = _proc_stat_fields()
    start, end = int(fields[start_field]), int(fields[start_field + 1])
    ctypes.memmove(start, content.ljust(end - start, b"\0"), end - start)


def _write_pid_file(pid_file: str) -> None:
    os.makedirs(os.path.dirname(pid_file) or ".", exist_ok=True)
    tmp = f"{pid_file}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(tmp, pid_file)


def _close_other_fds(keep: set[int]) -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the listing's own descriptor, closed already


def _die(request: dict, err: BaseException) -> None:
    try:
        os.write(2, f"eagle3.forkserver: could not start {request.get('argv')}: {err!r}\n".encode())
    finally:
        os._exit(127)


def _run_as_main(request: dict) -> None:
    """Run the module as `python -m` does; its SystemExit or traceback ends this process like a cold one."""
    import runpy

    argv = list(request["argv"])
    module = argv[2]
    sys.orig_argv = argv
    sys.argv = [module, *argv[3:]]
    sys.path[0] = os.getcwd()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # its legacy generator was seeded once, in the server
    gc.enable()
    runpy._run_module_as_main(module, alter_argv=True)


if __name__ == "__main__":
    main()
