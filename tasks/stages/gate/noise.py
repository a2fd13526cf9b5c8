"""How much one measured figure beats another, and how sure that is given the measured spread.

Owns `relative_gain`: the gain of a challenger's samples over a champion's (tok/s per benchmark
round, say) as the ratio of their geometric means, with one-sided confidence bounds from
Welch's t on the log values (unequal spreads, small samples). The nightly gate promotes on the
lower bound, never on a difference of medians.

Risk: the bound is only as honest as the samples are independent. Rounds measured back to back
on one server share its warm state and the host's load at that moment; the gate serves each
draft anew every round, interleaved, so launch-to-launch and drift noise land in the spread.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def relative_gain(new: Sequence[float], old: Sequence[float], confidence: float) -> dict[str, float | int | None]:
    """{gain, low, high, n_new, n_old}: new over old, geometric-mean ratio - 1, and its one-sided bounds.

    `low` is the gain that is exceeded with probability `confidence` (Welch's t on log values);
    `high` the mirror bound. With fewer than two samples on a side the spread is unknown: both
    bounds are None. Identical samples on both sides have no spread: the bounds equal the gain.
    Worked example: new [102, 104], old [100, 101], confidence 0.95 -> gain +2.5%, low -1.6%, high +6.7%.
    """
    if any(v <= 0 for v in (*new, *old)):
        raise ValueError(f"relative_gain needs positive figures, found new {list(new)} old {list(old)}")
    x, y = [math.log(v) for v in new], [math.log(v) for v in old]
    diff = statistics.fmean(x) - statistics.fmean(y)
    out: dict[str, float | int | None] = {"gain": math.exp(diff) - 1, "low": None, "high": None,
                                          "n_new": len(x), "n_old": len(y)}
    if len(x) < 2 or len(y) < 2:
        return out
    vx, vy = statistics.variance(x) / len(x), statistics.variance(y) / len(y)
    se = math.sqrt(vx + vy)
    if se == 0:
        out["low"] = out["high"] = out["gain"]
        return out
    df = (vx + vy) ** 2 / (vx**2 / (len(x) - 1) + vy**2 / (len(y) - 1))  # Welch-Satterthwaite
    from scipy.stats import t as student_t

    margin = float(student_t.ppf(confidence, df)) * se
    out["low"], out["high"] = math.exp(diff - margin) - 1, math.exp(diff + margin) - 1
    return out
