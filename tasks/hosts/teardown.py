"""Stopping every server a run started: the flow's `finally`, its failure and cancellation hooks, and
`eagleops teardown RUN_DIR` read the run's servers.json and stop each server still recorded live.

It never raises for a server it cannot stop (a host that no longer answers, a group already gone):
it logs why and stops the others, so the error that started the teardown stays the error; signals
wait until it is done. The SSH connections opened for the run's servers close with it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from pathlib import Path

from tasks.config.schema import ExperimentConfig
from tasks.hosts.remote import Executor, connect
from tasks.hosts.server_registry import (  # noqa: F401 (re-export)
    SERVERS_FILE,
    read_servers,
    record_server,
    registry_path,
)
from tasks.hosts.servers import (
    ServerHandle,
    close_run_executors,
    live_executor,
    one_line,
    stop,
)
from tasks.hosts.signals import signals_held
from tasks.log import logger
from tasks.run_lock import describe_holder, holder_of

TEARDOWN_CONNECT_RETRIES = 1  # a host that does not answer costs the teardown one retry, not connect_retries


def teardown_run(run_dir: str | Path, cfg: ExperimentConfig | None = None) -> list[str]:
    """Stop every server of a run that is not recorded as stopped (this process's, or a dead process's), then
    close the executors the run's servers held; -> the servers stopped.

    Never raises for what it cannot do (a host that does not answer, a group already gone, an unreadable
    servers.json): it logs why and goes on, so every server it can reach is stopped and the caller's own
    error (the flow's `finally`) stays the error; `unstopped_servers` lists what is left. Each host is
    connected to once (at most TEARDOWN_CONNECT_RETRIES retries). SIGINT/SIGTERM wait until it is done.
    """
    run_dir = Path(run_dir)
    stopped = []
    with signals_held(logger(), f"the teardown of {run_dir.name}"):
        hosts = _TeardownHosts(cfg)
        try:
            for handle in _unstopped_handles(run_dir):
                if _teardown_one(run_dir, handle, hosts):
                    stopped.append(f"{handle.label} (pid {handle.pid} on {handle.host})")
        finally:
            hosts.close()
            close_run_executors(run_dir)
    return stopped


def unstopped_servers(run_dir: str | Path) -> list[str]:
    """The servers servers.json records as not stopped: what a teardown could not stop."""
    return [f"{h.label} (pid {h.pid} on {h.host})" for h in _unstopped_handles(Path(run_dir))]


_HANDLE_FIELDS = {f.name for f in dataclasses.fields(ServerHandle)}


def _unstopped_handles(run_dir: Path) -> list[ServerHandle]:
    try:
        entries = read_servers(run_dir)
    except (OSError, ValueError) as err:
        logger().warning(f"teardown: cannot read {registry_path(run_dir)}: {err}; its servers were not stopped")
        return []
    return [ServerHandle(**{k: v for k, v in entry.items() if k in _HANDLE_FIELDS})
            for entry in entries.values() if entry.get("status") != "stopped"]


def _teardown_one(run_dir: Path, handle: ServerHandle, hosts: _TeardownHosts) -> bool:
    live = live_executor(run_dir, handle.pid)
    executor, why = (live, "") if live else hosts.executor(handle.host)
    if executor is None:
        logger().warning(f"{handle.label}: pid {handle.pid} on {handle.host} left running: {why}")
        return False
    return stop(run_dir, handle, executor)


class _TeardownHosts:
    """The executors a teardown opens itself, one per host, closed after it; a host it cannot reach is
    tried once, and its other servers are skipped with the same reason."""

    def __init__(self, cfg: ExperimentConfig | None):
        self.cfg = cfg
        self.opened: dict[str, Executor] = {}
        self.unreachable: dict[str, str] = {}

    def executor(self, host: str) -> tuple[Executor | None, str]:
        if host not in self.opened and host not in self.unreachable:
            try:
                executor = _executor_for(host, self.cfg)
            except Exception as err:  # ConnectError, HostKeyError, a missing key file: reported, never raised
                self.unreachable[host] = f"cannot reach host {host}: {one_line(err)}"
            else:
                if executor is None:
                    self.unreachable[host] = f"host {host} is not in the config's hosts (pass the config)"
                else:
                    self.opened[host] = executor
        return self.opened.get(host), self.unreachable.get(host, "")

    def close(self) -> None:
        for executor in self.opened.values():
            executor.close()


def teardown_for_flow_run(parameters: dict, flow_run_id: str) -> list[str]:
    """Teardown from a Prefect hook, which may run in another process: find the run folder whose
    manifest lists this flow run, then stop its recorded servers."""
    from tasks.config.load import load_experiment

    cfg = load_experiment(parameters["config_path"], parameters.get("variant"))
    folders = [Path(parameters["run_dir"])] if parameters.get("run_dir") else \
        sorted((Path(cfg.runs_root) / cfg.experiment).glob("*"), reverse=True)
    for folder in folders:
        manifest = folder / "manifest.json"
        if manifest.is_file() and flow_run_id in json.loads(manifest.read_text()).get("prefect_flow_run_ids", []):
            if held_by_another_process(folder):
                return []
            return teardown_run(folder, cfg)
    return []


def held_by_another_process(run_dir: Path) -> bool:
    """True (and one line saying so) when another live process holds the run folder: a Retry refused while the
    flow run's first attempt still runs has nothing of its own to stop, and that attempt's servers are its own."""
    holder = holder_of(run_dir)
    if holder is None or (holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()):
        return False
    named = describe_holder(holder) if holder else "another process"
    logger().warning(f"teardown: {run_dir} is held by {named}; its servers are left to that run's own teardown")
    return True


def _executor_for(host: str, cfg: ExperimentConfig | None) -> Executor | None:
    if host == "local":
        return connect(None)
    if cfg is None or host not in {h.name for h in cfg.hosts}:
        return None
    config = cfg.host(host)
    retries = min(config.connect_retries, TEARDOWN_CONNECT_RETRIES)
    return connect(config.model_copy(update={"connect_retries": retries}), cfg.hosts)
