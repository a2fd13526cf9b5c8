"""run_benchmark: baseline vs each speculative setting on the same host and prompts, and the verdict.

The seed's manual investigation (2 warm-ups, 5 timed runs, grepping "accept len", /server_info)
as one stage. Per setting: W warm-up then N timed runs through `eagle3.serving.sglang_client` (tok/s,
TTFT, ITL, accept length per request from meta_info), the server's own figures (/server_info,
/metrics, its decode log lines) compared with the client's, and the draft's offline figures
beside them (the simulated accept length from training, truncated to the setting's depth, and
the reference decoder's accept length on the same prompts when the target is here). Sweeps
launch one server per setting through the deploy stage's `launch`, each setting preflighted
against the served model and, where SGLang serves, resolved by SGLang in one batched dry run
before any sweep server starts; a setting the server would rewrite is run and reported under
what the server reports it runs. `deploy.baseline: false` measures no baseline (speedups are
then unknown). `tasks.stages.bench.diagnose` explains a setting that is not faster than the baseline or
whose online accept length falls short of the offline one, from what the servers report and
the served model's files (`tasks.hosts.served`). `bench.min_speedup` fails the stage, after
everything is recorded, when the best speedup is below it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from eagle3.serving.bench_prompts import builtin_prompts, heldout_overlap, load_prompts_jsonl, render_prompts
from eagle3.serving.sglang_client import (
    BenchResult,
    SGLangClient,
    compare_client_server,
    summarize_decode_log,
)
from eagle3.serving.sglang_client import (
    run_benchmark as run_rounds,
)
from eagle3.serving.step_costs import measure_step_costs
from tasks.config.schema import ExperimentConfig, SpeculativeConfig
from tasks.hosts.launch import launch_args
from tasks.hosts.servers import (
    Placement,
    ServerHandle,
    executor_of,
    launch,
    live_handles,
    log_tail,
    stop,
)
from tasks.log import logger
from tasks.runner.context import StageContext
from tasks.runner.flow_errors import redacted_failures
from tasks.stages.bench.diagnose import diagnose, expected_accept_length
from tasks.stages.bench.report import log_bench_report, rounded, shown
from tasks.stages.deploy import (
    dry_run_findings,
    preflight,
    report_findings,
    served_model_reported,
    setting_label,
    sglang_dry_run_batch,
)
from tasks.stages.target import recorded_target_dir

# ------------------------------------------------------------------ prompts


def bench_prompts(cfg: ExperimentConfig, samples: Path | None, tokenizer_dir: Path | None = None) -> list[list[dict]]:
    """The benchmark's conversations, never ones the draft trained on (the held-out check: by text, and by the
    ids the target's chat template renders (tokenizer_dir) against served samples, data.source: served)."""
    render = (lambda conversations: render_prompts(conversations, tokenizer_dir)) if tokenizer_dir else None
    if cfg.bench.prompts == "builtin":
        pool = builtin_prompts(cfg.bench.num_prompts * 4)
        if samples is not None and samples.is_file():
            seen = set(heldout_overlap(pool, samples, render_ids=render))
            pool = [p for i, p in enumerate(pool) if i not in seen]
        if len(pool) < cfg.bench.num_prompts:
            raise ValueError(f"bench.num_prompts={cfg.bench.num_prompts}: only {len(pool)} builtin prompts are not "
                             "training prompts; lower it or give a .jsonl")
        return pool  # more than needed: run_benchmark keeps the first num_prompts that fit
    prompts = load_prompts_jsonl(cfg.bench.prompts)[: cfg.bench.num_prompts]
    if samples is not None and samples.is_file():
        seen = heldout_overlap(prompts, samples, render_ids=render)
        if seen:
            raise ValueError(f"bench.prompts: {cfg.bench.prompts} prompts {[i + 1 for i in seen][:10]} are training "
                             "prompts of this draft; benchmark on held-out prompts")
    return prompts


