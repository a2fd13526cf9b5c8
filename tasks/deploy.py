"""deploy_server: the exported draft to a serving host, and SGLang (or the reference server) started on it.

The stage exists so a server cannot silently run with other settings than asked, or with a
draft wired to other layers than the target feeds it -- the two failures that cost days by hand
(SGLang turning 16 draft tokens into 2 because topk 1 forces num_steps + 1; a draft trained on
[embed, L3, L31] served with [L3, L31, L59]). In order, nothing expensive before it is needed:

1. the host's environment (the same checks as the local stage, run there over SSH);
2. preflight: the effective settings SGLang will run (`tasks.launch`), the draft <-> target wiring
   (`eagle3.export.check_serving_wiring` against the training record) with the served model's
   files as the serving host has them (`tasks.served`), a free port;
3. upload of the draft (and of a tiny target) -- verified, resumable, skipped when identical;
4. SGLang's own argument resolution in a dry run on the host, when sglang is installed there
   (`sglang_dry_run_batch` resolves the benchmark's sweep settings the same way, in one process);
5. launch detached in its own process group, wait for /health_generate while tailing the log,
   then /server_info: what the server reports is what it runs (`ServerHandle.effective`); a report
   other than the prediction fails the launch (`deploy.preflight: warn`: logged, and reported
   under the server's values).

Every live server is recorded in `<run_dir>/servers.json` (`tasks.server_registry`, writers under a
lock); `teardown_run` (the flow's `finally`, its failure/cancellation hooks, `eagleops teardown
RUN_DIR`) kills each process group -- only while its pid is still the process launched (its start
time, recorded at launch: a pid the host gave to another process since is never killed) -- and
checks the port is free. It never raises for a server it cannot stop (a host that no longer answers,
a group already gone): it logs why and stops the others, so the error that started the teardown stays
the error; signals wait until it is done. The SSH connections opened for the run's servers close
with it. The benchmark stage launches further servers (baseline, sweep) through `launch`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prefect import task
from prefect.cache_policies import NO_CACHE

from eagle3.environment import Facts, Needs, evaluate, overall_status
from eagle3.export import TRAINING_RECORD, Problem, check_serving_wiring
from tasks.config import ExperimentConfig, HostConfig, SpeculativeConfig
from tasks.host_job import poll_delay
from tasks.launch import (
    SERVER_MODULES,
    Finding,
    effective_settings,
    launch_args,
    predict,
    settings_findings,
)
from tasks.pipeline import StageContext, logger
from tasks.remote import CommandFailed, Executor, connect
from tasks.served import ServedModel, launch_paths, read_served_model, reported_paths
from tasks.server_registry import SERVERS_FILE, read_servers, record_server, registry_path  # noqa: F401 (re-export)
from tasks.signal_hold import signals_held

LOG_TAIL_LINES = 50
TEARDOWN_CONNECT_RETRIES = 1  # a host that does not answer costs the teardown one retry, not connect_retries
DRY_RUN_SCRIPT = Path(__file__).resolve().parents[1] / "eagle3" / "serving" / "sglang_dryrun.py"
ENVIRONMENT_SCRIPT = Path(__file__).resolve().parents[1] / "eagle3" / "environment.py"


class PreflightFailed(RuntimeError):
    """A check before launch failed; the message lists each failed check with its one-line reason."""


class ServerFailed(RuntimeError):
    """The server exited or never became healthy; the message carries the tail of its log."""


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


# ------------------------------------------------------------------ host and environment


def host_config(cfg: ExperimentConfig) -> HostConfig | None:
    return None if cfg.deploy.host == "local" else cfg.host(cfg.deploy.host)


def open_executor(cfg: ExperimentConfig, run_dir: Path | None = None) -> Executor:
    """The deploy host's executor; with `run_dir`, held for that run's servers and closed by its teardown."""
    executor = connect(host_config(cfg), cfg.hosts)
    if run_dir is not None:
        with _LIVE_LOCK:
            _RUN_EXECUTORS.setdefault(str(run_dir), []).append(executor)
    return executor


def remote_facts(executor: Executor, workdir: str) -> Facts:
    """`eagle3.environment` run by the host's own Python (its source piped in: nothing to install first)."""
    result = executor.run([executor.python, "-", "--path", workdir], stdin=ENVIRONMENT_SCRIPT.read_bytes(),
                          log_output=False, timeout=120)
    return Facts.from_dict(json.loads(result.stdout))


