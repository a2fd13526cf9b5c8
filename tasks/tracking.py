"""MLflow tracking: one parent run per experiment run, one nested child run per stage.

Everything goes through `MlflowClient` with explicit run ids rather than MLflow's fluent
active-run stack, which is per thread: Prefect may run a task in another thread than the
flow, and a stage's child run must not depend on which thread logs to it.

Default store: `sqlite:///<runs_root>/mlflow.db` with artifacts in `<runs_root>/mlartifacts`
(the experiment is created with that artifact location). An `http://` URI works the same.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from mlflow.entities import Metric, Param, RunTag  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from tasks.config import ExperimentConfig, flatten, masked_dict, masked_yaml  # noqa: E402
from tasks.secrets import redact, redact_obj  # noqa: E402

MAX_PARAM_LENGTH = 6000
BATCH = 100


def default_tracking_uri(runs_root: str | Path) -> str:
    return f"sqlite:///{Path(runs_root).resolve() / 'mlflow.db'}"


def tracking_uri_for(cfg: ExperimentConfig) -> str:
    return cfg.tracking.uri or default_tracking_uri(cfg.runs_root)


def ensure_experiment(client: MlflowClient, name: str, runs_root: str | Path, local_store: bool) -> str:
    """Experiment id for `name`, created with artifacts beside a local store when it is new."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        if found.lifecycle_stage == "deleted":
            client.restore_experiment(found.experiment_id)
        return found.experiment_id
    location = (Path(runs_root).resolve() / "mlartifacts").as_uri() if local_store else None
    return client.create_experiment(name, artifact_location=location)


def eagleops_version() -> str:
    try:
        return importlib.metadata.version("eagleops")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def git_commit(cwd: str | Path = ".") -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


@dataclass
class RunLogger:
    """Logging into one MLflow run (a parent or a stage's child), by id."""

    tracking_uri: str
    run_id: str

    @property
    def client(self) -> MlflowClient:
        return MlflowClient(self.tracking_uri)

    def log_params(self, params: dict[str, Any]) -> None:
        items = [Param(redact(k), redact(str(v))[:MAX_PARAM_LENGTH]) for k, v in params.items()]
        for start in range(0, len(items), BATCH):
            self.client.log_batch(self.run_id, params=items[start : start + BATCH])

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in metrics.items() if _is_number(v)]
        for start in range(0, len(items), BATCH):
            self.client.log_batch(self.run_id, metrics=items[start : start + BATCH])

    def set_tags(self, tags: dict[str, Any]) -> None:
        self.client.log_batch(self.run_id, tags=[RunTag(k, redact(str(v))) for k, v in tags.items()])

    def log_dict(self, data: dict | list, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, redact_obj(data), artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, redact(text), artifact_file)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        self.client.log_figure(self.run_id, figure, artifact_file)

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def start_parent_run(
    cfg: ExperimentConfig, run_name: str, tags: dict[str, str], config_path: str | Path
) -> RunLogger:
    """Create the experiment's parent run and log the validated config (params + YAML artifact)."""
    uri = tracking_uri_for(cfg)
    client = MlflowClient(uri)
    experiment_id = ensure_experiment(client, cfg.mlflow_experiment, cfg.runs_root, cfg.tracking.uri is None)
    run = client.create_run(experiment_id, run_name=run_name, tags={**tags, "eagleops.kind": "experiment"})
    parent = RunLogger(uri, run.info.run_id)
    if cfg.description:
        parent.set_tags({"mlflow.note.content": cfg.description})
    parent.log_params(flatten(masked_dict(cfg)))
    parent.log_text(masked_yaml(cfg), "config/experiment.yaml")
    parent.set_tags({"eagleops.config_file": str(config_path)})
    return parent


def mark_run(tracking_uri: str, run_id: str, status: str) -> None:
    """Set a run's terminal status (e.g. KILLED for an attempt whose process died)."""
    RunLogger(tracking_uri, run_id).finish(status)


def reopen_run(tracking_uri: str, run_id: str) -> RunLogger:
    logger = RunLogger(tracking_uri, run_id)
    logger.client.update_run(run_id, status="RUNNING")
    return logger


def start_child_run(parent: RunLogger, stage: str, tags: dict[str, str]) -> RunLogger:
    """A nested run for one stage (MLflow's UI nests it under the parent via mlflow.parentRunId)."""
    client = parent.client
    experiment_id = client.get_run(parent.run_id).info.experiment_id
    run = client.create_run(
        experiment_id,
        run_name=stage,
        tags={**tags, "mlflow.parentRunId": parent.run_id, "eagleops.stage": stage, "eagleops.kind": "stage"},
    )
    return RunLogger(parent.tracking_uri, run.info.run_id)


def log_json_file(logger: RunLogger, data: Any, artifact_file: str) -> None:
    """Log JSON that may hold non-dict roots; written through a temp file to keep key order."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / Path(artifact_file).name
        path.write_text(json.dumps(data, indent=2, default=str))
        parent = str(Path(artifact_file).parent)
        logger.log_artifact(path, None if parent == "." else parent)


def recent_runs(tracking_uri: str, experiment: str | None, limit: int) -> list[dict[str, Any]]:
    """Parent runs, newest first, as small dicts for the `eagleops runs` table."""
    client = MlflowClient(tracking_uri)
    if experiment:
        found = client.get_experiment_by_name(experiment)
        experiments = [found] if found else []
    else:
        experiments = client.search_experiments()
    ids = [e.experiment_id for e in experiments]
    if not ids:
        return []
    names = {e.experiment_id: e.name for e in experiments}
    runs = client.search_runs(
        ids, filter_string="tags.`eagleops.kind` = 'experiment'", order_by=["attributes.start_time DESC"], max_results=limit
    )
    return [_run_row(r, names) for r in runs]


def _run_row(run: Any, names: dict[str, str]) -> dict[str, Any]:
    metrics = run.data.metrics
    return {
        "experiment": names.get(run.info.experiment_id, run.info.experiment_id),
        "run_name": run.info.run_name,
        "run_id": run.info.run_id,
        "status": run.info.status,
        "start_time": run.info.start_time,
        "config_hash": run.data.tags.get("eagleops.config_hash", ""),
        "stages": run.data.tags.get("eagleops.stages", ""),
        "metrics": {k: metrics[k] for k in sorted(metrics)},
    }