def fitting_prompts(cfg: ExperimentConfig, prompts: list, context_len: int | None) -> list:
    """Prompts whose ids plus bench.max_new_tokens fit the served context: builtin ones that do not are
    left out; a user's file with one that does not is an error naming it (the server would refuse it)."""
    if not context_len or not prompts or not isinstance(prompts[0], list) or not isinstance(prompts[0][0], int):
        return prompts
    # Builtin prompts also stay within the length the draft was trained on (data.max_length): past it the
    # tiny target degenerates into patterns no training sample had, which measures nothing useful.
    limit = context_len if cfg.bench.prompts != "builtin" else min(context_len, cfg.data.max_length)
    fits = [len(p) + cfg.bench.max_new_tokens <= limit for p in prompts]
    if cfg.bench.prompts != "builtin" and not all(fits):
        bad = [i + 1 for i, ok in enumerate(fits) if not ok]
        raise ValueError(f"bench.prompts: prompts {bad[:10]} of {cfg.bench.prompts} plus bench.max_new_tokens="
                         f"{cfg.bench.max_new_tokens} exceed the served context of {context_len} tokens")
    kept = [p for p, ok in zip(prompts, fits) if ok]
    if not kept:
        raise ValueError(f"bench.max_new_tokens={cfg.bench.max_new_tokens}: no builtin prompt fits in {limit} tokens "
                         "(the served context, or data.max_length) with it; lower it")
    if len(kept) < cfg.bench.num_prompts:
        logger().warning(f"benchmark: only {len(kept)} builtin prompts fit in {limit} tokens with "
                         f"{cfg.bench.max_new_tokens} new tokens (bench.num_prompts={cfg.bench.num_prompts})")
    return kept


def request_inputs(cfg: ExperimentConfig, conversations: list[list[dict]], tokenizer_dir: Path | None):
    """Token ids through the target's chat template when the tokenizer is here; else the chat endpoint."""
    if cfg.bench.endpoint == "chat" or tokenizer_dir is None:
        return "chat", conversations
    ids = render_prompts(conversations, tokenizer_dir)
    return ("generate", ids) if cfg.bench.endpoint == "generate" else ("completions", ids)


# ------------------------------------------------------------------ one setting


def measure(cfg: ExperimentConfig, handle: ServerHandle, endpoint: str, prompts: list, concurrency: int) -> BenchResult:
    """One setting at one concurrency; a line when it starts and one per round at most every 5 s while it runs."""
    where = f"{handle.label} (concurrency {concurrency})"
    logger().info(f"{where}: {cfg.bench.warmup_runs} warm-up + {cfg.bench.timed_runs} timed runs of {len(prompts)} "
                  f"prompts x {cfg.bench.max_new_tokens} tokens")
    with SGLangClient(handle.local_url, timeout=max(600.0, cfg.deploy.startup_timeout_s)) as client:
        return run_rounds(client, prompts, warmup_runs=cfg.bench.warmup_runs, timed_runs=cfg.bench.timed_runs,
                          concurrency=concurrency, max_new_tokens=cfg.bench.max_new_tokens,
                          temperature=cfg.bench.temperature, endpoint=endpoint, ignore_eos=True,
                          log=lambda line: logger().info(f"{where}: {line}"))


def setting_row(label: str, handle: ServerHandle, result: BenchResult, decode_log: dict, concurrency: int) -> dict:
    """One comparison-table row: the client's figures (min/median/max), the server's, their disagreements."""
    summary = result.summary()
    tok_s = summary.get("output_tok_per_s", {})
    return {
        "setting": label, "speculative": handle.speculative, "concurrency": concurrency,
        "asked": handle.asked, "effective": handle.effective, "predicted": handle.predicted,
        "settings_source": handle.settings_source, "allow_adjustments": handle.allow_adjustments,
        "tok_s_min": tok_s.get("min"), "tok_s_median": tok_s.get("median"), "tok_s_max": tok_s.get("max"),
        "ttft_p50_s": summary.get("ttft_p50_s", {}).get("median"), "ttft_p99_s": summary.get("ttft_p99_s", {}).get("median"),
        "itl_p50_s": summary.get("itl_p50_s", {}).get("median"), "itl_p99_s": summary.get("itl_p99_s", {}).get("median"),
        "accept_length": result.accept_length, "decode_accept_length": result.decode_accept_length,
        "server_avg_spec_accept_length": result.server.avg_spec_accept_length,
        "server_metrics_accept_length": result.server.metrics_accept_length,
        "log_accept_len": decode_log.get("accept_len_mean"), "log_gen_throughput": decode_log.get("gen_throughput_mean"),
        "log_decode_lines": decode_log.get("lines"),
        "accepted_by_position": accepted_by_position(result, (handle.effective or {}).get("num_steps")),
        "step_costs": measure_step_costs(result, handle.effective if handle.speculative else None),
        "output_ids": [r.output_ids for r in result.runs[-1].requests] if result.runs else [],
        "disagreements": compare_client_server(result) if handle.speculative else [],
        "verify_s": _verify_seconds(result),
    }


