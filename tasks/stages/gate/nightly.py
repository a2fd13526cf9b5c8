"""The champion gate of the nightly retrain: champion and challenger measured alike, then a decision.

Both drafts are served on the deploy host `nightly.rounds` times each, interleaved (champion,
challenger, challenger, champion, ...: a drift in the host's speed weighs on both alike), one
server at a time, each launch anew, with the same speculative setting (`deploy.speculative`),
the same held-out prompts and the same warm-up and timed runs (`bench.*`), through the deploy
and benchmark stages' own functions (`tasks.stages.deploy.check_setting` and `launch`,
`tasks.stages.bench.stage.bench_one`), so the rows differ only by the draft. Each round's median tok/s is one
sample; `decide` promotes only on the lower confidence bound of the gain (`tasks.stages.gate.noise`,
`nightly.confidence`), never on a difference of medians, and only when the challenger is better
beyond noise at something: a challenger that accepts exactly what the champion accepts (same
draft config, same accept length and acceptance by position at every level) is the same draft
and never replaces it. The reason names the figures and the field that decided; the samples,
bounds and weight digests go to the registry version's tags (`eagleops.gate.evidence`). The
measurement is an MLflow child run (`nightly_gate`) of the experiment's parent run; its id is
the version's benchmark lineage.

Risk: on a shared host the servers see different load over time. Greedy accept length does
not depend on load, tok/s does: measured here, two identical drafts back to back differed by
0.7% with a +-3% spread within one benchmark; the bound widens with that spread, so a margin
below it refuses rather than decides by noise (more rounds narrow it).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from tasks.config.load import is_sweep
from tasks.config.schema import ExperimentConfig, NightlyConfig
from tasks.config.secrets import redact
from tasks.hosts.servers import host_config, launch, open_executor, stop
from tasks.hosts.teardown import teardown_run
from tasks.log import logger
from tasks.rundir import RunDirectory, write_json_atomic
from tasks.runner.context import StageContext
from tasks.runner.flow_errors import redacted_failures
from tasks.runner.gpu_hours import attempt_gpu_hours
from tasks.runner.host_slots import holding_gpu_hosts
from tasks.stages.bench.stage import bench_one, bench_prompts, request_inputs
from tasks.stages.deploy import (
    check_host_environment,
    check_setting,
    place,
    served_model_planned,
)
from tasks.stages.gate.gpu_report import GATE_STAGE, record_night_gpu_hours
from tasks.stages.gate.noise import relative_gain
from tasks.stages.target import recorded_target_dir
from tasks.tracking.journal import journal_path
from tasks.tracking.outage import is_offline, is_outage, short_reason
from tasks.tracking.registry import (
    DOWNLOAD_MARKER,
    GATE_TAG,
    lineage_tags,
    recorded_decision,
)
from tasks.tracking.run_logger import RunLogger, start_child_run
from tasks.tracking.views import tracking_uri_for
from tasks.watch.events import emit_champion_decision



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


def decide(nightly: NightlyConfig, challenger: list[dict], champion: list[dict] | None,
           same_draft_config: bool = False) -> dict[str, Any]:
    """Promote or refuse, from pooled bench rows (one per concurrency level, `pooled_rows`) of both drafts.

    Every level must pass the accept-length floor and, against a champion, the tok/s margin by its
    lower confidence bound (`nightly.min_tok_s_gain`, `nightly.confidence`) and the accept-length
    drop (`nightly.accept_length_tolerance`); and at some level the challenger must be better beyond
    noise (tok/s or accept length, lower bound above 0). A challenger with the champion's draft
    config that accepts exactly what it accepts is the same draft: refused whatever tok/s says.
    Returns {promote, reason, comparisons}; reason starts with "promoted:" or "refused:".
    """
    problems = [_below_floor(nightly, row) for row in challenger]
    problems = [p for p in problems if p]
    comparisons = [] if champion is None else [_compare(nightly, row, champion) for row in challenger]
    problems += [p for c in comparisons for p in c.pop("problems")]
    if champion is not None and not problems:
        problems += _no_difference(comparisons, same_draft_config)
    if problems:
        return {"promote": False, "reason": "refused: " + "; ".join(problems), "comparisons": comparisons}
    if champion is None:
        shown = ", ".join(f"accept length {_num(r['accept_length'])}, {_num(r['tok_s_median'], 1)} tok/s at "
                          f"concurrency {r['concurrency']}" for r in challenger)
        return {"promote": True, "reason": f"promoted: first champion (there was none); {shown}", "comparisons": []}
    shown = "; ".join(f"tok/s {_num(c['tok_s'], 1)} vs {_num(c['champion_tok_s'], 1)} ({_gain_shown(c, nightly)}), "
                      f"accept length {_num(c['accept_length'])} vs {_num(c['champion_accept_length'])} at "
                      f"concurrency {c['concurrency']}" for c in comparisons)
    return {"promote": True, "reason": f"promoted: {shown}", "comparisons": comparisons}


def _below_floor(nightly: NightlyConfig, row: dict) -> str | None:
    accept = row.get("accept_length")
    if accept is not None and accept >= nightly.min_accept_length:
        return None
    return (f"accept length {_num(accept)} below nightly.min_accept_length {nightly.min_accept_length} "
            f"at concurrency {row['concurrency']}")


def _compare(nightly: NightlyConfig, row: dict, champion: list[dict]) -> dict[str, Any]:
    """One concurrency level: the figures side by side, the gains with their bounds, what fails the margins."""
    level = row["concurrency"]
    old = next((r for r in champion if r["concurrency"] == level), None)
    if old is None or not old.get("tok_s_median") or old.get("accept_length") is None:
        return {"concurrency": level, "problems": [f"the champion has no tok/s or accept length at concurrency {level}"]}
    tok_s = relative_gain(_samples(row, "tok_s"), _samples(old, "tok_s"), nightly.confidence)
    accept = relative_gain(_samples(row, "accept_length"), _samples(old, "accept_length"), nightly.confidence)
    compared = {"concurrency": level, "tok_s": row.get("tok_s_median"), "champion_tok_s": old["tok_s_median"],
                "tok_s_gain": tok_s["gain"], "tok_s_gain_low": tok_s["low"], "tok_s_gain_high": tok_s["high"],
                "tok_s_samples": _samples(row, "tok_s"), "champion_tok_s_samples": _samples(old, "tok_s"),
                "accept_length": row.get("accept_length"), "champion_accept_length": old["accept_length"],
                "accept_length_gain": accept["gain"], "accept_length_gain_low": accept["low"],
                "accept_length_drop": -accept["gain"], "confidence": nightly.confidence,
                "same_acceptance": _same_acceptance(row, old)}
    compared["better"] = [what for what, low in (("tok/s", tok_s["low"]), ("accept length", accept["low"]))
                          if low is not None and low > 1e-9]
    compared["problems"] = _margin_problems(nightly, compared)
    return compared


def _margin_problems(nightly: NightlyConfig, c: dict[str, Any]) -> list[str]:
    level, problems = c["concurrency"], []
    if c["tok_s_gain_low"] is None:
        problems.append(f"tok/s spread unknown at concurrency {level} (fewer than two rounds measured)")
    elif c["tok_s_gain_low"] < nightly.min_tok_s_gain:
        problems.append(f"tok/s {_num(c['tok_s'], 1)} vs champion {_num(c['champion_tok_s'], 1)} "
                        f"({_gain_shown(c, nightly)}; nightly.min_tok_s_gain {nightly.min_tok_s_gain:+.1%} by the "
                        f"lower bound) at concurrency {level}")
    if c["accept_length_drop"] > nightly.accept_length_tolerance:
        problems.append(f"accept length {_num(c['accept_length'])} vs champion {_num(c['champion_accept_length'])} "
                        f"({c['accept_length_gain']:+.1%}; nightly.accept_length_tolerance "
                        f"{nightly.accept_length_tolerance:.1%}) at concurrency {level}")
    return problems


def _no_difference(comparisons: list[dict], same_draft_config: bool) -> list[str]:
    """Why a challenger that passes every margin is still no reason to move the champion, if it is none."""
    if same_draft_config and comparisons and all(c["same_acceptance"] for c in comparisons):
        return [("the challenger accepts exactly what the champion accepts (same draft config, same accept length "
                 "and acceptance by position at every concurrency level): the same draft, so a tok/s difference "
                 "between them is noise")]
    if not any(c["better"] for c in comparisons):
        shown = "; ".join(f"tok/s {_gain_shown(c)} and accept length {c['accept_length_gain']:+.1%} at concurrency "
                          f"{c['concurrency']}" for c in comparisons)
        return [f"no measured improvement over the champion beyond noise: {shown}"]
    return []


def _samples(row: dict, figure: str) -> list[float]:
    """A pooled row's per-round samples of `tok_s` or `accept_length` (a plain row: its one figure)."""
    samples = row.get(f"{figure}_samples")
    if samples:
        return [float(v) for v in samples]
    value = row.get("tok_s_median" if figure == "tok_s" else figure)
    return [] if value is None else [float(value)]


