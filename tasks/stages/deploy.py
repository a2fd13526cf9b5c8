"""deploy_server: the exported draft to a serving host, and SGLang (or the reference server) started on it.

The stage exists so a server cannot silently run with other settings than asked, or with a
draft wired to other layers than the target feeds it -- the two failures that cost days by hand
(SGLang turning 16 draft tokens into 2 because topk 1 forces num_steps + 1; a draft trained on
[embed, L3, L31] served with [L3, L31, L59]). In order, nothing expensive before it is needed:

1. the host's environment (the same checks as the local stage, run there over SSH);
2. preflight: the effective settings SGLang will run (`tasks.hosts.launch`), the draft <-> target wiring
   (`eagle3.export.check_serving_wiring` against the training record) with the served model's
   files as the serving host has them (`tasks.hosts.served`), a free port;
3. upload of the draft (and of a tiny target) -- verified, resumable, skipped when identical;
4. SGLang's own argument resolution in a dry run on the host, when sglang is installed there
   (`sglang_dry_run_batch` resolves the benchmark's sweep settings the same way, in one process);
5. launch detached in its own process group, wait for /health_generate while tailing the log,
   then /server_info: what the server reports is what it runs (`ServerHandle.effective`); a report
   other than the prediction fails the launch (`deploy.preflight: warn`: logged, and reported
   under the server's values). Launching, stopping and the run's teardown are `tasks.hosts.servers`
   and `tasks.hosts.teardown`; the benchmark stage launches further servers (baseline, sweep) the same way.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import asdict
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

import eagle3
from eagle3.environment import Facts, Needs, evaluate, overall_status
from eagle3.export import TRAINING_RECORD, Problem, check_serving_wiring
from tasks.config.schema import ExperimentConfig, SpeculativeConfig
from tasks.hosts.launch import (
    Finding,
    effective_settings,
    launch_args,
    predict,
    settings_findings,
)
from tasks.hosts.remote import Executor
from tasks.hosts.served import (
    ServedModel,
    launch_paths,
    read_served_model,
    reported_paths,
)
from tasks.hosts.server_registry import (  # noqa: F401 (re-export)
    SERVERS_FILE,
    read_servers,
    record_server,
    registry_path,
)
from tasks.hosts.servers import (
    Placement,
    PreflightFailed,
    ServerHandle,
    configure_request_dumps,
    host_config,
    launch,
    open_executor,
    setting_label,
)
from tasks.log import logger
from tasks.runner.context import StageContext
from tasks.runner.flow_errors import redacted_failures
from tasks.stages.target import recorded_target_dir

DRY_RUN_SCRIPT = Path(eagle3.__file__).resolve().parent / "serving" / "sglang_dryrun.py"


ENVIRONMENT_SCRIPT = Path(eagle3.__file__).resolve().parent / "environment.py"


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


@task(name="deploy_server", cache_policy=NO_CACHE)
@redacted_failures  # its exception reaches the task run's Prefect state message masked
def deploy_server(cfg: ExperimentConfig, ctx: StageContext) -> dict:
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
    dumps = _dump_requests(cfg, executor, handle, placement.workdir)
    served_dtype = draft_dtype_served(draft_dir)
    _log_to_mlflow(ctx, handle, findings, predicted, served_dtype, environment, dumps)
    summary = {"server": handle.to_dict(), "asked": handle.asked, "effective": handle.effective,
               "predicted": predicted, "settings_source": handle.settings_source,
               "adjusted": {k: v for k, v in handle.asked.items() if v is not None and handle.effective.get(k) != v},
               "draft_dtype_served": served_dtype, "placement": {"host": executor.name, "model_path": placement.model_path,
                                                                "draft_path": placement.draft_path,
                                                                "workdir": placement.workdir},
               "served_model": {k: v for k, v in served.to_dict().items() if k != "target_config"},
               "preflight": [asdict(f) for f in findings], "dump_requests": dumps}
    ctx.write_json("server.json", summary)
    return {**summary, "metrics": {"speculative_num_draft_tokens": handle.effective["num_draft_tokens"] or 0},
            "outputs": {"server_log": handle.log_file, "local_url": handle.local_url}}


def _dump_requests(cfg: ExperimentConfig, executor: Executor, handle: ServerHandle, workdir: str) -> dict | None:
    """Request dumping on, where `deploy.dump_requests` asks: -> {host, folder, threshold}, what the run records
    so a served-traffic nightly knows where to read."""
    asked = cfg.deploy.dump_requests
    if not asked.enabled:
        return None
    folder = asked.folder if posixpath.isabs(asked.folder) else posixpath.join(workdir, asked.folder)
    executor.makedirs(folder)
    configure_request_dumps(handle, folder, asked.threshold)
    return {"host": executor.name, "folder": folder, "threshold": asked.threshold}


def _workdir(cfg: ExperimentConfig, executor: Executor, ctx: StageContext) -> str:
    host = host_config(cfg)
    return executor.expand_path(host.workdir) if host else str(ctx.run_dir / "deploy_server")


def _log_to_mlflow(ctx: StageContext, handle: ServerHandle, findings: list[Finding], predicted: dict,
                   served_dtype: str, environment: dict, dumps: dict | None) -> None:
    run = ctx.mlflow
    run.log_params({"host": handle.host, "port": handle.port, "launch_command": " ".join(handle.argv),
                    "draft_dtype_served": served_dtype,
                    **({f"dump_requests.{k}": v for k, v in dumps.items()} if dumps else {}),
                    **{f"asked.{k}": v for k, v in handle.asked.items()},
                    **{f"predicted.{k}": v for k, v in predicted.items()},
                    **{f"effective.{k}": v for k, v in handle.effective.items()}})
    run.log_dict(handle.server_info, "server/server_info.json")
    run.log_text(" ".join(handle.argv) + "\n", "server/launch_command.txt")
    run.log_dict([asdict(f) for f in findings], "server/preflight.json")
    run.log_dict(environment, "server/host_environment.json")