def accepted_by_position(result: BenchResult, depth: int | None = None) -> list[float]:
    """Share of verify steps whose draft token at position k was accepted (from the correct-drafts histogram),
    k = 1..depth: a server may report more bins than it drafts (SGLang's histogram has a fixed width), and
    positions past the served depth are never drafted."""
    histogram: list[int] = []
    for run in result.runs:
        for request in run.requests:
            counts = (request.meta_info or {}).get("spec_correct_drafts_histogram") or []
            width = max(len(histogram), len(counts))  # summed bin by bin, never longer than the longest
            histogram = [a + b for a, b in zip(histogram + [0] * (width - len(histogram)),
                                               counts + [0] * (width - len(counts)))]
    total = sum(histogram)
    if not total:
        return []
    # histogram[j] = verifies with exactly j drafts accepted; position k accepted in those with j > k.
    positions = len(histogram) - 1 if depth is None else min(depth, len(histogram) - 1)
    return [sum(histogram[k + 1:]) / total for k in range(positions)]


def _verify_seconds(result: BenchResult) -> float | None:
    verifies = sum(r.spec_verify_ct for r in result.runs)
    decode = sum(sum(req.itl_s) for r in result.runs for req in r.requests)
    return decode / verifies if verifies else None


def bench_one(cfg, ctx, handle: ServerHandle, endpoint: str, prompts: list) -> list[dict]:
    """Every concurrency level against one live server; the server log's decode lines summarised."""
    executor = executor_of(ctx.run_dir, handle)
    rows = []
    for concurrency in cfg.bench.concurrency:
        result = measure(cfg, handle, endpoint, prompts, concurrency)
        decode_log = summarize_decode_log(log_tail(executor, handle, lines=5000))
        row = setting_row(handle.label, handle, result, decode_log, concurrency)
        for line in row["disagreements"]:
            logger().warning(f"{handle.label}: client and server disagree: {line}")
        logger().info(f"{handle.label} (concurrency {concurrency}): {shown(row['tok_s_median'], 'tok_s')} tok/s median, "
                      f"accept length {shown(row['decode_accept_length'], 'accept_length')} (tokens per verify step)")
        rows.append(row)
    return rows


# ------------------------------------------------------------------ settings


def sweep_settings(cfg: ExperimentConfig) -> list[SpeculativeConfig]:
    """The sweep grid; rewrites are allowed there (the run is labelled with the effective values)."""
    return [s.model_copy(update={"allow_adjustments": True}) for s in cfg.bench.sweep]


def checked_sweep(cfg: ExperimentConfig, placement: Placement, draft_dir: Path, served) -> list[tuple]:
    """Every sweep setting's preflight against the served model and, where SGLang serves, SGLang's own
    resolution of all of them in one dry run: all before any sweep server starts. -> [(spec, predicted)]"""
    checked = [(spec, *preflight(cfg, spec, draft_dir, served, placement)) for spec in sweep_settings(cfg)]
    if cfg.deploy.server == "sglang" and checked:
        argvs = [launch_args(cfg, model_path=placement.model_path, draft_path=placement.draft_path,
                             port=cfg.deploy.port, spec=spec) for spec, _, _ in checked]
        answers = sglang_dry_run_batch(placement.executor, argvs) or [None] * len(argvs)
        checked = [(spec, findings + dry_run_findings(answer, predicted), predicted)
                   for (spec, findings, predicted), answer in zip(checked, answers)]
    for spec, findings, predicted in checked:
        report_findings(findings, f"sweep {spec.num_steps}/{spec.eagle_topk}/{spec.num_draft_tokens} (runs as "
                        f"{setting_label(predicted)}): preflight failed", cfg.deploy.preflight == "enforce")
    return [(spec, predicted) for spec, _, predicted in checked]


