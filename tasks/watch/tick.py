"""One look at one production server: read, decide, tell (events, log line, MLflow), remember.

    /server_info ──no answer──▶ unreachable (its own alert, never a drift)
        │
    /metrics (always: the live gauges, and the windows when Prometheus cannot be used)
    Prometheus (watch.prometheus) ──no answer / no series──▶ one line, the scraped windows instead
        │
    windows ─▶ drift (band, watch.for, watch.min_requests)     settings + digests ─▶ changes
        │
    events (on a new episode, then once per watch.cooldown_s) · one log line · the newest window to MLflow

Every failure of the outside world ends as one line and an answer; the tick never raises for it, so a
scheduled watch keeps watching.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.config.schema import ExperimentConfig
from tasks.config.secrets import redact
from tasks.hosts.remote import RemoteError, connect
from tasks.log import logger
from tasks.watch.events import CHANGED, DRIFT, UNREACHABLE, emit, served_resource
from tasks.watch.identity import expected_identity, live_settings, served_digests, served_settings
from tasks.watch.monitor import MonitoringRun
from tasks.watch.rules import (
    Band,
    DriftStatus,
    Window,
    changes_key,
    drift_status,
    served_changes,
    should_emit,
    window_between,
)
from tasks.watch.sources import SourceError, prometheus_windows, read_server_info, scrape_reading
from tasks.watch.state import EndpointState, load_state, save_state, state_path


@dataclass
class Champion:
    """The model version the watch holds the servers to (name None: no champion known)."""

    name: str | None
    version: str | None
    tags: dict[str, str] = field(default_factory=dict)
    band: Band | None = None


@dataclass
class TickResult:
    endpoint: str
    source: str | None = None  # prometheus | scrape | None (no window this tick)
    window: dict[str, float] | None = None
    drift: str = "inactive"
    low_windows: int = 0
    changes: list[dict[str, Any]] = field(default_factory=list)
    unreachable: str | None = None
    events: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    def say(self, line: str, warn: bool = False) -> None:
        line = redact(line)
        self.lines.append(line)
        (logger().warning if warn else logger().info)(line)


def watch_endpoints(cfg: ExperimentConfig) -> list[str]:
    """watch.endpoints, else the server a run deploys on this machine; ValueError naming the field otherwise."""
    if cfg.watch.endpoints:
        return list(cfg.watch.endpoints)
    if cfg.deploy.host != "local":
        raise ValueError(f"watch.endpoints: deploy.host '{cfg.deploy.host}' serves on its own 127.0.0.1; name the "
                         "address the watch reaches it at (http://host:port)")
    return [f"http://127.0.0.1:{cfg.deploy.port}"]


@task(name="watch_endpoint", cache_policy=NO_CACHE)
def watch_endpoint(cfg: ExperimentConfig, endpoint: str, champion: Champion, monitor: MonitoringRun | None,
                   metric_prefix: str = "") -> TickResult:
    """Read one server, decide, emit, log the newest window, remember (see the module docstring)."""
    path = state_path(cfg.runs_root, cfg.experiment, endpoint)
    state, result, now = load_state(path), TickResult(endpoint), time.time()
    resource = served_resource(endpoint, champion.name, champion.version)
    try:
        info = read_server_info(endpoint, cfg.watch.timeout_s)
    except SourceError as err:
        _unreachable(cfg, state, result, resource, "server", str(err), now)
        save_state(path, state)
        return result
    state.alerts.pop("unreachable.server", None)  # it answers: the next outage is a new episode
    windows = _windows(cfg, endpoint, state, result, resource, now)
    result.window = windows[-1].figures() if windows else None
    drift = drift_status(windows, champion.band, cfg.watch.for_windows, cfg.watch.min_requests)
    _judge_drift(cfg, state, result, resource, drift, windows, champion, now)
    _judge_changes(cfg, state, result, resource, info, windows, champion, now)
    if windows and windows[-1].end > state.last_window_end and monitor is not None:
        state.logged_windows += 1
        monitor.log_window(windows[-1], champion.band, state.logged_windows, metric_prefix)
        state.last_window_end = windows[-1].end
    result.say(_summary(endpoint, result, drift, champion.band, windows))
    save_state(path, state)
    return result


# ------------------------------------------------------------------ reading


def _windows(cfg: ExperimentConfig, endpoint: str, state: EndpointState, result: TickResult,
             resource: dict[str, str], now: float) -> list[Window]:
    """The windows to judge: Prometheus' when it answers with series, else the scraped ones (kept in the state)."""
    scraped = _scrape(cfg, endpoint, state, result)
    if cfg.watch.prometheus:
        try:
            windows = prometheus_windows(cfg.watch.prometheus, endpoint, cfg.watch.window_s, cfg.watch.for_windows,
                                         cfg.watch.timeout_s, now)
        except SourceError as err:
            _prometheus_failed(cfg, state, result, resource, err, now)
        else:
            state.alerts.pop("unreachable.prometheus", None)
            result.source = "prometheus"
            return windows
    if scraped is not None:
        result.source = "scrape"
        return list(state.windows)
    return []


def _scrape(cfg: ExperimentConfig, endpoint: str, state: EndpointState, result: TickResult) -> Window | None:
    """Read /metrics; the window since the last reading joins the state's (None: no reading, or the first one)."""
    try:
        reading = scrape_reading(endpoint, cfg.watch.timeout_s)
    except SourceError as err:
        result.say(f"{err}; no window from /metrics this time", warn=True)
        return None
    previous, state.reading = state.reading, reading
    if previous is None:
        return None
    window = window_between(previous, reading)
    state.windows.append(window)
    state.keep_windows(cfg.watch.for_windows)
    return window


