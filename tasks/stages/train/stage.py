"""train_draft: EAGLE-3 training-time-test training of the draft, metrics streamed to MLflow.

A thin wrapper over `eagle3.training.train.train_draft`: it reads the data stage's outputs (dataset,
target directory, aux layer ids, draft vocab size), logs that data as an MLflow dataset input of this run
and the parent (`dataset_input`), streams per-step metrics (loss_k, acc_k, lr, simulated accept length on
validation) to the stage's MLflow run through the trainer's callback -- handed off to a background
sender (`tasks.tracking.handoff`), so the loop never waits on the tracking server -- and logs the curves.
Never retried: a failed training run needs a look, and the trainer resumes from its last checkpoint when
the stage is run again on the same run dir.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from eagle3.data.tiny_target import cpu_threads
from eagle3.training.train import train_draft as run_training
from tasks.config.schema import ExperimentConfig
from tasks.hosts.remote import LocalExecutor
from tasks.log import logger
from tasks.rundir import digest_json, digest_paths
from tasks.runner.context import StageContext
from tasks.runner.flow_errors import redacted_failures
from tasks.stages.target import recorded_target_dir
from tasks.stages.train.dataset_input import training_dataset
from tasks.stages.train.nodes import train_on_nodes
from tasks.stages.train.stream import StreamPlace, capture_side, relayed_in_background
from tasks.tracking.handoff import handed_off


def _online_features(cfg: ExperimentConfig, target_dir: Path, aux_layer_ids: list[int]):
    """Target features computed inside training (data.hidden_states: online), the target placed over
    target.placement's devices as the HF engine places it for capture."""
    from eagle3.data.capture import TargetFeatureExtractor
    from eagle3.data.target import load_engine_target

    model, device_map = load_engine_target(target_dir, cfg.target)
    return TargetFeatureExtractor.from_model(model, aux_layer_ids, device_map)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _train(cfg: ExperimentConfig, ctx: StageContext, dataset_dir: Path, target_dir: Path,
           aux_layer_ids: list[int], online, progress) -> dict:
    # The loop's metrics go through a queue: it never waits on the tracking server (tasks.tracking.handoff).
    with handed_off(ctx.mlflow) as on_metrics:
        if cfg.train.nodes:
            return train_on_nodes(cfg, ctx, dataset_dir, target_dir, aux_layer_ids, on_metrics=on_metrics,
                                  progress=progress)
        return _train_here(cfg, ctx, dataset_dir, target_dir, aux_layer_ids, online, progress, on_metrics)


def _train_here(cfg: ExperimentConfig, ctx: StageContext, dataset_dir: Path, target_dir: Path,
                aux_layer_ids: list[int], online, progress, on_metrics) -> dict:
    train_here = lambda: run_training(  # noqa: E731
        dataset_dir, target_dir, cfg.train, ctx.stage_dir / "draft",
        aux_layer_ids=aux_layer_ids, draft_vocab_size=cfg.data.draft_vocab_size, online_features=online,
        on_metrics=on_metrics,
        on_progress=lambda done, total: progress("optimizer steps", done, total), log=logger().info,
    )
    if cfg.data.hidden_states != "stream":
        return train_here()
    place = StreamPlace("local", LocalExecutor(), sys.executable, str(ctx.stage_dir / "draft"), str(target_dir),
                        str(dataset_dir), str(ctx.stage_dir))
    with capture_side(cfg, ctx, place, world_size=cfg.train.devices) as side:
        with relayed_in_background(side):
            summary = train_here()
        summary["stream"] = side.finish()
    return summary


def _log_training_data(cfg: ExperimentConfig, ctx: StageContext, data: dict) -> None:
    """The data stage's output as an MLflow dataset input of this run and of the parent (what the runs table groups by)."""
    digest = ctx.upstream_digests.get("generate_data")
    if not digest:
        return
    dataset = training_dataset(cfg, data, digest)
    for run in (ctx.mlflow, ctx.parent_mlflow):
        if run is not None:
            run.log_dataset(dataset, context="training")


def training_record(data: dict, target_dir: Path) -> dict:
    """What the draft was trained on, carried with its export so a deploy can check the server feeds the same."""
    target = json.loads((target_dir / "config.json").read_text())
    return {
        "architecture": data["architecture"],
        "num_hidden_layers": target.get("text_config", target)["num_hidden_layers"],
        "aux_layer_ids": data["aux_layer_ids"],
        "hf_indices": data["hf_indices"],
        "chat_template_sha256": data.get("chat_template_sha256"),
        "hidden_states": data.get("hidden_states"),
        "draft_vocab_coverage": data.get("vocab", {}).get("coverage"),
        "capture_engine": data.get("capture_engine"),  # name, version and the capture indices it hooked
    }


def _stream_metrics(stream: dict | None) -> dict:
    """The capture side's figures of data.hidden_states: stream (tasks.stages.train.stream), as stage metrics."""
    if not stream:
        return {}
    return {"stream_capture_tok_s": stream.get("capture_tok_s"), "stream_disk_peak_gb": stream["disk_high_water_bytes"] / 1e9,
            "stream_shards_captured": stream["shards_captured"], "stream_shards_reused": stream["shards_reused"],
            **{f"stream_capture_s_epoch_{e['epoch']}": e["capture_s"] for e in stream["epochs"]}}


@task(name="train_draft", cache_policy=NO_CACHE)
@redacted_failures  # its exception reaches the task run's Prefect state message masked
def train_draft(cfg: ExperimentConfig, ctx: StageContext) -> dict:
    data = ctx.upstream["generate_data"]
    target_dir = recorded_target_dir(cfg, ctx, data["outputs"]["target_dir"])
    dataset_dir = Path(data["outputs"]["dataset_dir"])
    aux_layer_ids = data["aux_layer_ids"]
    online = _online_features(cfg, target_dir, aux_layer_ids) if cfg.data.hidden_states == "online" else None
    ctx.mlflow.log_params({"aux_layer_ids": json.dumps(aux_layer_ids), "draft_vocab_size": cfg.data.draft_vocab_size})
    _log_training_data(cfg, ctx, data)
    progress = ctx.progress()
    # On a shared CPU, one thread per idle core: oversubscribed torch threads run 5-30x slower.
    with contextlib.nullcontext() if _cuda() or cfg.train.nodes else cpu_threads(log=logger().info):
        summary = _train(cfg, ctx, dataset_dir, target_dir, aux_layer_ids, online, progress)
    if summary.get("curves_png"):
        ctx.mlflow.log_artifact(summary["curves_png"], "plots")
    ctx.mlflow.log_dict(summary, "train/summary.json")
    metrics = {"simulated_accept_length": summary.get("simulated_accept_length"), "tokens_per_s": summary.get("tokens_per_s"),
               "steps": summary.get("steps")}
    metrics.update({f"acc_{i}": a for i, a in enumerate(summary.get("acc", [])) if a is not None})
    metrics.update(_stream_metrics(summary.get("stream")))
    logger().info(f"train_draft: simulated accept length {summary.get('simulated_accept_length')} "
                  f"({summary.get('metrics_split')} split), acc_k {summary.get('acc')}")
    return {
        **summary,
        "training_record": training_record(data, target_dir),
        "metrics": {k: v for k, v in metrics.items() if v is not None},
        "outputs": {"checkpoint": summary["checkpoint"], "target_dir": str(target_dir), "train_dir": str(ctx.stage_dir / "draft")},
        # the checkpoint's bytes and the dataset's digest (which names the target by content, not by path)
        "output_digest": digest_json([digest_paths([summary["checkpoint"]]), ctx.upstream_digests.get("generate_data")]),
    }
