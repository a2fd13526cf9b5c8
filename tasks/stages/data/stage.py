"""generate_data: target -> regenerated answers -> loss-masked samples -> draft vocab -> hidden states.

A thin wrapper over `eagle3.data.generate.generate_dataset` (or, with `data.host`, the same run on the
data host: `tasks.stages.data.host`). The tiny target is built here (`tasks.stages.target`), so the
whole CPU default needs nothing from a hub. Everything the data depends on is logged to the stage's
MLflow run: the aux layer ids in SGLang's convention *and* as HF indices, the chat-template hash,
regeneration settings (no secrets) and the draft vocab map. With `data.regenerate.deploy`, the stage
starts its own regeneration servers only when prompts are left to answer (`tasks.stages.data.regeneration`).
With `data.source: served` the samples come from SGLang request dumps where the stage runs; the run records
the window, the exclusions by reason and the sampling settings the answers were served with.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from eagle3.data.generate import generate_dataset
from eagle3.data.samples import SAMPLES_META
from eagle3.data.served_source import served_metrics
from tasks.config.schema import ExperimentConfig
from tasks.log import logger
from tasks.rundir import digest_paths
from tasks.runner.context import StageContext
from tasks.runner.flow_errors import redacted_failures
from tasks.stages.data.host import generate_on_host, split_counts
from tasks.stages.data.regeneration import regeneration_servers
from tasks.stages.data.served import local_workdir, record_night, with_cache_folder
from tasks.stages.target import resolve_target_dir


@task(name="generate_data", cache_policy=NO_CACHE)
@redacted_failures  # its exception reaches the task run's Prefect state message masked
def generate_data(cfg: ExperimentConfig, ctx: StageContext) -> dict:
    if cfg.data.host != "local":  # where the target is: the hidden states are written and stay there
        result = generate_on_host(cfg, ctx)
        return result | record_night(ctx, result)
    target_dir = resolve_target_dir(cfg, ctx)
    dataset_dir = ctx.stage_dir / "dataset"
    data = with_cache_folder(cfg.data, local_workdir(cfg))  # data.source served: the capture cache of every night
    summary = generate_dataset(target_dir, cfg.target, data, dataset_dir, on_progress=ctx.progress(),
                               log=logger().info, open_endpoints=lambda: regeneration_servers(cfg, ctx, target_dir))
    _log_to_mlflow(ctx, target_dir, summary)
    metrics = {
        key: summary[key]
        for key in ("loss_mask_fraction", "hidden_states_bytes", "bytes_written", "num_dropped", "num_failed")
        if isinstance(summary.get(key), (int, float))
    } | split_counts(summary)
    vocab = summary.get("vocab", {})
    if isinstance(vocab.get("coverage"), (int, float)):
        metrics["draft_vocab_coverage"] = vocab["coverage"]
    metrics |= served_metrics(summary)
    return {
        **summary,
        "metrics": metrics,
        "outputs": {"target_dir": str(target_dir), "dataset_dir": str(dataset_dir), **{k: v for k, v in summary["paths"].items() if v}},
        "output_digest": dataset_digest(target_dir, summary),
        **record_night(ctx, summary),
    }


def dataset_digest(target_dir: Path, summary: dict) -> str:
    """Content digest of what training consumes: samples, vocab map, the hidden-state shards'
    manifest (it holds each shard's sha256, so terabytes are not re-read) and the target's identity:
    its config.json and the samples' meta, whose fingerprint names the target by its config, weight
    and tokenizer files -- never by where it lies, so a moved run folder or runs root keeps the digest."""
    paths = summary["paths"]
    hashed = [paths["samples"], Path(paths["samples"]).with_name(SAMPLES_META), target_dir / "config.json"]
    if paths.get("vocab"):  # none on a served night with no new traffic
        hashed.append(paths["vocab"])
    if paths.get("hidden_states"):
        hashed.append(Path(paths["hidden_states"]) / "manifest.json")
    return digest_paths(hashed)


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
        **_served_params(summary),
    })
    run.log_dict(summary, "data/summary.json")  # with data.source: served, its full figures (summary["served"])
    vocab_dir = summary["paths"].get("vocab")  # none on a served night with no new traffic
    if vocab_dir and Path(vocab_dir).is_dir():
        run.log_artifact(vocab_dir, "vocab")
    eval_file = target_dir / "eval.json"
    if eval_file.is_file():
        run.log_artifact(eval_file, "target")


def _served_params(summary: dict) -> dict:
    """The source and, for served dumps, the window actually used and the sampling settings served with."""
    served = summary.get("served")
    if not served:
        return {"source": summary.get("source", "prompts")}
    cache = served.get("cache") or {}
    return {"source": "served", "served.dumps": served["dumps"], "served.since": str(served["window"]["since"]),
            "served.until": str(served["window"]["until"]),
            **{f"served.{k}": cache[k] for k in ("dir", "replay_fraction", "replay_seed", "min_new_samples")
               if k in cache},
            "served.sampling_params": json.dumps(served["sampling_params"])[:6000]}  # MLflow's param length limit

