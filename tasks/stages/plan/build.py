"""The serving plan from a benchmark's rows, without a server: what `plan_serving` starts from and all of
`eagleops plan RUN_DIR`.

From run_benchmark's rows (step costs and acceptance per setting and concurrency) and the config (bench.plan's
grid, bench.sla, deploy.tp): the grid as SGLang runs it, every setting predicted at every bench.concurrency,
the pick per concurrency, the frontier, the launch flags for the stated load (bench.plan.load, else the highest
concurrency) and the adaptive config where picks differ by load. `with_check` adds measured points and the
checked picks. `render_markdown` and `frontier_figure` show it. Imports no Prefect or MLflow (the CLI uses it).
"""

from __future__ import annotations

import json
from typing import Any

from eagle3.serving.plan import (
    Sla,
    adaptive_config,
    adaptive_launch_flags,
    check_points,
    checked_choice,
    choose,
    frontier,
    mean_absolute_error,
)
from eagle3.serving.prediction import Measurement, Prediction, Predictor
from eagle3.serving.spec_grid import OFF, Setting, resolve_grid
from tasks.config.schema import ExperimentConfig, PlanConfig

ADAPTIVE_FILE = "adaptive_config.json"


class Plan:
    """Predictions and picks for one run; `as_dict()` is plan.json."""

    def __init__(self, cfg: ExperimentConfig, rows: list[dict]) -> None:
        plan_cfg = cfg.bench.plan or PlanConfig()
        measured = [Measurement.from_row(r) for r in rows]
        self.grid, self.refused = resolve_grid(plan_cfg.num_steps, plan_cfg.eagle_topk, plan_cfg.num_draft_tokens)
        self.predictor = Predictor(measured, cfg.bench.max_new_tokens, gpus=cfg.deploy.tp)
        self.measured = measured
        self.predictions = self.predictor.grid(sorted(set(self.grid) | {m.setting for m in measured}))
        self.sla = Sla(**cfg.bench.sla.model_dump())
        self.tolerance = cfg.bench.plan_tolerance
        self.choices = {c: choose(self.predictions, self.sla, c) for c in self.predictor.concurrencies}
        self.load = plan_cfg.load or max(self.predictor.concurrencies)
        self.adaptive = adaptive_config(self.predictions, self.sla, plan_cfg.adaptive_slack)
        self.check_top, self.held_out_count = plan_cfg.check_top, plan_cfg.held_out
        self.checked: list[Measurement] = []
        self.final: dict[int, tuple[Setting, str]] = {c: (ch.setting, "predicted only (not measured)")
                                                      for c, ch in self.choices.items()}

    # ---- what the check measures

    def settings_to_check(self) -> list[Setting]:
        """Per concurrency the `check_top` best predicted within the SLA, then `held_out` grid settings spread over
        the grid that were neither measured nor chosen (speculation off is the benchmark's already)."""
        picked: list[Setting] = []
        for c in self.predictor.concurrencies:
            ranked = sorted((p for p in self.predictions if p.concurrency == c and not self.sla.violations(p.as_dict())),
                            key=lambda p: -p.tok_s_per_gpu)
            picked += [p.setting for p in ranked[: self.check_top]]
        measured = {m.setting for m in self.measured}
        chosen = [s for s in dict.fromkeys(picked) if s.speculative and s not in measured]
        rest = [s for s in self.grid if s not in measured and s not in chosen]
        step = max(len(rest) // max(self.held_out_count, 1), 1)
        return chosen + rest[::step][: self.held_out_count]

    def with_check(self, rows: list[dict]) -> None:
        """Measured rows of the checked settings: errors per point and each pick kept or replaced."""
        self.checked = [Measurement.from_row(r) for r in rows]
        points = check_points(self.predictions, self.checked + self.measured)
        for c, choice in self.choices.items():
            self.final[c] = checked_choice(choice, points, self.checked + self.measured, self.sla, self.tolerance)

    # ---- output

    def launch_flags(self) -> list[str]:
        return self.final[self.load][0].launch_flags()

    def check_table(self) -> list[dict]:
        held = {m.setting for m in self.checked}
        return [{"setting": p.setting.label, "concurrency": p.concurrency, "predicted_tok_s": p.predicted_tok_s,
                 "measured_tok_s": p.measured_tok_s, "error": p.error,
                 "kind": "checked" if p.setting in held else "calibration"}
                for p in check_points(self.predictions, self.checked + self.measured)]

    def held_out_error(self) -> float | None:
        return mean_absolute_error(check_points(self.predictions, self.checked))

    def as_dict(self) -> dict[str, Any]:
        return {
            "sla": {k: v for k, v in vars(self.sla).items() if v is not None}, "tolerance": self.tolerance,
            "grid": [s.label for s in self.grid], "refused": self.refused,
            "cost_source": {str(c): "server" if m.server else "client" for c, m in self.predictor.costs.items()},
            "predictions": [p.as_dict() for p in self.predictions],
            "choices": [{"concurrency": c, "predicted": ch.setting.label, "within_sla": ch.within_sla, "why": ch.why,
                         "setting": self.final[c][0].label, "check": self.final[c][1],
                         "figures": ch.prediction.as_dict()} for c, ch in self.choices.items()],
            "frontier": {str(c): [p.setting.label for p in frontier(self.predictions, c)]
                         for c in self.predictor.concurrencies},
            "launch": {"load": self.load, "flags": self.launch_flags()},
            "adaptive_config": self.adaptive,
            "adaptive_flags": adaptive_launch_flags(self.adaptive, ADAPTIVE_FILE) if self.adaptive else None,
            "check": self.check_table(), "held_out_mae": self.held_out_error(),
        }


def render_markdown(plan: Plan, title: str) -> str:
    """plan.md: the picks per concurrency, the flags, the adaptive config and the check, one page."""
    d = plan.as_dict()
    lines = [f"# Serving plan: {title}", "", f"SLA: {plan.sla.describe()}; total tok/s per GPU is maximised.", "",
             "| concurrency | serve | predicted tok/s (per GPU) | per request | ITL p50 / p99 ms | TTFT p99 ms | "
             "why | check |", "|---|---|---|---|---|---|---|---|"]
    for choice in d["choices"]:
        f = choice["figures"]
        lines.append(f"| {choice['concurrency']} | {choice['setting']} | {f['tok_s_total']:.1f} ({f['tok_s_per_gpu']:.1f}) "
                     f"| {f['tok_s_per_request']:.1f} | {f['itl_ms_p50']:.1f} / {f['itl_ms_p99']:.1f} | "
                     f"{f['ttft_ms_p99']:.1f} | {choice['why']} | {choice['check']} |")
    lines += ["", f"SGLang launch flags at concurrency {plan.load}:", "", "```",
              " ".join(d["launch"]["flags"]) or "(no speculative flags: serve without speculation)", "```", ""]
    if d["adaptive_config"]:
        lines += ["The picks differ by load: SGLang's adaptive depth (`--speculative-adaptive`, topk 1 only) with "
                  f"this `{ADAPTIVE_FILE}` (tiers = batch sizes, candidate depths within the slack of the best):", "",
                  "```json", json.dumps(d["adaptive_config"], indent=1), "```", "", "```",
                  " ".join(d["adaptive_flags"]), "```", ""]
    else:
        lines += ["No adaptive config: the chain depths worth serving are the same at every load.", ""]
    if d["check"]:
        lines += ["Prediction vs measurement (total tok/s):", "", "| setting | concurrency | predicted | measured | "
                  "error | point |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['setting']} | {r['concurrency']} | {r['predicted_tok_s']:.1f} | {r['measured_tok_s']:.1f} | "
                  f"{r['error']:+.1%} | {r['kind']} |" for r in d["check"]]
        if d["held_out_mae"] is not None:
            lines += ["", f"Mean absolute error over the checked points: {d['held_out_mae']:.1%}."]
    lines += ["", f"Grid: {len(d['grid'])} settings as SGLang runs them; {len(d['refused'])} asked combinations "
              "SGLang cannot run were left out. Step costs from: " + ", ".join(
                  f"c{c} {src}" for c, src in d["cost_source"].items()) + "."]
    return "\n".join(lines) + "\n"


def frontier_figure(plan: Plan):
    """Total tok/s vs ITL p50 per concurrency: every predicted setting, the frontier, the pick, measured points."""
    from eagle3.figures import preview_figure

    concurrencies = plan.predictor.concurrencies
    fig, axes = preview_figure(len(concurrencies), row_height_in=2.6)
    measured = plan.measured + plan.checked
    for ax, c in zip(axes, concurrencies):
        here: list[Prediction] = [p for p in plan.predictions if p.concurrency == c]
        ax.scatter([1e3 * p.itl_p50_s for p in here], [p.tok_s_total for p in here], s=12, color="0.6",
                   label="predicted")
        front = frontier(plan.predictions, c)
        ax.plot([1e3 * p.itl_p50_s for p in front], [p.tok_s_total for p in front], color="C0", label="frontier")
        seen = [m for m in measured if m.concurrency == c]
        ax.scatter([1e3 * m.itl_p50_s for m in seen], [m.tok_s for m in seen], marker="x", color="C3",
                   label="measured")
        pick = plan.choices[c].prediction
        ax.scatter([1e3 * pick.itl_p50_s], [pick.tok_s_total], s=60, facecolors="none", edgecolors="C2",
                   label=f"pick {plan.final[c][0].label}")
        ax.set_title(f"concurrency {c}")
        ax.set_xlabel("ITL p50 (ms)")
        ax.set_ylabel("total tok/s")
        ax.legend(loc="best")
    return fig


def pick_metrics(plan: Plan) -> dict[str, float]:
    """`c<N>.tok_s_predicted`, `c<N>.speculative` (0/1) per concurrency and the checked points' error."""
    metrics: dict[str, float] = {}
    for c, choice in plan.choices.items():
        metrics[f"c{c}.tok_s_predicted"] = round(choice.prediction.tok_s_total, 1)
        metrics[f"c{c}.speculative"] = float(plan.final[c][0] != OFF)
    if (mae := plan.held_out_error()) is not None:
        metrics["held_out_mae"] = round(mae, 4)
    return metrics
