"""System metrics of a stage's SSH hosts (tasks.tracking.host_metrics): the probe's output read as MLflow names
its system metrics, then the session's real sshd sampled into a run on the real `mlflow server` as
`system/<host>/...` (CPU and memory: the test machine has no GPU); a host that never answers and a host that
stops answering mid-stage (its sshd connection process stopped with SIGSTOP) each give one warning, stop
their sampling and never hold up the stage."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time

import psutil
import pytest
from mlflow.tracking import MlflowClient

from tasks.tracking import host_metrics
from tasks.tracking.host_metrics import host_system_metrics, parse_probe
from tasks.tracking.journal import journal_path
from tasks.tracking.outage import check_tracking_server
from tasks.tracking.run_logger import create_run
from tests.helpers import free_port

PROBE_OUTPUT = """\
cpu  150 0 50 1700 100 0 0 0 0 0
MemTotal:       16000000 kB
MemAvailable:    4000000 kB
0, 87, 40960, 81920, 300.5
1, [N/A], 1024, 81920, [N/A]
"""


def test_the_probe_reads_as_mlflow_names_its_system_metrics():
    metrics, cpu = parse_probe(PROBE_OUTPUT, previous_cpu=(100, 1000))
    assert cpu == (200, 2000)  # busy = total - idle - iowait
    assert metrics == pytest.approx({
        "cpu_utilization_percentage": 10.0,  # 100 busy jiffies of 1000
        "system_memory_usage_megabytes": 12000000 * 1024 / 1e6,
        "system_memory_usage_percentage": 75.0,
        "gpu_0_utilization_percentage": 87.0, "gpu_0_memory_usage_megabytes": 40960 * 1.048576,
        "gpu_0_memory_usage_percentage": 50.0, "gpu_0_power_usage_watts": 300.5,
        "gpu_1_memory_usage_megabytes": 1024 * 1.048576, "gpu_1_memory_usage_percentage": 1024 / 81920 * 100,
    })
    first, _ = parse_probe(PROBE_OUTPUT, previous_cpu=None)  # no CPU % before a second sample
    assert "cpu_utilization_percentage" not in first and "system_memory_usage_percentage" in first


@pytest.fixture
def run(mlflow_server, tmp_path):
    mlflow_server.start()
    assert check_tracking_server(mlflow_server.uri, journal_path(tmp_path))
    return create_run(mlflow_server.uri, journal_path(tmp_path), "host-metrics", {}, experiment="host-metrics")


@pytest.fixture
def fast_sampling(monkeypatch):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.3")
    monkeypatch.setattr(host_metrics, "PROBE_TIMEOUT_S", 2.0)


def test_an_ssh_host_is_sampled_under_its_name(sshd, run, mlflow_server, fast_sampling, caplog):
    host = sshd.host_config(name="gpu_7")
    with caplog.at_level(logging.WARNING, logger="eagleops"), host_system_metrics(True, [host], [host], run):
        time.sleep(2.0)
    client = MlflowClient(mlflow_server.uri)
    metrics = client.get_run(run.run_id).data.metrics
    assert not [r for r in caplog.records if "system metrics" in r.getMessage()]
    assert {"system/gpu_7/cpu_utilization_percentage", "system/gpu_7/system_memory_usage_megabytes",
            "system/gpu_7/system_memory_usage_percentage"} <= set(metrics), metrics
    assert not [k for k in metrics if "/gpu_7/gpu_" in k]  # a CPU host: CPU and memory only
    memory = client.get_metric_history(run.run_id, "system/gpu_7/system_memory_usage_percentage")
    assert len(memory) >= 3 and sorted(m.step for m in memory) == list(range(len(memory)))
    assert all(0 < m.value < 100 for m in memory)
    cpu = client.get_metric_history(run.run_id, "system/gpu_7/cpu_utilization_percentage")
    assert all(0 <= m.value <= 100 for m in cpu)
    with host_system_metrics(False, [host], [host], run) as samplers:  # tracking.log_system_metrics off
        assert samplers == []


class SilentListener:
    """A TCP port that accepts connections and never says anything: a host whose sshd hangs."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", free_port()))
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        for conn in self.held:
            conn.close()
        self.sock.close()


def test_a_host_that_never_answers_is_one_warning_and_holds_nothing_up(sshd, run, fast_sampling, caplog):
    silent = SilentListener()
    host = sshd.host_config(name="gpu_8", port=silent.port, connect_timeout_s=1, connect_retries=0)
    try:
        with caplog.at_level(logging.WARNING, logger="eagleops"):
            started = time.monotonic()
            with host_system_metrics(True, [host], [host], run):
                time.sleep(3.0)  # the stage's work
            elapsed = time.monotonic() - started
    finally:
        silent.close()
    warnings = [r.getMessage() for r in caplog.records if "system metrics of gpu_8" in r.getMessage()]
    assert len(warnings) == 1 and "sampling gpu_8 stopped" in warnings[0], warnings
    assert elapsed < 3.0 + host_metrics.JOIN_S


def test_a_host_that_stops_answering_mid_stage_is_one_warning(sshd, run, mlflow_server, fast_sampling, caplog):
    host = sshd.host_config(name="gpu_9")
    before = set(sshd.connection_pids())
    stopped: list[int] = []
    try:
        with caplog.at_level(logging.WARNING, logger="eagleops"):
            with host_system_metrics(True, [host], [host], run):
                time.sleep(1.5)
                connection = sorted(set(sshd.connection_pids()) - before)  # the sampler's own connection
                assert connection
                stopped = [p.pid for pid in connection for p in (psutil.Process(pid), *psutil.Process(pid).children(True))]
                for pid in stopped:
                    os.kill(pid, signal.SIGSTOP)
                time.sleep(2.0 + host_metrics.WATCHDOG_GRACE_S + 1.5)  # past the probe's timeout and the grace
            warnings = [r.getMessage() for r in caplog.records if "system metrics of gpu_9" in r.getMessage()]
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert len(warnings) == 1 and "no answer within 7 s" in warnings[0] and "sampling gpu_9 stopped" in warnings[0], warnings
    samples = MlflowClient(mlflow_server.uri).get_metric_history(run.run_id, "system/gpu_9/system_memory_usage_megabytes")
    assert samples  # sampled while it answered


def test_the_hosts_sampled_are_those_a_stage_puts_work_on_over_ssh(monkeypatch):
    from tasks.config.schema import ExperimentConfig
    from tasks.runner.host_slots import HOST_ENV, remote_stage_hosts

    monkeypatch.setenv(HOST_ENV, "worker_0")
    hosts = [{"name": n, "address": "10.0.0.1", "user": "eagle"} for n in ("gpu_1", "gpu_2", "worker_0")]
    cfg = ExperimentConfig.model_validate({"experiment": "h", "target": {"kind": "tiny"}, "hosts": hosts,
                                           "train": {"nodes": ["local", "gpu_2"]}, "deploy": {"host": "gpu_1"}})
    assert remote_stage_hosts(cfg, "train_draft") == ["gpu_2"]  # `local` is this machine, sampled as system/*
    assert remote_stage_hosts(cfg, "generate_data") == []  # data.host: local
    assert remote_stage_hosts(cfg, "run_benchmark") == ["gpu_1"]
    assert remote_stage_hosts(cfg, "check_environment") == []
    # a hosts[] entry that is this machine (a gpu worker's $EAGLEOPS_GPU_HOST) is not sampled twice
    assert remote_stage_hosts(cfg.model_copy(update={"deploy": cfg.deploy.model_copy(update={"host": "worker_0"})}),
                              "deploy_server") == []
