"""The watch's drift episodes across looks: one event per episode, a lull in the traffic is not the end of one."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tasks.watch.events import DRIFT
from tasks.watch.rules import Band, Window, drift_status
from tasks.watch.state import EndpointState, load_state, save_state
from tasks.watch.tick import Champion, TickResult, _judge_drift

BAND = Band(center=3.0, spread=0.1, lower=2.55, samples=4, accepted_by_position=[], settings={}, engine_version=None,
            source="test")
CFG = SimpleNamespace(watch=SimpleNamespace(cooldown_s=3600, for_windows=2, min_requests=20))
LOW, OK, QUIET = (2.0, 50), (3.0, 50), (2.0, 3)


@pytest.fixture(autouse=True)
def sent(monkeypatch) -> list[str]:
    """The events the tick emits, kept here: sending them is test_watch.py's subject (a real Prefect server)."""
    events: list[str] = []
    monkeypatch.setattr("tasks.watch.tick.emit", lambda event, resource, payload: events.append(event))
    return events


def look(state: EndpointState, champion: Champion, figures: list[tuple[float, int]], now: float) -> list[str]:
    """One look at the last two windows (accept length, requests), as Prometheus' range query returns them."""
    windows = [Window(end=now - 3 * i, seconds=3, generation_tokens=accept * 100, verify_calls=100, requests=requests)
               for i, (accept, requests) in reversed(list(enumerate(reversed(figures))))]
    result = TickResult("http://127.0.0.1:1")
    _judge_drift(CFG, state, result, {}, drift_status(windows, BAND, 2, 20), windows, champion, now)
    return result.events


def test_a_drift_is_one_event_until_a_window_is_back_in_the_band():
    state, champion = EndpointState(), Champion("draft", "1", band=BAND)
    assert look(state, champion, [LOW, LOW], now=100) == [DRIFT]
    assert look(state, champion, [LOW, QUIET], now=103) == []  # a lull: no verdict, no new episode
    assert look(state, champion, [QUIET, LOW], now=106) == []
    assert look(state, champion, [LOW, LOW], now=109) == []  # firing again: the same episode, in its cooldown
    assert look(state, champion, [LOW, LOW], now=100 + 3600) == [DRIFT]  # the cooldown is over, still drifting
    assert look(state, champion, [LOW, OK], now=3703) == []  # back in the band: the episode ends
    assert look(state, champion, [OK, LOW], now=3706) == []  # pending
    assert look(state, champion, [LOW, LOW], now=3709) == [DRIFT]  # a new episode: at once


def test_a_new_champion_drifting_is_a_new_episode():
    state = EndpointState()
    assert look(state, Champion("draft", "1", band=BAND), [LOW, LOW], now=100) == [DRIFT]
    assert look(state, Champion("draft", "2", band=BAND), [LOW, LOW], now=103) == [DRIFT]


def test_the_episode_records_the_champion_version_and_a_state_file_from_before_keeps_its_episode(tmp_path):
    """A drift episode saved before its version had a field of its own ("version V since T" only) is the same
    episode after the upgrade: no second event inside the cooldown; a new champion's drift still is a new one."""
    state, champion = EndpointState(), Champion("draft", "7", band=BAND)
    assert look(state, champion, [LOW, LOW], now=100) == [DRIFT]
    assert state.alerts["drift"] == {"episode": "version 7 since 97", "emitted_at": 100, "version": "7"}
    path = tmp_path / "endpoint.json"
    save_state(path, state)
    saved = json.loads(path.read_text())
    del saved["alerts"]["drift"]["version"]  # as the watch wrote it before
    path.write_text(json.dumps(saved))
    before = load_state(path)
    assert look(before, champion, [LOW, LOW], now=160) == []  # the same episode, in its cooldown
    assert look(before, Champion("draft", "8", band=BAND), [LOW, LOW], now=163) == [DRIFT]
