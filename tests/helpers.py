"""Small pieces several test modules share: the test-size tiny target as a config block, a free port,
an app served on loopback."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

# The test-size tiny target (builds in seconds): 7 layers so SGLang's default aux layers are distinct.
TEST_TARGET_YAML = """\
target:
  kind: tiny
  dtype: float32
  tiny: {vocab_size: 300, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 7, num_attention_heads: 2,
         num_key_value_heads: 1, max_position_embeddings: 256, corpus_max_bytes: 60000, train_steps: 10,
         batch_size: 4, seq_len: 64, eval_tokens: 1024, num_threads: 1}
"""


def free_port() -> int:
    """A port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app):
    """uvicorn running `app` on a free 127.0.0.1 port in a daemon thread; yields the base URL, stops on exit."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "test server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def reference_servers_alive(marker: str) -> list[int]:
    """Pids of `python -m eagle3.serve` processes whose command line mentions `marker` (a run folder or workdir)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if "eagle3.serve" in line and marker in line:
            found.append(proc.info["pid"])
    return found


@contextlib.contextmanager
def mounted_tmpfs(mount: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (e.g. 192m) mounted at `mount` (created) for the block, unmounted after (lazily: a process
    may still hold a file there open); skips the test where mounting is not allowed."""
    import pytest

    mount.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(mount)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def stop_group(pid: int, first: int = signal.SIGTERM, grace_s: float = 15,
               leader: subprocess.Popen | None = None) -> None:
    """Signal a process group, then SIGINT (a Prefect worker needs a second signal), then SIGKILL.

    `leader`: the group's leader when it is this process's child. It is reaped while waiting: an exited
    but unreaped leader is a zombie that still counts as the group (kill(-pgid, 0) succeeds), so without
    this every signal's grace was waited out in full after the process had already stopped.
    """
    for sig in (first, signal.SIGINT, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if leader is not None:
                leader.poll()
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