def _same_acceptance(row: dict, old: dict) -> bool:
    """Every round of both drafts accepted the same (accept length and by draft position, to 1e-9)."""
    accepts = _samples(row, "accept_length") + _samples(old, "accept_length")
    by_position = [row.get("accepted_by_position") or [], old.get("accepted_by_position") or []]
    return bool(accepts) and max(accepts) - min(accepts) <= 1e-9 * max(accepts) and \
        len(by_position[0]) == len(by_position[1]) and all(abs(a - b) <= 1e-9 for a, b in zip(*by_position))


def _gain_shown(c: dict[str, Any], nightly: NightlyConfig | None = None) -> str:
    if c.get("tok_s_gain_low") is None:
        return f"{c['tok_s_gain']:+.1%}, spread unknown"
    level = f"{c['confidence']:.0%} " if nightly is None else f"{nightly.confidence:.0%} "
    return f"{c['tok_s_gain']:+.1%}, {level}bounds {c['tok_s_gain_low']:+.1%} .. {c['tok_s_gain_high']:+.1%}"


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


def interleaved_order(labels: list[str], rounds: int) -> list[str]:
    """Each label `rounds` times, alternating pairs ABBA ABBA...: a linear drift in the host's speed
    weighs on both drafts alike. One label (no champion): it alone, once (only its floor is decided)."""
    if len(labels) == 1:
        return list(labels)
    first, second = labels
    return [label for r in range(rounds) for label in ((first, second) if r % 2 == 0 else (second, first))]


