"""The nightly's GPU-hours: this night's (every stage it ran, the gate's servers included) against a full
retrain's, in one line of the gate's report, on the MLflow parent run and in the run folder's manifest.

The full retrain's figure is measured, never assumed: the newest parent run of the same experiment in
MLflow tagged `eagleops.full_retrain` (data from data.source: prompts -- regeneration included when it
regenerates -- every sample captured, training and export, all run in that flow run, nothing reused),
its `gpu_hours_retrain` (what those three stages held) scaled linearly by samples to this config's
data.num_samples. Its deploy, benchmark or gate are left out, and this night's data, training and export
are held against it; the night's total adds the gate. No such run yet: the line says so (the first
nightly on data.source: prompts is one).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from tasks.config.schema import ExperimentConfig
from tasks.rundir import RunDirectory
from tasks.runner.gpu_hours import RETRAIN_STAGES
from tasks.tracking.journal import journal_path
from tasks.tracking.outage import is_outage, short_error
from tasks.tracking.run_logger import RunLogger
from tasks.tracking.runs import last_full_retrain

GATE_STAGE = "nightly_gate"  # the gate's folder and MLflow child run (tasks.stages.gate.nightly)


def record_night_gpu_hours(cfg: ExperimentConfig, experiment: dict[str, Any], gate: dict[str, Any]) -> dict[str, Any]:
    """{block (the manifest's gpu_hours with the gate and the estimate), line (markdown)}; logs the night's total
    (`gpu_hours_total`, the gate included), `nightly_gate.gpu_hours` and the estimate on the parent run."""
    run = RunDirectory.open(experiment["run_dir"])
    block = dict(experiment.get("gpu_hours") or run.manifest.get("gpu_hours") or {})
    stages = {**block.get("stages", {}), GATE_STAGE: gate.get("gpu_hours", 0.0)}
    estimate = full_retrain_estimate(cfg, run.manifest["mlflow"]["tracking_uri"], experiment["mlflow_run_id"])
    block.update(stages=stages, total=sum(stages.values()), full_retrain_estimate=estimate)
    parent = RunLogger(run.manifest["mlflow"]["tracking_uri"], experiment["mlflow_run_id"], journal_path(run.path))
    parent.log_metrics({"gpu_hours_total": block["total"], f"{GATE_STAGE}.gpu_hours": stages[GATE_STAGE],
                        **({"gpu_hours_full_retrain_estimate": estimate["gpu_hours"]} if estimate.get("gpu_hours") is not None else {})})
    return {"block": block, "line": night_line(stages, block.get("reused_total", 0.0), estimate)}


def full_retrain_estimate(cfg: ExperimentConfig, tracking_uri: str, this_run_id: str) -> dict[str, Any]:
    """{gpu_hours, basis}: the newest full retrain's data + training + export GPU-hours, scaled to data.num_samples
    (gpu_hours None when MLflow has none or cannot be asked; basis says which)."""
    try:
        found = last_full_retrain(tracking_uri, cfg.mlflow_experiment, cfg.experiment)
    except Exception as err:
        if not is_outage(err):
            raise
        return {"gpu_hours": None, "basis": f"MLflow cannot be asked for the last full retrain ({short_error(err)})"}
    if found is None:
        return {"gpu_hours": None, "basis": f"no full retrain of {cfg.experiment} in MLflow yet (a run whose data, "
                                            "training and export all ran on data.source: prompts)"}
    samples = found.get("samples") or cfg.data.num_samples
    scale = cfg.data.num_samples / samples
    when = datetime.fromtimestamp(found["start_time"] / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    which = "this night itself" if found["run_id"] == this_run_id else f"run {found['run_name']} ({found['run_id']}, {when})"
    basis = (f"{which}: data + training + export held {found['gpu_hours']:.4g} GPU-h for {samples:.0f} samples"
             + ("" if abs(scale - 1) < 1e-9 else f", x {scale:.4g} for data.num_samples {cfg.data.num_samples}"))
    return {"gpu_hours": found["gpu_hours"] * scale, "basis": basis, "run_id": found["run_id"]}


def night_line(stages: dict[str, float], reused_total: float, estimate: dict[str, Any]) -> str:
    """`GPU-hours this night: T (stage h, ...; reused ...)` and the full retrain's estimate beside it."""
    per_stage = ", ".join(f"{name} {hours:.4g}" for name, hours in stages.items())
    reused = f"; reused stages held {reused_total:.4g} when they ran, not counted" if reused_total else ""
    line = f"**GPU-hours this night: {sum(stages.values()):.4g}** ({per_stage}{reused})."
    retrain = sum(stages.get(s, 0.0) for s in RETRAIN_STAGES)
    if estimate.get("gpu_hours") is None:
        return f"{line} A full retrain's estimate: unknown ({estimate['basis']})."
    share = f" = {retrain / estimate['gpu_hours']:.1%} of it" if estimate["gpu_hours"] > 0 else ""
    return (f"{line} Its data + training + export: {retrain:.4g} GPU-h{share}, against a full retrain's "
            f"{estimate['gpu_hours']:.4g} GPU-h (measured: {estimate['basis']}).")
