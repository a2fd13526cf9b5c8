"""Commands as shell lines: argv quoted, env validated, secret env values masked in what is logged.

Owns `shell_command()` (the one shell line an executor runs), `describe_command()` (the line as
logged and put in errors), `_OutputStream` (one output stream, logged line by line while it
runs), `CommandResult`, and the helper shell scripts the executors run as `sh -c SCRIPT sh ARGS...`.

Risk, and what guards it:
- A command string built by hand lets a config value such as `x; touch pwned` run as shell
  code. Every command goes through `shell_command()`, which `shlex.quote`s each argv element,
  and both executors run exactly that string, so the quoting is tested on both.
"""

from __future__ import annotations

import codecs
import os
import re
import shlex
from dataclasses import dataclass
from typing import Sequence

from tasks.config.secrets import SECRET_NAME as SECRET_ENV_KEY
from tasks.hosts.remote.log import logger

# `timeout -k`: seconds between SIGTERM and SIGKILL for a command that overran its timeout.
KILL_AFTER_S = 5
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MASK = "****"
# Exit status of `timeout` when it had to stop the command (TERM, then KILL).
TIMEOUT_EXIT_STATUSES = (124, 137)
MISSING = 3  # exit status the helper scripts below (and transfer_host.py) use for "no such file" (or process)
NOT_OURS = 4  # _KILL_GROUP_SCRIPT: the pid belongs to another process than the one recorded


@dataclass
class CommandResult:
    exit_status: int
    stdout: str
    stderr: str


def is_secret_env_key(key: str) -> bool:
    return bool(SECRET_ENV_KEY.search(key))


def quote_path(path: str) -> str:
    """Shell-quote a path; a leading `~/` stays the host's home ("$HOME"/...)."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def _validated(argv: Sequence[object], env: dict[str, str] | None) -> list[str]:
    if isinstance(argv, (str, bytes)) or not argv:
        raise ValueError(f"argv must be a non-empty list of arguments, got {argv!r}")
    words = [os.fspath(a) if isinstance(a, os.PathLike) else a for a in argv]
    bad = [a for a in words if not isinstance(a, str) or "\0" in a]
    if bad:
        raise ValueError(f"argv elements must be strings without NUL bytes, got {bad!r}")
    for key in env or {}:
        if not ENV_NAME.match(key):
            raise ValueError(f"env: {key!r} is not a valid environment variable name")
    return words


def shell_command(argv: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None,
                  timeout: float | None = None) -> str:
    """The one shell line that runs `argv` literally: `cd D && timeout -k 5 T env K=V argv...`.

    Every argv element and `K=V` is `shlex.quote`d, so `$(id)` or `x; touch pwned` reach the
    program as text. coreutils `timeout` puts the command in its own process group and kills
    that whole group when the time is up, so nothing it started outlives the timeout.
    """
    words = [shlex.quote(a) for a in _validated(argv, env)]
    if env:
        words = ["env", *(shlex.quote(f"{k}={v}") for k, v in env.items()), *words]
    if timeout is not None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        words = ["timeout", "-k", str(KILL_AFTER_S), f"{timeout:.3f}", *words]
    line = " ".join(words)
    return f"cd {quote_path(cwd)} && {line}" if cwd else line


def describe_command(argv: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None) -> str:
    """The command as logged and put in errors: env values of secret-looking keys masked."""
    shown_env = [f"{k}={MASK if is_secret_env_key(k) else v}" for k, v in (env or {}).items()]
    line = shlex.join([*shown_env, *(str(a) for a in argv)])
    return f"(cd {cwd}) {line}" if cwd else line


class _OutputStream:
    """One output stream: decoded incrementally, logged line by line while it runs, kept whole."""

    def __init__(self, label: str, log_lines: bool):
        self.label, self.log_lines = label, log_lines
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._parts: list[str] = []
        self._pending = ""

    def feed(self, data: bytes, final: bool = False) -> None:
        text = self._decoder.decode(data, final)
        self._parts.append(text)
        if not self.log_lines:
            return
        *lines, self._pending = (self._pending + text).split("\n")
        if final and self._pending:
            lines, self._pending = [*lines, self._pending], ""
        for line in lines:
            logger().info("[%s] %s", self.label, line)

    def close(self) -> None:
        self.feed(b"", final=True)

    @property
    def text(self) -> str:
        return "".join(self._parts)


# Helper scripts run as `sh -c SCRIPT sh ARGS...`: the arguments arrive as "$1"... and are
# never parsed as shell code.
_SHA256_SCRIPT = """[ -f "$1" ] || exit 3
if command -v openssl >/dev/null 2>&1; then exec openssl dgst -sha256 -r "$1"; fi
exec "$2" -c "$3" "$1"
"""
_SHA256_PY = """import hashlib, sys
digest = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        digest.update(block)
print(digest.hexdigest())
"""
# Files under $1 (symlinks followed, as `scp -r` does), relative to it, NUL-separated so any
# file name survives.
_LIST_FILES_SCRIPT = '[ -d "$1" ] || exit 3; cd "$1" && exec find -L . -type f -print0'
# The last $2 lines, or from line $3 on (`tail -n +K`: only the new lines cross), or the whole file.
_READ_SCRIPT = """[ -f "$1" ] || exit 3; if [ -n "$2" ]; then exec tail -n "$2" "$1"; fi
if [ -n "$3" ]; then exec tail -n "+$3" "$1"; fi; exec cat "$1"
"""
_PORT_PY = """import socket, sys
probe = socket.socket()
probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is free
try:
    probe.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(3)
