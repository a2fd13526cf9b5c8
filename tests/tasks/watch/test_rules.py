"""The watch's decisions on figures alone: windows from readings, the band, `for:` drift, changes, re-sending."""

from __future__ import annotations

import pytest

from tasks.watch.rules import (
    GENERATION_TOKENS,
    NUM_STEPS,
    REQUESTS,
    VERIFY_CALLS,
    Band,
    Reading,
    Window,
    band_from_evidence,
    changes_key,
    drift_status,
    served_changes,
    should_emit,
    window_between,
)

BAND = Band(center=3.0, spread=0.1, lower=2.55, samples=4, accepted_by_position=[], settings={}, engine_version=None,
            source="test")


def window(accept: float, requests: int = 50, end: float = 0.0) -> Window:
    return Window(end=end, seconds=10, generation_tokens=accept * 100, verify_calls=100, requests=requests)


def reading(at: float, tokens: float, verifies: float, requests: float, steps: float = 3) -> Reading:
    return Reading(at, {GENERATION_TOKENS: tokens, VERIFY_CALLS: verifies, REQUESTS: requests}, {NUM_STEPS: steps})


def test_a_window_is_the_increase_between_two_readings_and_a_restart_counts_from_zero():
    w = window_between(reading(100, 1000, 400, 10), reading(110, 1600, 600, 16))
    assert (w.seconds, w.generation_tokens, w.verify_calls, w.requests) == (10, 600, 200, 6)
    assert w.accept_length == 3.0 and w.tok_s == 60.0 and w.num_steps == 3
    restarted = window_between(reading(100, 1000, 400, 10), reading(110, 90, 60, 2, steps=0))
    assert (restarted.generation_tokens, restarted.verify_calls, restarted.requests) == (90, 60, 2)
    assert restarted.num_steps is None  # SGLang's gauge is 0 until its first decode log line: unknown


def test_the_band_is_the_mean_less_the_larger_of_sigmas_and_tolerance():
    evidence = {"levels": [{"concurrency": 1, "accept_length_samples": [3.0, 3.2, 2.8, 3.0],
                            "accepted_by_position": [0.9, 0.7, 0.5], "effective": {"num_steps": 3, "eagle_topk": 1,
                                                                                   "num_draft_tokens": 4}}]}
    band = band_from_evidence(evidence, tolerance=0.05, sigmas=3, source="t")
    assert band.center == pytest.approx(3.0) and band.spread == pytest.approx(0.163299, rel=1e-4)
    assert band.lower == pytest.approx(3.0 - 3 * 0.163299, rel=1e-4)  # 3 sd (0.49) > 5% of the mean (0.15)
    assert band_from_evidence(evidence, tolerance=0.25, sigmas=3, source="t").lower == pytest.approx(2.25)
    assert band.settings == {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}
    older = {"order": ["champion", "challenger"], "levels": [{"concurrency": 1, "accept_length": 2.5}]}
    assert band_from_evidence(older, 0.1, 3, "t").center == 2.5  # a version gated before the band tag
    assert band_from_evidence({"levels": []}, 0.1, 3, "t") is None


def test_drift_fires_only_after_for_consecutive_low_windows():
    assert drift_status([window(3.0), window(2.0)], BAND, 3, 20).state == "pending"
    assert drift_status([window(2.0), window(2.0), window(3.0)], BAND, 3, 20).state == "inactive"
    firing = drift_status([window(2.0)] * 3, BAND, 3, 20)
    assert firing.firing and firing.low_windows == 3 and firing.verdicts == ["low"] * 3


def test_low_traffic_never_alarms_and_resets_the_count():
    quiet = [window(1.0, requests=5)] * 5
    assert drift_status(quiet, BAND, 3, 20).state == "inactive"
    # a quiet window between low ones starts the count over, as an absent series resets a Prometheus alert
    assert drift_status([window(2.0), window(2.0), window(1.0, requests=3), window(2.0)], BAND, 3, 20).low_windows == 1
    assert drift_status([window(2.0)] * 3, None, 3, 20).state == "inactive"  # no band: not judged


def test_a_drift_episode_ends_only_on_a_window_back_in_the_band():
    lull = drift_status([window(2.0), window(1.0, requests=3)], BAND, 2, 20)
    assert not lull.firing and not lull.recovered  # a quiet window stops the count, not the episode
    assert not drift_status([window(1.0, requests=3)] * 2, BAND, 2, 20).recovered
    assert not drift_status([window(2.0)] * 2, None, 2, 20).recovered  # no band: no evidence either way
    back = drift_status([window(3.0), window(2.0)], BAND, 2, 20)
    assert back.state == "pending" and back.recovered  # judged in the band since it fired: a new episode next


def test_changes_name_the_setting_and_both_values():
    expected = {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4, "draft_sha256": "aa", "engine_version": "0.5.23"}
    same = {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4, "draft_sha256": "aa", "engine_version": "0.5.23",
            "adaptive": False, "live_num_steps": 3.0, "live_num_draft_tokens": None, "target_sha256": "tt"}
    assert served_changes(expected, same) == []  # unknown on one side (target) is no evidence of a change
    other = {**same, "num_steps": 2, "num_draft_tokens": 3, "draft_sha256": "bb", "adaptive": True, "live_num_steps": 5}
    lines = [c.line() for c in served_changes(expected, other)]
    assert lines == ["num_steps 3 -> 2", "num_draft_tokens 4 -> 3", "draft_sha256 aa -> bb",
                     "speculative_adaptive False -> True", "sglang:spec_num_steps 3 -> 5"]
    assert changes_key(served_changes(expected, other)) == changes_key(list(reversed(served_changes(expected, other))))


def test_an_alert_is_sent_on_a_new_episode_then_once_per_cooldown():
    state: dict = {}
    assert should_emit(True, "a", state, now=100, cooldown_s=60)
    state.update(episode="a", emitted_at=100)
    assert not should_emit(True, "a", state, now=150, cooldown_s=60)
    assert should_emit(True, "a", state, now=160, cooldown_s=60)
    assert should_emit(True, "b", state, now=101, cooldown_s=60)  # another change: at once
    assert not should_emit(False, "b", state, now=1000, cooldown_s=60)