def serving_needs(cfg: ExperimentConfig, draft_bytes: int) -> Needs:
    sglang = cfg.deploy.server == "sglang"
    return Needs(gpu=sglang, flash_attn=False, sglang=sglang, disk_bytes=draft_bytes)


def check_host_environment(cfg: ExperimentConfig, executor: Executor, workdir: str, draft_dir: Path) -> dict:
    """The local stage's checks, evaluated on the serving host's facts; fails before any upload."""
    executor.makedirs(workdir)
    facts = remote_facts(executor, workdir)
    size = sum(p.stat().st_size for p in draft_dir.rglob("*") if p.is_file())
    checks = evaluate(facts, serving_needs(cfg, size))
    for check in checks:
        log = logger().error if check.status == "fail" else logger().warning if check.status == "warn" else logger().info
        log(f"[{executor.name}] {check.name}: {check.status}: {check.reason}")
    failed = [c for c in checks if c.status == "fail"]
    if failed:
        raise PreflightFailed(f"host {executor.name} cannot serve this config: "
                              + "; ".join(f"{c.name}: {c.reason}" for c in failed))
    return {"status": overall_status(checks), "facts": asdict(facts), "checks": [asdict(c) for c in checks]}


# ------------------------------------------------------------------ preflight


def read_training_record(draft_dir: Path) -> dict | None:
    path = Path(draft_dir) / TRAINING_RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def wiring_findings(draft_dir: Path, target_config: dict) -> list[Finding]:
    problems: list[Problem] = check_serving_wiring(draft_dir, target_config, read_training_record(draft_dir))
    return [Finding(p.severity, f"wiring.{p.code}", p.message) for p in problems]


def preflight(cfg: ExperimentConfig, spec: SpeculativeConfig, draft_dir: Path, served: ServedModel,
              placement: Placement) -> tuple[list[Finding], dict]:
    """Every check that needs no server: effective settings, and the draft <-> target wiring against the
    served model's files as the serving host has them (`served`, from `served_model_planned`)."""
    # The draft's local copy for the prediction: SGLang's algorithm-alias rule reads the draft's config.json.
    args = launch_args(cfg, model_path=placement.model_path, draft_path=str(draft_dir), port=cfg.deploy.port, spec=spec)
    resolution = predict(cfg, args, served.target_config.get("architectures", [None])[0])
    findings = settings_findings(spec, resolution) + served_draft_findings(placement, draft_dir, served)
    return findings, effective_settings(spec, resolution) | {"max_running_requests": resolution.max_running_requests}


def served_draft_findings(placement: Placement, draft_dir: Path, served: ServedModel) -> list[Finding]:
    """The wiring of the draft the server will load: this run's export, unless the flags name another."""
    if served.paths.get("draft") != placement.draft_path:
        return [Finding("error", "wiring.draft_override", f"the launch flags (deploy.extra_args) make the server load "
                        f"the draft at {served.paths.get('draft')}, not this run's export ({placement.draft_path}); "
                        "what it was trained on is not what this run checked")]
    return wiring_findings(draft_dir, served.target_config)


