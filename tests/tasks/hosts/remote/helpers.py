"""Helpers shared by tests/tasks/hosts/remote: random files and their hashes, `ps` checks, a racy-pipe trap."""

from __future__ import annotations

import hashlib
import subprocess
import sys

PY = sys.executable
SIZE = 6_000_000



def live_processes(pattern: str) -> list[str]:
    """`ps` lines (zombies excluded: PID 1 here may not reap) whose command line contains `pattern`."""
    lines = subprocess.run(["ps", "-e", "-o", "pid=,stat=,args="], capture_output=True, text=True, check=True).stdout
    return [line for line in lines.splitlines() if pattern in line and line.split()[1][0] != "Z"]


def random_file(path, size: int, seed: int = 0):
    path.write_bytes(hashlib.shake_256(f"seed{seed}".encode()).digest(size))
    return path


def sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def no_fileno(channel):
    raise AssertionError("Channel.fileno() creates paramiko's racy pipe")
