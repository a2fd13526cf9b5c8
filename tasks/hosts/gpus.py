"""How many CUDA GPUs a host has, as `nvidia-smi --list-gpus` there says: what GPU-hours count.

A process a stage starts holds GPUs only on a host that has them: training and capture on a CPU
machine (the tiny demo) hold none, and their GPU-hours are 0, not "devices x wall time" of CPU
processes. The answer is asked once per host name and process (it does not change while a run
lasts). A host without nvidia-smi (a CPU box) has 0. A host that cannot be asked (unreachable,
a command that times out) is counted as having every device asked of it, with one warning:
a cost is better over-counted than hidden.
"""

from __future__ import annotations

import threading

from tasks.config.schema import ExperimentConfig
from tasks.hosts.remote import Executor, connect
from tasks.hosts.remote.errors import RemoteError
from tasks.log import logger

_known: dict[str, int] = {}
_lock = threading.Lock()


def gpus_on(executor: Executor) -> int | None:
    """The CUDA GPUs on the executor's host (0 without an NVIDIA driver), None when it cannot be asked;
    cached by host name."""
    with _lock:
        if executor.name in _known:
            return _known[executor.name]
    try:
        count = _count_gpus(executor)
    except RemoteError as err:
        logger().warning(f"GPU-hours: cannot count the GPUs of {executor.name} ({err}); counting the devices asked")
        return None
    with _lock:
        _known[executor.name] = count
    return count


def gpus_of_host(cfg: ExperimentConfig, name: str) -> int | None:
    """`gpus_on` for `local` or a hosts[] name, connecting when it is not known yet (None: not reachable)."""
    with _lock:
        if name in _known:
            return _known[name]
    try:
        executor = connect(None if name == "local" else cfg.host(name), cfg.hosts)
    except (RemoteError, OSError, ValueError, StopIteration) as err:
        logger().warning(f"GPU-hours: cannot reach {name} to count its GPUs ({err}); counting the devices asked")
        return None
    try:
        return gpus_on(executor)
    finally:
        executor.close()


def held(asked: int, available: int | None) -> int:
    """GPUs a process asked for `asked` devices holds on a host with `available` (None: unknown -> asked)."""
    return asked if available is None else min(asked, available)


def _count_gpus(executor: Executor) -> int:
    """`nvidia-smi --list-gpus` prints one `GPU i: <name> (UUID: ...)` line per GPU; a missing binary exits 127."""
    result = executor.run(["nvidia-smi", "--list-gpus"], check=False, log_output=False, timeout=60)
    if result.exit_status != 0:
        return 0
    return sum(line.startswith("GPU ") for line in result.stdout.splitlines())
