"""What the watch remembers between two ticks, per endpoint: one JSON file under
`<runs_root>/watch/<experiment>/`.

Owns the memory a stateless schedule needs: the last `/metrics` reading (the scrape path's windows are
differences of two readings), the last windows read that way (the `for:` count needs them), each alert's
last emitted episode and time (so an event is sent on a new episode and then once per cooldown), the
identity first seen serving a model version (the baseline for what the gate did not record), and the
number of windows logged (the MLflow step). Through Prometheus the windows come from Prometheus'
own history instead; the file then only carries the alerts and the baseline.

Risk: two watches on the same endpoint and runs_root would overwrite each other's memory; the schedule
runs one at a time (the deployment's concurrency limit).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tasks.rundir import write_json_atomic
from tasks.watch.rules import Reading, Window


@dataclass
class EndpointState:
    reading: Reading | None = None
    windows: list[Window] = field(default_factory=list)
    # drift | changed | unreachable -> {episode, emitted_at}; a drift also -> version (the champion its episode is about)
    alerts: dict[str, dict[str, Any]] = field(default_factory=dict)
    baseline: dict[str, Any] = field(default_factory=dict)  # model_version, target_sha256, engine_version
    logged_windows: int = 0
    last_window_end: float = 0.0  # the newest window already logged (Prometheus windows overlap ticks)

    def keep_windows(self, count: int) -> None:
        self.windows = self.windows[-count:]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["reading"] = asdict(self.reading) if self.reading else None
        return data


def state_path(runs_root: str | Path, experiment: str, endpoint: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9.-]+", "-", endpoint.split("://", 1)[-1]).strip("-")
    return Path(runs_root).resolve() / "watch" / experiment / f"{slug}.json"


def load_state(path: Path) -> EndpointState:
    """The endpoint's memory; a fresh one when the file is missing or unreadable (the watch starts over)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return EndpointState()
    reading = data.get("reading")
    return EndpointState(
        reading=Reading(**reading) if reading else None,
        windows=[Window(**w) for w in data.get("windows", [])],
        alerts=_with_drift_version(data.get("alerts", {})), baseline=data.get("baseline", {}),
        logged_windows=int(data.get("logged_windows", 0)), last_window_end=float(data.get("last_window_end", 0.0)),
    )


def _with_drift_version(alerts: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A drift episode recorded before its champion version had a field of its own ("version V since T") gets
    it, so the watch goes on with the same episode after an upgrade instead of telling it again at once."""
    drift = alerts.get("drift", {})
    found = re.fullmatch(r"version (\S+) since \S+", str(drift.get("episode", "")))
    if found and "version" not in drift:
        drift["version"] = found.group(1)
    return alerts


def save_state(path: Path, state: EndpointState) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, state.to_dict())
