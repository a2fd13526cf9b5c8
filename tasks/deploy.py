"""deploy_server: the exported draft to a serving host, and SGLang (or the reference server) started on it.

The stage exists so a server cannot silently run with other settings than asked, or with a
draft wired to other layers than the target feeds it -- the two failures that cost days by hand
(SGLang turning 16 draft tokens into 2 because topk 1 forces num_steps + 1; a draft trained on
[embed, L3, L31] served with [L3, L31, L59]). In order, nothing expensive before it is needed:

1. the host's environment (the same checks as the local stage, run there over SSH);
2. preflight: the effective settings SGLang will run (`tasks.launch`), the draft <-> target wiring
   (`eagle3.export.check_serving_wiring` against the training record), a free port;
3. upload of the draft (and of a tiny target) -- verified, resumable, skipped when identical;
4. SGLang's own argument resolution in a dry run on the host, when sglang is installed there;
5. launch detached in its own process group, wait for /health_generate while tailing the log,
   then /server_info: the resolved settings must equal the prediction.

Every live server is recorded in `<run_dir>/servers.json`; `teardown_run` (the flow's `finally`,
its failure/cancellation hooks, `eagleops teardown RUN_DIR`) kills each process group and checks
the port is free. The benchmark stage launches further servers (baseline, sweep) through `launch`.
"""

from __future__ import annotations

import contextlib
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
from eagle3.export import TRAINING_RECORD, Problem, check_serving_wiring, read_target_config
from tasks.config import ExperimentConfig, HostConfig, SpeculativeConfig
from tasks.launch import (
    SERVER_MODULES,
    Finding,
    effective_settings,
    launch_args,
    predict,
    settings_findings,
    target_architecture,
)
from tasks.pipeline import StageContext, logger
from tasks.remote import CommandFailed, Executor, connect
from tasks.rundir import write_json_atomic

SERVERS_FILE = "servers.json"
LOG_TAIL_LINES = 50
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
    effective: dict[str, Any] = field(default_factory=dict)
    server_info: dict[str, Any] = field(default_factory=dict)
    local_url: str = ""  # how this process reaches it (a tunnel for SSH hosts)

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


# Executors and tunnels this process holds open for live servers, by run folder: the benchmark
# stage reaches the servers the deploy stage started through them.
_LIVE: dict[str, dict[str, Any]] = {}
_LIVE_LOCK = threading.Lock()


# ------------------------------------------------------------------ host and environment


def host_config(cfg: ExperimentConfig) -> HostConfig | None:
    return None if cfg.deploy.host == "local" else cfg.host(cfg.deploy.host)


def open_executor(cfg: ExperimentConfig) -> Executor:
    return connect(host_config(cfg), cfg.hosts)


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


def preflight(cfg: ExperimentConfig, spec: SpeculativeConfig, draft_dir: Path, target_config: dict,
              model_path: str) -> tuple[list[Finding], dict]:
    """Every check that needs no server: effective settings and draft <-> target wiring."""
    args = launch_args(cfg, model_path=model_path, draft_path=str(draft_dir), port=cfg.deploy.port, spec=spec)
    resolution = predict(cfg, args, target_config.get("architectures", [None])[0] or target_architecture(cfg))
    findings = settings_findings(spec, resolution) + wiring_findings(draft_dir, target_config)
    return findings, effective_settings(spec, resolution) | {"max_running_requests": resolution.max_running_requests}


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


def target_config_on_host(cfg: ExperimentConfig, executor: Executor, model_path: str, local_target: Path | None) -> dict:
    """The serving target's config.json: the local copy when the target is ours, else read on the host."""
    if local_target is not None and (local_target / "config.json").is_file():
        return read_target_config(local_target)
    text = executor.read_file(f"{model_path}/config.json")
    config = json.loads(text)
    return {**config, **config.get("text_config", {})}


def place(cfg: ExperimentConfig, executor: Executor, ctx: StageContext, draft_dir: Path, target_dir: Path | None) -> Placement:
    """Upload the draft (and a tiny target) to the host's workdir; local hosts serve the files in place."""
    host = host_config(cfg)
    workdir = executor.expand_path(host.workdir if host else str(ctx.run_dir / "deploy_server"))
    if host is None:
        model = cfg.deploy.model_path or str(target_dir)
        return Placement(executor, None, workdir, model, str(draft_dir))
    run_dir = f"{workdir}/runs/{ctx.run_dir.parent.name}/{ctx.run_dir.name}"
    draft_path = f"{run_dir}/draft-{_digest_of(draft_dir)}"
    _upload(executor, draft_dir, draft_path)
    model = cfg.deploy.model_path or cfg.target.model_path
    if cfg.target.kind == "tiny" and cfg.deploy.model_path is None:  # our own target: it travels too
        model = f"{workdir}/targets/{Path(target_dir).name}"
        _upload(executor, Path(target_dir), model)
    return Placement(executor, host, workdir, model, draft_path)


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


