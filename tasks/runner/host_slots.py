"""One GPU stage per GPU host at a time, whatever started the run: Prefect global concurrency limits.

`eagleops deploy-flows` creates a limit of 1 named `gpu-host-<name>` for each GPU host of the team (the gpu
pool's queues: `gpu-1` = hosts[].name). A stage that puts work on a host takes that host's slot for its whole
attempt -- the data stage on data.host, training on each of train.nodes (this machine without nodes), the
deploy stage, the benchmark and the plan's checks on deploy.host, the nightly gate on deploy.host -- through Prefect's own
`concurrency()`, so a run from the CLI (with the team's PREFECT_API_URL), a UI run with a host override, the
nightly and a watch automation all queue on the same slot, where the gpu queue's limit only sees deployment
runs of that queue. A stage that finds the slot taken says so in one line and waits.

"This machine" is named by $EAGLEOPS_GPU_HOST (infra/prefect-worker.sh sets it to the worker's queue, so a
gpu-1 worker's runs take gpu-host-gpu-1), else its hostname. Hosts without a limit are not limited (a CPU run,
a temporary Prefect server): no limit exists, nothing is taken.

The slot is a lease (Prefect 3.9): released when the stage ends however it ends (raise, Ctrl-C, cancellation);
a process killed with SIGKILL stops renewing it and the server frees it when the lease runs out (`LEASE_S`,
renewed every 3/4 of that while the stage runs).
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Iterator

from tasks.config.schema import ExperimentConfig
from tasks.log import logger

PREFIX = "gpu-host-"
LEASE_S = 60.0  # Prefect 3.9's shortest lease: a SIGKILLed holder's slot frees about this long after
HOST_ENV = "EAGLEOPS_GPU_HOST"
_DEPLOY_HOST_STAGES = ("deploy_server", "run_benchmark", "plan_serving", "nightly_gate")


def limit_name(host: str) -> str:
    return PREFIX + host


def this_machine() -> str:
    return os.environ.get(HOST_ENV) or socket.gethostname()


def stage_hosts(cfg: ExperimentConfig, stage: str) -> list[str]:
    """The hosts (hosts[] names; `local` as this machine's name) a stage puts work on."""
    if stage == "generate_data":
        hosts = [cfg.data.host]
    elif stage == "train_draft":
        hosts = list(cfg.train.nodes or ["local"])
    elif stage in _DEPLOY_HOST_STAGES:
        hosts = [cfg.deploy.host]
    else:
        return []
    return sorted({this_machine() if host == "local" else host for host in hosts})


def remote_stage_hosts(cfg: ExperimentConfig, stage: str) -> list[str]:
    """The hosts[] names a stage puts work on over SSH (not this machine): whose system metrics are sampled there."""
    inventory = {h.name for h in cfg.hosts}
    return [host for host in stage_hosts(cfg, stage) if host in inventory and host != this_machine()]


@contextlib.contextmanager
def holding_gpu_hosts(cfg: ExperimentConfig, stage: str, flow_run_id: str | None = None) -> Iterator[list[str]]:
    """Hold the slot of every GPU host `stage` uses that has a limit; yield their names."""
    limited = _existing_limits([limit_name(host) for host in stage_hosts(cfg, stage)])
    if not limited:
        yield []
        return
    from prefect.concurrency.sync import concurrency

    busy = [name for name, (active, limit) in limited.items() if active >= limit]
    if busy:
        logger().info("%s: waiting for %s (one GPU stage per host at a time: another run holds it)", stage,
                      ", ".join(busy))
    with concurrency(sorted(limited), occupy=1, lease_duration=LEASE_S, strict=True, holder=_holder(flow_run_id)):
        if busy:
            logger().info("%s: %s free, going on", stage, ", ".join(busy))
        yield sorted(limited)


def _holder(flow_run_id: str | None):
    """The flow run as the lease's holder (shown with the limit's active slots), when there is one."""
    from uuid import UUID

    from prefect.client.schemas.objects import ConcurrencyLeaseHolder

    try:
        return ConcurrencyLeaseHolder(type="flow_run", id=UUID(str(flow_run_id)))
    except ValueError:
        return None


def _existing_limits(names: list[str]) -> dict[str, tuple[int, int]]:
    """{name: (active slots, limit)} of the active limits among `names` on the Prefect API; {} without an API."""
    if not names or not _has_api():
        return {}
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    found = {}
    with get_client(sync_client=True) as client:
        for name in names:
            try:
                limit = client.read_global_concurrency_limit_by_name(name)
            except ObjectNotFound:
                continue
            if limit.active:
                found[name] = (limit.active_slots, limit.limit)
    return found


def _has_api() -> bool:
    from prefect.settings import PREFECT_API_URL

    return bool(PREFECT_API_URL.value())
