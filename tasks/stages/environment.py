"""check_environment: the first stage, over eagle3.environment's pure checks.

A `fail` stops the flow here, before any expensive stage. The report goes to the stage
folder (environment.json), to MLflow (JSON artifact + env.* params) and to Prefect (a
markdown table artifact on the flow run).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from eagle3.environment import (
    Check,
    Needs,
    evaluate,
    gather_facts,
    hidden_state_bytes,
    overall_status,
)
from tasks.config.schema import ExperimentConfig
from tasks.config.secrets import redact
from tasks.log import logger
from tasks.runner.context import StageContext
from tasks.runner.flow_errors import redacted_failures


class EnvironmentCheckFailed(RuntimeError):
    pass


def needs_for(cfg: ExperimentConfig) -> Needs:
    """What the experiment asks of this machine: only what runs here (the data stage on data.host,
    training on train.nodes and the servers on deploy.host ask their own hosts, checked there)."""
    data_here, train_here = cfg.data.host == "local", not cfg.train.nodes
    # Training here asks for a GPU only for bf16: devices > 1 on a CPU is torchrun with gloo.
    gpu = (train_here and cfg.train.precision == "bf16") or (data_here and cfg.target.kind == "hf")
    return Needs(
        gpu=gpu,
        flash_attn=gpu,
        sglang=(cfg.deploy.server == "sglang" and cfg.deploy.host == "local")
        or (data_here and cfg.target.engine == "sglang"),
        disk_bytes=data_stage_bytes(cfg) if data_here else 0,
    )


def data_stage_bytes(cfg: ExperimentConfig) -> int:
    """Upper bound of the hidden states the data host keeps: tokens x (aux layers + last) x hidden in the dump's
    dtype (`data.hidden_states_dtype`, fp8 scales included) -- every sample offline; streamed, the validation
    split plus the stream's budget."""
    data = cfg.data
    if data.hidden_states == "online":
        return 0
    samples = data.num_samples if data.hidden_states == "offline" else math.ceil(data.num_samples * data.validation_fraction)
    hidden = _target_hidden_size(cfg)
    num_aux = len(set(cfg.target.aux_layer_ids)) if cfg.target.aux_layer_ids else 3
    stored = hidden_state_bytes(samples * data.max_length, hidden, num_aux, dtype=data.hidden_states_dtype)
    return stored + (int(data.stream.disk_budget_gb * 1e9) if data.hidden_states == "stream" else 0)


def _target_hidden_size(cfg: ExperimentConfig) -> int:
    if cfg.target.kind == "tiny":
        return cfg.target.tiny.hidden_size
    if cfg.target.shape:
        return cfg.target.shape.hidden_size
    config_file = Path(cfg.target.model_path or "", "config.json")
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        return int(config.get("hidden_size") or config.get("text_config", {}).get("hidden_size", 0))
    raise ValueError("target.shape is required: target.model_path/config.json is not readable here")


def markdown_report(checks: list[Check]) -> str:
    icon = {"ok": "ok", "warn": "WARN", "fail": "FAIL"}
    rows = [f"| {c.name} | {icon[c.status]} | {c.reason.replace('|', '/')} |" for c in checks]
    return "\n".join([f"### Environment: {overall_status(checks)}", "", "| check | status | reason |", "|---|---|---|", *rows])


@task(name="check_environment", cache_policy=NO_CACHE)
@redacted_failures  # its exception reaches the task run's Prefect state message masked
def check_environment(cfg: ExperimentConfig, ctx: StageContext) -> dict:
    facts = gather_facts(cfg.runs_root)
    checks = evaluate(facts, needs_for(cfg))
    status = overall_status(checks)
    report = {"status": status, "facts": asdict(facts), "checks": [asdict(c) for c in checks]}
    path = ctx.write_json("environment.json", report)
    for check in checks:
        log = logger().error if check.status == "fail" else logger().warning if check.status == "warn" else logger().info
        log(f"{check.name}: {check.status}: {check.reason}")
    ctx.mlflow.log_dict(report, "environment/report.json")
    ctx.mlflow.log_params({f"env.{c.name}": f"{c.status}: {c.reason}" for c in checks} | {"env.hostname": facts.hostname})
    create_markdown_artifact(redact(markdown_report(checks)), key="environment-report",
                             description="eagleops environment checks")
    failed = [c for c in checks if c.status == "fail"]
    if failed:
        raise EnvironmentCheckFailed("; ".join(f"{c.name}: {c.reason}" for c in failed))
    return {
        "status": status,
        "outputs": {"report": str(path)},
        "metrics": {"env_warnings": sum(c.status == "warn" for c in checks), "gpus": len(facts.gpus)},
    }
