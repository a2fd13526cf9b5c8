"""GPU-hours of one stage attempt from what it held: its own processes' devices and the servers recorded in
servers.json, per host, against figures worked out by hand here (not by the code under test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.config.load import load_experiment
from tasks.hosts import gpus
from tasks.hosts.server_registry import record_server
from tasks.runner.gpu_hours import attempt_gpu_hours
from tasks.tracking.journal import Journal, new_placeholder_id
from tasks.tracking.run_logger import RunLogger

CONFIG = """\
experiment: gpu-hours
runs_root: {runs}
target:
  kind: hf
  model_path: /models/target
  placement: {{devices: [cuda:0, cuda:1]}}
data:
  prompts: builtin
  regenerate: {{backend: sglang, deploy: {{host: local, servers: 2}}}}
train: {{devices: 4}}
deploy: {{host: gpu-1, server: sglang, tp: 8, model_path: /models/target}}
hosts:
  - {{name: gpu-1, address: 127.0.0.1, user: nobody, workdir: /tmp}}
"""
T0 = 1_700_000_000.0


@pytest.fixture
def cfg(tmp_path):
    path = tmp_path / "gpu.yaml"
    path.write_text(CONFIG.format(runs=tmp_path / "runs"))
    return load_experiment(path)


@pytest.fixture
def host_gpus(monkeypatch):
    """This machine has 8 GPUs as far as nvidia-smi says (the count is asked once per host and cached)."""
    monkeypatch.setattr(gpus, "_known", {})
    counts = {"local": 8}
    monkeypatch.setattr(gpus, "_count_gpus", lambda executor: counts[executor.name])
    return counts


def server(run_dir: Path, host: str, pid: int, gpus_held: int, start: float, stop: float | None) -> None:
    record_server(run_dir, f"{host}:30000:{pid}", {"label": f"server {pid}", "host": host, "pid": pid, "port": 30000,
                                                   "gpus": gpus_held, "launched_at": start, "stopped_at": stop,
                                                   "status": "stopped" if stop else "live"})


def test_data_stage_counts_regeneration_servers_then_the_capture_on_the_gpus_they_freed(cfg, host_gpus, tmp_path):
    # two TP-2 regeneration servers from +10 s to +40 s; the capture (placement over 2 GPUs) the other 70 s of 100
    server(tmp_path, "local", 1, 2, T0 + 10, T0 + 40)
    server(tmp_path, "local", 2, 2, T0 + 10, T0 + 40)
    held = attempt_gpu_hours(cfg, tmp_path, "generate_data", T0, 100.0)
    assert held["gpu_hours"] == pytest.approx((2 * 2 * 30 + 2 * 70) / 3600)
    assert held["gpu_hours_by_host"] == {"local": pytest.approx(260 / 3600)}
    assert held["gpus"] == {"local": 4}  # both servers at once
    assert held["gpu_window"] == [T0, T0 + 100]


def test_a_server_is_charged_only_for_its_time_inside_the_stage(cfg, host_gpus, tmp_path):
    server(tmp_path, "gpu-1", 1, 8, T0 - 50, None)  # deployed before the stage, still up
    server(tmp_path, "gpu-1", 2, 8, T0 + 20, T0 + 30)  # a baseline server for 10 s
    server(tmp_path, "gpu-1", 3, 8, T0 - 90, T0 - 60)  # stopped before the stage began
    held = attempt_gpu_hours(cfg, tmp_path, "run_benchmark", T0, 60.0)
    assert held["gpu_hours_by_host"] == {"gpu-1": pytest.approx((8 * 60 + 8 * 10) / 3600)}
    assert held["gpus"] == {"gpu-1": 16}


def test_training_holds_its_ranks_for_its_wall_time_and_nothing_on_a_cpu(cfg, host_gpus, tmp_path):
    assert attempt_gpu_hours(cfg, tmp_path, "train_draft", T0, 900.0)["gpu_hours"] == pytest.approx(4 * 900 / 3600)
    host_gpus["local"] = 0
    gpus._known.clear()
    held = attempt_gpu_hours(cfg, tmp_path, "train_draft", T0, 900.0)
    assert held["gpu_hours"] == 0 and held["gpus"] == {}


def test_stages_that_start_nothing_hold_nothing(cfg, host_gpus, tmp_path):
    server(tmp_path, "local", 1, 0, T0, T0 + 50)  # the reference server: CPU only
    for stage in ("check_environment", "export_checkpoint", "deploy_server", "report"):
        assert attempt_gpu_hours(cfg, tmp_path, stage, T0, 100.0)["gpu_hours"] == 0


def test_gpu_hours_are_journaled_in_an_outage_like_every_metric(tmp_path):
    from tasks.runner.attempt import _log_gpu_hours

    journal = tmp_path / "mlflow-journal.jsonl"
    child = RunLogger("http://127.0.0.1:9", new_placeholder_id(), journal)  # a run that exists only locally
    _log_gpu_hours(child, {"gpu_hours": 0.5, "gpu_hours_by_host": {"gpu-1": 0.5}, "gpus": {"gpu-1": 8}})
    written = [e["args"] for e in Journal(journal).entries()]
    metrics = {m[0]: m[1] for args in written for m in args.get("metrics", [])}
    params = dict(p for args in written for p in args.get("params", []))
    assert metrics == {"gpu_hours": 0.5, "gpu_hours.gpu-1": 0.5} and params == {"gpus.gpu-1": "8"}
    assert json.loads(journal.read_text().splitlines()[0])["op"] == "log_batch"