def measure_drafts(cfg: ExperimentConfig, ctx: StageContext, drafts: dict[str, str],
                   rounds: int | None = None) -> dict[str, list[list[dict]]]:
    """Serve the drafts in `interleaved_order` with deploy.speculative, each round a new server, and bench
    each round: {label: [round 1 rows, round 2 rows, ...]} (rows: one per bench.concurrency level).

    Same host, prompts (held out from this run's training samples), warm-up and timed runs for all.
    Each draft is uploaded and checked once (preflight against the served model, SGLang's dry run).
    """
    exported = ctx.upstream["export_checkpoint"]["outputs"]
    target_dir = recorded_target_dir(cfg, ctx, exported["target_dir"])
    samples = ctx.upstream.get("generate_data", {}).get("outputs", {}).get("samples")
    tokenizer_dir = target_dir if target_dir.is_dir() else None
    conversations = bench_prompts(cfg, Path(samples) if samples else None, tokenizer_dir)  # held out: text and ids
    endpoint, prompts = request_inputs(cfg, conversations, tokenizer_dir)
    executor = open_executor(cfg, ctx.run_dir)  # closed by the teardown below, with the run's servers
    host = host_config(cfg)
    workdir = executor.expand_path(host.workdir) if host else str(ctx.run_dir / "deploy_server")
    check_host_environment(cfg, executor, workdir, Path(next(iter(drafts.values()))))
    measured: dict[str, list[list[dict]]] = {label: [] for label in drafts}
    try:
        ready = {label: _placed_and_checked(cfg, ctx, executor, label, Path(draft), target_dir)
                 for label, draft in drafts.items()}
        for label in interleaved_order(list(drafts), rounds or cfg.nightly.rounds):
            placement, predicted = ready[label]
            handle = launch(cfg, placement, ctx.run_dir, label=label, spec=cfg.deploy.speculative, predicted=predicted)
            try:
                measured[label].append([{k: v for k, v in r.items() if k != "output_ids"}
                                        for r in bench_one(cfg, ctx, handle, endpoint, prompts)])
            finally:
                stop(ctx.run_dir, handle)
    finally:
        teardown_run(ctx.run_dir, cfg)  # a server whose stop failed half-way
    return measured