def report_findings(findings: list[Finding], what: str, enforce: bool = True) -> None:
    """Log each finding; raise with every error's one-line reason (only log them when not enforced)."""
    for f in findings:
        {"error": logger().error, "warning": logger().warning}.get(f.level, logger().info)(f"preflight {f.line()}")
    errors = [f for f in findings if f.level == "error"]
    if errors and enforce:
        raise PreflightFailed(f"{what}: " + "; ".join(f.line() for f in errors))
    if errors:
        logger().warning(f"{what}, launching anyway (deploy.preflight: warn)")


# ------------------------------------------------------------------ placement


def plan_placement(cfg: ExperimentConfig, executor: Executor, ctx: StageContext, draft_dir: Path,
                   target_dir: Path | None) -> Placement:
    """Where the host will find the target and the draft, and what must be uploaded there (nothing moves yet).

    A local host serves the files in place; a remote one gets the draft (and a tiny target, unless
    deploy.model_path names the model to serve) in its workdir; any other target is served from
    deploy.model_path, else target.model_path, as the host has it.
    """
    host = host_config(cfg)
    workdir = _workdir(cfg, executor, ctx)
    if host is None:
        return Placement(executor, None, workdir, cfg.deploy.model_path or str(target_dir), str(draft_dir))
    run_dir = f"{workdir}/runs/{ctx.run_dir.parent.name}/{ctx.run_dir.name}"
    draft_path = f"{run_dir}/draft-{_digest_of(draft_dir)}"
    uploads = {draft_path: Path(draft_dir)}
    model = cfg.deploy.model_path or cfg.target.model_path
    if cfg.target.kind == "tiny" and cfg.deploy.model_path is None:  # our own target: it travels too
        model = f"{workdir}/targets/{Path(target_dir).name}"
        uploads[model] = Path(target_dir)
    return Placement(executor, host, workdir, model, draft_path, uploads)


def place(cfg: ExperimentConfig, executor: Executor, ctx: StageContext, draft_dir: Path, target_dir: Path | None) -> Placement:
    """`plan_placement`, then the uploads it lists (verified, resumable, skipped when identical)."""
    placement = plan_placement(cfg, executor, ctx, draft_dir, target_dir)
    for remote, local in placement.uploads.items():
        _upload(executor, local, remote)
    return placement


def served_model_planned(cfg: ExperimentConfig, placement: Placement) -> ServedModel:
    """The model and draft the deployed launch will load, as the host has them (or will, once uploaded)."""
    args = launch_args(cfg, model_path=placement.model_path, draft_path=placement.draft_path, port=cfg.deploy.port)
    try:
        return read_served_model(placement.executor, launch_paths(args), paths_from="launch command",
                                 uploads=placement.uploads, cwd=placement.workdir)
    except FileNotFoundError as err:
        raise PreflightFailed(f"preflight failed: {err}") from err


def served_model_reported(handle: ServerHandle, placement: Placement) -> ServedModel:
    """The model and draft a running server says it loaded (/server_info), read on its host."""
    paths, source = reported_paths(handle.server_info), "/server_info"
    if paths is None:
        paths, source = launch_paths(handle.argv), "launch command (/server_info reports no model_path)"
    return read_served_model(placement.executor, paths, paths_from=source, cwd=placement.workdir)


def _digest_of(folder: Path) -> str:
    from tasks.rundir import digest_paths

    return digest_paths([folder])[:12]


def _upload(executor: Executor, local: Path, remote: str) -> None:
    results = executor.upload_dir(local, remote)
    sent = sum(r.bytes_sent for r in results)
    skipped = sum(1 for r in results if r.skipped)
    logger().info(f"[{executor.name}] {local.name} -> {remote}: {len(results)} files, {sent / 1e6:.1f} MB sent, "
                  f"{skipped} already there with the same sha256")


# ------------------------------------------------------------------ dry run


