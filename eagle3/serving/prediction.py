"""Predicted serving figures of any speculative setting at any measured concurrency, from measured step costs
and the online acceptance by draft position.

Owns: `Measurement` (one benchmark row: a setting at a concurrency), `AcceptanceModel`, `CostModel` and
`predict`, which give per-request tok/s, total tok/s (and per GPU), ITL p50/p99 and TTFT p99 for a
`spec_grid.Setting` at a concurrency `c` the benchmark measured.

Assumptions (each is what the plan's check measures against):
- Load: a closed loop keeps `c` requests in flight, every request generates `max_new_tokens` tokens
  (ignore_eos) and the prompt count is a multiple of `c`, so a round is prompts/c waves of one request
  latency: total tok/s = c * max_new_tokens / latency, per-request tok/s = max_new_tokens / latency,
  latency = TTFT + (max_new_tokens - 1) / accept_length * iteration.
- Acceptance (greedy) does not depend on load. A chain's draft tokens 1..n are the same whatever its depth,
  so P(position k accepted) measured at depth m holds for every depth >= k; past the deepest measured
  position the conditional rate of the last measured position continues (geometric tail). A tree of topk K
  uses the measured profile of topk K (the tree with the most draft tokens; else of the nearest measured topk);
  with fewer draft tokens than that tree it moves towards the chain profile in proportion to its draft nodes
  beyond one; whatever its depth, it accepts at most num_draft_tokens - 1 drafts (SGLang verifies the
  num_draft_tokens - 1 best candidates over all depths, so a deeper tree of as many nodes is no better: seen
  on the tiny demo, 3/2/8 to 6/2/8 all accept 2.88). A measured setting keeps its own profile (pooled over
  the concurrencies it was measured at).
- One decode iteration at `c` (each request one verify) costs target verify + draft + draft extend + other.
  With the server's own forward timings (`eagle3.serving.step_costs`): verify is linear in draft tokens per
  request, fitted on the measured settings at `c` and the baseline decode step (a verify of 1 token); the
  draft is linear in depth, fitted per topk (proportional to depth with one measured depth; the nearest
  measured topk's cost where none); draft extend is proportional to the accept length; `other` is the
  median of the measured settings'. Without server timings: iteration = baseline step + a + b*depth (a line
  through the measured chains at `c`) + g per tree node beyond a chain's (the measured trees' median).
- TTFT = (measured TTFT - measured iteration), the median over the settings measured at `c`, + iteration:
  a new request waits about one iteration of the running batch, its prefill does not depend on the setting.
- ITL: a verify that accepts j drafts streams j+1 tokens after one iteration, so each gets iteration/(j+1);
  p50/p99 are token-weighted percentiles of that under the predicted acceptance, times the ratio measured /
  predicted at `c` (the jitter of the serving host), the median over the settings measured there.
- What the load law leaves out at `c` (gaps between a client's requests, the last verify's tokens past
  max_new_tokens, HTTP) is one factor: tok/s times the median of measured / predicted tok/s over the settings
  measured at `c`, each predicted from its own measured iteration.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from eagle3.serving.spec_grid import OFF, Setting


@dataclass(frozen=True)
class Measurement:
    """One benchmark row: a setting served at a concurrency (medians over the timed rounds)."""

    setting: Setting
    concurrency: int
    tok_s: float  # total output tok/s
    iteration_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    accepted_by_position: tuple[float, ...] = ()
    costs: dict = field(default_factory=dict, hash=False, compare=False)
    tok_s_spread: tuple[float, float] | None = None  # min, max over the timed rounds

    @classmethod
    def from_row(cls, row: dict) -> Measurement:
        """From a run_benchmark row (bench.json `rows`)."""
        costs = row.get("step_costs") or {}
        iteration = (costs.get("iteration_s") or {}).get("median")
        if iteration is None:
            raise ValueError(f"benchmark row {row.get('setting')} at concurrency {row.get('concurrency')} has no "
                             "step costs (measured before step costs were recorded?): re-run the benchmark")
        spread = (row["tok_s_min"], row["tok_s_max"]) if row.get("tok_s_min") is not None else None
        return cls(Setting.of(row.get("effective") if row.get("speculative") else None), int(row["concurrency"]),
                   float(row["tok_s_median"]), float(iteration), float(row["ttft_p99_s"]), float(row["itl_p50_s"]),
                   float(row["itl_p99_s"]), tuple(row.get("accepted_by_position") or ()), costs, spread)

    def cost(self, name: str) -> float | None:
        return (self.costs.get(f"{name}_s") or {}).get("median")


# --------------------------------------------------------------------------- acceptance


class AcceptanceModel:
    """P(draft position k accepted) for any setting, from the measured profiles (module docstring)."""

    def __init__(self, measured: Sequence[Measurement]) -> None:
        profiles: dict[Setting, list[tuple[float, ...]]] = {}
        for m in measured:
            if m.setting.speculative and m.accepted_by_position:
                profiles.setdefault(m.setting, []).append(m.accepted_by_position)
        if not profiles:
            raise ValueError("no measured speculative setting reports acceptance by draft position "
                             "(spec_correct_drafts_histogram): nothing to predict acceptance from")
        pooled = {s: [statistics.fmean(col) for col in zip(*ps)] for s, ps in profiles.items()}
        self.measured = pooled  # a measured setting keeps its own profile
        # per topk, the measured setting with the most draft tokens (the deepest, widest profile)
        self.by_topk: dict[int, tuple[Setting, list[float]]] = {}
        for s, p in sorted(pooled.items()):
            best = self.by_topk.get(s.eagle_topk)
            if best is None or (s.num_draft_tokens, s.num_steps) > (best[0].num_draft_tokens, best[0].num_steps):
                self.by_topk[s.eagle_topk] = (s, p)

    def positions(self, setting: Setting) -> list[float]:
        """[P(position 1 accepted), ..., P(position num_steps accepted)]; [] when speculation is off."""
        if not setting.speculative:
            return []
        if setting in self.measured:
            return _extended(self.measured[setting], setting.num_steps)
        reach = min(setting.num_steps, setting.num_draft_tokens - 1)  # a tree of n nodes is at most n deep
        chain = _extended(self._profile(1)[1], reach)
        if not setting.chain:
            measured_setting, profile = self._profile(setting.eagle_topk)
            tree = _extended(profile, reach)
            share = _node_share(setting, measured_setting)
            chain = [c + (t - c) * share for c, t in zip(chain, tree)]
        return chain + [0.0] * (setting.num_steps - reach)

    def accept_length(self, setting: Setting) -> float:
        """Tokens per verify: 1 (the bonus token) + expected accepted drafts."""
        return 1.0 + sum(self.positions(setting))

    def histogram(self, setting: Setting) -> list[float]:
        """P(exactly j drafts accepted), j = 0..num_steps."""
        p = [1.0, *self.positions(setting), 0.0]
        return [max(p[j] - p[j + 1], 0.0) for j in range(len(p) - 1)]

    def _profile(self, topk: int) -> tuple[Setting, list[float]]:
        if topk in self.by_topk:
            return self.by_topk[topk]
        nearest = min(self.by_topk, key=lambda k: (abs(k - topk), k))
        return self.by_topk[nearest]


def _extended(profile: Sequence[float], depth: int) -> list[float]:
    """The profile truncated or extended to `depth` positions (geometric tail at the last conditional rate)."""
    out = list(profile[:depth])
    if not out:
        return [0.0] * depth
    rate = out[-1] / out[-2] if len(out) >= 2 and out[-2] > 0 else out[-1]
    while len(out) < depth:
        out.append(out[-1] * min(rate, 1.0))
    return out


def _node_share(setting: Setting, measured: Setting) -> float:
    """How far a tree lies from the chain towards the measured tree of its topk: by its draft nodes beyond the one
    node a 1-deep chain has, against the measured tree's (a deeper tree of as many nodes is no wider: SGLang keeps
    the num_draft_tokens - 1 best candidates over all depths)."""
    if measured.eagle_topk != setting.eagle_topk or measured.num_draft_tokens <= 2:
        return 1.0 if measured.eagle_topk == setting.eagle_topk else 0.0
    return min(max((setting.num_draft_tokens - 2) / (measured.num_draft_tokens - 2), 0.0), 1.0)


# --------------------------------------------------------------------------- costs


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope through the origin, clipped at 0 (a cost does not fall with more work)."""
    den = sum(x * x for x in xs)
    return max(sum(x * y for x, y in zip(xs, ys)) / den, 0.0) if den else 0.0