def _placed_and_checked(cfg: ExperimentConfig, ctx: StageContext, executor, label: str, draft_dir: Path,
                        target_dir: Path):
    """Upload one draft and check it against the model the host serves (read there); -> (placement, prediction)."""
    placement = place(cfg, executor, ctx, draft_dir, target_dir)
    served = served_model_planned(cfg, replace(placement, uploads={}))  # uploaded now: read what the host has
    return placement, check_setting(cfg, cfg.deploy.speculative, label, placement, served, draft_dir)


def pooled_rows(rounds: list[list[dict]]) -> list[dict]:
    """A draft's rounds as one row per concurrency level: each round's median tok/s and accept length are
    the samples (`tok_s_samples`, `accept_length_samples`); tok_s_median is the median round."""
    pooled = []
    for i, first in enumerate(rounds[0]):
        per_round = [round_rows[i] for round_rows in rounds]
        tok_s = [r["tok_s_median"] for r in per_round if r.get("tok_s_median")]
        accept = [r["accept_length"] for r in per_round if r.get("accept_length") is not None]
        pooled.append({"setting": first["setting"], "concurrency": first["concurrency"], "asked": first["asked"],
                       "effective": first["effective"], "settings_source": first.get("settings_source"),
                       "rounds": len(per_round), "tok_s_samples": tok_s,
                       "tok_s_median": statistics.median(tok_s) if tok_s else None,
                       "accept_length_samples": accept,
                       "accept_length": statistics.fmean(accept) if accept else None,
                       "accepted_by_position": first.get("accepted_by_position") or []})
    return pooled


def draft_identity(draft_dir: str | Path) -> dict[str, str]:
    """{config, weights}: sha256 of the draft's config.json (as JSON, key order aside) and model.safetensors."""
    folder = Path(draft_dir)
    config = json.dumps(json.loads((folder / "config.json").read_text()), sort_keys=True)
    digest = hashlib.sha256()
    with (folder / "model.safetensors").open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"config": hashlib.sha256(config.encode()).hexdigest(), "weights": digest.hexdigest()}


@task(name="champion_gate", cache_policy=NO_CACHE)
@redacted_failures  # its exception reaches the task run's Prefect state message masked
def champion_gate(cfg: ExperimentConfig, experiment: dict[str, Any], champion: dict | None, challenger: str,
                  flow_run_id: str) -> dict[str, Any]:
    """Measure champion and challenger interleaved, decide; {promote, reason, comparisons, rows, rounds, evidence,
    lineage, bench_run_id} (`lineage` carries the evidence tags too, for the registry version).

    A challenger version that carries a decision already (a resumed nightly) is not measured again:
    its recorded decision is returned, for promote_or_keep to re-apply idempotently.
    """
    recorded = _recorded_decision(cfg, experiment, challenger)
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
        with holding_gpu_hosts(cfg, GATE_STAGE, flow_run_id):  # it serves on deploy.host, as the deploy stage does
            start, started_at = time.monotonic(), time.time()
            rounds = measure_drafts(cfg, ctx, drafts)
    except BaseException:
        ctx.mlflow.finish("FAILED")
        raise
    gpu = attempt_gpu_hours(cfg, ctx.run_dir, GATE_STAGE, started_at, time.monotonic() - start)  # its servers
    rows = {label: pooled_rows(measured) for label, measured in rounds.items()}
    identity = {label: draft_identity(folder) for label, folder in drafts.items()}
    same_config = champion is not None and identity[labels["champion"]]["config"] == identity[labels["challenger"]]["config"]
    decision = decide(cfg.nightly, rows[labels["challenger"]], rows.get(labels.get("champion", "")), same_config)
    evidence = gate_evidence(cfg.nightly, labels, rounds, decision, identity)
    evidence["band"] = band_evidence(rows[labels["challenger"]])
    lineage = lineage_tags(cfg, ctx.run_dir, ctx.mlflow_run_id, _init_from(ctx.run_dir)) | evidence_tags(evidence)
    gate = {**decision, "rows": rows, "rounds": rounds, "labels": labels, "evidence": evidence, "lineage": lineage,
            "bench_run_id": ctx.mlflow_run_id, "gpu_hours": gpu["gpu_hours"], "gpu_hours_by_host": gpu["gpu_hours_by_host"],
            "gpus": gpu["gpus"]}
    _log_gate(ctx, gate)
    return gate


