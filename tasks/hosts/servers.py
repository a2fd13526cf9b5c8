"""Servers on hosts: launch one (SGLang or the reference server), wait until it generates, check what it
reports it runs against what was predicted, reach it (a tunnel for SSH hosts) and stop it.

Every live server is recorded in `<run_dir>/servers.json` (`tasks.hosts.server_registry`, writers under
a lock). `stop` kills its process group only while its pid is still the process launched (its start
time, recorded at launch: a pid the host gave to another process since is never killed). The deploy
stage, the data stage's regeneration servers, the benchmark's baseline and sweep servers and the
nightly gate all start theirs through `launch`; `tasks.hosts.teardown` stops what a run left.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tasks.config.schema import ExperimentConfig, HostConfig, SpeculativeConfig
from tasks.hosts.gpus import gpus_on, held
from tasks.hosts.jobs import poll_delay
from tasks.hosts.launch import SERVER_MODULES, launch_args
from tasks.hosts.remote import CommandFailed, Executor, connect
from tasks.hosts.server_registry import (  # noqa: F401 (re-export)
    SERVERS_FILE,
    read_servers,
    record_server,
    registry_path,
)
from tasks.log import logger

LOG_TAIL_LINES = 50


class PreflightFailed(RuntimeError):
    """A check before launch failed; the message lists each failed check with its one-line reason."""

    one_line_in_logs = True  # expected: its message says it all (tasks.log)


class ServerFailed(RuntimeError):
    """The server exited or never became healthy; the message carries the tail of its log."""


class PortTaken(ServerFailed):
    """The port was free at launch, but another process bound it before the launched server did (a server
    imports and loads for seconds to minutes first): it exited on the bind, or another process answers there."""


BIND_FAILED = "address already in use"  # uvicorn's line (the reference server's and SGLang's) on a taken port


@dataclass
class ServerHandle:
    """One launched server: where it runs, how to reach and stop it, what it was asked and runs."""

    label: str  # "speculative 5/1/6", "baseline"
    host: str
    pid: int
    port: int
    log_file: str
    pid_file: str
    argv: list[str]
    speculative: bool
    asked: dict[str, Any] = field(default_factory=dict)
    effective: dict[str, Any] = field(default_factory=dict)  # what the server runs: its /server_info, else predicted
    server_info: dict[str, Any] = field(default_factory=dict)
    local_url: str = ""  # how this process reaches it (a tunnel for SSH hosts)
    predicted: dict[str, Any] = field(default_factory=dict)  # the preflight's resolution of the flags
    settings_source: str = ""  # "/server_info", or "prediction" when the server reports no speculative settings
    allow_adjustments: bool = False  # the config opted into SGLang rewriting the asked values
    identity: str = ""  # the process at launch (host boot id:start time); "" (older records): unchecked
    gpus: int = 0  # the GPUs it holds (`held_gpus`); with launched_at and stopped_at, its GPU-hours
    launched_at: float = 0.0  # epoch seconds when it was started
    stopped_at: float | None = None  # epoch seconds when it was stopped (None while it runs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Placement:
    """Where the serving host finds the target and the draft, and which executor reaches it."""

    executor: Executor
    host: HostConfig | None
    workdir: str
    model_path: str
    draft_path: str
    uploads: dict[str, Path] = field(default_factory=dict)  # host path -> the local folder uploaded there


# Executors and tunnels this process holds open for live servers, by run folder: the benchmark
# stage reaches the servers the deploy stage started through them.
_LIVE: dict[str, dict[str, Any]] = {}


_LIVE_LOCK = threading.Lock()


# Executors opened for a run's servers (deploy, the gate): they outlive the stage, the run's teardown closes them.
_RUN_EXECUTORS: dict[str, list[Executor]] = {}


def host_config(cfg: ExperimentConfig) -> HostConfig | None:
    return None if cfg.deploy.host == "local" else cfg.host(cfg.deploy.host)


def open_executor(cfg: ExperimentConfig, run_dir: Path | None = None) -> Executor:
    """The deploy host's executor; with `run_dir`, held for that run's servers and closed by its teardown."""
    executor = connect(host_config(cfg), cfg.hosts)
    if run_dir is not None:
        with _LIVE_LOCK:
            _RUN_EXECUTORS.setdefault(str(run_dir), []).append(executor)
    return executor


def _record(run_dir: Path, handle: ServerHandle, status: str) -> None:
    record_server(run_dir, f"{handle.host}:{handle.port}:{handle.pid}", {**handle.to_dict(), "status": status})


def server_command(cfg: ExperimentConfig, python: str, args: list[str]) -> list[str]:
    return [python, "-m", SERVER_MODULES[cfg.deploy.server], *args]


def launch(cfg: ExperimentConfig, placement: Placement, run_dir: Path, *, label: str,
           spec: SpeculativeConfig | None, predicted: dict | None) -> ServerHandle:
    """Start one server (speculative with `spec`, baseline with None), wait until it generates, verify it."""
    executor, port = placement.executor, cfg.deploy.port
    if executor.port_in_use(port):
        raise PreflightFailed(f"port {port} on {executor.name} is already in use: another server is listening; "
                              "stop it or set deploy.port")
    args = launch_args(cfg, model_path=placement.model_path, port=port, spec=spec,
                       draft_path=placement.draft_path if spec is not None else None)
    argv = server_command(cfg, executor.python, args)
    stamp = f"{label.replace(' ', '-').replace('/', '_')}-{int(time.time())}"
    logs = f"{placement.workdir}/logs"
    executor.makedirs(logs)
    gpus, launched_at = held_gpus(cfg, executor), time.time()
    pid = executor.start_detached(argv, env=cfg.deploy.server_env(), cwd=placement.workdir,
                                  log_file=f"{logs}/{stamp}.log", pid_file=f"{logs}/{stamp}.pid")
    handle = ServerHandle(label, executor.name, pid, port, f"{logs}/{stamp}.log", f"{logs}/{stamp}.pid", argv,
                          spec is not None, asked=_asked(spec), effective=dict(predicted or {}),
                          predicted=dict(predicted or {}), allow_adjustments=bool(spec and spec.allow_adjustments),
                          identity=executor.process_identity(pid) or "", gpus=gpus, launched_at=launched_at)
    _record(run_dir, handle, "starting")
    try:
        local_port = _open_tunnel(run_dir, handle, executor)
        handle.local_url = f"http://127.0.0.1:{local_port}"
        handle.server_info = wait_healthy(executor, handle, cfg.deploy.startup_timeout_s)
        _verify_resolved(handle, enforce=cfg.deploy.preflight == "enforce")
    except BaseException:
        stop(run_dir, handle, executor)
        raise
    _record(run_dir, handle, "live")
    logger().info(f"{handle.label}: serving on {executor.name}:{port} (pid {pid}), reached at {handle.local_url}")
    return handle


def held_gpus(cfg: ExperimentConfig, executor: Executor) -> int:
    """The GPUs a server of `cfg.deploy` holds: deploy.tp on a host that has them; none for the reference server,
    which computes on the CPU wherever it runs."""
    if cfg.deploy.server == "reference":
        return 0
    return held(cfg.deploy.tp, gpus_on(executor))


def _asked(spec: SpeculativeConfig | None) -> dict:
    if spec is None:
        return {}
    return {k: getattr(spec, k) for k in ("num_steps", "eagle_topk", "num_draft_tokens")}


def _open_tunnel(run_dir: Path, handle: ServerHandle, executor: Executor) -> int:
    stack = contextlib.ExitStack()
    local_port = stack.enter_context(executor.forward(handle.port))
    with _LIVE_LOCK:
        _LIVE.setdefault(str(run_dir), {})[handle.pid] = {"executor": executor, "tunnel": stack, "handle": handle}
    return local_port


def wait_healthy(executor: Executor, handle: ServerHandle, timeout_s: float) -> dict:
    """Poll /health_generate until 200; fail fast with the log tail if the process exits."""
    started, shown = time.monotonic(), 0
    deadline = started + timeout_s
    with httpx.Client(timeout=10.0) as client:
        while time.monotonic() < deadline:
            if not executor.is_alive(handle.pid):
                tail = log_tail(executor, handle)
                failed = PortTaken if BIND_FAILED in tail.lower() else ServerFailed
                raise failed(f"{handle.label}: the server exited during startup; last {LOG_TAIL_LINES} log "
                             f"lines of {handle.log_file}:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{handle.local_url}/health_generate").status_code == 200:
                    _check_own_port(executor, handle)
                    return client.get(f"{handle.local_url}/server_info").json()
            shown = _relay_log(executor, handle, shown)
            time.sleep(poll_delay(started, 1.0))
    raise ServerFailed(f"{handle.label}: not healthy within deploy.startup_timeout_s={timeout_s:.0f}s; last "
                       f"{LOG_TAIL_LINES} log lines:\n{log_tail(executor, handle)}")


def _check_own_port(executor: Executor, handle: ServerHandle) -> None:
    """The server that answered is the one launched: the port was free at launch, but a server of another run
    starting on that host at the same moment may have bound it first while this one still loads its weights
    (minutes, for a large target) -- its answers would be measured as this run's. "nobody": the host cannot
    tell (no /proc), trusted as before."""
    if executor.port_listener(handle.port, handle.pid) == "other":
        raise PortTaken(f"{handle.label}: port {handle.port} on {executor.name} answers, but from another process "
                        f"than the server launched (pid {handle.pid}): another server took the port while this one "
                        f"started; stop it or set deploy.port. Last {LOG_TAIL_LINES} log lines of "
                        f"{handle.log_file}:\n{log_tail(executor, handle)}")


def _relay_log(executor: Executor, handle: ServerHandle, shown: int) -> int:
    """Forward the log's new complete lines to the run log while waiting (the startup is where things go
    wrong); only the lines after the `shown` ones cross (`tail -n +K`), never the whole log again."""
    with contextlib.suppress(CommandFailed, FileNotFoundError):
        text = executor.read_file(handle.log_file, from_line=shown + 1)
        lines = text[:text.rfind("\n") + 1].split("\n")[:-1]  # a line still being written waits for its newline
        for line in lines:
            logger().info(f"[{handle.label}] {line}")
        return shown + len(lines)
    return shown


def log_tail(executor: Executor, handle: ServerHandle, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return executor.read_file(handle.log_file, tail_lines=lines)
    except CommandFailed as err:
        return f"(log unreadable: {err})"


SPEC_INFO_KEYS = {"num_steps": "speculative_num_steps", "eagle_topk": "speculative_eagle_topk",
                  "num_draft_tokens": "speculative_num_draft_tokens"}


def reported_settings(server_info: dict) -> dict[str, int]:
    """The speculative settings a server reports in /server_info (top level, else its first internal state)."""
    states = server_info.get("internal_states") or [{}]
    found = {}
    for field_name, key in SPEC_INFO_KEYS.items():
        value = server_info.get(key, states[0].get(key) if isinstance(states[0], dict) else None)
        if value is not None:
            found[field_name] = value
    return found


def _verify_resolved(handle: ServerHandle, enforce: bool = True) -> None:
    """What /server_info reports becomes the handle's effective settings; it must be the prediction (else the
    server runs others than were checked: an error, or under `deploy.preflight: warn` a warning and a new label)."""
    if not handle.speculative:
        return
    reported = reported_settings(handle.server_info)
    if not reported:
        handle.settings_source = "prediction"
        logger().warning(f"{handle.label}: /server_info reports no speculative settings; what the server runs is "
                         "unknown, its figures are reported under the preflight's prediction")
        return
    handle.settings_source = "/server_info"
    handle.effective = {**handle.predicted, **reported}
    differ = [f"{SPEC_INFO_KEYS[k]}={v} (the preflight predicted {handle.predicted.get(k)})"
              for k, v in reported.items() if handle.predicted.get(k) is not None and v != handle.predicted[k]]
    if not differ:
        return
    message = f"{handle.label}: /server_info reports {', '.join(differ)}; the server does not run what was checked"
    if enforce:
        raise ServerFailed(message)
    if handle.label.startswith("speculative "):  # settings label their rows: the label says what runs
        handle.label = f"speculative {setting_label(handle.effective)}"
    logger().warning(f"{message}; serving anyway (deploy.preflight: warn), reported as {handle.label}")


def setting_label(effective: dict) -> str:
    return f"{effective['num_steps']}/{effective['eagle_topk']}/{effective['num_draft_tokens']}"


def stop(run_dir: Path, handle: ServerHandle, executor: Executor | None = None) -> bool:
    """Kill the server's process group, close its tunnel, check the port is free; idempotent.

    True once it is stopped (or gone). Never raises for what goes wrong on the way (a host that no
    longer answers, a full disk): False, the reason logged, the entry left unstopped in servers.json
    for the run's teardown and `eagleops teardown` -- callers stop servers on their way out of an
    error, which must stay the error.
    """
    with _LIVE_LOCK:
        live = _LIVE.get(str(run_dir), {}).pop(handle.pid, None)
    executor = executor or (live or {}).get("executor")
    if live:
        live["tunnel"].close()
    if executor is None:
        return False
    try:
        _kill_server(executor, handle)
        handle.stopped_at = handle.stopped_at or time.time()
        _record(run_dir, handle, "stopped")
    except Exception as err:  # whatever it is, the caller's own error and the other servers come first
        logger().warning(f"{handle.label}: could not stop pid {handle.pid} on {executor.name}: {one_line(err)}")
        return False
    logger().info(f"{handle.label}: stopped (pid {handle.pid} on {executor.name})")
    return True


def _kill_server(executor: Executor, handle: ServerHandle) -> None:
    """The process group, only while its pid is still the process launched; then wait for the port."""
    if not executor.kill_group(handle.pid, identity=handle.identity or None):
        logger().warning(f"{handle.label}: pid {handle.pid} on {executor.name} is another process now: the server "
                         "is gone, nothing was killed")
        return
    deadline = time.monotonic() + 15
    while executor.port_in_use(handle.port) and time.monotonic() < deadline:
        time.sleep(0.5)
    if executor.port_in_use(handle.port):
        logger().warning(f"{handle.label}: port {handle.port} on {executor.name} is still in use after the teardown")


def one_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def close_run_executors(run_dir: Path) -> None:
    with _LIVE_LOCK:
        executors = _RUN_EXECUTORS.pop(str(run_dir), [])
    for executor in executors:
        executor.close()


def live_handles(run_dir: Path) -> list[ServerHandle]:
    with _LIVE_LOCK:
        return [entry["handle"] for entry in _LIVE.get(str(run_dir), {}).values()]


def executor_of(run_dir: Path, handle: ServerHandle) -> Executor:
    with _LIVE_LOCK:
        return _LIVE[str(run_dir)][handle.pid]["executor"]


def live_executor(run_dir: Path, pid: int) -> Executor | None:
    """The executor this process reaches a live server of the run through (None: not started by this process)."""
    with _LIVE_LOCK:
        live = _LIVE.get(str(run_dir), {}).get(pid)
    return live["executor"] if live else None


def configure_request_dumps(handle: ServerHandle, folder: str, threshold: int) -> None:
    """Turn the server's request dumping on (SGLang's `POST /configure_logging`: `dump_requests_folder`,
    `dump_requests_threshold`); a server that refuses it fails the launch with its answer."""
    try:
        answer = httpx.post(f"{handle.local_url}/configure_logging", timeout=30.0,
                            json={"dump_requests_folder": folder, "dump_requests_threshold": threshold})
    except httpx.HTTPError as err:
        raise ServerFailed(f"{handle.label}: /configure_logging did not answer ({err})") from err
    if answer.status_code != 200:
        raise ServerFailed(f"{handle.label}: /configure_logging answered HTTP {answer.status_code}: "
                           f"{answer.text[:500]}")
    logger().info(f"{handle.label}: dumping finished requests to {handle.host}:{folder}, {threshold} per file")
