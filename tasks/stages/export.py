"""export_checkpoint: SGLang (and vLLM speculators) checkpoints, validated, logged, registered.

A thin wrapper over `eagle3.export.export_checkpoint`, which refuses an export that SGLang
or vLLM would silently mis-load. The exported directories become MLflow artifacts; with
`export.registered_model` set, the SGLang directory is registered as a model version (the
raw checkpoint dir, which is what SGLang loads) so deploys can fetch `models:/name@alias`.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from eagle3.config import ExportConfig
from eagle3.export import TRAINING_RECORD
from eagle3.export import export_checkpoint as run_export
from tasks.config.schema import ExperimentConfig
from tasks.log import logger
from tasks.rundir import digest_json, digest_paths
from tasks.runner.context import StageContext
from tasks.runner.flow_errors import redacted_failures
from tasks.stages.target import recorded_target_dir
from tasks.tracking.journal import is_placeholder


def export_settings(cfg: ExperimentConfig, target_dir: Path) -> ExportConfig:
    """The export config with a verifier that names the target where it is served, never this machine's path:
    the configured id, else the serving host's model path, else the tiny target's cache name."""
    verifier = (cfg.export.verifier_name_or_path or cfg.deploy.model_path or cfg.target.model_path
                or f"eagleops-tiny-target/{target_dir.name}")
    return cfg.export.model_copy(update={"verifier_name_or_path": verifier})


@task(name="export_checkpoint", cache_policy=NO_CACHE)
@redacted_failures  # its exception reaches the task run's Prefect state message masked
def export_checkpoint(cfg: ExperimentConfig, ctx: StageContext) -> dict:
    trained = ctx.upstream["train_draft"]
    checkpoint = trained["outputs"]["checkpoint"]
    if not checkpoint:
        raise ValueError("train_draft produced no checkpoint to export")
    target_dir = recorded_target_dir(cfg, ctx, trained["outputs"]["target_dir"])
    result = run_export(Path(checkpoint), target_dir, export_settings(cfg, target_dir), ctx.stage_dir)
    if "sglang" in result["formats"] and trained.get("training_record"):
        record = {**trained["training_record"], "simulated_accept_length": trained.get("simulated_accept_length"),
                  "acc": trained.get("acc")}
        Path(result["formats"]["sglang"], TRAINING_RECORD).write_text(json.dumps(record, indent=2))
    for fmt, path in result["formats"].items():
        ctx.mlflow.log_artifact(path, f"checkpoint/{fmt}")
        logger().info(f"export_checkpoint: {fmt} checkpoint at {path}")
    ctx.mlflow.log_dict(result["validation"], "checkpoint/validation.json")
    outputs = {f"{fmt}_dir": path for fmt, path in result["formats"].items()} | {"target_dir": str(target_dir)}
    if cfg.export.registered_model and "sglang" in result["formats"]:
        version = ctx.mlflow.register_version(cfg.export.registered_model, "checkpoint/sglang", {"format": "sglang"})
        shown = f"pending as {version} (MLflow does not answer: `eagleops sync` registers it)" \
            if is_placeholder(version) else version
        logger().info(f"registered {cfg.export.registered_model} version {shown}")
        # a placeholder until the journal is synced, which writes the version number here in the manifest
        outputs["registered_model_version"] = f"{cfg.export.registered_model}/{version}"
    digest = digest_json([digest_paths(result["formats"].values()), ctx.upstream_digests.get("train_draft")])
    return {**result, "metrics": {"validation_warnings": result["warnings"]}, "outputs": outputs, "output_digest": digest}