"""
# Who listens on TCP port argv[1]: "group" (a process of process group argv[2] holds the listening
# socket), "other" or "nobody"; from /proc (Linux): the socket inodes listening on the port, then
# the fds of the group's processes.
_PORT_LISTENER_PY = """import os, sys
port, group = int(sys.argv[1]), int(sys.argv[2])
inodes = set()
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    try:
        rows = open(table).read().splitlines()[1:]
    except OSError:
        continue
    for row in rows:
        fields = row.split()
        if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
            inodes.add("socket:[%s]" % fields[9])
def held_by_group():
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != group:
                continue
            fds = "/proc/%s/fd" % pid
            if any(os.readlink(os.path.join(fds, fd)) in inodes for fd in os.listdir(fds)):
                return True
        except OSError:
            continue
    return False
print("nobody" if not inodes else "group" if held_by_group() else "other")
"""
# The child writes its own pid (it is the new session's leader, so pid == process group id)
# before exec'ing the command; the parent waits for that file instead of trusting `$!`.
_DETACH_SCRIPT = """log=$1; pidfile=$2; dir=$3; shift 3
mkdir -p "$(dirname "$log")" "$(dirname "$pidfile")" || exit 1
rm -f "$pidfile"
if [ -n "$dir" ]; then cd "$dir" || exit 1; fi
setsid sh -c 'echo $$ > "$0"; exec "$@"' "$pidfile" "$@" > "$log" 2>&1 < /dev/null &
i=0
while [ ! -s "$pidfile" ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done
[ -s "$pidfile" ] || { echo "no pid in $pidfile after 10 s" >&2; exit 1; }
cat "$pidfile"
"""
# Whether process $1 runs: it exists and is not a zombie. ps printing nothing means it was reaped between the two
# looks (a subreaper or init reaps within moments), unless ps cannot tell at all: kill -0 decides again.
_ALIVE_FUNCTION = """alive() {
  kill -0 "$1" 2>/dev/null || return 1
  case "$(ps -o stat= -p "$1" 2>/dev/null)" in
    Z*) return 1;;
    "") kill -0 "$1" 2>/dev/null || return 1;;
  esac
}
"""
_ALIVE_SCRIPT = _ALIVE_FUNCTION + 'alive "$1"\n'
# One poll of a watched job in one command instead of two (on an SSH host each command is a session and a start of
# the user's shell): "1" or "0" on the first line, whether process $1 runs, then log $2 from byte $3 on
# (tail -c +N), read after that check so no line written before the process ended is missed. Exit 3: no log.
_WATCH_SCRIPT = _ALIVE_FUNCTION + """if alive "$1"; then echo 1; else echo 0; fi
[ -f "$2" ] || exit 3
exec tail -c "+$3" "$2"
"""
# A process's identity: the host's boot id and the process's start time in clock ticks since boot
# (/proc/PID/stat field 22, read after the last ") " since the command name may hold spaces and
# parentheses). A pid is reused only by a process started later, so a different identity means
# another process. Exit 3: no such process.
_IDENTITY_FUNCTION = """identity() {
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 3
  set -- ${stat##*) }
  printf '%s:%s\\n' "$(cat /proc/sys/kernel/random/boot_id 2>/dev/null)" "${20}"
}
"""
_IDENTITY_SCRIPT = _IDENTITY_FUNCTION + 'identity "$1"\n'
# Members of the group that are not zombies; TERM (and CONT, so a stopped group gets it), wait up to
# $2 s, then KILL. With an identity $3, exit 4 without signalling anything when the pid now belongs
# to another process (the recorded one is gone and its pid was reused). A leader already gone with
# members left is still ours: Linux never hands out a pid that is still some process group's id.
_KILL_GROUP_SCRIPT = _IDENTITY_FUNCTION + """group=$1; limit=$(( $2 * 10 )); want=$3
if [ -n "$want" ] && now=$(identity "$group") && [ "$now" != "$want" ]; then
  echo "pid $group is another process now (started $now, the recorded one $want): not killed" >&2
  exit 4
fi
alive() { ps -e -o pgid=,stat= | awk -v g="$group" '$1 == g && $2 !~ /^Z/ {found = 1} END {exit !found}'; }
alive || exit 0
kill -TERM "-$group" 2>/dev/null
kill -CONT "-$group" 2>/dev/null
i=0
while alive && [ $i -lt $limit ]; do sleep 0.1; i=$((i+1)); done
alive || exit 0
echo "process group $group still running after SIGTERM and $2 s; sending SIGKILL" >&2
kill -KILL "-$group" 2>/dev/null
i=0
while alive && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done
alive && { echo "process group $group survived SIGKILL" >&2; exit 1; }
exit 0
"""


def _sh(script: str, *args: object) -> list[str]:
    return ["sh", "-c", script, "sh", *(str(a) for a in args)]
