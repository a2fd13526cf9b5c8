"""System metrics of the SSH hosts a stage puts work on (data.host, train.nodes, deploy.host), sampled over SSH.

`tracking.log_system_metrics` samples the machine the stage runs on with MLflow's own monitors
(`system_metrics`); the GPUs that do the work are often elsewhere. For each hosts[] entry a stage uses,
a daemon thread opens its own SSH connection to the host (never the stage's: a slow sample must not
queue behind an upload) and, every `MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL` seconds (default 10), runs
one short shell probe there: `/proc/stat`, `/proc/meminfo` and, where there is one, `nvidia-smi`. Each
sample is logged as MLflow names its own system metrics, under the host's name as node id:
`system/<host>/cpu_utilization_percentage` (busy share of the CPU time since the previous sample),
`system/<host>/system_memory_usage_megabytes`, `..._percentage`, and per GPU
`system/<host>/gpu_<i>_utilization_percentage`, `gpu_<i>_memory_usage_megabytes`, `..._percentage`,
`gpu_<i>_power_usage_watts`; a CPU host records CPU and memory only. Written through the stage's
RunLogger, so an outage journals them like every other metric.

Risk: the sampling must never slow or fail the stage. Nothing here raises into it: a host that cannot be
reached or stops answering (no answer to a probe within `PROBE_TIMEOUT_S` + `WATCHDOG_GRACE_S`: its
connection is closed) gives one warning naming it, and its sampling
stops for the rest of the attempt; the stage's end waits at most `JOIN_S` for a sampler stuck in a call.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence

from mlflow.environment_variables import MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL

from tasks.config.schema import HostConfig
from tasks.hosts.remote import Executor, connect
from tasks.tracking.run_logger import RunLogger
from tasks.tracking.system_metrics import PREFIX

DEFAULT_INTERVAL_S = 10.0  # MLflow's default sampling interval
PROBE_TIMEOUT_S = 10.0     # one probe (the host kills it); past WATCHDOG_GRACE_S more, the connection is closed
WATCHDOG_GRACE_S = 5.0
JOIN_S = 5.0

# One line of /proc/stat ("cpu  user nice system idle iowait irq softirq steal ..."), the two memory lines, then
# one CSV line per GPU (none without nvidia-smi).
PROBE = ("head -n 1 /proc/stat; grep -E '^(MemTotal|MemAvailable):' /proc/meminfo; "
         "nvidia-smi --query-gpu=index,utilization.gpu,memory.used,memory.total,power.draw "
         "--format=csv,noheader,nounits 2>/dev/null || true")


def parse_probe(text: str, previous_cpu: tuple[int, int] | None) -> tuple[dict[str, float], tuple[int, int] | None]:
    """(metrics, this sample's (busy, total) CPU jiffies) from PROBE's output; CPU % needs the previous sample.

    e.g. previous (100, 1000), now `cpu 150 0 50 1700 100 0 0 0` -> (200, 2000): 100 busy of 1000 -> 10.0 %
    (idle and iowait are not busy).
    """
    metrics: dict[str, float] = {}
    cpu = None
    memory: dict[str, int] = {}
    for line in text.splitlines():
        words = line.replace(",", " ").split()
        if not words:
            continue
        if words[0] == "cpu":
            jiffies = [int(w) for w in words[1:9]]
            total = sum(jiffies)
            cpu = (total - jiffies[3] - jiffies[4], total)
        elif words[0] in ("MemTotal:", "MemAvailable:"):
            memory[words[0][:-1]] = int(words[1]) * 1024
        elif words[0].isdigit() and len(words) >= 5:
            metrics |= _gpu_metrics(words)
    if cpu and previous_cpu and cpu[1] > previous_cpu[1]:
        metrics["cpu_utilization_percentage"] = 100.0 * (cpu[0] - previous_cpu[0]) / (cpu[1] - previous_cpu[1])
    if len(memory) == 2:
        used = memory["MemTotal"] - memory["MemAvailable"]
        metrics["system_memory_usage_megabytes"] = used / 1e6
        metrics["system_memory_usage_percentage"] = 100.0 * used / memory["MemTotal"]
    return metrics, cpu


def _gpu_metrics(words: list[str]) -> dict[str, float]:
    """One nvidia-smi CSV row (index, utilization %, memory used MiB, memory total MiB, power W); `[N/A]` skipped."""
    index, util, used, total, power = words[:5]
    values = {f"gpu_{index}_utilization_percentage": util, f"gpu_{index}_memory_usage_megabytes": used,
              f"gpu_{index}_power_usage_watts": power}
    metrics = {}
    for key, value in values.items():
        with contextlib.suppress(ValueError):
            metrics[key] = float(value) * (1.048576 if key.endswith("megabytes") else 1.0)
    with contextlib.suppress(ValueError, ZeroDivisionError):
        metrics[f"gpu_{index}_memory_usage_percentage"] = 100.0 * float(used) / float(total)
    return metrics


class HostSampler:
    """A daemon thread sampling one SSH host into `run` as `system/<host>/...` until `stop()`."""

    def __init__(self, host: HostConfig, inventory: Sequence[HostConfig], run: RunLogger, interval_s: float):
        self.host, self.inventory, self.run, self.interval_s = host, tuple(inventory), run, interval_s
        self.prefix = f"{PREFIX}{host.name}/"
        self.step = 0
        self._cpu: tuple[int, int] | None = None
        self._executor: Executor | None = None
        self._stop = threading.Event()
        self._abandoned = False  # stop() gave up waiting: what the thread samples later is not logged
        self._silent = False  # a probe got no answer within PROBE_TIMEOUT_S + WATCHDOG_GRACE_S
        self._thread = threading.Thread(target=self._loop, name=f"eagleops-host-metrics-{host.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """One last sample (when the host answers within JOIN_S), then the connection is closed."""
        self._stop.set()
        self._thread.join(JOIN_S)
        self._abandoned = self._thread.is_alive()

    def _give_up(self) -> None:
        self._silent = True
        self._executor.close()

    def _loop(self) -> None:
        try:
            self._executor = connect(self.host, self.inventory)
            while True:
                self._sample()
                if self._stop.wait(self.interval_s):
                    self._sample()  # the stage's end: a point even for a stage shorter than the interval
                    return
        except Exception as err:  # noqa: BLE001 -- whatever the host or the tracking server does, the stage goes on
            first_line = (str(err).strip().splitlines() or [""])[0][:300]
            reason = (f"no answer within {PROBE_TIMEOUT_S + WATCHDOG_GRACE_S:.0f} s" if self._silent
                      else f"{type(err).__name__}: {first_line}")
            logging.getLogger("eagleops").warning(f"system metrics of {self.host.name}: {reason}; "
                                                  f"sampling {self.host.name} stopped for this stage")
        finally:
            if self._executor is not None:
                self._executor.close()

    def _sample(self) -> None:
        # The host's `timeout` ends a slow probe; a host that stops answering altogether can leave paramiko
        # waiting with no deadline (opening or starting the channel): closing the connection ends that wait.
        watchdog = threading.Timer(PROBE_TIMEOUT_S + WATCHDOG_GRACE_S, self._give_up)
        watchdog.daemon = True
        watchdog.start()
        try:
            result = self._executor.run(["sh", "-c", PROBE], check=True, log_output=False, timeout=PROBE_TIMEOUT_S)
        finally:
            watchdog.cancel()
        if self._silent:  # it answered just as the connection was closed
            raise TimeoutError("no answer")
        metrics, self._cpu = parse_probe(result.stdout, self._cpu)
        if metrics and not self._abandoned:
            self.run.log_metrics({self.prefix + k: v for k, v in metrics.items()}, step=self.step)
            self.step += 1


def sampling_interval_s() -> float:
    return MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL.get() or DEFAULT_INTERVAL_S


@contextlib.contextmanager
def host_system_metrics(enabled: bool, hosts: Sequence[HostConfig], inventory: Sequence[HostConfig],
                        run: RunLogger) -> Iterator[list[HostSampler]]:
    """Sample each of `hosts` into `run` for the duration of the block when `enabled` (tracking.log_system_metrics)."""
    samplers = [HostSampler(host, inventory, run, sampling_interval_s()) for host in hosts] if enabled else []
    for sampler in samplers:
        sampler.start()
    try:
        yield samplers
    finally:
        for sampler in samplers:
            sampler.stop()
