"""The champion gate of the nightly retrain: champion and challenger measured alike, then a decision.

Both drafts are served in turn on the deploy host -- one server at a time, champion first --
with the same speculative setting (`deploy.speculative`), the same held-out prompts and the
same warm-up and timed runs (`bench.*`), through the deploy and benchmark stages' own
functions (`tasks.deploy.prepare_and_launch`, `tasks.bench.bench_one`), so the two rows differ
only by the draft. `decide` turns the rows into promote/refuse against `nightly.*` with a reason
that names the figures and the field that decided. The measurement is an MLflow child run
(`nightly_gate`) of the experiment's parent run; its id is the version's benchmark lineage.

Risk: on a shared host the two servers can see different load. Greedy accept length does not
depend on load, tok/s does: a `nightly.min_tok_s_gain` below the run-to-run spread on that host
(about +-5% on the 2-core CPU box, tests/benchmarks/NOTES_spec_decode.md) decides by noise.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from tasks.bench import bench_one, bench_prompts, request_inputs
from tasks.config import ExperimentConfig, NightlyConfig, is_sweep
from tasks.deploy import (
    check_host_environment, host_config, open_executor, place, prepare_and_launch, stop, target_config_on_host,
    teardown_run,
)
from tasks.mlflow_journal import journal_path
from tasks.pipeline import StageContext, logger
from tasks.registry import DOWNLOAD_MARKER, GATE_TAG, lineage_tags, recorded_decision
from tasks.rundir import RunDirectory, write_json_atomic
from tasks.tracking import RunLogger, start_child_run

GATE_STAGE = "nightly_gate"


# ------------------------------------------------------------------ the training config


def training_config(cfg: ExperimentConfig, config_path: str, champion: dict | None,
                    run_dir: str | None) -> tuple[str, int | None]:
    """The config file (and sweep variant) the experiment flow runs: `config_path`, or an overlay of it
    that sets train.init_checkpoint to the downloaded champion (nightly.start_from: champion).

    The overlay is a one-variant sweep file whose base is `config_path`, so the loader validates
    it, expands its ${ENV} references and reports errors at the base file's lines. A resumed
    nightly (`run_dir`) keeps the overlay it started with, so training resumes on the same weights.
    """
    if run_dir is not None:
        started_with = RunDirectory.open(run_dir).manifest.get("config_path")
        if started_with and _is_overlay_of(Path(started_with), config_path):
            return started_with, 0
    if cfg.nightly.start_from != "champion" or champion is None:
        return config_path, None
    folder = Path(cfg.runs_root).resolve() / "nightly" / cfg.experiment
    folder.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-%f")
    overlay = folder / f"train-{stamp}.yaml"
    sweep = {"sweep": {"base": str(Path(config_path).resolve()), "name": "nightly",
                       "grid": [{"train.init_checkpoint": champion["dir"]}]}}
    overlay.write_text(json.dumps(sweep, indent=2) + "\n")  # JSON is YAML: the loader reads it as is
    logger().info(f"nightly: training starts from champion {champion['uri']} ({overlay})")
    return str(overlay), 0


def _is_overlay_of(path: Path, config_path: str) -> bool:
    if not path.is_file() or path.parent.parent.name != "nightly" or not is_sweep(path):
        return False
    base = json.loads(path.read_text())["sweep"]["base"]
    return Path(base).resolve() == Path(config_path).resolve()


# ------------------------------------------------------------------ the decision


def decide(nightly: NightlyConfig, challenger: list[dict], champion: list[dict] | None) -> dict[str, Any]:
    """Promote or refuse, from bench rows (one per concurrency level) of the challenger and the champion.

    Every level must pass: the accept-length floor, and against a champion the tok/s gain
    (`nightly.min_tok_s_gain`, relative) and the accept-length drop (`nightly.accept_length_tolerance`).
    Returns {promote, reason, comparisons}; reason starts with "promoted:" or "refused:".
    """
    problems = [_below_floor(nightly, row) for row in challenger]
    problems = [p for p in problems if p]
    comparisons = [] if champion is None else [_compare(nightly, row, champion) for row in challenger]
    problems += [p for c in comparisons for p in c.pop("problems")]
    if problems:
        return {"promote": False, "reason": "refused: " + "; ".join(problems), "comparisons": comparisons}
    if champion is None:
        shown = ", ".join(f"accept length {_num(r['accept_length'])}, {_num(r['tok_s_median'], 1)} tok/s at "
                          f"concurrency {r['concurrency']}" for r in challenger)
        return {"promote": True, "reason": f"promoted: first champion (there was none); {shown}", "comparisons": []}
    shown = "; ".join(f"tok/s {_num(c['tok_s'], 1)} vs {_num(c['champion_tok_s'], 1)} ({c['tok_s_gain']:+.1%}), accept "
                      f"length {_num(c['accept_length'])} vs {_num(c['champion_accept_length'])} at concurrency "
                      f"{c['concurrency']}" for c in comparisons)
    return {"promote": True, "reason": f"promoted: {shown}", "comparisons": comparisons}


def _below_floor(nightly: NightlyConfig, row: dict) -> str | None:
    accept = row.get("accept_length")
    if accept is not None and accept >= nightly.min_accept_length:
        return None
    return (f"accept length {_num(accept)} below nightly.min_accept_length {nightly.min_accept_length} "
            f"at concurrency {row['concurrency']}")


def _compare(nightly: NightlyConfig, row: dict, champion: list[dict]) -> dict[str, Any]:
    """One concurrency level: the figures side by side and what fails the margins."""
    level = row["concurrency"]
    old = next((r for r in champion if r["concurrency"] == level), None)
    if old is None or not old.get("tok_s_median") or old.get("accept_length") is None:
        return {"concurrency": level, "problems": [f"the champion has no tok/s or accept length at concurrency {level}"]}
    new_tok_s, new_accept = row.get("tok_s_median") or 0.0, row.get("accept_length") or 0.0
    gain = new_tok_s / old["tok_s_median"] - 1
    drop = 1 - new_accept / old["accept_length"] if old["accept_length"] else 0.0
    problems = []
    if gain < nightly.min_tok_s_gain:
        problems.append(f"tok/s {new_tok_s:.1f} vs champion {old['tok_s_median']:.1f} ({gain:+.1%}; "
                        f"nightly.min_tok_s_gain {nightly.min_tok_s_gain:+.1%}) at concurrency {level}")
    if drop > nightly.accept_length_tolerance:
        problems.append(f"accept length {new_accept:.2f} vs champion {old['accept_length']:.2f} ({-drop:+.1%}; "
                        f"nightly.accept_length_tolerance {nightly.accept_length_tolerance:.1%}) at concurrency {level}")
    return {"concurrency": level, "tok_s": new_tok_s, "champion_tok_s": old["tok_s_median"], "tok_s_gain": gain,
            "accept_length": new_accept, "champion_accept_length": old["accept_length"], "accept_length_drop": drop,
            "problems": problems}


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# ------------------------------------------------------------------ the measurement


def open_gate(cfg: ExperimentConfig, experiment: dict[str, Any], flow_run_id: str) -> StageContext:
    """The gate's folder and MLflow child run in the experiment's run; the nightly flow run is recorded in
    the manifest, so its failure hooks find the servers it started (`teardown_for_flow_run`)."""
    run = RunDirectory.open(experiment["run_dir"])
    run.update(prefect_flow_run_ids=run.manifest.get("prefect_flow_run_ids", []) + [flow_run_id])
    tracking_uri = run.manifest["mlflow"]["tracking_uri"]
    parent = RunLogger(tracking_uri, experiment["mlflow_run_id"], journal_path(run.path))
    child = start_child_run(parent, GATE_STAGE, {"prefect.flow_run_id": flow_run_id})
    stage_dir = run.path / GATE_STAGE
    stage_dir.mkdir(exist_ok=True)
    return StageContext(GATE_STAGE, stage_dir, run.path, tracking_uri, child.run_id, dict(experiment["results"]))


def measure_drafts(cfg: ExperimentConfig, ctx: StageContext, drafts: dict[str, str]) -> dict[str, list[dict]]:
    """Serve each draft in turn (dict order) with deploy.speculative and bench it: {label: rows}.

    Same host, prompts (held out from this run's training samples), warm-up and timed runs for all.
    """
    exported = ctx.upstream["export_checkpoint"]["outputs"]
    target_dir = Path(exported["target_dir"])
    samples = ctx.upstream.get("generate_data", {}).get("outputs", {}).get("samples")
    conversations = bench_prompts(cfg, Path(samples) if samples else None)
    endpoint, prompts = request_inputs(cfg, conversations, target_dir if target_dir.is_dir() else None)
    executor = open_executor(cfg)
    host = host_config(cfg)
    workdir = executor.expand_path(host.workdir) if host else str(ctx.run_dir / "deploy_server")
    check_host_environment(cfg, executor, workdir, Path(next(iter(drafts.values()))))
    local_target = target_dir if cfg.target.kind == "tiny" or cfg.deploy.host == "local" else None
    model_path = cfg.deploy.model_path or (str(target_dir) if local_target else cfg.target.model_path)
    target_config = target_config_on_host(cfg, executor, model_path, local_target)
    rows: dict[str, list[dict]] = {}
    try:
        for label, draft_dir in drafts.items():
            placement = place(cfg, executor, ctx, Path(draft_dir), target_dir)
            handle = prepare_and_launch(cfg, ctx, cfg.deploy.speculative, label, placement, target_config, Path(draft_dir))
            try:
                rows[label] = [{k: v for k, v in r.items() if k != "output_ids"}
                               for r in bench_one(cfg, ctx, handle, endpoint, prompts)]
            finally:
                stop(ctx.run_dir, handle)
    finally:
        teardown_run(ctx.run_dir, cfg)  # a server whose stop failed half-way
    return rows


@task(name="champion_gate", cache_policy=NO_CACHE)
def champion_gate(cfg: ExperimentConfig, experiment: dict[str, Any], champion: dict | None, challenger: str,
                  flow_run_id: str) -> dict[str, Any]:
    """Measure champion and challenger, decide; {promote, reason, comparisons, rows, lineage, bench_run_id}.

    A challenger version that carries a decision already (a resumed nightly) is not measured again:
    its recorded decision is returned, for promote_or_keep to re-apply idempotently.
    """
    recorded = recorded_decision(cfg, challenger)
    if recorded is not None:
        reason = recorded[GATE_TAG]
        logger().info(f"version {challenger} was decided before ({reason}); not measured again")
        return {"promote": reason.startswith("promoted"), "reason": reason, "comparisons": [], "rows": {},
                "lineage": {}, "bench_run_id": recorded.get("eagleops.benchmark_run_id", ""), "labels": {}}
    ctx = open_gate(cfg, experiment, flow_run_id)
    labels = {"challenger": f"challenger v{challenger}"}
    drafts = {}
    if champion is not None:
        labels["champion"] = f"champion v{champion['version']}"
        drafts[labels["champion"]] = champion["dir"]
    drafts[labels["challenger"]] = experiment["results"]["export_checkpoint"]["outputs"]["sglang_dir"]
    try:
        rows = measure_drafts(cfg, ctx, drafts)
    except BaseException:
        ctx.mlflow.finish("FAILED")
        raise
    decision = decide(cfg.nightly, rows[labels["challenger"]], rows.get(labels.get("champion", "")))
    lineage = lineage_tags(cfg, ctx.run_dir, ctx.mlflow_run_id, _init_from(ctx.run_dir))
    gate = {**decision, "rows": rows, "labels": labels, "lineage": lineage, "bench_run_id": ctx.mlflow_run_id}
    _log_gate(ctx, gate)
    return gate


def _init_from(run_dir: Path) -> str:
    """Where training started, from the train attempt's recorded inputs: "scratch" or the champion's models:/ URI."""
    entry = RunDirectory.open(run_dir).stage("train_draft")
    attempt = next((a for a in entry.get("attempts", []) if a["attempt"] == entry.get("current_attempt")), {})
    start = attempt.get("inputs", {}).get("config", {}).get("train.init_checkpoint")
    if not start or start == "None":
        return "scratch"
    marker = Path(start) / DOWNLOAD_MARKER
    return marker.read_text().strip() if marker.is_file() else start


def _log_gate(ctx: StageContext, gate: dict[str, Any]) -> None:
    """The gate's figures and decision in its MLflow child run and the run folder."""
    metrics = {}
    for role, label in gate["labels"].items():
        for row in gate["rows"].get(label, []):
            for key in ("tok_s_median", "accept_length"):
                if isinstance(row.get(key), (int, float)):
                    metrics[f"{role}.c{row['concurrency']}.{key}"] = row[key]
    ctx.mlflow.log_metrics(metrics)
    ctx.mlflow.set_tags({GATE_TAG: gate["reason"][:5000],
                         "eagleops.gate.decision": "promoted" if gate["promote"] else "refused"})
    ctx.mlflow.log_dict({k: gate[k] for k in ("promote", "reason", "comparisons", "rows", "labels")}, "gate/gate.json")
    ctx.write_json("gate.json", {k: v for k, v in gate.items()})
    ctx.mlflow.finish("FINISHED")


# ------------------------------------------------------------------ the report


def report_gate(cfg: ExperimentConfig, experiment: dict[str, Any], gate: dict[str, Any], outcome: dict[str, Any]) -> str:
    """The decision and the side-by-side figures as a Prefect markdown artifact (and in the manifest)."""
    markdown = gate_markdown(gate, outcome)
    write_json_atomic(Path(experiment["run_dir"]) / GATE_STAGE / "outcome.json", outcome)
    RunDirectory.open(experiment["run_dir"]).update(nightly={**outcome, "bench_run_id": gate["bench_run_id"]})
    key = "".join(c if c.isalnum() else "-" for c in cfg.experiment.lower()) + "-nightly-gate"
    create_markdown_artifact(markdown, key=key, description=f"eagleops nightly gate: {outcome['reason'][:200]}")
    return markdown


def gate_markdown(gate: dict[str, Any], outcome: dict[str, Any]) -> str:
    verdict = "**promoted**" if outcome["promoted"] else "**refused** (champion kept)"
    lines = [f"# Nightly gate: {outcome['model']} version {outcome['challenger']} {verdict}", "",
             f"{outcome['reason']}", "", f"Aliases after the gate: {outcome['aliases']}", "",
             "| draft | concurrency | tok/s (median) | accept length |", "|---|---:|---:|---:|"]
    for label, rows in gate["rows"].items():
        for row in rows:
            lines.append(f"| {label} | {row['concurrency']} | {_num(row.get('tok_s_median'), 1)} | "
                         f"{_num(row.get('accept_length'))} |")
    lines += ["", "Lineage: " + ", ".join(f"`{k}`={v}" for k, v in gate["lineage"].items())]
    return "\n".join(lines) + "\n"