def sglang_dry_run_batch(executor: Executor, argvs: list[list[str]]) -> list[dict] | None:
    """SGLang's own resolution of several launch argvs in one process (the script's --batch-json), one answer
    per argv; a script that could not answer (sglang not importable) answers the same error for each."""
    if not DRY_RUN_SCRIPT.is_file() or not argvs:
        return None
    result = executor.run([executor.python, "-", "--batch-json", json.dumps(argvs)], stdin=DRY_RUN_SCRIPT.read_bytes(),
                          check=False, log_output=False, timeout=600)
    try:
        answers = json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        answers = {"ok": False, "error": f"dry run printed no JSON (exit {result.exit_status}): {result.stderr[-500:]}"}
    if isinstance(answers, list) and len(answers) == len(argvs):
        return answers
    if not isinstance(answers, dict):
        answers = {"ok": False, "error": f"dry run answered {len(answers)} objects for {len(argvs)} launch argvs"}
    return [answers] * len(argvs)


def sglang_dry_run(executor: Executor, args: list[str]) -> dict | None:
    """SGLang's own argument resolution on the host (eagle3/serving/sglang_dryrun.py piped to its Python)."""
    if not DRY_RUN_SCRIPT.is_file():
        return None
    result = executor.run([executor.python, "-", "--", *args], stdin=DRY_RUN_SCRIPT.read_bytes(), check=False,
                          log_output=False, timeout=300)
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"ok": False, "error": f"dry run printed no JSON (exit {result.exit_status}): {result.stderr[-500:]}"}


def dry_run_findings(dry: dict | None, predicted: dict) -> list[Finding]:
    """SGLang's resolution must agree with the prediction; a disagreement shows both sides."""
    if dry is None:
        return []
    if not dry.get("ok"):
        return [Finding("error", "sglang_dry_run", f"SGLang refuses these flags: {dry.get('error')}")]
    resolved = dry.get("resolved", {})
    findings = []
    for field_name, key in (("num_steps", "speculative_num_steps"), ("eagle_topk", "speculative_eagle_topk"),
                            ("num_draft_tokens", "speculative_num_draft_tokens"),
                            ("max_running_requests", "max_running_requests")):
        if key in resolved and resolved[key] != predicted.get(field_name):
            findings.append(Finding("error", "sglang_dry_run", f"{key}: SGLang resolves {resolved[key]}, eagleops "
                                    f"predicted {predicted.get(field_name)}"))
    return findings or [Finding("info", "sglang_dry_run", "SGLang's own resolution agrees with the prediction")]


# ------------------------------------------------------------------ lifecycle


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
    pid = executor.start_detached(argv, env=cfg.deploy.server_env(), cwd=placement.workdir,
                                  log_file=f"{logs}/{stamp}.log", pid_file=f"{logs}/{stamp}.pid")
    handle = ServerHandle(label, executor.name, pid, port, f"{logs}/{stamp}.log", f"{logs}/{stamp}.pid", argv,
                          spec is not None, asked=_asked(spec), effective=dict(predicted or {}),
                          predicted=dict(predicted or {}), allow_adjustments=bool(spec and spec.allow_adjustments),
                          identity=executor.process_identity(pid) or "")
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
                raise ServerFailed(f"{handle.label}: the server exited during startup; last {LOG_TAIL_LINES} log "
                                   f"lines of {handle.log_file}:\n{log_tail(executor, handle)}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{handle.local_url}/health_generate").status_code == 200:
                    return client.get(f"{handle.local_url}/server_info").json()
            shown = _relay_log(executor, handle, shown)
            time.sleep(poll_delay(started, 1.0))
    raise ServerFailed(f"{handle.label}: not healthy within deploy.startup_timeout_s={timeout_s:.0f}s; last "
                       f"{LOG_TAIL_LINES} log lines:\n{log_tail(executor, handle)}")


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
        _record(run_dir, handle, "stopped")
    except Exception as err:  # whatever it is, the caller's own error and the other servers come first
        logger().warning(f"{handle.label}: could not stop pid {handle.pid} on {executor.name}: {_one_line(err)}")
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