def _registry_path(run_dir: Path) -> Path:
    return Path(run_dir) / SERVERS_FILE


def _record(run_dir: Path, handle: ServerHandle, status: str) -> None:
    path = _registry_path(run_dir)
    servers = json.loads(path.read_text()) if path.is_file() else {}
    servers[f"{handle.host}:{handle.port}:{handle.pid}"] = {**handle.to_dict(), "status": status}
    write_json_atomic(path, servers)


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
    pid = executor.start_detached(argv, env=dict(cfg.deploy.env), cwd=placement.workdir,
                                  log_file=f"{logs}/{stamp}.log", pid_file=f"{logs}/{stamp}.pid")
    handle = ServerHandle(label, executor.name, pid, port, f"{logs}/{stamp}.log", f"{logs}/{stamp}.pid", argv,
                          spec is not None, asked=_asked(spec), effective=predicted or {})
    _record(run_dir, handle, "starting")
    try:
        local_port = _open_tunnel(run_dir, handle, executor)
        handle.local_url = f"http://127.0.0.1:{local_port}"
        handle.server_info = wait_healthy(executor, handle, cfg.deploy.startup_timeout_s)
        _verify_resolved(handle)
    except BaseException:
        stop(run_dir, handle, executor)
        raise
    _record(run_dir, handle, "live")
    logger().info(f"{label}: serving on {executor.name}:{port} (pid {pid}), reached at {handle.local_url}")
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
    deadline, shown = time.monotonic() + timeout_s, 0
    with httpx.Client(timeout=10.0) as client:
        while time.monotonic() < deadline:
            if not executor.is_alive(handle.pid):
                raise ServerFailed(f"{handle.label}: the server exited during startup; last {LOG_TAIL_LINES} log "
                                   f"lines of {handle.log_file}:\n{log_tail(executor, handle)}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{handle.local_url}/health_generate").status_code == 200:
                    return client.get(f"{handle.local_url}/server_info").json()
            shown = _relay_log(executor, handle, shown)
            time.sleep(1.0)
    raise ServerFailed(f"{handle.label}: not healthy within deploy.startup_timeout_s={timeout_s:.0f}s; last "
                       f"{LOG_TAIL_LINES} log lines:\n{log_tail(executor, handle)}")


def _relay_log(executor: Executor, handle: ServerHandle, shown: int) -> int:
    """Forward new server log lines to the run log while waiting (the startup is where things go wrong)."""
    with contextlib.suppress(CommandFailed):
        lines = executor.read_file(handle.log_file).splitlines()
        for line in lines[shown:]:
            logger().info(f"[{handle.label}] {line}")
        return len(lines)
    return shown


