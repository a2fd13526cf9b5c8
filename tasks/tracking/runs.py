"""What a run is tagged with and how runs are listed: the parent run's filterable tags (target, layers,
speculation, host), the code version and commit, and `eagleops runs`' rows."""
from __future__ import annotations

import importlib.metadata
import json
import subprocess
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from tasks.config.schema import ExperimentConfig


def run_tags(cfg: ExperimentConfig) -> dict[str, str]:
    """Tags every parent run carries, so runs filter and compare by target, layers, speculation and host.

    `eagleops.speculative` is `num_steps/eagle_topk/num_draft_tokens` as asked (`auto` = SGLang chooses);
    `eagleops.layer_ids` the aux layer ids as asked, else SGLang's default for the target (`default`
    when its depth is not known here); `eagleops.architecture` only when known.
    """
    from tasks.hosts.launch import target_architecture

    spec = cfg.deploy.speculative
    tags = {
        "eagleops.target": "tiny" if cfg.target.kind == "tiny" else str(cfg.target.model_path),
        "eagleops.layer_ids": ",".join(map(str, _layer_ids(cfg))) or "default",
        "eagleops.speculative": "/".join(
            "auto" if v is None else str(v) for v in (spec.num_steps, spec.eagle_topk, spec.num_draft_tokens)
        ),
        "eagleops.host": cfg.deploy.host,
    }
    architecture = target_architecture(cfg)
    if architecture:
        tags["eagleops.architecture"] = architecture
    return tags


def _layer_ids(cfg: ExperimentConfig) -> list[int]:
    """The aux layer ids as asked, else SGLang's default when the target's depth is known here, else []."""
    from eagle3.data.capture import default_aux_layer_ids
    from tasks.hosts.launch import target_architecture

    if cfg.target.aux_layer_ids:
        return list(cfg.target.aux_layer_ids)
    architecture = target_architecture(cfg)
    config_file = Path(cfg.target.model_path or "", "config.json")
    if cfg.target.kind == "tiny":
        layers = cfg.target.tiny.num_hidden_layers
    elif cfg.target.shape:
        layers = cfg.target.shape.num_hidden_layers
    elif cfg.target.model_path and config_file.is_file():
        layers = json.loads(config_file.read_text()).get("num_hidden_layers")
    else:
        layers = None
    if not (architecture and layers):
        return []
    try:
        return default_aux_layer_ids(architecture, layers)
    except ValueError:  # no capture rule for this architecture: a tag is no place to fail the run
        return []


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


def recent_runs(tracking_uri: str, experiment: str | None, limit: int) -> list[dict[str, Any]]:
    """Parent runs, newest first, as small dicts for the `eagleops runs` table."""
    client = MlflowClient(tracking_uri)
    if experiment:
        found = client.get_experiment_by_name(experiment)
        if found is None:
            raise LookupError(f"no MLflow experiment named {experiment!r}")
        experiments = [found]
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


def parent_run_ids(tracking_uri: str, name: str) -> list[str]:
    """The ids of the parent runs named `name`, as `eagleops runs` prints it (`RUN_NAME`, or `EXPERIMENT/RUN_NAME`
    when it lists several experiments)."""
    client = MlflowClient(tracking_uri)
    experiment, _, run_name = name.rpartition("/")
    found = client.get_experiment_by_name(experiment) if experiment else None
    if experiment and found is None:
        return []
    ids = [found.experiment_id] if found else [e.experiment_id for e in client.search_experiments()]
    quoted = run_name.replace("'", "\\'")
    runs = client.search_runs(ids, filter_string=f"tags.`eagleops.kind` = 'experiment' and "
                                                 f"attributes.run_name = '{quoted}'", max_results=10) if ids else []
    return [r.info.run_id for r in runs]


def _run_row(run: Any, names: dict[str, str]) -> dict[str, Any]:
    metrics = run.data.metrics
    return {
        "experiment": names.get(run.info.experiment_id, run.info.experiment_id),
        "run_name": run.info.run_name,
        "run_id": run.info.run_id,
        "status": run.info.status,
        "start_time": run.info.start_time,
        "config_hash": run.data.tags.get("eagleops.config_hash", ""),
        # the setting the headline figures are of (the benchmark's best), else the one the config asks for
        "setting": run.data.tags.get("eagleops.best_setting") or run.data.tags.get("eagleops.speculative", "-"),
        "stages": run.data.tags.get("eagleops.stages", ""),
        "flow_run_id": run.data.tags.get("prefect.flow_run_id", ""),
        "metrics": {k: metrics[k] for k in sorted(metrics)},
    }


# The parent run's tag when data, training and export all ran in it on the prompts data set (tasks.runner.gpu_hours).
FULL_RETRAIN_TAG = "eagleops.full_retrain"


def last_full_retrain(tracking_uri: str, mlflow_experiment: str, experiment: str) -> dict[str, Any] | None:
    """The newest parent run of `experiment` tagged a full retrain, with what its data, training and export held
    (`gpu_hours_retrain`) and the samples it asked for (its `data.num_samples`, the measure a config's estimate is
    scaled by: the samples a data stage makes fall short of it by the ones it drops); None when there is none."""
    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(mlflow_experiment)
    if found is None:
        return None
    runs = client.search_runs([found.experiment_id], order_by=["attributes.start_time DESC"], max_results=1,
                              filter_string=f"tags.`{FULL_RETRAIN_TAG}` = 'true' and params.experiment = '{experiment}' "
                                            "and metrics.gpu_hours_retrain >= 0")
    if not runs:
        return None
    run = runs[0]
    return {"run_id": run.info.run_id, "run_name": run.info.run_name, "start_time": run.info.start_time,
            "gpu_hours": run.data.metrics["gpu_hours_retrain"],
            "samples": _number(run.data.params.get("data.num_samples"))}


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None
