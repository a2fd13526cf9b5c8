"""GPU-hours a stage attempt held: GPUs x wall time, per host, from two sources.

- The stage's own processes (`own_devices`): the data stage's capture engine on data.host
  (data.capture.tp ranks for target.engine sglang; the cuda devices of target.placement for hf, 1
  when it lists none), training's train.devices ranks on each of train.nodes (this machine without
  nodes). They hold their GPUs for the attempt's wall time, except while servers with GPUs run on the
  same host inside the attempt: the data stage stops its regeneration servers before the capture
  needs those GPUs, so the two take turns rather than add up.
- Servers (`<run>/servers.json`, `tasks.hosts.servers`): each holds its GPUs (deploy.tp on a GPU host,
  none for the CPU reference server) from launch to stop, and a stage is charged the part of that
  span inside its own window. The deployed server is charged to deploy_server from its launch, then
  to run_benchmark and report while it stays up; regeneration servers to the data stage; the
  nightly gate's servers to the gate.
GPUs count only on a host that has them (`tasks.hosts.gpus`): the tiny demo on a CPU records 0.
Servers the user runs (data.regenerate.endpoints) are not this run's to count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.config.schema import ExperimentConfig
from tasks.hosts.gpus import gpus_of_host, held
from tasks.hosts.server_registry import read_servers
from tasks.log import logger

Span = tuple[float, float]

# A full retrain (FULL_RETRAIN_TAG on the parent run) ran these in one flow run, nothing reused: what a nightly's
# report holds its own GPU-hours against (`gpu_hours_retrain`).
RETRAIN_STAGES = ("generate_data", "train_draft", "export_checkpoint")


@dataclass
class ThisRunsGpuHours:
    """One flow run's GPU-hours (`eagleops run`, a resume, a nightly): the stages it ran, and apart from them what
    the stages it reused held when they ran, so the total is this run's cost."""

    stages: dict[str, float] = field(default_factory=dict)
    reused: dict[str, float] = field(default_factory=dict)

    def count(self, stage: str, hours: float, reused: bool) -> None:
        held_by = self.reused if reused else self.stages
        held_by[stage] = held_by.get(stage, 0.0) + hours

    @property
    def total(self) -> float:
        return sum(self.stages.values())

    def block(self, flow_run_id: str) -> dict[str, Any]:
        """As the manifest's `gpu_hours` (the latest flow run's) and the flow's result carry it."""
        return {"flow_run_id": flow_run_id, "stages": dict(self.stages), "total": self.total,
                "reused": dict(self.reused), "reused_total": sum(self.reused.values())}

    @property
    def retrain(self) -> float:
        """What data, training and export held in this flow run (a full retrain's figure when they all ran)."""
        return sum(self.stages.get(s, 0.0) for s in RETRAIN_STAGES)

    def parent_metrics(self) -> dict[str, float]:
        return {"gpu_hours_total": self.total, "gpu_hours_reused": sum(self.reused.values())}

    def is_full_retrain(self, cfg: ExperimentConfig, statuses: dict[str, str | None]) -> bool:
        """Data from prompts (served traffic is a window, not the data set), training and export all ran in this
        flow run and completed."""
        ran = all(s in self.stages and statuses.get(s) == "completed" for s in RETRAIN_STAGES)
        return ran and cfg.data.source != "served"


def own_devices(cfg: ExperimentConfig, stage: str) -> dict[str, int]:
    """The devices a stage's own processes ask for, by host (`local` or a hosts[] name)."""
    if stage == "generate_data":
        return {cfg.data.host: _capture_devices(cfg)}
    if stage == "train_draft":
        return {node: cfg.train.devices for node in (cfg.train.nodes or ["local"])}
    return {}


def _capture_devices(cfg: ExperimentConfig) -> int:
    """The target's devices in the data stage: its capture engine, or local regeneration with the target itself."""
    data = cfg.data
    uses_target = data.hidden_states != "online" or (data.regenerate.enabled and data.regenerate.backend == "local")
    if not uses_target:
        return 0
    if cfg.target.engine == "sglang":
        return data.capture.tp
    listed = cfg.target.placement.devices
    return sum(d.startswith("cuda") for d in listed) if listed else 1


def attempt_gpu_hours(cfg: ExperimentConfig, run_dir: Path, stage: str, started_at: float,
                      wall_s: float) -> dict[str, Any]:
    """{gpu_hours, gpu_hours_by_host, gpus (the most held at once, by host), gpu_window [start, end] (epoch s)}
    of one attempt that started at `started_at` and ran `wall_s` seconds."""
    window = (started_at, started_at + wall_s)
    servers = server_spans(run_dir, window)
    seconds: dict[str, float] = {}
    gpus: dict[str, int] = {}
    for host, spans in servers.items():
        seconds[host] = sum(n * (end - start) for n, start, end in spans)
        gpus[host] = peak_gpus(spans)
    for host, asked in own_devices(cfg, stage).items():
        count = held(asked, gpus_of_host(cfg, host)) if asked else 0
        if count:
            busy = union_length([(start, end) for _, start, end in servers.get(host, [])])
            seconds[host] = seconds.get(host, 0.0) + count * max(0.0, wall_s - busy)
            gpus[host] = max(gpus.get(host, 0), count)
    by_host = {host: s / 3600 for host, s in seconds.items()}
    return {"gpu_hours": sum(by_host.values()), "gpu_hours_by_host": by_host, "gpus": gpus, "gpu_window": list(window)}


def server_spans(run_dir: Path, window: Span) -> dict[str, list[tuple[int, float, float]]]:
    """Per host, (GPUs, start, end) of each server with GPUs that ran inside `window`, clipped to it; a server
    not stopped yet runs to the window's end."""
    try:
        entries = read_servers(run_dir)
    except (OSError, ValueError) as err:
        logger().warning(f"GPU-hours: servers unknown ({err}); their GPU-hours are not counted")
        return {}
    spans: dict[str, list[tuple[int, float, float]]] = {}
    for entry in entries.values():
        if not entry.get("gpus") or not entry.get("launched_at"):
            continue
        start = max(window[0], entry["launched_at"])
        end = min(window[1], entry.get("stopped_at") or window[1])
        if end > start:
            spans.setdefault(entry["host"], []).append((int(entry["gpus"]), start, end))
    return spans


def union_length(spans: list[Span]) -> float:
    """Seconds covered by at least one span."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def peak_gpus(spans: list[tuple[int, float, float]]) -> int:
    """The most GPUs the spans hold at one moment (a span ends before another starting at that instant)."""
    events = sorted([(start, n) for n, start, _ in spans] + [(end, -n) for n, _, end in spans], key=lambda e: (e[0], e[1]))
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak
