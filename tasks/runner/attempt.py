"""One stage attempt, top-down: what it owns and the order it goes through.

An attempt owns its folder and its entry in the run folder's manifest (`RunDirectory`), its MLflow
child run under the run's parent, and the record of the config fields it read. `StageAttempt.run`
opens the child run, marks the entry running, runs the stage task under the read recorder and the
system-metrics sampler, checks the reads against the stage's spec, then records the outcome in the
same three places: completed (summary, output digest, metrics on child and parent), failed (the
error, redacted) or interrupted (Ctrl-C, SIGTERM). A failure is re-raised as `StageFailed` (or
`DiskFull`, naming what filled) so the flow stops; an interrupt is re-raised as it is. Nothing a stage
already wrote is deleted, and a manifest that cannot be written (a full disk) keeps its previous
content rather than hide the stage's own error.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from tasks.runner.specs import STRICT_READS_ENV, UndeclaredReads, undeclared_reads
from tasks.runner.stages import DiskFull, StageFailed
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
                           self.entry["attempt"], digests)
        self.run.update_attempt(self.name, self.entry, status="running", started=now_iso(),
                                mlflow_run_id=child.run_id, error=None)
        start = time.monotonic()
        try:
            with system_metrics(self.cfg.tracking.log_system_metrics, child), recording_reads(self.cfg) as reads:
                summary = task(self.cfg, ctx) or {}
            self._check_reads(reads)
        except BaseException as err:
            recorded = self._record_failure(child, err, start)
            if is_interrupt(err):
                raise
            if (full := disk_full_error(err)) is not None:
                raise self._disk_full(full, recorded) from err
            raise StageFailed(f"{self.name} failed: {redact(str(err))}") from err
        try:
            return self._record_success(child, summary, start, reads)
        except OSError as err:  # the stage's work is done, but its record does not fit on the disk
            if (full := disk_full_error(err)) is None:
                raise
            raise self._disk_full(full, recorded=False) from err

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

    def _record_success(self, child: RunLogger, summary: dict, start: float,
                        reads: set[str]) -> tuple[str, dict[str, Any]]:
        wall = elapsed_since(start)
        summary = {**summary, "wall_time_s": wall}
        digest = summary.pop("output_digest", None) or digest_json(summary.get("outputs", {}))
        write_json_atomic(self.folder / "summary.json", self.run.portable(summary))
        metrics = numbers(summary.get("metrics", {}))
        child.log_metrics({"wall_time_s": wall, **metrics})
        child.finish("FINISHED")
        self.parent.log_metrics({f"{self.name}.{k}": v for k, v in metrics.items()})
        self.parent.log_metrics({f"{self.name}.wall_time_s": wall})
        self.run.update_attempt(self.name, self.entry, status="completed", finished=now_iso(), wall_time_s=wall,
                                summary=summary, outputs=summary.get("outputs", {}), output_digest=digest,
                                config_reads=sorted(reads))
        logger().info(f"{self.name}: completed in {wall:.1f}s")
        return digest, summary

    def _record_failure(self, child: RunLogger, err: BaseException, start: float) -> bool:
        """Record the failed or interrupted attempt (manifest, MLflow); False when the manifest could not be written."""
        interrupted = is_interrupt(err)
        detail = redact("".join(traceback.format_exception_only(type(err), err)).strip())
        status = "interrupted" if interrupted else "failed"
        if interrupted:
            detail = f"interrupted ({type(err).__name__})"
        recorded = self._update_if_possible(status=status, finished=now_iso(), wall_time_s=elapsed_since(start),
                                            error=detail)
        try:
            with store_errors_reported_by_caller():
                child.set_tags({"eagleops.error": detail[:5000]})
                child.finish("KILLED" if interrupted else "FAILED")
        except Exception as tracking_err:  # the manifest already holds the truth; say why MLflow does not
            logging.getLogger("eagleops").warning(f"{self.name}: could not record the {status} state in MLflow: "
                                                  f"{short_error(tracking_err)}")
        if not interrupted:
            logger().error(f"{self.name}: failed: {detail}")
        return recorded

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


def numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric metrics of a stage summary, as floats (booleans and text left out)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
