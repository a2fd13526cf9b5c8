"""What a stage task gets besides the config (`StageContext`: its folder, its MLflow child run, what came
before) and how it reports progress (`ProgressLog`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.log import logger
from tasks.rundir import write_json_atomic
from tasks.tracking.run_logger import RunLogger


def is_interrupt(err: BaseException) -> bool:
    """Ctrl-C, SIGTERM (Prefect's TerminationSignal) or a SystemExit raised by a signal handler."""
    return not isinstance(err, Exception)


@dataclass
class StageContext:
    """What a stage task gets besides the config: where to write, where to log, what came before."""

    name: str
    stage_dir: Path
    run_dir: Path
    tracking_uri: str
    mlflow_run_id: str
    upstream: dict[str, dict[str, Any]] = field(default_factory=dict)
    attempt: int = 1
    upstream_digests: dict[str, str] = field(default_factory=dict)  # each upstream's output digest
    parent_run_id: str | None = None  # the experiment's MLflow parent run (None outside a pipeline)

    @property
    def parent_mlflow(self) -> RunLogger | None:
        return RunLogger(self.tracking_uri, self.parent_run_id) if self.parent_run_id else None

    @property
    def mlflow(self) -> RunLogger:
        return RunLogger(self.tracking_uri, self.mlflow_run_id)

    def write_json(self, filename: str, data: Any) -> Path:
        path = self.stage_dir / filename
        write_json_atomic(path, data)
        return path

    def progress(self, label: str | None = None, every_s: float = 5.0) -> ProgressLog:
        return ProgressLog(label or self.name, every_s)


class ProgressLog:
    """`callback(what, done, total)` that logs `what: done/total (rate/s, ETA)` at most every `every_s`."""

    def __init__(self, label: str, every_s: float = 5.0):
        self.label, self.every_s = label, every_s
        self._started: dict[str, tuple[float, int]] = {}
        self._last_log = 0.0

    def __call__(self, what: str, done: int, total: int) -> None:
        now = time.monotonic()
        start, first = self._started.setdefault(what, (now, done))
        finished = total > 0 and done >= total
        if not finished and now - self._last_log < self.every_s:
            return
        self._last_log = now
        rate = (done - first) / max(now - start, 1e-9)
        eta = f", ETA {(total - done) / rate:.0f}s" if rate > 0 and total > done else ""
        logger().info(f"{self.label}: {what} {done}/{total} ({rate:.1f}/s{eta})")
