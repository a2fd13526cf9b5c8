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
        "metrics": {k: metrics[k] for k in sorted(metrics)},
    }
