"""A real Prometheus (Debian's `prometheus` binary) on 127.0.0.1 for tests: a temp config, a 1 s scrape interval,
targets from a file the test rewrites (file_sd, re-read within a second), a temp TSDB.

Started by the module that needs it, in its own process group, stopped (SIGTERM, then SIGKILL) at the end;
tests may stop it and start it again on the same port and storage, e.g. to show the watch without it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx

from tests.helpers import free_port

CONFIG = """\
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: sglang
    scrape_interval: 1s
    scrape_timeout: 900ms
    file_sd_configs:
      - files: ["{targets}"]
        refresh_interval: 1s
"""


class PrometheusUnavailable(RuntimeError):
    pass


class PrometheusServer:
    def __init__(self, root: Path) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise PrometheusUnavailable("no prometheus binary (apt-get install prometheus)")
        self.binary, self.root, self.port = binary, Path(root), free_port()
        self.targets = self.root / "targets.json"
        self.process: subprocess.Popen | None = None
        self.root.mkdir(parents=True, exist_ok=True)
        self.set_targets([])
        (self.root / "prometheus.yml").write_text(CONFIG.format(targets=self.targets))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_targets(self, instances: list[str]) -> None:
        """Scrape these host:port instances (the file is replaced whole, so Prometheus never reads half of it)."""
        tmp = self.targets.with_suffix(".tmp")
        tmp.write_text(json.dumps([{"targets": instances, "labels": {}}]))
        os.replace(tmp, self.targets)

    def start(self, timeout_s: float = 60) -> None:
        command = [self.binary, f"--config.file={self.root / 'prometheus.yml'}",
                   f"--storage.tsdb.path={self.root / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
                   "--log.level=warn"]
        with (self.root / "prometheus.log").open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PrometheusUnavailable(f"prometheus exited {self.process.returncode}: "
                                            f"{(self.root / 'prometheus.log').read_text()[-1500:]}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise PrometheusUnavailable(f"prometheus not ready within {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue

    def scraped(self, instance: str, timeout_s: float = 20) -> None:
        """Wait until Prometheus has scraped `instance` successfully (its `up` is 1)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            answer = httpx.get(f"{self.url}/api/v1/query", params={"query": f'up{{instance="{instance}"}}'},
                               timeout=5).json()["data"]["result"]
            if answer and answer[0]["value"][1] == "1":
                return
            time.sleep(0.3)
        raise AssertionError(f"prometheus did not scrape {instance} within {timeout_s:.0f} s")
