"""The stage runner behind the experiment flow: selection, resume, run directory, MLflow runs.

A stage is a Prefect task `fn(cfg, ctx) -> summary` (see `StageContext`). `Pipeline.run`
decides whether it runs (selected with --stages? completed earlier with the same inputs?),
opens its MLflow child run, calls it, and records status, outputs and fingerprint in the
manifest. A failure is recorded everywhere (manifest, child and parent run FAILED) and then
re-raised so the flow stops before any later, more expensive stage. Nothing a stage already
wrote is deleted.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.exceptions import MissingContextError

from tasks.config import ExperimentConfig, config_hash, masked_yaml, section_hash
from tasks.rundir import RunDirectory, elapsed_since, fingerprint, now_iso, write_json_atomic
from tasks.tracking import RunLogger, eagleops_version, git_commit, reopen_run, start_child_run, start_parent_run, tracking_uri_for

# Stage order and the config sections each stage's outputs depend on.
STAGE_SECTIONS: dict[str, list[str]] = {
    "check_environment": ["target", "data", "train", "deploy", "hosts", "runs_root"],
    "generate_data": ["target", "data"],
    "train_draft": ["train"],
    "export_checkpoint": ["export"],
    "deploy_server": ["deploy", "hosts"],
    "run_benchmark": ["bench"],
    "report": [],
}
STAGES = list(STAGE_SECTIONS)
# Stages with side effects on other machines or whose result is a measurement: never reused.
ALWAYS_RUN = {"deploy_server", "run_benchmark", "report"}
# Stages that run whatever --stages says: the report summarises whatever ran.
ALWAYS_SELECTED = {"report"}


class StageFailed(RuntimeError):
    """A stage raised; the message names the stage and its error."""


def logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("eagleops")


@dataclass
class StageContext:
    """What a stage task gets besides the config: where to write, where to log, what came before."""

    name: str
    stage_dir: Path
    run_dir: Path
    tracking_uri: str
    mlflow_run_id: str
    upstream: dict[str, dict[str, Any]] = field(default_factory=dict)

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


class Pipeline:
    """One experiment run: its run directory, MLflow parent run and the stages chosen for it."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        config_path: str,
        selected: list[str] | None,
        run_dir: str | None,
        flow_run_id: str,
    ):
        unknown = sorted(set(selected or []) - set(STAGES))
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; stages are {STAGES}")
        self.cfg, self.selected = cfg, selected
        self.version = eagleops_version()
        self.run = self._open_run_dir(config_path, run_dir)
        self.parent = self._open_parent_run(config_path, flow_run_id)
        self.results: dict[str, dict[str, Any]] = {}
        self.fingerprints: dict[str, str] = {}

    # ------------------------------------------------------------------ setup

    def _open_run_dir(self, config_path: str, run_dir: str | None) -> RunDirectory:
        header = {"config_path": str(config_path), "config_hash": config_hash(self.cfg), "eagleops_version": self.version}
        if run_dir is None:
            run = RunDirectory.create(self.cfg.runs_root, self.cfg.experiment, header)
        else:
            run = RunDirectory.open(run_dir)
            if run.manifest.get("experiment") != self.cfg.experiment:
                raise ValueError(
                    f"{run.path}: run of experiment '{run.manifest.get('experiment')}', "
                    f"not '{self.cfg.experiment}'"
                )
            run.update(**header)
        (run.path / "config.yaml").write_text(masked_yaml(self.cfg))
        logger().info(f"run directory: {run.path}")
        return run

    def _open_parent_run(self, config_path: str, flow_run_id: str) -> RunLogger:
        tags = {
            "prefect.flow_run_id": flow_run_id,
            "mlflow.source.git.commit": git_commit(Path(__file__).parent),
            "eagleops.config_hash": config_hash(self.cfg),
            "eagleops.version": self.version,
            "eagleops.run_dir": str(self.run.path),
        }
        previous = self.run.manifest.get("mlflow", {})
        same_config = previous.get("config_hash") == config_hash(self.cfg)
        if previous.get("parent_run_id") and same_config and previous.get("tracking_uri") == tracking_uri_for(self.cfg):
            parent = reopen_run(previous["tracking_uri"], previous["parent_run_id"])
            parent.set_tags({"prefect.flow_run_id": flow_run_id})
        else:
            parent = start_parent_run(self.cfg, f"{self.cfg.experiment}-{self.run.run_id}", tags, config_path)
            if previous.get("parent_run_id"):
                parent.set_tags({"eagleops.resumed_from": previous["parent_run_id"]})
        flow_runs = self.run.manifest.get("prefect_flow_run_ids", []) + [flow_run_id]
        self.run.update(
            mlflow={"tracking_uri": parent.tracking_uri, "parent_run_id": parent.run_id, "config_hash": config_hash(self.cfg)},
            prefect_flow_run_ids=flow_runs,
        )
        logger().info(f"MLflow parent run {parent.run_id} at {parent.tracking_uri}")
        return parent

    # ------------------------------------------------------------------ stages

    def run_stage(self, task: Any) -> dict[str, Any] | None:
        """Run one stage task unless it is deselected or reusable; return its summary."""
        name = task.name
        stage_fingerprint = self._fingerprint(name)
        if self.selected is not None and name not in self.selected and name not in ALWAYS_SELECTED:
            return self._reuse_or_skip(name, stage_fingerprint, "not selected with --stages")
        if name not in ALWAYS_RUN and self.run.is_reusable(name, stage_fingerprint):
            logger().info(f"{name}: completed earlier with the same inputs; reusing its outputs")
            return self._remember(name, stage_fingerprint, self.run.stage(name).get("summary", {}))
        return self._execute(task, name, stage_fingerprint)

    def run_pending(self, name: str, reason: str) -> None:
        """A stage that is not built yet: logged and recorded as such, never faked."""
        logger().warning(f"{name}: not available yet ({reason}); skipped")
        self.run.update_stage(name, status="not_available", reason=reason)

    def _execute(self, task: Any, name: str, stage_fingerprint: str) -> dict[str, Any]:
        child = start_child_run(self.parent, name, {"prefect.flow_run_id": self._flow_run_id()})
        ctx = StageContext(name, self.run.stage_dir(name), self.run.path, child.tracking_uri, child.run_id, dict(self.results))
        self.run.update_stage(name, status="running", started=now_iso(), mlflow_run_id=child.run_id, fingerprint=stage_fingerprint)
        start = time.monotonic()
        try:
            summary = task(self.cfg, ctx) or {}
        except Exception as err:
            self._record_failure(name, child, err, start)
            raise StageFailed(f"{name} failed: {err}") from err
        wall = elapsed_since(start)
        summary = {**summary, "wall_time_s": wall}
        write_json_atomic(ctx.stage_dir / "summary.json", summary)
        child.log_metrics({"wall_time_s": wall, **_numbers(summary.get("metrics", {}))})
        child.finish("FINISHED")
        self.parent.log_metrics({f"{name}.{k}": v for k, v in _numbers(summary.get("metrics", {})).items()})
        self.parent.log_metrics({f"{name}.wall_time_s": wall})
        self.run.update_stage(name, status="completed", finished=now_iso(), wall_time_s=wall, summary=summary,
                              outputs=summary.get("outputs", {}))
        logger().info(f"{name}: completed in {wall:.1f}s")
        return self._remember(name, stage_fingerprint, summary)

    def _record_failure(self, name: str, child: RunLogger, err: Exception, start: float) -> None:
        detail = "".join(traceback.format_exception_only(type(err), err)).strip()
        self.run.update_stage(name, status="failed", finished=now_iso(), wall_time_s=elapsed_since(start), error=detail)
        child.set_tags({"eagleops.error": detail[:5000]})
        child.finish("FAILED")
        logger().error(f"{name}: failed: {detail}")

    def _reuse_or_skip(self, name: str, stage_fingerprint: str, reason: str) -> dict[str, Any] | None:
        if self.run.is_reusable(name, stage_fingerprint):
            return self._remember(name, stage_fingerprint, self.run.stage(name).get("summary", {}))
        logger().info(f"{name}: skipped ({reason})")
        if self.run.stage(name).get("status") != "completed":
            self.run.update_stage(name, status="skipped", reason=reason)
        return None

    def _remember(self, name: str, stage_fingerprint: str, summary: dict[str, Any]) -> dict[str, Any]:
        self.fingerprints[name] = stage_fingerprint
        self.results[name] = summary
        return summary

    def _fingerprint(self, name: str) -> str:
        sections = [s for s in STAGE_SECTIONS[name] if s != "runs_root"]
        upstream = [self.fingerprints.get(s, self.run.stage(s).get("fingerprint", "")) for s in STAGES[: STAGES.index(name)]]
        extra = self.cfg.runs_root if "runs_root" in STAGE_SECTIONS[name] else ""
        return fingerprint(name, section_hash(self.cfg, sections) + extra, upstream, self.version)

    def _flow_run_id(self) -> str:
        return self.run.manifest.get("prefect_flow_run_ids", ["unknown"])[-1]

    # ------------------------------------------------------------------ end

    def finish(self, status: str) -> dict[str, Any]:
        stages = {name: entry.get("status") for name, entry in self.run.manifest["stages"].items()}
        self.parent.set_tags({"eagleops.stages": json.dumps(stages)})
        self.parent.finish(status)
        self.run.update(status=status.lower(), finished=now_iso())
        return {"run_dir": str(self.run.path), "mlflow_run_id": self.parent.run_id, "stages": stages, "status": status}


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
