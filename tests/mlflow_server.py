"""A real `mlflow server` on 127.0.0.1 for tests: sqlite backend and artifacts in a tmp folder.

Started once per session by the `mlflow_server` fixture (tests/conftest.py); tests may stop it
and start it again on the same port (same database), e.g. to simulate an outage. It runs in
its own process group, killed as a group on stop, so no uvicorn worker outlives the session.
Job execution is off and there is one worker (a fresh start takes ~12 s on two cores, see
/work/shared/reference/prefect-mlflow.md §4.1).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

STARTUP_TIMEOUT_S = 240.0  # the box is shared; a fresh DB takes 12 s idle, much more under load
STOP_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MlflowServer:
    def __init__(self, root: Path, port: int | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        if self.running:
            return
        command = [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination", str(self.root / "mlartifacts"),
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
        ]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
        log = (self.root / "server.log").open("ab")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root,
                                        start_new_session=True)
        log.close()
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.process.returncode}; see {self.root / 'server.log'}")
            try:
                if requests.get(f"{self.uri}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass  # not listening yet
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"mlflow server not healthy after {STARTUP_TIMEOUT_S}s; see {self.root / 'server.log'}")

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it if it outlives STOP_TIMEOUT_S; port closed on return."""
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=STOP_TIMEOUT_S)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # a worker that outlived its parent
        except ProcessLookupError:
            pass  # the whole group is gone
        self.process = None
        self._wait_port_closed()

    def _wait_port_closed(self) -> None:
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) != 0:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"port {self.port} still accepts connections after the mlflow server stopped")