def log_tail(executor: Executor, handle: ServerHandle, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return executor.read_file(handle.log_file, tail_lines=lines)
    except CommandFailed as err:
        return f"(log unreadable: {err})"


def _verify_resolved(handle: ServerHandle) -> None:
    """/server_info's resolved settings must be the predicted effective ones (else the server runs others)."""
    if not handle.speculative:
        return
    info = handle.server_info
    for field_name, key in (("num_steps", "speculative_num_steps"), ("eagle_topk", "speculative_eagle_topk"),
                            ("num_draft_tokens", "speculative_num_draft_tokens")):
        if key in info and handle.effective.get(field_name) is not None and info[key] != handle.effective[field_name]:
            raise ServerFailed(f"{handle.label}: /server_info reports {key}={info[key]}, the preflight predicted "
                               f"{handle.effective[field_name]}; the server does not run what was checked")


def stop(run_dir: Path, handle: ServerHandle, executor: Executor | None = None) -> None:
    """Kill the server's process group, close its tunnel, check the port is free; idempotent."""
    with _LIVE_LOCK:
        live = _LIVE.get(str(run_dir), {}).pop(handle.pid, None)
    executor = executor or (live or {}).get("executor")
    if live:
        live["tunnel"].close()
    if executor is None:
        return
    executor.kill_group(handle.pid)
    deadline = time.monotonic() + 15
    while executor.port_in_use(handle.port) and time.monotonic() < deadline:
        time.sleep(0.5)
    if executor.port_in_use(handle.port):
        logger().warning(f"{handle.label}: port {handle.port} on {executor.name} is still in use after the teardown")
    _record(run_dir, handle, "stopped")
    logger().info(f"{handle.label}: stopped (pid {handle.pid} on {executor.name})")


def teardown_run(run_dir: str | Path, cfg: ExperimentConfig | None = None) -> list[str]:
    """Stop every server of a run that is not recorded as stopped (this process's, or a dead process's)."""
    path = _registry_path(Path(run_dir))
    if not path.is_file():
        return []
    stopped = []
    for entry in json.loads(path.read_text()).values():
        if entry.get("status") == "stopped":
            continue
        handle = ServerHandle(**{k: v for k, v in entry.items() if k != "status"})
        with _LIVE_LOCK:
            live = _LIVE.get(str(run_dir), {}).get(handle.pid)
        executor = live["executor"] if live else _executor_for(handle.host, cfg)
        if executor is None:
            logger().warning(f"{handle.label}: cannot reach host {handle.host} to stop pid {handle.pid}")
            continue
        stop(Path(run_dir), handle, executor)
        stopped.append(f"{handle.label} (pid {handle.pid} on {handle.host})")
    return stopped


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
    return connect(cfg.host(host), cfg.hosts)


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


def prepare_and_launch(cfg: ExperimentConfig, ctx: StageContext, spec: SpeculativeConfig, label: str,
                       placement: Placement, target_config: dict, draft_dir: Path,
                       already_checked: bool = False) -> ServerHandle:
    """Preflight one speculative setting on a placed draft, dry-run it where SGLang is, launch it."""
    findings, predicted = preflight(cfg, spec, draft_dir, target_config, placement.model_path)
    if not already_checked:
        report_findings(findings, f"{label}: preflight failed", cfg.deploy.preflight == "enforce")
    if cfg.deploy.server == "sglang":
        args = launch_args(cfg, model_path=placement.model_path, draft_path=placement.draft_path,
                           port=cfg.deploy.port, spec=spec)
        report_findings(dry_run_findings(sglang_dry_run(placement.executor, args), predicted),
                        f"{label}: SGLang's dry run disagrees", cfg.deploy.preflight == "enforce")
    return launch(cfg, placement, ctx.run_dir, label=label, spec=spec, predicted=predicted)


def setting_label(effective: dict) -> str:
    return f"{effective['num_steps']}/{effective['eagle_topk']}/{effective['num_draft_tokens']}"


@task(name="deploy_server", cache_policy=NO_CACHE)
def deploy_server(cfg: ExperimentConfig, ctx: StageContext) -> dict:
    exported = ctx.upstream["export_checkpoint"]["outputs"]
    draft_dir, target_dir = Path(exported["sglang_dir"]), Path(exported["target_dir"])
    local_target = target_dir if cfg.target.kind == "tiny" or cfg.deploy.host == "local" else None
    executor = open_executor(cfg)
    environment = check_host_environment(cfg, executor, _workdir(cfg, executor, ctx), draft_dir)
    model_path = cfg.deploy.model_path or (str(target_dir) if local_target else cfg.target.model_path)
    target_config = target_config_on_host(cfg, executor, model_path, local_target)
    findings, predicted = preflight(cfg, cfg.deploy.speculative, draft_dir, target_config, model_path)
    report_findings(findings, "preflight failed", cfg.deploy.preflight == "enforce")  # before anything is uploaded
    placement = place(cfg, executor, ctx, draft_dir, target_dir)
    handle = prepare_and_launch(cfg, ctx, cfg.deploy.speculative, f"speculative {setting_label(predicted)}",
                                placement, target_config, draft_dir, already_checked=True)
    served_dtype = draft_dtype_served(draft_dir)
    _log_to_mlflow(ctx, handle, findings, predicted, served_dtype, environment)
    summary = {"server": handle.to_dict(), "asked": handle.asked, "effective": predicted,
               "adjusted": {k: v for k, v in handle.asked.items() if v is not None and predicted.get(k) != v},
               "draft_dtype_served": served_dtype, "placement": {"host": executor.name, "model_path": placement.model_path,
                                                                "draft_path": placement.draft_path,
                                                                "workdir": placement.workdir},
               "preflight": [asdict(f) for f in findings]}
    ctx.write_json("server.json", summary)
    return {**summary, "metrics": {"speculative_num_draft_tokens": predicted["num_draft_tokens"] or 0},
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
                    **{f"effective.{k}": v for k, v in predicted.items()}})
    run.log_dict(handle.server_info, "server/server_info.json")
    run.log_text(" ".join(handle.argv) + "\n", "server/launch_command.txt")
    run.log_dict([asdict(f) for f in findings], "server/preflight.json")
    run.log_dict(environment, "server/host_environment.json")