def _recorded_decision(cfg: ExperimentConfig, experiment: dict[str, Any], challenger: str) -> dict[str, str] | None:
    """The decision on `challenger` the registry holds; while the registry does not answer, the one this run
    folder recorded (a resumed nightly whose gate ran in the outage), else None: the gate measures."""
    uri = tracking_uri_for(cfg)
    if not is_offline(uri):
        try:
            return recorded_decision(cfg, challenger)
        except Exception as err:
            if not is_outage(err):
                raise
            logger().warning(f"the MLflow registry at {redact(uri)} does not answer ({short_reason(err)}): "
                             "the gate looks for an earlier decision on this challenger in the run folder")
    recorded = Path(experiment["run_dir"]) / GATE_STAGE / "gate.json"
    if not recorded.is_file():
        return None
    gate = json.loads(recorded.read_text())
    if gate.get("labels", {}).get("challenger") != f"challenger v{challenger}":
        return None
    return {GATE_TAG: gate["reason"], "eagleops.benchmark_run_id": gate.get("bench_run_id", "")}


def gate_evidence(nightly: NightlyConfig, labels: dict[str, str], rounds: dict[str, list], decision: dict,
                  identity: dict[str, dict[str, str]]) -> dict[str, Any]:
    """What the decision stood on: the measuring order, per level the samples and bounds, the drafts' digests."""
    levels = [{k: _rounded(c.get(k)) for k in ("concurrency", "tok_s_samples", "champion_tok_s_samples", "tok_s_gain",
                                               "tok_s_gain_low", "tok_s_gain_high", "accept_length",
                                               "champion_accept_length", "accept_length_gain", "same_acceptance",
                                               "better")}
              for c in decision["comparisons"]]
    weights = {role: identity[label]["weights"] for role, label in labels.items()}
    role_of = {label: role for role, label in labels.items()}
    return {"confidence": nightly.confidence, "rounds": {role: len(rounds[label]) for role, label in labels.items()},
            "order": [role_of[label] for label in interleaved_order(list(rounds), nightly.rounds)],
            "levels": levels, "weights_sha256": weights,
            "identical_weights": len(set(weights.values())) == 1 and len(weights) > 1}


def band_evidence(rows: list[dict]) -> dict[str, Any]:
    """What the production watch holds this draft to once it is champion (tasks/watch/rules.py, the band): per
    concurrency level each round's accept length, the acceptance by position and the settings it was served at."""
    return {"levels": [{"concurrency": row["concurrency"], "accept_length_samples": _rounded(row["accept_length_samples"]),
                        "accepted_by_position": _rounded(list(row.get("accepted_by_position") or [])),
                        "effective": row.get("effective") or {}} for row in rows]}


