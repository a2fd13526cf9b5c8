"""One stage attempt, top-down: what it owns and the order it goes through.

An attempt owns its folder and its entry in the run folder's manifest (`RunDirectory`), its MLflow
child run under the run's parent, and the record of the config fields it read. `StageAttempt.run`
opens the child run, marks the entry running, takes the slots of the GPU hosts the stage uses
(`host_slots.py`), runs the stage task under the read recorder and the system-metrics samplers (this
machine; over SSH, the hosts[] entries the stage puts work on),
checks the reads against the stage's spec, then records the outcome in the same three places:
completed (summary, output digest, metrics on child and parent), failed (the error, redacted) or
interrupted (Ctrl-C, SIGTERM). A failure is re-raised as `StageFailed` (or
`DiskFull`, naming what filled) so the flow stops; an interrupt is re-raised as it is. Nothing a stage
already wrote is deleted, and a manifest that cannot be written (a full disk) keeps its previous
content rather than hide the stage's own error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from tasks.config.reads import recording_reads
from tasks.config.schema import ExperimentConfig
from tasks.config.secrets import redact
from tasks.log import logger
from tasks.rundir import (
    MANIFEST,
    RunDirectory,
    digest_json,
    elapsed_since,
    now_iso,
    write_json_atomic,
)
from tasks.runner.context import StageContext, is_interrupt
from tasks.runner.diskspace import describe_disk_full, disk_full_error
from tasks.runner.gpu_hours import attempt_gpu_hours
from tasks.runner.host_slots import holding_gpu_hosts, remote_stage_hosts
from tasks.runner.specs import STRICT_READS_ENV, UndeclaredReads, undeclared_reads
from tasks.runner.stages import DiskFull, StageFailed
from tasks.tracking.host_metrics import host_system_metrics
from tasks.tracking.outage import short_error, store_errors_reported_by_caller
from tasks.tracking.run_logger import RunLogger, start_child_run
from tasks.tracking.system_metrics import system_metrics


@dataclass
class StageAttempt:
    """One attempt of stage `name`: `entry` is its manifest entry (number, folder, status) in `run`."""

    name: str
    entry: dict[str, Any]
    run: RunDirectory
    parent: RunLogger
    cfg: ExperimentConfig
    config_path: str

    @property
    def folder(self) -> Path:
        return Path(self.entry["dir"])

    def run_task(self, task: Any, upstream: dict[str, dict[str, Any]], digests: dict[str, str],
                 flow_run_id: str) -> tuple[str, dict[str, Any]]:
        """Run the stage task once; (output digest, summary) when it completed, else raise (see the module)."""
        child = start_child_run(self.parent, self.name, {"prefect.flow_run_id": flow_run_id,
                                                         "eagleops.attempt": self.entry["attempt"]})
        ctx = StageContext(self.name, self.folder, self.run.path, child.tracking_uri, child.run_id, upstream,
                           self.entry["attempt"], digests, parent_run_id=self.parent.run_id)
        self.run.update_attempt(self.name, self.entry, status="running", started=now_iso(),
                                mlflow_run_id=child.run_id, error=None)
        start, started_at = time.monotonic(), time.time()
        try:
            with holding_gpu_hosts(self.cfg, self.name, flow_run_id):
                start, started_at = time.monotonic(), time.time()  # GPU time counts from the slot, not the wait
                with self._system_metrics(child), recording_reads(self.cfg) as reads:
                    summary = named(task, self.name, self.entry["attempt"])(self.cfg, ctx) or {}
            self._check_reads(reads)
        except BaseException as err:
            recorded = self._record_failure(child, err, start, started_at)
            if is_interrupt(err):
                raise
            if (full := disk_full_error(err)) is not None:
                raise self._disk_full(full, recorded) from err
            raise StageFailed(f"{self.name} failed: {redact(str(err))}") from err
        try:
            return self._record_success(child, summary, start, started_at, reads)
        except OSError as err:  # the stage's work is done, but its record does not fit on the disk
            if (full := disk_full_error(err)) is None:
                raise
            raise self._disk_full(full, recorded=False) from err

    @contextlib.contextmanager
    def _system_metrics(self, child: RunLogger) -> Iterator[None]:
        """tracking.log_system_metrics: this machine, and over SSH each hosts[] entry the stage puts work on."""
        enabled = self.cfg.tracking.log_system_metrics
        remote = [self.cfg.host(name) for name in remote_stage_hosts(self.cfg, self.name)]
        with system_metrics(enabled, child), host_system_metrics(enabled, remote, self.cfg.hosts, child):
            yield

    def _check_reads(self, reads: set[str]) -> None:
        """A field the stage read that its spec does not declare would leave its fingerprint stale: a warning,
        or (with STRICT_READS_ENV set, as in the tests) the stage's failure."""
        undeclared = undeclared_reads(self.name, self.cfg, reads)
        if not undeclared:
            return
        message = (f"{self.name} read {', '.join(undeclared)}, which STAGE_SPECS['{self.name}'] in "
                   "tasks/runner/specs.py neither takes as inputs nor lists as operational: changing them would "
                   "not re-run it")
        if os.environ.get(STRICT_READS_ENV):
            raise UndeclaredReads(message)
        logger().warning(message)

    def _record_success(self, child: RunLogger, summary: dict, start: float, started_at: float,
                        reads: set[str]) -> tuple[str, dict[str, Any]]:
        wall = elapsed_since(start)
        gpu = attempt_gpu_hours(self.cfg, self.run.path, self.name, started_at, wall)
        summary = {**summary, "wall_time_s": wall, **_gpu_summary(gpu)}
        digest = summary.pop("output_digest", None) or digest_json(summary.get("outputs", {}))
        write_json_atomic(self.folder / "summary.json", self.run.portable(summary))
        metrics = numbers(summary.get("metrics", {}))
        _log_gpu_hours(child, gpu)
        child.log_metrics({"wall_time_s": wall, **metrics})
        child.finish("FINISHED")
        self.parent.log_metrics({f"{self.name}.{k}": v for k, v in metrics.items()})
        self.parent.log_metrics({f"{self.name}.wall_time_s": wall, f"{self.name}.gpu_hours": gpu["gpu_hours"]})
        self.run.update_attempt(self.name, self.entry, status="completed", finished=now_iso(), wall_time_s=wall,
                                summary=summary, outputs=summary.get("outputs", {}), output_digest=digest,
                                config_reads=sorted(reads), **gpu)
        logger().info(f"{self.name}: completed in {wall:.1f}s")
        return digest, summary

    def _record_failure(self, child: RunLogger, err: BaseException, start: float, started_at: float) -> bool:
        """Record the failed or interrupted attempt (manifest, MLflow); False when the manifest could not be written.
        Its GPU-hours too: the GPUs were held whether or not the stage completed."""
        interrupted = is_interrupt(err)
        detail = redact("".join(traceback.format_exception_only(type(err), err)).strip())
        status = "interrupted" if interrupted else "failed"
        if interrupted:
            detail = f"interrupted ({type(err).__name__})"
        wall = elapsed_since(start)
        gpu = self._gpu_hours_if_possible(started_at, wall)
        recorded = self._update_if_possible(status=status, finished=now_iso(), wall_time_s=wall, error=detail, **gpu)
        try:
            with store_errors_reported_by_caller():
                if gpu:
                    _log_gpu_hours(child, gpu)
                child.set_tags({"eagleops.error": detail[:5000]})
                child.finish("KILLED" if interrupted else "FAILED")
        except Exception as tracking_err:  # the manifest already holds the truth; say why MLflow does not
            logging.getLogger("eagleops").warning(f"{self.name}: could not record the {status} state in MLflow: "
                                                  f"{short_error(tracking_err)}")
        if not interrupted:
            logger().error(f"{self.name}: failed: {detail}")
        return recorded

    def _gpu_hours_if_possible(self, started_at: float, wall: float) -> dict[str, Any]:
        """attempt_gpu_hours on the way out of a failure: {} (and a warning) rather than an error over the stage's."""
        try:
            return attempt_gpu_hours(self.cfg, self.run.path, self.name, started_at, wall)
        except Exception as err:  # noqa: BLE001 -- the stage's own error is the one to raise
            logging.getLogger("eagleops").warning(f"{self.name}: GPU-hours not recorded: {short_error(err)}")
            return {}

    def _update_if_possible(self, **fields: Any) -> bool:
        """update_attempt on the way out of a failure: a manifest that cannot be written (a full disk) keeps
        its previous content (the write is atomic) and is reported, never raised over the stage's own error."""
        try:
            self.run.update_attempt(self.name, self.entry, **fields)
        except OSError as err:
            logging.getLogger("eagleops").warning(
                f"{self.name}: could not record the {fields.get('status')} attempt in {self.run.path / MANIFEST} "
                f"({err}); it keeps its previous content")
            return False
        return True

    def _disk_full(self, full: BaseException, recorded: bool) -> DiskFull:
        detail = describe_disk_full(full, self.folder)
        if not recorded:
            detail += (f"; {MANIFEST} could not be updated either and keeps its previous content (the next run "
                       "closes the attempt as interrupted)")
        return DiskFull(self.name, redact(detail), self.run.path, self.config_path)


