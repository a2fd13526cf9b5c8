"""The watch's decisions, as plain functions of figures: no Prefect, MLflow, HTTP or SSH here.

Owns what an on-call engineer would otherwise judge by eye on a dashboard:
- a window's figures from two counter readings (`window_between`; a counter that went down is a
  restarted server: the new reading counts from zero, as Prometheus' `increase()` does);
- the band the served accept length should stay in, from the champion's gate evidence (`band_from_evidence`);
- drift with Prometheus `for:` semantics (`drift_status`): an alert is *pending* while the condition
  holds and *firing* once it held for `for` consecutive windows; a window with fewer than
  `min_requests` requests has no verdict and resets the count, as an absent series resets a Prometheus
  alert, so low traffic never alarms; a drift *episode* (what its events are about) ends only on a window
  back in the band (`DriftStatus.recovered`): a quiet window says nothing either way, so a firing drift that a
  lull interrupts and that fires again is the same episode, under the same cooldown;
- served settings and identities other than the recorded ones (`served_changes`);
- when an alert is worth an event again (`should_emit`: on a new episode or a new change, then at most
  once per cooldown while it lasts).

Risk: a band too tight alarms on healthy traffic that differs from the benchmark prompts; the lower bound
is the champion's mean minus the larger of `sigmas` standard deviations and `tolerance` of the mean.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

# Counters and gauges of a reading, under SGLang's Prometheus names (srt/observability/metrics_collector.py).
GENERATION_TOKENS = "sglang:generation_tokens_total"
VERIFY_CALLS = "sglang:spec_verify_calls_total"
REQUESTS = "sglang:num_requests_total"
COUNTERS = (GENERATION_TOKENS, VERIFY_CALLS, REQUESTS)
NUM_STEPS = "sglang:spec_num_steps"
NUM_DRAFT_TOKENS = "sglang:spec_num_draft_tokens"
ACCEPT_RATE = "sglang:spec_accept_rate"
GAUGES = (NUM_STEPS, NUM_DRAFT_TOKENS, ACCEPT_RATE)
# /server_info's resolved names of the settings a champion was measured with.
SETTING_KEYS = {"num_steps": "speculative_num_steps", "eagle_topk": "speculative_eagle_topk",
                "num_draft_tokens": "speculative_num_draft_tokens"}


@dataclass(frozen=True)
class Reading:
    """Counters and gauges of one server at one time (`at`: seconds since the epoch)."""

    at: float
    counters: dict[str, float]
    gauges: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Window:
    """What one window served: increases of the counters over `seconds`, the gauges at its end."""

    end: float
    seconds: float
    generation_tokens: float
    verify_calls: float
    requests: float
    num_steps: float | None = None
    num_draft_tokens: float | None = None
    accept_rate: float | None = None

    @property
    def accept_length(self) -> float | None:
        """Tokens per verify forward (SGLang's accept length: accepted drafts + the bonus token)."""
        return self.generation_tokens / self.verify_calls if self.verify_calls > 0 else None

    @property
    def tok_s(self) -> float:
        return self.generation_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def request_rate(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    def figures(self) -> dict[str, float]:
        """The window's numbers (what MLflow and the events carry); unknown ones left out."""
        shown = {"accept_length": self.accept_length, "accept_rate": self.accept_rate, "num_steps": self.num_steps,
                 "num_draft_tokens": self.num_draft_tokens, "tok_s": self.tok_s, "request_rate": self.request_rate,
                 "requests": self.requests, "window_s": self.seconds}
        return {k: round(float(v), 6) for k, v in shown.items() if v is not None}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def window_between(before: Reading, after: Reading) -> Window:
    """The window from one reading to the next; a counter that went down restarted (its new value is the increase)."""
    def increase(name: str) -> float:
        old, new = before.counters.get(name, 0.0), after.counters.get(name, 0.0)
        return new - old if new >= old else new

    gauges = after.gauges
    return Window(end=after.at, seconds=max(after.at - before.at, 0.0), generation_tokens=increase(GENERATION_TOKENS),
                  verify_calls=increase(VERIFY_CALLS), requests=increase(REQUESTS),
                  num_steps=_known(gauges.get(NUM_STEPS)), num_draft_tokens=_known(gauges.get(NUM_DRAFT_TOKENS)),
                  accept_rate=gauges.get(ACCEPT_RATE))


def _known(value: float | None) -> float | None:
    """SGLang sets the settings gauges at its first decode log line: 0 until then means unknown, not 0 steps."""
    return value if value else None


# ------------------------------------------------------------------ the band


@dataclass(frozen=True)
class Band:
    """Where the served accept length should be: `lower` is the alarm line."""

    center: float
    spread: float
    lower: float
    samples: int
    accepted_by_position: list[float]
    settings: dict[str, int]  # the effective num_steps / eagle_topk / num_draft_tokens the champion was measured at
    engine_version: str | None
    source: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def band_from_evidence(evidence: dict[str, Any], tolerance: float, sigmas: float, source: str) -> Band | None:
    """The band from a champion's recorded gate figures; None when they hold no accept length.

    `evidence` is the version's `eagleops.gate.band` tag (per concurrency level the accept-length samples
    of each round, the acceptance by position, the effective settings) or, for versions gated before it
    existed, the `levels` of `eagleops.gate.evidence` (the mean accept length of each level only).
    lower = mean - max(sigmas * stdev, tolerance * mean).
    """
    levels = evidence.get("levels") or []
    samples = [float(s) for level in levels for s in (level.get("accept_length_samples") or [])]
    if not samples:
        samples = [float(level["accept_length"]) for level in levels if level.get("accept_length") is not None]
    if not samples:
        return None
    center = statistics.fmean(samples)
    spread = statistics.stdev(samples) if len(samples) > 1 else 0.0
    first = levels[0]
    return Band(center=center, spread=spread, lower=center - max(sigmas * spread, tolerance * center),
                samples=len(samples), accepted_by_position=list(first.get("accepted_by_position") or []),
                settings={k: int(v) for k, v in (first.get("effective") or {}).items() if k in SETTING_KEYS and v},
                engine_version=evidence.get("engine_version"), source=source)


# ------------------------------------------------------------------ drift


@dataclass(frozen=True)
class DriftStatus:
    """`state`: inactive | pending | firing (Prometheus' alert states); `low_windows`: trailing windows below the band."""

    state: str
    low_windows: int
    needed: int
    verdicts: list[str]  # per window, oldest first: low | ok | quiet (too few requests: no verdict)

    @property
    def firing(self) -> bool:
        return self.state == "firing"

    @property
    def recovered(self) -> bool:
        """A window judged back in the band: evidence the drift is over (a quiet window is no evidence)."""
        return "ok" in self.verdicts


def window_verdict(window: Window, band: Band, min_requests: int) -> str:
    if window.requests < min_requests or window.accept_length is None:
        return "quiet"
    return "low" if window.accept_length < band.lower else "ok"


def drift_status(windows: list[Window], band: Band | None, for_windows: int, min_requests: int) -> DriftStatus:
    """Drift over the windows given (oldest first): firing once the last `for_windows` were all low."""
    if band is None:
        return DriftStatus("inactive", 0, for_windows, [])
    verdicts = [window_verdict(w, band, min_requests) for w in windows]
    low = 0
    for verdict in reversed(verdicts):
        if verdict != "low":
            break
        low += 1
    state = "firing" if low >= for_windows else "pending" if low else "inactive"
    return DriftStatus(state, low, for_windows, verdicts)


# ------------------------------------------------------------------ change


@dataclass(frozen=True)
class Change:
    """One served setting or identity other than the recorded one."""

    setting: str
    expected: Any
    served: Any

    def line(self) -> str:
        return f"{self.setting} {self.expected} -> {self.served}"


def served_changes(expected: dict[str, Any], served: dict[str, Any]) -> list[Change]:
    """What the server runs other than what the champion was measured with.

    `expected` / `served`: {num_steps, eagle_topk, num_draft_tokens, adaptive, draft_sha256, target_sha256,
    engine_version, and served only: live_num_steps / live_num_draft_tokens (the gauges)}. A value unknown on
    either side is no evidence of a change. The gauges are compared with the recorded settings too: SGLang's
    adaptive mode changes the depth while serving, and its flags then still show the launch values.
    """
    changes = [Change(key, expected[key], served[key]) for key in
               ("num_steps", "eagle_topk", "num_draft_tokens", "draft_sha256", "target_sha256", "engine_version")
               if expected.get(key) is not None and served.get(key) is not None and expected[key] != served[key]]
    if served.get("adaptive"):
        changes.append(Change("speculative_adaptive", False, True))
    for live, recorded in (("live_num_steps", "num_steps"), ("live_num_draft_tokens", "num_draft_tokens")):
        value, want = served.get(live), expected.get(recorded)
        if value is not None and want is not None and int(value) != int(want):
            changes.append(Change(f"sglang:spec_{recorded}", want, int(value)))
    return changes


def changes_key(changes: list[Change]) -> str:
    """One string per distinct set of changes (a new change is a new episode)."""
    return ";".join(sorted(c.line() for c in changes))


# ------------------------------------------------------------------ emitting


def should_emit(active: bool, episode: str, state: dict[str, Any], now: float, cooldown_s: float) -> bool:
    """An event for this alert now? On a new episode (`episode` differs from the last one emitted), then again only
    after `cooldown_s` while it lasts; never while inactive. `state` is the alert's record ({episode, emitted_at})."""
    if not active:
        return False
    if state.get("episode") != episode:
        return True
    return now - float(state.get("emitted_at", 0.0)) >= cooldown_s
