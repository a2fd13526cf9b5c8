"""generate_data: target -> regenerated answers -> loss-masked samples -> draft vocab -> hidden states.

A thin wrapper over `eagle3.data.generate_dataset`. The tiny target is built (or reused from
the content-addressed cache under `<runs_root>/cache/targets`) here, so the whole CPU default
needs nothing from a hub. Everything the data depends on is logged to the stage's MLflow
run: the aux layer ids in SGLang's convention *and* as HF indices, the chat-template hash,
regeneration settings (no secrets) and the draft vocab map.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from eagle3.data import generate_dataset
from eagle3.tiny_target import build_tiny_target
from tasks.config import ExperimentConfig
from tasks.pipeline import StageContext, logger
from tasks.rundir import digest_json, digest_paths


def resolve_target_dir(cfg: ExperimentConfig, ctx: StageContext) -> Path:
    """The target's HF directory on this machine: the built tiny target or target.model_path."""
    if cfg.target.kind == "tiny":
        cache = Path(cfg.runs_root).resolve() / "cache" / "targets"
        target_dir = build_tiny_target(cfg.target.tiny, cache, on_progress=ctx.progress("tiny target"))
        logger().info(f"tiny target: {target_dir}")
        return target_dir
    target_dir = Path(cfg.target.model_path or "").expanduser()
    if not (target_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"target.model_path: {target_dir}/config.json not found on this machine; "
            "run the data stage where the target weights are"
        )
    return target_dir


@task(name="generate_data", cache_policy=NO_CACHE)
def generate_data(cfg: ExperimentConfig, ctx: StageContext) -> dict:
    target_dir = resolve_target_dir(cfg, ctx)
    dataset_dir = ctx.stage_dir / "dataset"
    summary = generate_dataset(target_dir, cfg.target, cfg.data, dataset_dir, on_progress=ctx.progress(), log=logger().info)
    _log_to_mlflow(ctx, target_dir, summary)
    metrics = {
        key: summary[key]
        for key in ("num_train", "num_val", "num_samples", "tokens", "assistant_tokens", "loss_mask_fraction",
                    "hidden_states_bytes", "bytes_written", "num_dropped")
        if isinstance(summary.get(key), (int, float))
    }
    vocab = summary.get("vocab", {})
    if isinstance(vocab.get("coverage"), (int, float)):
        metrics["draft_vocab_coverage"] = vocab["coverage"]
    return {
        **summary,
        "metrics": metrics,
        "outputs": {"target_dir": str(target_dir), "dataset_dir": str(dataset_dir), **{k: v for k, v in summary["paths"].items() if v}},
        "output_digest": dataset_digest(target_dir, summary),
    }


def dataset_digest(target_dir: Path, summary: dict) -> str:
    """Content digest of what training consumes: samples, vocab map, the hidden-state shards'
    manifest (it holds each shard's sha256, so terabytes are not re-read) and the target's identity."""
    paths = summary["paths"]
    hashed = [paths["samples"], paths["vocab"], target_dir / "config.json"]
    if paths.get("hidden_states"):
        hashed.append(Path(paths["hidden_states"]) / "manifest.json")
    return digest_json([digest_paths(hashed), str(target_dir.resolve())])


def _log_to_mlflow(ctx: StageContext, target_dir: Path, summary: dict) -> None:
    run = ctx.mlflow
    run.log_params({
        "aux_layer_ids": json.dumps(summary["aux_layer_ids"]),
        "hf_hidden_state_indices": json.dumps(summary["hf_indices"]),
        "architecture": summary["architecture"],
        "chat_template_sha256": summary["chat_template_sha256"],
        "hidden_states": summary["hidden_states"],
        "target_dir": str(target_dir),
        **{f"regenerate.{k}": v for k, v in summary["regeneration"].items()},
    })
    run.log_dict(summary, "data/summary.json")
    vocab_dir = Path(summary["paths"]["vocab"])
    if vocab_dir.is_dir():
        run.log_artifact(vocab_dir, "vocab")
    eval_file = target_dir / "eval.json"
    if eval_file.is_file():
        run.log_artifact(eval_file, "target")
