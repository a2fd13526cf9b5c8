"""The data stage's side of `data.source: served`: where the capture cache lies on the data host, and what a
night with "no new traffic" records (the stage's MLflow run, a Prefect artifact, the log; the pipeline then
stops after the data stage: `halt` in the stage's result).

The cache (`eagle3.data.capture_cache`) lives where the data stage runs and never crosses to this machine:
`data.served.cache`, or by default `capture-cache` under the data host's workdir (`<runs_root>` for
data.host local), outside every run folder so that every night of every run on that host shares it.
"""

from __future__ import annotations

import posixpath
from pathlib import Path

from prefect.artifacts import create_markdown_artifact
from prefect.states import Completed, State

from eagle3.config import DataConfig
from tasks.config.schema import ExperimentConfig
from tasks.log import logger
from tasks.runner.context import StageContext

CACHE_FOLDER = "capture-cache"
NO_NEW_TRAFFIC_TAG = "eagleops.no_new_traffic"


def with_cache_folder(data: DataConfig, workdir: str) -> DataConfig:
    """data with data.served.cache set: as configured, else `<workdir>/capture-cache` on the data host."""
    if data.source != "served" or data.served.cache:
        return data
    served = data.served.model_copy(update={"cache": posixpath.join(workdir, CACHE_FOLDER)})
    return data.model_copy(update={"served": served})


def local_workdir(cfg: ExperimentConfig) -> str:
    """The data host's workdir when it is this machine: the runs root."""
    return str(Path(cfg.runs_root).resolve())


def record_night(ctx: StageContext, summary: dict) -> dict:
    """Record a night's cache figures; with no new traffic, say so everywhere and halt the pipeline after data.
    Returns what the stage's result gains ({"halt": reason} or {})."""
    reason = summary.get("no_new_traffic")
    if not reason:
        return {}
    cache = (summary.get("served") or {}).get("cache") or {}
    ctx.mlflow.set_tags({NO_NEW_TRAFFIC_TAG: "true"})
    logger().info(f"generate_data: {reason}")
    create_markdown_artifact(
        f"## No new traffic\n\n{reason}.\n\n| new | known | min_new_samples | cache |\n|---|---|---|---|\n"
        f"| {cache.get('new_samples')} | {cache.get('known_samples')} | {cache.get('min_new_samples')} | "
        f"{cache.get('dir')} |\n\nNothing was trained, exported or gated.",
        key="no-new-traffic", description=reason[:200])
    return {"halt": reason}


def no_new_traffic_outcome(cfg: ExperimentConfig, experiment: dict, champion: dict | None) -> State:
    """The nightly's Completed state when its data stage found no new traffic: nothing trained, exported or gated,
    the champion unchanged; the state's message and the returned dict say why."""
    reason = experiment["halted"]
    logger().info(f"nightly: {reason}; nothing trained, exported or gated, the champion stays")
    result = {"no_new_traffic": reason, "promoted": False, "model": cfg.export.registered_model,
              "champion_before": champion["version"] if champion else None, "run_dir": experiment["run_dir"],
              "mlflow_run_id": experiment["mlflow_run_id"]}
    return Completed(message=reason, data=result)