def _prometheus_failed(cfg: ExperimentConfig, state: EndpointState, result: TickResult, resource: dict[str, str],
                       err: SourceError, now: float) -> None:
    from tasks.watch.sources import Unreachable

    result.say(f"cannot see through Prometheus: {err}; scraping {result.endpoint}/metrics directly", warn=True)
    if isinstance(err, Unreachable):
        _unreachable(cfg, state, result, resource, "prometheus", str(err), now, already_said=True)


# ------------------------------------------------------------------ deciding and telling


def _unreachable(cfg: ExperimentConfig, state: EndpointState, result: TickResult, resource: dict[str, str],
                 what: str, reason: str, now: float, already_said: bool = False) -> None:
    result.unreachable = reason
    if not already_said:
        result.say(f"{result.endpoint}: unreachable: {reason} (not a drift; the watch keeps watching)", warn=True)
    alert = state.alerts.setdefault(f"unreachable.{what}", {})
    if should_emit(True, what, alert, now, cfg.watch.cooldown_s):
        _send(result, alert, UNREACHABLE, what, now, resource, {"what": what, "reason": reason,
                                                                "endpoint": result.endpoint})


def _judge_drift(cfg: ExperimentConfig, state: EndpointState, result: TickResult, resource: dict[str, str],
                 drift: DriftStatus, windows: list[Window], champion: Champion, now: float) -> None:
    result.drift, result.low_windows = drift.state, drift.low_windows
    alert = state.alerts.setdefault("drift", {})
    if not drift.firing:
        if drift.recovered:
            alert.pop("episode", None)  # back in the band: the next drift is a new episode
            alert.pop("version", None)
        return
    episode = alert.get("episode")
    if episode is None or alert.get("version") != champion.version:  # none yet, or another champion's
        episode = f"version {champion.version} since {windows[-drift.low_windows].end:.0f}"
    if should_emit(True, episode, alert, now, cfg.watch.cooldown_s):
        band = champion.band
        payload = {"accept_length": windows[-1].accept_length, "band_lower": band.lower, "band_center": band.center,
                   "band_spread": band.spread, "band_source": band.source, "for": cfg.watch.for_windows,
                   "min_requests": cfg.watch.min_requests, "low_windows": drift.low_windows, "source": result.source,
                   "windows": [w.figures() for w in windows[-drift.low_windows:]], "endpoint": result.endpoint}
        _send(result, alert, DRIFT, episode, now, resource, payload)
        alert["version"] = champion.version  # whose episode it is


def _judge_changes(cfg: ExperimentConfig, state: EndpointState, result: TickResult, resource: dict[str, str],
                   info: dict[str, Any], windows: list[Window], champion: Champion, now: float) -> None:
    served = {**served_settings(info), **live_settings(windows[-1] if windows else state.reading),
              **_digests(cfg, info, result)}
    if state.baseline.get("model_version") != champion.version:  # first seen serving this version
        state.baseline = {"model_version": champion.version, "target_sha256": served.get("target_sha256"),
                          "engine_version": served.get("engine_version")}
    expected = expected_identity(champion.band, champion.tags, state.baseline)
    changes = served_changes(expected, served)
    result.changes = [{"setting": c.setting, "expected": c.expected, "served": c.served} for c in changes]
    alert = state.alerts.setdefault("changed", {})
    if not changes:
        alert.pop("episode", None)
        return
    key = changes_key(changes)
    if should_emit(True, key, alert, now, cfg.watch.cooldown_s):
        payload = {"changes": result.changes, "summary": "; ".join(c.line() for c in changes),
                   "endpoint": result.endpoint, "served": {k: v for k, v in served.items() if v is not None}}
        result.say(f"{result.endpoint}: served other than the champion was measured with: {payload['summary']}",
                   warn=True)
        _send(result, alert, CHANGED, key, now, resource, payload)


def _digests(cfg: ExperimentConfig, info: dict[str, Any], result: TickResult) -> dict[str, Any]:
    if not cfg.watch.digests:
        return {}
    host = cfg.watch.host or cfg.deploy.host
    try:
        executor = connect(host, cfg.hosts)
        try:
            return served_digests(executor, info)
        finally:
            executor.close()
    except (RemoteError, OSError, ValueError) as err:
        result.say(f"{result.endpoint}: the served files' digests on {host} are not readable ({err}); not judged",
                   warn=True)
        return {}


def _send(result: TickResult, alert: dict[str, Any], event: str, episode: str, now: float,
          resource: dict[str, str], payload: dict[str, Any]) -> None:
    emit(event, resource, payload)
    alert.update({"episode": episode, "emitted_at": now})
    result.events.append(event)


def _summary(endpoint: str, result: TickResult, drift: DriftStatus, band: Band | None, windows: list[Window]) -> str:
    if not windows:
        return f"{endpoint}: no window yet (first reading, or no figures); drift {drift.state}"
    latest = windows[-1]
    accept = f"{latest.accept_length:.2f}" if latest.accept_length is not None else "n/a"
    band_text = f"band >= {band.lower:.2f}" if band else "no band"
    return (f"{endpoint}: accept length {accept} ({band_text}), {latest.requests:.0f} requests, "
            f"{latest.tok_s:.1f} tok/s over {latest.seconds:.0f}s via {result.source}; drift {drift.state} "
            f"({drift.low_windows}/{drift.needed} low windows)")
