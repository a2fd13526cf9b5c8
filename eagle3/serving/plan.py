"""Which setting to serve at which load: the choice under a latency SLA, the frontier, SGLang's flags and its
`--speculative-adaptive-config`, and the check of predictions against measurement.

Owns the decisions, not the figures (those are `eagle3.serving.prediction`'s): per concurrency, the setting
with the highest total tok/s per GPU among those predicted within the SLA ("speculation off" when the
baseline wins); the throughput-vs-ITL frontier; an adaptive config whose batch-size tiers are the measured
concurrencies and whose candidate steps are the chain depths within `slack` of the best at each (SGLang
0.5.23 `srt/speculative/adaptive_spec_params.py`: a batch of size b uses the largest tier <= b, the smallest
tier below it; adaptive serves topk 1 only, depth 0 = speculation off); and `check`, which compares the
predictions with measured points and falls back to the measured best where the error exceeds a tolerance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from eagle3.serving.prediction import Measurement, Prediction
from eagle3.serving.spec_grid import OFF, Setting

SLA_FIELDS = ("itl_ms_p50", "itl_ms_p99", "ttft_ms_p99")


@dataclass(frozen=True)
class Sla:
    """Latency limits in ms (None: no limit on that figure)."""

    itl_ms_p50: float | None = None
    itl_ms_p99: float | None = None
    ttft_ms_p99: float | None = None

    def violations(self, figures: dict) -> list[str]:
        """`itl_ms_p99 41.2 > 30` for each limit the figures (Prediction.as_dict keys) exceed."""
        return [f"{name} {figures[name]:.1f} > {limit:g}" for name in SLA_FIELDS
                if (limit := getattr(self, name)) is not None and figures[name] > limit]

    def describe(self) -> str:
        limits = [f"{name} <= {getattr(self, name):g}" for name in SLA_FIELDS if getattr(self, name) is not None]
        return ", ".join(limits) or "no SLA"


@dataclass(frozen=True)
class Choice:
    concurrency: int
    prediction: Prediction
    within_sla: bool
    why: str

    @property
    def setting(self) -> Setting:
        return self.prediction.setting


def choose(predictions: Sequence[Prediction], sla: Sla, concurrency: int) -> Choice:
    """The setting with the most predicted tok/s per GPU within the SLA at this concurrency; when none is
    within it, the one that misses it least (the largest limit ratio smallest), said so."""
    here = [p for p in predictions if p.concurrency == concurrency]
    if not here:
        raise ValueError(f"no prediction at concurrency {concurrency}")
    within = [p for p in here if not sla.violations(p.as_dict())]
    if within:
        best = max(within, key=lambda p: (p.tok_s_per_gpu, -p.setting.num_draft_tokens))
        off = next((p for p in within if not p.setting.speculative), None)
        why = "the baseline is fastest within the SLA" if not best.setting.speculative else (
            f"{best.tok_s_per_gpu / off.tok_s_per_gpu:.2f}x the baseline's tok/s per GPU" if off else
            "the baseline misses the SLA")
        return Choice(concurrency, best, True, why)
    closest = min(here, key=lambda p: _worst_ratio(p, sla))
    return Choice(concurrency, closest, False, f"no setting meets {sla.describe()}; closest: "
                  + "; ".join(sla.violations(closest.as_dict())))


def _worst_ratio(p: Prediction, sla: Sla) -> float:
    figures = p.as_dict()
    return max(figures[name] / limit for name in SLA_FIELDS if (limit := getattr(sla, name)) is not None)


def frontier(predictions: Sequence[Prediction], concurrency: int) -> list[Prediction]:
    """Settings no other beats on both total tok/s and ITL p50 at this concurrency, by ITL."""
    here = sorted((p for p in predictions if p.concurrency == concurrency), key=lambda p: (p.itl_p50_s, -p.tok_s_total))
    front, best = [], -1.0
    for p in here:
        if p.tok_s_total > best:
            front.append(p)
            best = p.tok_s_total
    return front


def adaptive_config(predictions: Sequence[Prediction], sla: Sla, slack: float = 0.05) -> dict | None:
    """SGLang's --speculative-adaptive-config: per concurrency (a batch-size tier), the chain depths (0 = off)
    within `slack` of the best chain-or-off tok/s per GPU within the SLA. None when every tier has the same
    candidates (a static setting says it all) or no chain is within the SLA anywhere."""
    tiers: dict[str, dict] = {}
    for c in sorted({p.concurrency for p in predictions}):
        chains = [p for p in predictions if p.concurrency == c and (p.setting.chain or not p.setting.speculative)
                  and not sla.violations(p.as_dict())]
        if not chains:
            continue
        top = max(p.tok_s_per_gpu for p in chains)
        steps = sorted({p.setting.num_steps for p in chains if p.tok_s_per_gpu >= (1 - slack) * top})
        tiers[str(c)] = {"candidate_steps": steps}
    if not tiers or len({tuple(t["candidate_steps"]) for t in tiers.values()}) == 1:
        return None
    return tiers


def adaptive_launch_flags(config: dict, config_path: str) -> list[str]:
    """Flags that serve `config`: topk 1 and a starting depth that every tier's union holds (SGLang requires it)."""
    union = sorted({s for tier in config.values() for s in tier["candidate_steps"]})
    first = config[min(config, key=int)]["candidate_steps"]  # the lowest load's deepest candidate
    start = max(first) if max(first) > 0 else next((s for s in union if s > 0), 1)
    return ["--speculative-algorithm", "EAGLE3", "--speculative-adaptive", "--speculative-adaptive-config",
            config_path, "--speculative-num-steps", str(start), "--speculative-eagle-topk", "1"]


