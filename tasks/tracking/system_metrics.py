"""`tracking.log_system_metrics`: this machine's CPU, memory, disk, network (and GPU) sampled into a stage's MLflow run.

While a stage runs, MLflow's own monitors (`mlflow.system_metrics.SystemMetricsMonitor`'s CPU,
disk, network and, where NVML/ROCm answer, GPU monitors, with its settings
`MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL` (default 10 s), `..._SAMPLES_BEFORE_LOGGING` and
`..._NODE_ID`) take a sample every interval; the averages are logged as `system/<name>` (e.g.
`system/cpu_utilization_percentage`) at steps 0, 1, 2 ... and once more when the stage ends, so a
stage shorter than the interval still gets a point.

MLflow's monitor thread itself is not started: it writes with its own client
(`BatchMetricsLogger`), stops for good at the first failed write or `get_run`, and never sees the
offline journal, so an outage would silently end the sampling and an `offline-` run id would
reach the server. Here each aggregate goes through `RunLogger.log_metrics`: online while the
server answers, journaled while it does not, replayed by `eagleops sync`.
Risk: what is sampled is the machine running the stage (the Prefect worker); the SSH hosts that
data.host, `train.nodes` or `deploy.host` name are sampled over SSH by `host_metrics`, as
`system/<host>/...`. A write the server refuses (4xx) ends the sampling with one warning, never the stage.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import psutil

from tasks.tracking.run_logger import RunLogger

PREFIX = "system/"


class SystemMetricsSampler:
    """A daemon thread sampling with MLflow's monitors and logging each aggregate through a RunLogger."""

    def __init__(self, run: RunLogger):
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self.run = run
        # Only its monitors and settings are used (no thread, no client call: resume_logging stays off).
        self._mlflow = SystemMetricsMonitor(run.run_id, tracking_uri=run.tracking_uri)
        node = self._mlflow.node_id
        self.prefix = PREFIX + (f"{node}/" if node else "")
        self.interval_s = float(self._mlflow.sampling_interval)
        self.samples_per_point = max(1, int(self._mlflow.samples_before_logging))
        self.step = 0
        self._pending = 0
        self._failed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="eagleops-system-metrics", daemon=True)

    def start(self) -> None:
        psutil.cpu_percent()  # CPU % is measured since the previous call: the first sample covers from here
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and log what was sampled since the last point, plus a sample of now."""
        self._stop.set()
        self._thread.join()
        if not self._failed:
            self._sample()
            self._publish()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s) and not self._failed:
            self._sample()
            if self._pending >= self.samples_per_point:
                self._publish()

    def _sample(self) -> None:
        self._mlflow.collect_metrics()
        self._pending += 1

    def _publish(self) -> None:
        if not self._pending:
            return
        metrics = {self.prefix + key: value for key, value in self._mlflow.aggregate_metrics().items()}
        for monitor in self._mlflow.monitors:
            monitor.clear_metrics()
        self._pending = 0
        try:
            self.run.log_metrics(metrics, step=self.step)
        except Exception as err:  # an outage is journaled by RunLogger; this is a refusal: stop, keep the stage
            self._failed = True
            logging.getLogger("eagleops").warning(f"system metrics: MLflow refused them for run {self.run.run_id} "
                                                  f"({type(err).__name__}: {err}); sampling stopped")
            return
        self.step += 1


@contextlib.contextmanager
def system_metrics(enabled: bool, run: RunLogger) -> Iterator[None]:
    """Sample into `run` for the duration of the block when `enabled` (tracking.log_system_metrics)."""
    if not enabled:
        yield
        return
    sampler = SystemMetricsSampler(run)
    sampler.start()
    try:
        yield
    finally:
        sampler.stop()