def evidence_tags(evidence: dict[str, Any]) -> dict[str, str]:
    """The evidence as registry version tags (each value within MLflow's 5000 characters)."""
    tags = {"eagleops.gate.confidence": str(evidence["confidence"]),
            "eagleops.gate.rounds": json.dumps(evidence["rounds"], sort_keys=True),
            "eagleops.gate.identical_weights": str(evidence["identical_weights"]).lower(),
            "eagleops.gate.evidence": json.dumps({k: evidence[k] for k in ("order", "levels")}, separators=(",", ":"))}
    tags.update({f"eagleops.gate.{role}_weights_sha256": digest for role, digest in evidence["weights_sha256"].items()})
    if "band" in evidence:
        tags["eagleops.gate.band"] = json.dumps(evidence["band"], separators=(",", ":"))[:5000]
    return tags


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


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
    for c in gate["comparisons"]:
        for key in ("tok_s_gain", "tok_s_gain_low", "tok_s_gain_high", "accept_length_gain"):
            if isinstance(c.get(key), float):
                metrics[f"gate.c{c['concurrency']}.{key}"] = c[key]
    metrics["gpu_hours"] = gate["gpu_hours"]
    metrics.update({f"gpu_hours.{host}": hours for host, hours in gate["gpu_hours_by_host"].items()})
    ctx.mlflow.log_metrics(metrics)
    if gate["gpus"]:
        ctx.mlflow.log_params({f"gpus.{host}": n for host, n in gate["gpus"].items()})
    ctx.mlflow.set_tags({GATE_TAG: gate["reason"][:5000],
                         "eagleops.gate.decision": "promoted" if gate["promote"] else "refused"})
    ctx.mlflow.log_dict({k: gate[k] for k in ("promote", "reason", "comparisons", "rows", "rounds", "labels",
                                              "evidence", "gpu_hours", "gpu_hours_by_host", "gpus")}, "gate/gate.json")
    ctx.write_json("gate.json", {k: v for k, v in gate.items()})
    ctx.mlflow.finish("FINISHED")


# ------------------------------------------------------------------ the report


def report_gate(cfg: ExperimentConfig, experiment: dict[str, Any], gate: dict[str, Any], outcome: dict[str, Any]) -> str:
    """The decision, the side-by-side figures and the night's GPU-hours against a full retrain's as a Prefect
    markdown artifact (and in the manifest; the GPU-hours on the MLflow parent run too)."""
    night = record_night_gpu_hours(cfg, experiment, gate)
    markdown = redact(gate_markdown(gate, outcome) + "\n" + night["line"] + "\n")
    write_json_atomic(Path(experiment["run_dir"]) / GATE_STAGE / "outcome.json", outcome)
    (Path(experiment["run_dir"]) / GATE_STAGE / "report.md").write_text(markdown)
    RunDirectory.open(experiment["run_dir"]).update(nightly={**outcome, "bench_run_id": gate["bench_run_id"]},
                                                    gpu_hours=night["block"])
    key = "".join(c if c.isalnum() else "-" for c in cfg.experiment.lower()) + "-nightly-gate"
    create_markdown_artifact(markdown, key=key, description=redact(f"eagleops nightly gate: {outcome['reason']}")[:200])
    emit_champion_decision(outcome["model"], outcome["challenger"], outcome.get("champion_before"),
                           outcome["promoted"], outcome["reason"], outcome.get("journaled"))
    return markdown


def _aliases_line(outcome: dict[str, Any]) -> str:
    if outcome.get("journaled"):
        return (f"Aliases not moved yet: the MLflow registry did not answer, so the decision is journaled in "
                f"`{outcome['journaled']}`; `eagleops sync` makes it (a promotion only if the champion is still "
                f"{outcome.get('champion_before') or 'unset'} then).")
    return f"Aliases after the gate: {outcome['aliases']}"


def gate_markdown(gate: dict[str, Any], outcome: dict[str, Any]) -> str:
    verdict = "**promoted**" if outcome["promoted"] else "**refused** (champion kept)"
    lines = [f"# Nightly gate: {outcome['model']} version {outcome['challenger']} {verdict}", "",
             f"{outcome['reason']}", "", _aliases_line(outcome), "",
             "| draft | concurrency | rounds | tok/s per round | accept length |", "|---|---:|---:|---|---:|"]
    for label, rows in gate["rows"].items():
        for row in rows:
            samples = ", ".join(_num(v, 1) for v in row.get("tok_s_samples") or [row.get("tok_s_median")])
            lines.append(f"| {label} | {row['concurrency']} | {row.get('rounds', 1)} | {samples} | "
                         f"{_num(row.get('accept_length'))} |")
    for c in gate.get("comparisons", []):
        if "tok_s_gain" in c:
            lines.append(f"\nConcurrency {c['concurrency']}: tok/s {_gain_shown(c)}; accept length "
                         f"{c['accept_length_gain']:+.2%}" + (" (the same acceptance)" if c["same_acceptance"] else ""))
    lines += ["", "Lineage: " + ", ".join(f"`{k}`={v}" for k, v in gate["lineage"].items())]
    return "\n".join(lines) + "\n"
