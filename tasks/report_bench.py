"""The benchmark's report: one table (baseline vs each setting) and the verdict, wherever a person looks.

MLflow (the stage's child run, every write through `RunLogger`, so an outage journals it): metrics
per setting (`<setting>/tok_s` ...), the comparison as a table (`RunLogger.log_table`), plots
(tok/s by setting with the baseline line, acceptance by draft position, online vs offline accept
length); the same table and verdict, secrets masked, as a Prefect markdown artifact and as
`bench.md` in the stage folder.
"""

from __future__ import annotations

import re
from typing import Any

from prefect.artifacts import create_markdown_artifact

from tasks.config import ExperimentConfig
from tasks.pipeline import StageContext, logger
from tasks.secrets import redact


def metric_key(setting: str) -> str:
    """`speculative 5/1/6` -> `spec_5_1_6` (MLflow metric names allow no '/' runs of spaces)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", setting.replace("speculative", "spec")).strip("_")


def render_markdown(cfg: ExperimentConfig, rows: list[dict], offline: dict, verdict: dict) -> str:
    per_setting = offline.get("per_setting", {})
    lines = [f"### Benchmark: {verdict['summary']}", "",
             f"{cfg.bench.num_prompts} prompts x {cfg.bench.max_new_tokens} tokens, {cfg.bench.warmup_runs} warm-up + "
             f"{cfg.bench.timed_runs} timed runs; tok/s min / median / max", "",
             "| setting | conc. | tok/s | speedup | accept len online | offline (sim.) | reference decoder | TTFT p50 ms | ITL p50 ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    baselines = {r["concurrency"]: r["tok_s_median"] for r in rows if not r["speculative"]}
    for r in rows:
        base = baselines.get(r["concurrency"])
        speedup = f"{r['tok_s_median'] / base:.2f}x" if base and r["tok_s_median"] else "1.00x" if not r["speculative"] else "unknown"
        figures = per_setting.get(r["setting"], {})
        lines.append(
            f"| {r['setting']} | {r['concurrency']} | {_f(r['tok_s_min'])} / {_f(r['tok_s_median'])} / {_f(r['tok_s_max'])} "
            f"| {speedup} | {_f(r['decode_accept_length'])} | {_f(figures.get('expected_accept_length'))} "
            f"| {_f(figures.get('reference_decoder_accept_length'))} | {_ms(r['ttft_p50_s'])} | {_ms(r['itl_p50_s'])} |")
    for s in verdict["settings"]:
        lines += [f"- alarm: {a}" for a in s["alarms"]]
        lines += [f"- {s['setting']}: asked {k} {asked}, the server runs {runs} (reported by "
                  f"{s.get('settings_source') or 'prediction'})" for k, (asked, runs) in s.get("rewritten", {}).items()]
    if verdict["causes"]:
        lines += ["", "#### Probable causes (ranked)", ""]
        lines += [f"{i}. **{c['cause']}** ({c['score']:.2f}, {c['setting']}): {c['summary']}"
                  for i, c in enumerate(verdict["causes"], 1)]
    if verdict.get("missing_evidence"):
        lines += ["", "#### Evidence the diagnosis did not have", ""]
        lines += [f"- {m['check']} ({m['setting']}): {m['reason']}" for m in verdict["missing_evidence"]]
    return "\n".join(lines) + "\n"


def _f(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def log_bench_report(ctx: StageContext, cfg: ExperimentConfig, rows: list[dict], offline: dict, verdict: dict) -> None:
    markdown = redact(render_markdown(cfg, rows, offline, verdict))
    (ctx.stage_dir / "bench.md").write_text(markdown)
    run = ctx.mlflow
    for r in rows:
        key = f"{metric_key(r['setting'])}.c{r['concurrency']}"
        run.log_metrics({f"{key}.{name}": r[field] for name, field in (
            ("tok_s", "tok_s_median"), ("accept_length", "decode_accept_length"), ("ttft_p50_s", "ttft_p50_s"),
            ("itl_p50_s", "itl_p50_s")) if r[field] is not None})
    for s in verdict["settings"]:
        if s["speedup"] is not None:
            run.log_metrics({f"{metric_key(s['setting'])}.speedup": s["speedup"]})
    run.log_dict(verdict, "bench/verdict.json")
    run.log_dict({"rows": [{k: v for k, v in r.items() if k != "output_ids"} for r in rows], "offline": offline},
                 "bench/results.json")
    _log_table(run, rows)
    _log_plots(run, rows, offline)
    create_markdown_artifact(markdown, key=f"{_artifact_key(cfg.experiment)}-benchmark", description="eagleops benchmark")
    logger().info(f"benchmark verdict: {verdict['summary']}")


def _artifact_key(name: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-") or "eagleops"


def _log_table(run, rows: list[dict]) -> None:
    columns = ("setting", "concurrency", "tok_s_min", "tok_s_median", "tok_s_max", "decode_accept_length",
               "ttft_p50_s", "itl_p50_s", "itl_p99_s")
    table = {c: [r[c] for r in rows] for c in columns}
    run.log_table(table, "bench/comparison.json")


def _log_plots(run, rows: list[dict], offline: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = [r for r in rows if r["concurrency"] == rows[0]["concurrency"]]
    baseline = next((r for r in first if not r["speculative"]), None)
    spec = [r for r in first if r["speculative"]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].bar([r["setting"].replace("speculative ", "") for r in spec], [r["tok_s_median"] or 0 for r in spec])
    if baseline:
        axes[0].axhline(baseline["tok_s_median"], color="red", linestyle="--", label="baseline")
        axes[0].legend()
    axes[0].set(title="tok/s by setting (median)", ylabel="tok/s")
    for r in spec:
        axes[1].plot(range(1, len(r["accepted_by_position"]) + 1), r["accepted_by_position"], marker="o", label=r["setting"])
    if offline.get("acc"):
        axes[1].plot(range(1, len(offline["acc"]) + 1), offline["acc"], "k--", label="training acc_k")
    axes[1].set(title="acceptance by draft position", xlabel="position", ylim=(0, 1.05))
    axes[1].legend(fontsize=7)
    names = [r["setting"].replace("speculative ", "") for r in spec]
    online = [r["decode_accept_length"] or 0 for r in spec]
    expected = [offline.get("per_setting", {}).get(r["setting"], {}).get("expected_accept_length") or 0 for r in spec]
    xs = range(len(spec))
    axes[2].bar([x - 0.2 for x in xs], online, width=0.4, label="online")
    axes[2].bar([x + 0.2 for x in xs], expected, width=0.4, label="offline (simulated)")
    axes[2].set_xticks(list(xs), names)
    axes[2].set(title="accept length: online vs offline")
    axes[2].legend()
    fig.tight_layout()
    run.log_figure(fig, "plots/benchmark.png")
    plt.close(fig)
