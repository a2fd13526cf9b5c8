"""The benchmark's report: one table (baseline vs each setting) and the verdict, wherever a person looks.

MLflow (the stage's child run and the experiment's parent run, every write through `RunLogger`, so an
outage journals it): metrics per setting (`<setting>.c<concurrency>.tok_s` ...), the comparison as a
table (`RunLogger.log_table`), one figure (tok/s by setting with the baseline line, cumulative
acceptance by draft position online vs offline, online vs offline accept length); the same table and
verdict, secrets masked, as a Prefect markdown artifact and as `bench.md` in the stage folder.

One rounding per kind of figure (`DIGITS`), applied before a figure is logged or shown: the log line,
bench.md, the CLI's tables and the MLflow runs table show the same digits. The offline accept length
beside a setting is always training's simulated figure at that setting's depth (its served
`num_steps`), never the full TTT depth, which would promise more than any shallower setting can reach.

This module imports no Prefect or MLflow at import time: the CLI formats with it.
"""

from __future__ import annotations

import re
from typing import Any

# Decimal places per kind of figure, for every place a figure is logged or shown.
DIGITS = {"tok_s": 1, "speedup": 2, "accept_length": 2, "share": 3, "seconds": 4, "count": 0}


def figure_kind(name: str) -> str:
    """The kind of a metric by its name: `run_benchmark.best_tok_s` -> tok_s, `spec_4_1_5.speedup` -> speedup."""
    leaf = name.rsplit(".", 1)[-1]
    if "depth" in leaf or leaf in ("alarms", "steps", "num_samples", "stages_completed"):
        return "count"
    for kind, marks in (("speedup", ("speedup",)), ("accept_length", ("accept_length", "accept_len")),
                        ("tok_s", ("tok_s", "tokens_per_s"))):
        if any(mark in leaf for mark in marks):
            return kind
    return "seconds" if leaf.endswith("_s") else "share"


def rounded(value: float | None, kind: str) -> float | None:
    return None if value is None else round(float(value), DIGITS[kind])


def shown(value: Any, kind: str) -> str:
    """A figure as every table and log line prints it: `1266.8`, `1.61x`, `3.34`, `-` when unknown."""
    if value is None or isinstance(value, str):
        return "-" if value is None else value
    text = f"{float(value):.{DIGITS[kind]}f}"
    return f"{text}x" if kind == "speedup" else text