def _one_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


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
            _close_run_executors(run_dir)
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
    with _LIVE_LOCK:
        live = _LIVE.get(str(run_dir), {}).get(handle.pid)
    executor, why = (live["executor"], "") if live else hosts.executor(handle.host)
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
                self.unreachable[host] = f"cannot reach host {host}: {_one_line(err)}"
            else:
                if executor is None:
                    self.unreachable[host] = f"host {host} is not in the config's hosts (pass the config)"
                else:
                    self.opened[host] = executor
        return self.opened.get(host), self.unreachable.get(host, "")

    def close(self) -> None:
        for executor in self.opened.values():
            executor.close()


def _close_run_executors(run_dir: Path) -> None:
    with _LIVE_LOCK:
        executors = _RUN_EXECUTORS.pop(str(run_dir), [])
    for executor in executors:
        executor.close()


def teardown_for_flow_run(parameters: dict, flow_run_id: str) -> list[str]:
    """Teardown from a Prefect hook, which may run in another process: find the run folder whose
    manifest lists this flow run, then stop its recorded servers."""
    from tasks.config import load_experiment

    cfg = load_experiment(parameters["config_path"], parameters.get("variant"))
    folders = [Path(parameters["run_dir"])] if parameters.get("run_dir") else \
        sorted((Path(cfg.runs_root) / cfg.experiment).glob("*"), reverse=True)
    for folder in folders:
        manifest = folder / "manifest.json"
        if manifest.is_file() and flow_run_id in json.loads(manifest.read_text()).get("prefect_flow_run_ids", []):
            return teardown_run(folder, cfg)
    return []


def _executor_for(host: str, cfg: ExperimentConfig | None) -> Executor | None:
    if host == "local":
        return connect(None)
    if cfg is None or host not in {h.name for h in cfg.hosts}:
        return None
    config = cfg.host(host)
    retries = min(config.connect_retries, TEARDOWN_CONNECT_RETRIES)
    return connect(config.model_copy(update={"connect_retries": retries}), cfg.hosts)


def live_handles(run_dir: Path) -> list[ServerHandle]:
    with _LIVE_LOCK:
        return [entry["handle"] for entry in _LIVE.get(str(run_dir), {}).values()]


def executor_of(run_dir: Path, handle: ServerHandle) -> Executor:
    with _LIVE_LOCK:
        return _LIVE[str(run_dir)][handle.pid]["executor"]


# ------------------------------------------------------------------ the stage


def draft_dtype_served(draft_dir: Path, server_dtype: str = "auto") -> str:
    """SGLang serves a float32 draft config in float16 under --dtype auto (model config's dtype rule)."""
    torch_dtype = json.loads((Path(draft_dir) / "config.json").read_text()).get("torch_dtype", "float32")
    if server_dtype != "auto":
        return server_dtype
    return "float16" if torch_dtype in ("float32", "float") else torch_dtype


def check_setting(cfg: ExperimentConfig, spec: SpeculativeConfig, label: str, placement: Placement,
                  served: ServedModel, draft_dir: Path, already_checked: bool = False) -> dict:
    """Preflight one speculative setting on a placed draft and dry-run it where SGLang is; -> the prediction."""
    findings, predicted = preflight(cfg, spec, draft_dir, served, placement)
    if not already_checked:
        report_findings(findings, f"{label}: preflight failed", cfg.deploy.preflight == "enforce")
    if cfg.deploy.server == "sglang":
        args = launch_args(cfg, model_path=placement.model_path, draft_path=placement.draft_path,
                           port=cfg.deploy.port, spec=spec)
        report_findings(dry_run_findings(sglang_dry_run(placement.executor, args), predicted),
                        f"{label}: SGLang's dry run disagrees", cfg.deploy.preflight == "enforce")
    return predicted