def measure_settings(cfg, ctx, placement: Placement, deployed: ServerHandle, sweep: list[tuple], endpoint: str,
                     prompts: list) -> list[dict]:
    """The deployed setting, then the baseline (deploy.baseline), then each sweep setting, one server at a time;
    a setting whose effective values were measured already is skipped."""
    rows = bench_one(cfg, ctx, deployed, endpoint, prompts)
    stop(ctx.run_dir, deployed)
    if not cfg.deploy.baseline:
        logger().info("deploy.baseline: false: no baseline is measured, so speedups are unknown")
    done = {deployed.label}
    for spec, predicted in ([(None, None)] if cfg.deploy.baseline else []) + sweep:
        label = "baseline" if spec is None else f"speculative {setting_label(predicted)}"
        if label in done:
            logger().info(f"sweep {spec.num_steps}/{spec.eagle_topk}/{spec.num_draft_tokens}: runs as {label}, "
                          "measured already; skipped")
            continue
        handle = launch(cfg, placement, ctx.run_dir, label=label, spec=spec, predicted=predicted)
        try:
            rows += bench_one(cfg, ctx, handle, endpoint, prompts)
        finally:
            stop(ctx.run_dir, handle)
        done.add(handle.label)
    return rows


# ------------------------------------------------------------------ offline figures


def offline_figures(ctx: StageContext, rows: list[dict], prompt_ids, target_dir: Path | None, draft_dir: Path,
                    cfg: ExperimentConfig) -> dict[str, Any]:
    """Training's simulated accept length at each setting's depth (its served num_steps: what that setting can
    accept at most), the full-depth figure, and the reference decoder's accept length on the same prompts."""
    trained = ctx.upstream.get("train_draft", {})
    acc = trained.get("acc") or []
    figures: dict[str, Any] = {"simulated_accept_length": trained.get("simulated_accept_length"), "acc": acc,
                               "per_setting": {}}
    for row in rows:
        if row["speculative"] and acc:
            depth = row["effective"]["num_steps"]
            figures["per_setting"][row["setting"]] = {"expected_accept_length": expected_accept_length(acc, depth),
                                                      "depth": depth}
    if cfg.bench.offline_reference and not _weights_here(target_dir, cfg):
        logger().info("reference decoder: not run (the target's weights are not on this machine, or "
                      "target.engine is sglang: they are never loaded in transformers)")
    elif cfg.bench.offline_reference and isinstance(prompt_ids[0], list):
        for row in rows:
            if row["speculative"] and row["concurrency"] == cfg.bench.concurrency[0]:
                figures["per_setting"].setdefault(row["setting"], {}).update(
                    _reference_figure(target_dir, draft_dir, prompt_ids, row["effective"], cfg.bench.max_new_tokens))
    return figures


def _reference_figure(target_dir: Path, draft_dir: Path, prompt_ids, effective: dict, max_new_tokens: int) -> dict:
    """The reference decoder's accept length, or why it has none: a draft this code cannot wire (an architecture
    without a known capture rule) must not fail the stage after every measurement is taken."""
    logger().info(f"reference decoder: {setting_label(effective)} on {len(prompt_ids)} prompts x {max_new_tokens} "
                  "tokens, in this process")
    try:
        return {"reference_decoder_accept_length":
                reference_accept_length(target_dir, draft_dir, prompt_ids, effective, max_new_tokens)}
    except ValueError as err:
        logger().warning(f"reference decoder: not run for {setting_label(effective)}: {err}")
        return {"reference_decoder_unavailable": str(err)}