# --------------------------------------------------------------------------- checked against measurement


@dataclass(frozen=True)
class CheckedPoint:
    setting: Setting
    concurrency: int
    predicted_tok_s: float
    measured_tok_s: float
    measured_spread: tuple[float, float] | None

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_tok_s - self.measured_tok_s) / self.measured_tok_s


def check_points(predictions: Sequence[Prediction], measured: Sequence[Measurement]) -> list[CheckedPoint]:
    """Each measured point beside its prediction (points without a prediction are left out)."""
    by_key = {(p.setting, p.concurrency): p for p in predictions}
    return [CheckedPoint(m.setting, m.concurrency, by_key[(m.setting, m.concurrency)].tok_s_total, m.tok_s,
                         m.tok_s_spread) for m in measured if (m.setting, m.concurrency) in by_key]


def checked_choice(choice: Choice, points: Sequence[CheckedPoint], measured: Sequence[Measurement], sla: Sla,
                   tolerance: float) -> tuple[Setting, str]:
    """The plan's setting at the choice's concurrency after its check: kept when its measured tok/s is within
    `tolerance` of the prediction and its measured latencies within the SLA; else the measured best within the
    SLA (by measured ITL p50/p99 and TTFT p99), said so with the figures."""
    c = choice.concurrency
    point = next((p for p in points if p.setting == choice.setting and p.concurrency == c), None)
    if point is None:
        return choice.setting, "not measured: predicted only"
    pick = next(m for m in measured if m.setting == choice.setting and m.concurrency == c)
    missed = sla.violations(_measured_figures(pick))
    if abs(point.error) <= tolerance and not missed:
        return choice.setting, f"measured {point.measured_tok_s:.1f} tok/s, prediction off by {point.error:+.1%}"
    why = (f"measured {', '.join(missed)}" if missed and abs(point.error) <= tolerance else
           f"prediction off by {point.error:+.1%} (> bench.plan_tolerance {tolerance:.0%})")
    here = [m for m in measured if m.concurrency == c and not sla.violations(_measured_figures(m))]
    if not here:
        return choice.setting, f"{why} and no measured setting meets the SLA: kept"
    best = max(here, key=lambda m: m.tok_s)
    if best.setting == choice.setting:
        return choice.setting, f"{why}; still the measured best within the SLA ({best.tok_s:.1f} tok/s)"
    return best.setting, (f"{why}: the measured best within the SLA, {best.setting.label} at {best.tok_s:.1f} "
                          "tok/s, instead")


def _measured_figures(m: Measurement) -> dict:
    return {"itl_ms_p50": 1e3 * m.itl_p50_s, "itl_ms_p99": 1e3 * m.itl_p99_s, "ttft_ms_p99": 1e3 * m.ttft_p99_s}


def mean_absolute_error(points: Sequence[CheckedPoint]) -> float | None:
    return sum(abs(p.error) for p in points) / len(points) if points else None


def setting_flags(setting: Setting) -> list[str]:
    """Launch flags of a static choice (none for speculation off)."""
    return setting.launch_flags() if setting != OFF else []