def _line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope >= 0) through the points; through the origin when all share one x."""
    if len({x for x, _ in points}) < 2:
        return 0.0, _slope([x for x, _ in points], [y for _, y in points])
    mx, my = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
    slope = _slope([x - mx for x, _ in points], [y - my for _, y in points])
    return my - slope * mx, slope


class CostModel:
    """Seconds of one decode iteration of any setting at one concurrency (module docstring)."""

    def __init__(self, measured: Sequence[Measurement], concurrency: int, acceptance: AcceptanceModel) -> None:
        here = [m for m in measured if m.concurrency == concurrency]
        base = [m for m in here if not m.setting.speculative]
        spec = [m for m in here if m.setting.speculative]
        if not base or not spec:
            raise ValueError(f"concurrency {concurrency}: the prediction needs the baseline and at least one "
                             f"speculative setting measured there (measured: {[m.setting.label for m in here]})")
        self.concurrency, self.acceptance = concurrency, acceptance
        self.baseline = base[0]
        self.server = all(m.cost("target_verify") is not None and m.cost("eagle_draft") is not None for m in spec) \
            and self.baseline.cost("decode") is not None
        self._fit_server(spec) if self.server else self._fit_client(spec)

    def _fit_server(self, spec: Sequence[Measurement]) -> None:
        points = [(1.0, self.baseline.cost("decode"))] + [(m.setting.num_draft_tokens, m.cost("target_verify"))
                                                          for m in spec]
        self.verify = _line(points)  # v0 + v1 * draft tokens
        self.draft = {k: _line([(m.setting.num_steps, m.cost("eagle_draft")) for m in spec if m.setting.eagle_topk == k])
                      for k in sorted({m.setting.eagle_topk for m in spec})}  # topk -> d0 + d1 * depth
        extend = [(m.cost("eagle_draft_extend") or 0.0) / acc for m in spec
                  if (acc := self.acceptance.accept_length(m.setting)) > 0]
        self.extend_per_token = statistics.median(extend) if extend else 0.0
        self.other = statistics.median([m.iteration_s - (m.cost("target_verify") or 0.0) - (m.cost("eagle_draft")
                                        or 0.0) - (m.cost("eagle_draft_extend") or 0.0) for m in spec])

    def _fit_client(self, spec: Sequence[Measurement]) -> None:
        """iteration - baseline step = a + b * depth (+ g * tree nodes beyond a chain's, from measured trees)."""
        extra = [(m.setting, m.iteration_s - self.baseline.iteration_s) for m in spec]
        chains = [(s.num_steps, e) for s, e in extra if s.chain] or [(s.num_steps, e) for s, e in extra]
        self.client = _line(chains)
        trees = [(e - self.client[0] - self.client[1] * s.num_steps) / nodes for s, e in extra
                 if (nodes := s.num_draft_tokens - 1 - s.num_steps) > 0]
        self.client_tree_node = max(statistics.median(trees), 0.0) if trees else 0.0

    def iteration_s(self, setting: Setting) -> float:
        """Predicted seconds of one decode iteration at this concurrency."""
        if not setting.speculative:
            return self.baseline.iteration_s
        if not self.server:
            a, b = self.client
            nodes = setting.num_draft_tokens - 1 - setting.num_steps
            return self.baseline.iteration_s + a + b * setting.num_steps + self.client_tree_node * max(nodes, 0)
        v0, v1 = self.verify
        k = min(self.draft, key=lambda t: (abs(t - setting.eagle_topk), t))
        d0, d1 = self.draft[k]
        return (v0 + v1 * setting.num_draft_tokens + d0 + d1 * setting.num_steps
                + self.extend_per_token * self.acceptance.accept_length(setting) + self.other)


# --------------------------------------------------------------------------- the prediction


@dataclass(frozen=True)
class Prediction:
    setting: Setting
    concurrency: int
    accept_length: float
    iteration_s: float
    tok_s_per_request: float
    tok_s_total: float
    tok_s_per_gpu: float
    itl_p50_s: float
    itl_p99_s: float
    ttft_p99_s: float

    def as_dict(self) -> dict:
        return {"setting": self.setting.label, "concurrency": self.concurrency,
                "accept_length": self.accept_length, "iteration_ms": 1e3 * self.iteration_s,
                "tok_s_per_request": self.tok_s_per_request, "tok_s_total": self.tok_s_total,
                "tok_s_per_gpu": self.tok_s_per_gpu, "itl_ms_p50": 1e3 * self.itl_p50_s,
                "itl_ms_p99": 1e3 * self.itl_p99_s, "ttft_ms_p99": 1e3 * self.ttft_p99_s}


def token_itl_percentile(histogram: Sequence[float], iteration_s: float, q: float) -> float:
    """q-th percentile (0..100) of per-token ITL when j accepted drafts give j+1 tokens of iteration/(j+1) each.

    Example: histogram [0.5, 0.5] (half the verifies accept nothing, half one draft), iteration 30 ms: tokens
    at 30 ms weigh 0.5, at 15 ms 1.0 -> p50 = 15 ms, p99 = 30 ms.
    """
    weighted = sorted((iteration_s / (j + 1), p * (j + 1)) for j, p in enumerate(histogram) if p > 0)
    total = sum(w for _, w in weighted)
    seen = 0.0
    for value, weight in weighted:
        seen += weight
        if seen >= total * q / 100.0 - 1e-12:
            return value
    return weighted[-1][0]


class Predictor:
    """Predictions for every setting at every measured concurrency (the assumptions: module docstring).

    Args:
        measured: the benchmark's rows as Measurements (baseline and >= 1 speculative setting per concurrency).
        max_new_tokens: tokens per request, as the benchmark generated them.
        gpus: GPUs one server uses (tensor parallel), for tok/s per GPU.
    """

    def __init__(self, measured: Sequence[Measurement], max_new_tokens: int, gpus: int = 1) -> None:
        self.measured, self.max_new_tokens, self.gpus = list(measured), max_new_tokens, gpus
        self.acceptance = AcceptanceModel(self.measured)
        self.concurrencies = sorted({m.concurrency for m in self.measured})
        self.costs = {c: CostModel(self.measured, c, self.acceptance) for c in self.concurrencies}
        self._calibration = {c: self._calibrate(c) for c in self.concurrencies}

    def predict(self, setting: Setting, concurrency: int) -> Prediction:
        iteration = self.costs[concurrency].iteration_s(setting)
        return self._figures(setting, concurrency, iteration, self._calibration[concurrency])

    def _figures(self, setting: Setting, c: int, iteration: float,
                 calibration: tuple[float, float, float, float]) -> Prediction:
        wait, jitter50, jitter99, efficiency = calibration
        accept = self.acceptance.accept_length(setting) if setting.speculative else 1.0
        histogram = self.acceptance.histogram(setting) if setting.speculative else [1.0]
        ttft = wait + iteration
        latency = ttft + (self.max_new_tokens - 1) / accept * iteration
        per_request = efficiency * self.max_new_tokens / latency
        return Prediction(setting, c, accept, iteration, per_request, c * per_request, c * per_request / self.gpus,
                          jitter50 * token_itl_percentile(histogram, iteration, 50),
                          jitter99 * token_itl_percentile(histogram, iteration, 99), ttft)

    def _calibrate(self, c: int) -> tuple[float, float, float, float]:
        """(prefill wait, ITL p50 ratio, ITL p99 ratio, tok/s ratio) at c from the measured settings (docstring)."""
        here = [m for m in self.measured if m.concurrency == c]
        wait = statistics.median(max(m.ttft_p99_s - m.iteration_s, 0.0) for m in here)
        raw = [self._figures(m.setting, c, m.iteration_s, (wait, 1.0, 1.0, 1.0)) for m in here]
        r50 = statistics.median(m.itl_p50_s / p.itl_p50_s for m, p in zip(here, raw) if p.itl_p50_s > 0)
        r99 = statistics.median(m.itl_p99_s / p.itl_p99_s for m, p in zip(here, raw) if p.itl_p99_s > 0)
        efficiency = statistics.median(m.tok_s / p.tok_s_total for m, p in zip(here, raw) if p.tok_s_total > 0)
        return wait, r50, r99, efficiency

    def grid(self, settings: Sequence[Setting]) -> list[Prediction]:
        """Every setting (and speculation off) at every concurrency."""
        everything = [OFF] + [s for s in settings if s.speculative]
        return [self.predict(s, c) for c in self.concurrencies for s in everything]