def metric_key(setting: str) -> str:
    """`speculative 5/1/6` -> `spec_5_1_6` (MLflow metric names allow no '/' runs of spaces)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", setting.replace("speculative", "spec")).strip("_")


def short_setting(setting: str) -> str:
    """`speculative 4/1/5` -> `spec 4/1/5`: narrow tables keep a setting on one line."""
    return setting.replace("speculative ", "spec ")


# ------------------------------------------------------------------ the comparison, one row per setting


def comparison_rows(rows: list[dict], offline: dict) -> list[dict[str, Any]]:
    """The comparison table's rows, rounded: tok/s min/median/max, speedup, online and offline accept length
    (the offline one at the setting's depth, with that depth), the reference decoder's, latencies."""
    per_setting = offline.get("per_setting", {})
    baselines = {r["concurrency"]: r["tok_s_median"] for r in rows if not r["speculative"]}
    table = []
    for r in rows:
        base = baselines.get(r["concurrency"])
        speedup = r["tok_s_median"] / base if base and r["tok_s_median"] else None if r["speculative"] else 1.0
        figures = per_setting.get(r["setting"], {}) if r["speculative"] else {}
        table.append({
            "setting": r["setting"], "concurrency": r["concurrency"],
            "tok_s_min": rounded(r["tok_s_min"], "tok_s"), "tok_s_median": rounded(r["tok_s_median"], "tok_s"),
            "tok_s_max": rounded(r["tok_s_max"], "tok_s"), "speedup": rounded(speedup, "speedup"),
            "accept_length_online": rounded(r["decode_accept_length"], "accept_length"),
            "accept_length_offline": rounded(figures.get("expected_accept_length"), "accept_length"),
            "offline_depth": figures.get("depth"),
            "reference_decoder_accept_length": rounded(figures.get("reference_decoder_accept_length"), "accept_length"),
            "ttft_p50_s": rounded(r["ttft_p50_s"], "seconds"), "itl_p50_s": rounded(r["itl_p50_s"], "seconds"),
            "itl_p99_s": rounded(r["itl_p99_s"], "seconds"),
        })
    return table


def render_markdown(cfg, rows: list[dict], offline: dict, verdict: dict) -> str:
    lines = [f"### Benchmark: {verdict['summary']}", "",
             f"{cfg.bench.num_prompts} prompts x {cfg.bench.max_new_tokens} tokens, {cfg.bench.warmup_runs} warm-up + "
             f"{cfg.bench.timed_runs} timed runs; tok/s min / median / max; accept length in tokens per verify step, "
             "offline = training's simulated figure at the setting's depth", "",
             "| setting | conc. | tok/s | speedup | accept len online | offline (sim., at depth) | reference decoder "
             "| TTFT p50 ms | ITL p50 ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in comparison_rows(rows, offline):
        depth = f" (depth {c['offline_depth']})" if c["offline_depth"] else ""
        lines.append(
            f"| {c['setting']} | {c['concurrency']} | {shown(c['tok_s_min'], 'tok_s')} / {shown(c['tok_s_median'], 'tok_s')}"
            f" / {shown(c['tok_s_max'], 'tok_s')} | {shown(c['speedup'], 'speedup') if c['speedup'] else 'unknown'} "
            f"| {shown(c['accept_length_online'], 'accept_length')} "
            f"| {shown(c['accept_length_offline'], 'accept_length')}{depth} "
            f"| {shown(c['reference_decoder_accept_length'], 'accept_length')} | {_ms(c['ttft_p50_s'])} "
            f"| {_ms(c['itl_p50_s'])} |")
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


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def headline_line(metrics: dict[str, float], best_setting: str | None) -> str:
    """`best speculative 4/1/5: 1266.8 tok/s, 1.61x the baseline (784.9 tok/s), accept length 3.32 online vs
    3.59 offline (simulated at depth 4)`: the headline as the log, the report and the MLflow description say it."""
    if best_setting is None or metrics.get("best_tok_s") is None:
        return "no speculative setting measured"
    parts = [f"best {best_setting}: {shown(metrics['best_tok_s'], 'tok_s')} tok/s"]
    if metrics.get("speedup") is not None:
        parts.append(f"{shown(metrics['speedup'], 'speedup')} the baseline "
                     f"({shown(metrics.get('baseline_tok_s'), 'tok_s')} tok/s)")
    depth = metrics.get("accept_length_offline_depth")
    offline = (f" vs {shown(metrics['accept_length_offline'], 'accept_length')} offline (simulated at depth "
               f"{depth:.0f})" if metrics.get("accept_length_offline") is not None and depth else "")
    parts.append(f"accept length {shown(metrics.get('accept_length_online'), 'accept_length')} online{offline}")
    return ", ".join(parts)


# ------------------------------------------------------------------ where it goes


def log_bench_report(ctx, cfg, rows: list[dict], offline: dict, verdict: dict, metrics: dict[str, float]) -> None:
    """bench.md, the stage's MLflow run (metrics per setting, table, figure, JSON records), the parent run
    (the table and the figure, so the experiment's own run shows the comparison), a Prefect artifact."""
    from prefect.artifacts import create_markdown_artifact

    from tasks.config.secrets import redact
    from tasks.log import logger

    markdown = redact(render_markdown(cfg, rows, offline, verdict))
    (ctx.stage_dir / "bench.md").write_text(markdown)
    run = ctx.mlflow
    run.log_metrics(setting_metrics(rows, offline, verdict))
    run.log_dict(verdict, "bench/verdict.json")
    run.log_dict({"rows": [{k: v for k, v in r.items() if k != "output_ids"} for r in rows], "offline": offline},
                 "bench/results.json")
    table = {column: [c[column] for c in comparison_rows(rows, offline)] for column in COMPARISON_COLUMNS}
    figure = benchmark_figure(rows, offline, verdict)
    figure.savefig(ctx.stage_dir / "benchmark.png")  # in the run folder too, not only in MLflow
    parent = _parent_run(ctx)
    for target in (run, parent):
        if target is None:
            continue
        target.log_table(table, "bench/comparison.json")
        target.log_figure(figure, "plots/benchmark.png")
    _close(figure)
    best = (verdict.get("best") or {}).get("setting")
    if parent is not None and best:  # what `eagleops runs` and the runs table name the headline figures by
        parent.set_tags({"eagleops.best_setting": best.replace("speculative ", "")})
    create_markdown_artifact(markdown, key=f"{_artifact_key(cfg.experiment)}-benchmark", description="eagleops benchmark")
    logger().info(f"benchmark: {headline_line(metrics, best)}; verdict: {verdict['summary']}")


COMPARISON_COLUMNS = ("setting", "concurrency", "tok_s_min", "tok_s_median", "tok_s_max", "speedup",
                      "accept_length_online", "accept_length_offline", "offline_depth",
                      "reference_decoder_accept_length", "ttft_p50_s", "itl_p50_s", "itl_p99_s")


def setting_metrics(rows: list[dict], offline: dict, verdict: dict) -> dict[str, float]:
    """`<setting>.c<concurrency>.{tok_s, accept_length, ttft_p50_s, itl_p50_s}`, `<setting>.speedup` and
    `<setting>.accept_length_offline` (at the setting's depth), each rounded as it is shown."""
    metrics: dict[str, float] = {}
    for r in rows:
        key = f"{metric_key(r['setting'])}.c{r['concurrency']}"
        for name, field in (("tok_s", "tok_s_median"), ("accept_length", "decode_accept_length"),
                            ("ttft_p50_s", "ttft_p50_s"), ("itl_p50_s", "itl_p50_s")):
            if r[field] is not None:
                metrics[f"{key}.{name}"] = rounded(r[field], figure_kind(name))
    for s in verdict["settings"]:
        if s["speedup"] is not None:
            metrics[f"{metric_key(s['setting'])}.speedup"] = rounded(s["speedup"], "speedup")
    for setting, figures in offline.get("per_setting", {}).items():
        if figures.get("expected_accept_length") is not None:
            metrics[f"{metric_key(setting)}.accept_length_offline"] = rounded(figures["expected_accept_length"],
                                                                              "accept_length")
    return metrics


def _parent_run(ctx):
    """The experiment's parent run (from the run folder's manifest), or None when the manifest names none."""
    import json

    from tasks.tracking.run_logger import RunLogger

    manifest = ctx.run_dir / "manifest.json"
    parent_id = json.loads(manifest.read_text()).get("mlflow", {}).get("parent_run_id") if manifest.is_file() else None
    return RunLogger(ctx.tracking_uri, parent_id) if parent_id else None


def _artifact_key(name: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-") or "eagleops"


# ------------------------------------------------------------------ the figure


def cumulative(values: list[float]) -> list[float]:
    """[a1, a2, a3] -> [a1, a1*a2, a1*a2*a3]: training's acc_k is conditional on the earlier positions being
    accepted; online acceptance by position counts verifies that accepted at least k drafts."""
    out, alive = [], 1.0
    for value in values:
        alive *= value or 0.0
        out.append(alive)
    return out


def benchmark_figure(rows: list[dict], offline: dict, verdict: dict | None = None):
    """Three stacked panels drawn for MLflow's preview width (`eagle3.figures`), each titled with its units:
    throughput (the baseline a bar of its own, each bar with its tok/s and speedup), cumulative acceptance by draft
    position, accept length online vs offline (values on the bars); the verdict as the figure's title."""
    from eagle3.figures import preview_figure

    level = rows[0]["concurrency"] if rows else 1
    first = [r for r in rows if r["concurrency"] == level]
    baseline = next((r for r in first if not r["speculative"]), None)
    spec = [r for r in first if r["speculative"]]
    fig, axes = preview_figure(3)
    _throughput_panel(axes[0], spec, baseline, level)
    _acceptance_panel(axes[1], spec, offline)
    _accept_length_panel(axes[2], spec, offline)
    if verdict and verdict.get("summary"):
        fig.suptitle(_wrapped(f"verdict: {verdict['summary']}", 70), fontweight="bold")
    return fig


def _wrapped(text: str, width: int) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width)[:2])


def _close(figure) -> None:
    import matplotlib.pyplot as plt

    plt.close(figure)


def _throughput_panel(ax, spec: list[dict], baseline: dict | None, level: int) -> None:
    bars = ([baseline] if baseline and baseline["tok_s_median"] else []) + spec
    base = baseline["tok_s_median"] if baseline and baseline["tok_s_median"] else None
    values = [r["tok_s_median"] or 0 for r in bars]
    drawn = ax.bar([short_setting(r["setting"]) for r in bars], values,
                   color=["0.6" if not r["speculative"] else "C0" for r in bars])
    labels = [f"{shown(v, 'tok_s')}" + (f"\n{shown(v / base, 'speedup')}" if base and r["speculative"] else "")
              for r, v in zip(bars, values)]
    ax.bar_label(drawn, labels, padding=2)
    ax.set(title=f"Throughput by setting (median output tok/s, concurrency {level})", ylabel="output tok/s",
           ylim=(0, max(values + [1.0]) * 1.4))


def _acceptance_panel(ax, spec: list[dict], offline: dict) -> None:
    """Online: share of verify steps that accepted at least k drafts, k = 1..the setting's depth. Offline: the
    same quantity from training, prod_{j<=k} acc_j, over the deepest served depth."""
    depth = max((_depth(r) for r in spec), default=0)
    for i, r in enumerate(spec):
        online = (r.get("accepted_by_position") or [])[:_depth(r)]
        if online:
            ax.plot(range(1, len(online) + 1), online, marker="o", color=f"C{i}", label=f"online {short_setting(r['setting'])}")
    acc = (offline.get("acc") or [])[:depth]
    if acc:
        ax.plot(range(1, len(acc) + 1), cumulative(acc), "k--", marker="x", label="offline (training, prod of acc_k)")
    ax.set(title="Cumulative acceptance by draft position (share of verify steps)", xlabel="draft position k",
           ylabel="share accepting >= k drafts (0-1)", ylim=(0, 1.05))
    if depth:
        ax.set_xticks(list(range(1, depth + 1)))
        ax.set_xlim(0.5, depth + 0.5)
    if ax.lines:
        ax.legend()


def _accept_length_panel(ax, spec: list[dict], offline: dict) -> None:
    per_setting = offline.get("per_setting", {})
    xs = list(range(len(spec)))
    online = [r["decode_accept_length"] or 0 for r in spec]
    expected = [per_setting.get(r["setting"], {}).get("expected_accept_length") or 0 for r in spec]
    for shift, values, label in ((-0.2, online, "online (server)"),
                                 (0.2, expected, "offline (simulated at the setting's depth)")):
        drawn = ax.bar([x + shift for x in xs], values, width=0.4, label=label)
        ax.bar_label(drawn, [shown(v, "accept_length") if v else "-" for v in values], padding=2)
    ax.set_xticks(xs, [short_setting(r["setting"]) for r in spec])
    ax.set(title="Accept length, online vs offline (tokens per verify step)", ylabel="tokens / verify step",
           ylim=(0, max(online + expected + [1.0]) * 1.45))
    ax.legend(loc="upper left", ncol=2)


def _depth(row: dict) -> int:
    return int((row.get("effective") or {}).get("num_steps") or len(row.get("accepted_by_position") or []))