def _gpu_summary(gpu: dict[str, Any]) -> dict[str, Any]:
    """The attempt's GPU-hours as its summary carries them (CLI views, the report, Prefect artifacts)."""
    return {k: gpu[k] for k in ("gpu_hours", "gpu_hours_by_host", "gpus")}


def _log_gpu_hours(child: RunLogger, gpu: dict[str, Any]) -> None:
    """On the stage's MLflow run, through its RunLogger (journaled in an outage): metric gpu_hours and
    gpu_hours.<host>, param gpus.<host> (the most GPUs held at once there)."""
    child.log_metrics({"gpu_hours": gpu["gpu_hours"], **{f"gpu_hours.{h}": v for h, v in gpu["gpu_hours_by_host"].items()}})
    if gpu["gpus"]:
        child.log_params({f"gpus.{h}": n for h, n in gpu["gpus"].items()})


def numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric metrics of a stage summary, as floats (booleans and text left out)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def named(task: Any, stage: str, attempt: Any) -> Any:
    """The stage task with its Prefect task run named by stage and attempt (`train_draft (attempt 2)`), not Prefect's
    random suffix (`train_draft-b7f`); a plain function (a test's stand-in) as it is."""
    with_options = getattr(task, "with_options", None)
    return with_options(task_run_name=f"{stage} (attempt {attempt})") if with_options else task