def _weights_here(target_dir: Path | None, cfg: ExperimentConfig) -> bool:
    """Whether the in-process reference decoder may load the target: its weights are here (not a target
    card of the data host) and the config lets transformers load it."""
    return (target_dir is not None and cfg.target.engine == "hf"
            and any(Path(target_dir).glob("*.safetensors")))


def reference_accept_length(target_dir: Path, draft_dir: Path, prompt_ids: list[list[int]], effective: dict,
                            max_new_tokens: int) -> float:
    """Accept length of eagle3.serving.decoding (SGLang's loop, in-process) on the same prompts, greedy."""
    from eagle3.data.target import load_target
    from eagle3.serving.decoding import (
        SamplingParams,
        SpecConfig,
        SpeculativeEngine,
        TargetModel,
    )
    from eagle3.serving.settings import load_eagle3_drafter

    model, _ = load_target(target_dir, "float32", "cpu")
    drafter = load_eagle3_drafter(draft_dir, model)
    spec = SpecConfig(effective["num_steps"], effective["eagle_topk"], effective["num_draft_tokens"])
    engine = SpeculativeEngine(TargetModel(model, drafter.aux_hidden_indices), drafter, spec)
    tokens = verifies = 0
    for ids in prompt_ids:
        result = engine.generate(ids, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
        tokens += len(result.output_ids)
        verifies += result.stats.verify_ct
    return tokens / verifies if verifies else 0.0


# ------------------------------------------------------------------ the stage


@task(name="run_benchmark", cache_policy=NO_CACHE)
@redacted_failures  # its exception reaches the task run's Prefect state message masked
def run_benchmark(cfg: ExperimentConfig, ctx: StageContext) -> dict:
    deployed = ctx.upstream["deploy_server"]
    exported = ctx.upstream.get("export_checkpoint", {}).get("outputs", {})
    draft_dir = Path(exported["sglang_dir"])
    target_dir = recorded_target_dir(cfg, ctx, exported["target_dir"]) if exported.get("target_dir") else None
    samples = ctx.upstream.get("generate_data", {}).get("outputs", {}).get("samples")
    tokenizer_dir = target_dir if target_dir and target_dir.is_dir() else None
    conversations = bench_prompts(cfg, Path(samples) if samples else None, tokenizer_dir)
    endpoint, prompts = request_inputs(cfg, conversations, tokenizer_dir)
    spec_handle = _deployed_handle(ctx, deployed)
    fitting = fitting_prompts(cfg, prompts, spec_handle.server_info.get("context_len"))
    prompts = fitting[: cfg.bench.num_prompts]
    placement = _placement_of(ctx, deployed, spec_handle)
    served = served_model_reported(spec_handle, placement)  # what the deployed server loaded, read on its host
    if served.paths.get("draft") == placement.draft_path:
        served.draft_local_dir = str(draft_dir)  # this run's export, uploaded there sha256-verified
    sweep = checked_sweep(cfg, placement, draft_dir, served)

    rows = measure_settings(cfg, ctx, placement, spec_handle, sweep, endpoint, prompts)
    offline = offline_figures(ctx, rows, prompts, target_dir, draft_dir, cfg)
    requests = requests_sent(endpoint, target_dir if endpoint != "chat" else None, served)
    verdict = diagnose(cfg, rows, offline, served.to_dict(), data=ctx.upstream.get("generate_data"), requests=requests)
    metrics = headline_metrics(rows, offline, verdict)
    log_bench_report(ctx, cfg, rows, offline, verdict, metrics)
    summary = {"rows": [_without_ids(r) for r in rows], "offline": offline, "verdict": verdict, "requests": requests,
               "metrics": metrics, "outputs": {"report": str(ctx.stage_dir / "bench.md")},
               "inputs": {"endpoint": endpoint, "prompts": prompts}}  # what plan_serving's checks send again
    ctx.write_json("bench.json", summary)
    enforce_min_speedup(cfg, ctx, summary)
    return summary


class BelowMinSpeedup(RuntimeError):
    """The best speedup is below bench.min_speedup; raised after the benchmark is recorded."""


def speedup_shortfall(cfg: ExperimentConfig, verdict: dict) -> str | None:
    """Why the run misses bench.min_speedup (the figure and the field), or None when it does not."""
    floor, best = cfg.bench.min_speedup, verdict.get("best") or {}
    if floor is None:
        return None
    if best.get("speedup") is None:
        return f"bench.min_speedup {floor:g}: the speedup is unknown ({verdict['summary']})"
    if best["speedup"] < floor:
        return (f"bench.min_speedup {floor:g}: the best setting, {best['setting']}, reached {best['speedup']:.2f}x "
                f"the baseline ({best['tok_s_median']:.1f} tok/s)")
    return None


def enforce_min_speedup(cfg: ExperimentConfig, ctx: StageContext, summary: dict) -> None:
    """Fail the stage below bench.min_speedup; its figures stay in bench.md, bench.json and the stage's MLflow run."""
    shortfall = speedup_shortfall(cfg, summary["verdict"])
    if shortfall is None:
        return
    ctx.mlflow.log_metrics(summary["metrics"])  # a failed stage's metrics are not logged by the runner
    raise BelowMinSpeedup(f"{shortfall}; the benchmark is recorded in {ctx.stage_dir / 'bench.md'}")


def requests_sent(endpoint: str, tokenizer_dir: Path | None, served) -> dict[str, Any]:
    """How the prompts reached the model: the endpoint and the chat template they went through (rendered
    here by the target's tokenizer for the token-id endpoints, by the server itself for chat)."""
    if endpoint == "chat":
        return {"endpoint": endpoint, "template_sha256": served.chat_template_sha256,
                "template_source": f"the server's own ({served.template_source})"}
    return {"endpoint": endpoint, "template_sha256": _template_sha(tokenizer_dir),
            "template_source": f"rendered by this machine's tokenizer in {tokenizer_dir}"}


def _deployed_handle(ctx: StageContext, deployed: dict) -> ServerHandle:
    pid = deployed["server"]["pid"]
    for handle in live_handles(ctx.run_dir):
        if handle.pid == pid:
            return handle
    raise RuntimeError(f"the server deploy_server started (pid {pid}) is not reachable from this process; "
                       "run deploy_server and run_benchmark in one flow run")


def _placement_of(ctx: StageContext, deployed: dict, handle: ServerHandle) -> Placement:
    where = deployed["placement"]
    return Placement(executor_of(ctx.run_dir, handle), None, where["workdir"], where["model_path"], where["draft_path"])


def _template_sha(target_dir: Path | None) -> str | None:
    if target_dir is None or not (target_dir / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    from eagle3.data.chat import chat_template_sha256

    return chat_template_sha256(AutoTokenizer.from_pretrained(target_dir))


def _without_ids(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "output_ids"}


def headline_metrics(rows: list[dict], offline: dict, verdict: dict) -> dict[str, float]:
    """Baseline and best tok/s, speedup, online/offline accept length: the numbers a reader wants first, each of
    the best setting and rounded as every table shows it. `accept_length_offline` is training's simulated accept
    length at the best setting's depth (`accept_length_offline_depth`), the figure its online one is held to."""
    first = [r for r in rows if r["concurrency"] == rows[0]["concurrency"]]
    baseline = next((r for r in first if not r["speculative"]), None)
    best = verdict.get("best") or {}
    at_depth = offline.get("per_setting", {}).get(best.get("setting"), {})
    metrics = {"baseline_tok_s": rounded(baseline["tok_s_median"], "tok_s") if baseline else None,
               "best_tok_s": rounded(best.get("tok_s_median"), "tok_s"),
               "speedup": rounded(best.get("speedup"), "speedup"),
               "accept_length_online": rounded(best.get("accept_length"), "accept_length"),
               "accept_length_offline": rounded(at_depth.get("expected_accept_length"), "accept_length"),
               "accept_length_offline_depth": at_depth.get("depth"),
               "alarms": float(len(verdict.get("causes", [])))}
    return {k: float(v) for k, v in metrics.items() if v is not None}