def prepare_and_launch(cfg: ExperimentConfig, ctx: StageContext, spec: SpeculativeConfig, label: str,
                       placement: Placement, served: ServedModel, draft_dir: Path,
                       already_checked: bool = False) -> ServerHandle:
    """`check_setting`, then launch it."""
    predicted = check_setting(cfg, spec, label, placement, served, draft_dir, already_checked)
    return launch(cfg, placement, ctx.run_dir, label=label, spec=spec, predicted=predicted)


def setting_label(effective: dict) -> str:
    return f"{effective['num_steps']}/{effective['eagle_topk']}/{effective['num_draft_tokens']}"


@task(name="deploy_server", cache_policy=NO_CACHE)
def deploy_server(cfg: ExperimentConfig, ctx: StageContext) -> dict:
    from tasks.data import recorded_target_dir  # here: tasks.data imports this module

    exported = ctx.upstream["export_checkpoint"]["outputs"]
    draft_dir, target_dir = Path(exported["sglang_dir"]), recorded_target_dir(cfg, ctx, exported["target_dir"])
    executor = open_executor(cfg, ctx.run_dir)  # the run's teardown closes it: the server outlives this stage
    environment = check_host_environment(cfg, executor, _workdir(cfg, executor, ctx), draft_dir)
    plan = plan_placement(cfg, executor, ctx, draft_dir, target_dir)
    served = served_model_planned(cfg, plan)  # the model the host serves, read there (uploads: their local bytes)
    findings, predicted = preflight(cfg, cfg.deploy.speculative, draft_dir, served, plan)
    report_findings(findings, "preflight failed", cfg.deploy.preflight == "enforce")  # before anything is uploaded
    placement = place(cfg, executor, ctx, draft_dir, target_dir)
    handle = prepare_and_launch(cfg, ctx, cfg.deploy.speculative, f"speculative {setting_label(predicted)}",
                                placement, served, draft_dir, already_checked=True)
    served_dtype = draft_dtype_served(draft_dir)
    _log_to_mlflow(ctx, handle, findings, predicted, served_dtype, environment)
    summary = {"server": handle.to_dict(), "asked": handle.asked, "effective": handle.effective,
               "predicted": predicted, "settings_source": handle.settings_source,
               "adjusted": {k: v for k, v in handle.asked.items() if v is not None and handle.effective.get(k) != v},
               "draft_dtype_served": served_dtype, "placement": {"host": executor.name, "model_path": placement.model_path,
                                                                "draft_path": placement.draft_path,
                                                                "workdir": placement.workdir},
               "served_model": {k: v for k, v in served.to_dict().items() if k != "target_config"},
               "preflight": [asdict(f) for f in findings]}
    ctx.write_json("server.json", summary)
    return {**summary, "metrics": {"speculative_num_draft_tokens": handle.effective["num_draft_tokens"] or 0},
            "outputs": {"server_log": handle.log_file, "local_url": handle.local_url}}


def _workdir(cfg: ExperimentConfig, executor: Executor, ctx: StageContext) -> str:
    host = host_config(cfg)
    return executor.expand_path(host.workdir) if host else str(ctx.run_dir / "deploy_server")


def _log_to_mlflow(ctx: StageContext, handle: ServerHandle, findings: list[Finding], predicted: dict,
                   served_dtype: str, environment: dict) -> None:
    run = ctx.mlflow
    run.log_params({"host": handle.host, "port": handle.port, "launch_command": " ".join(handle.argv),
                    "draft_dtype_served": served_dtype,
                    **{f"asked.{k}": v for k, v in handle.asked.items()},
                    **{f"predicted.{k}": v for k, v in predicted.items()},
                    **{f"effective.{k}": v for k, v in handle.effective.items()}})
    run.log_dict(handle.server_info, "server/server_info.json")
    run.log_text(" ".join(handle.argv) + "\n", "server/launch_command.txt")
    run.log_dict([asdict(f) for f in findings], "server/preflight.json")
    run.log_dict(environment, "server/host_environment.json")
