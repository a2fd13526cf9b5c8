"""`eagleops` command line: validate, run and list experiments.

Exit codes: 0 ok, 2 bad input (config, flags, run directory), 1 a stage failed.
Prefect and MLflow are imported only by the commands that need them, so `validate` and
`--version` answer at once.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

# Telemetry off before Prefect or MLflow is imported (DO_NOT_TRACK covers Prefect's client,
# PREFECT_SERVER_ANALYTICS_ENABLED its ephemeral server, MLFLOW_DISABLE_TELEMETRY MLflow).
for _key, _value in {
    "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
}.items():
    os.environ.setdefault(_key, _value)

from tasks.config.load import (  # noqa: E402
    ConfigError,
    is_sweep,
    load_experiment,
    load_sweep,
    load_variants,
)

app = typer.Typer(add_completion=False, no_args_is_help=True, help="EAGLE-3 draft pipeline: data, training, export, SGLang deploy, benchmark.")
out = Console()
err = Console(stderr=True)

BAD_INPUT, STAGE_FAILED = 2, 1


def _version_callback(value: bool) -> None:
    if value:
        from tasks.tracking.runs import eagleops_version

        out.print(f"eagleops {eagleops_version()}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True, help="Print the version."),
) -> None:
    """eagleops."""


def _say(label: str, style: str, message: str) -> None:
    """`label message` on stderr, the message as written: brackets in it (a regex, a user's string) are text,
    never Rich markup."""
    err.print(Text.assemble((label, style), " ", message), highlight=False, soft_wrap=True)


def _fail_config(error: ConfigError) -> None:
    for message in error.messages:
        _say("error", "red", message)
    raise typer.Exit(BAD_INPUT)


@app.command()
def validate(config: Path = typer.Argument(..., help="Experiment or sweep YAML.")) -> None:
    """Validate a config; print what differs from the defaults (${ENV} expanded, secrets masked) and what SGLang
    will run (asked -> effective); a sweep as one table of its variants. What SGLang would refuse is an error,
    what it would rewrite is an error unless deploy.speculative.allow_adjustments is set."""
    try:
        variants = load_variants(config)
    except ConfigError as error:
        _fail_config(error)
    changed = [_non_defaults(cfg) for _, cfg in variants]
    varying = sorted({k for c in changed for k in c if any(c.get(k) != other.get(k) for other in changed)})
    common = {k: v for k, v in changed[0].items() if k not in varying}
    out.print(f"{config}: what differs from the defaults (secrets masked)", highlight=False, soft_wrap=True)
    for key, value in sorted(common.items()):
        out.print(f"  {key}: {value}", highlight=False, soft_wrap=True, markup=False)
    runs = [_sglang_runs(cfg) for _, cfg in variants]
    if len(variants) == 1:
        out.print(f"SGLang runs: {runs[0]}", highlight=False, soft_wrap=True)
    else:
        table = Table(title=f"{len(variants)} sweep variants (each with the fields above)", box=box.SIMPLE_HEAD)
        for column in ("#", "variant", "differs", "SGLang runs (asked -> effective)"):
            table.add_column(column)
        for index, ((name, _), diff, ran) in enumerate(zip(variants, changed, runs)):
            differs = ", ".join(f"{k.removeprefix('deploy.speculative.')}={diff.get(k, '(default)')}" for k in varying)
            table.add_row(str(index), name or "-", differs, ran)
        out.print(table)
    errors = sum(_print_launch_findings(config, index if name else None, name, cfg)
                 for index, (name, cfg) in enumerate(variants))
    if errors:
        raise typer.Exit(BAD_INPUT)
    _say("ok", "green", str(config))


def _non_defaults(cfg) -> dict[str, str]:
    """Flattened fields whose value differs from a config with only the required fields set, secrets masked;
    a whole section that is only the default for another kind (target.tiny of an HF target) is left out."""
    from tasks.config.masked import flatten, masked_dict
    from tasks.config.schema import ExperimentConfig

    mine = flatten(masked_dict(cfg))
    try:
        defaults = flatten(masked_dict(ExperimentConfig.model_validate({"experiment": cfg.experiment})))
    except ValueError:  # a config model whose required fields are more than the name: show it all
        defaults = {}
    return {k: v for k, v in mine.items() if defaults.get(k) != v}


def _sglang_runs(cfg) -> str:
    """`4/1/5 -> 4/1/5` (num_steps/eagle_topk/num_draft_tokens, `auto` = unset): asked, then SGLang 0.5.23's
    effective values for these launch flags."""
    from tasks.hosts.launch import (
        effective_settings,
        launch_args,
        predict,
        target_architecture,
    )

    spec = cfg.deploy.speculative
    asked = "/".join("auto" if v is None else str(v) for v in (spec.num_steps, spec.eagle_topk, spec.num_draft_tokens))
    try:
        args = launch_args(cfg, model_path=cfg.deploy.model_path or cfg.target.model_path or "TARGET", draft_path="DRAFT",
                           port=cfg.deploy.port)
        effective = effective_settings(spec, predict(cfg, args, target_architecture(cfg, cfg.deploy.model_path)))
    except (ValueError, OSError) as error:  # the findings below say why
        return f"{asked} -> unknown ({str(error).splitlines()[0][:80]})"
    ran = "/".join("?" if effective[k] is None else str(effective[k]) for k in ("num_steps", "eagle_topk", "num_draft_tokens"))
    return f"{asked} -> {ran}" + ("" if asked == ran else " (rewritten)")


def _print_launch_findings(config: Path, index: int | None, variant: str | None, cfg) -> int:
    """Each finding as `file:line: [variant: ]field: check: message`, at the line that sets the field."""
    from tasks.config.load import field_location
    from tasks.hosts.launch import validate_launch

    findings = validate_launch(cfg)
    style = {"error": "red", "warning": "yellow", "info": "dim"}
    for finding in findings:
        where = field_location(config, finding.field, index) if finding.field else str(config)
        about = "".join(f"{part}: " for part in (variant, finding.field) if part)
        _say(finding.level, style[finding.level], f"{where}: {about}{finding.line()}")
    return sum(f.level == "error" for f in findings)


@app.command()
def run(
    config: Path = typer.Argument(..., help="Experiment or sweep YAML."),
    stages: Optional[str] = typer.Option(None, help="Comma-separated stages to run, e.g. check_environment,generate_data."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Resume this run directory; completed stages with unchanged inputs are skipped."),
    variant: Optional[int] = typer.Option(None, help="For a sweep file: run only this grid point (default: all)."),
) -> None:
    """Run the experiment flow (ephemeral Prefect unless PREFECT_API_URL points at a server)."""
    try:  # a bad config is answered before Prefect is even imported (seconds on a small machine)
        variants = _variants(config, variant)
    except ConfigError as error:
        _fail_config(error)
    from tasks.runner.stages import STAGES

    selected = [s.strip() for s in stages.split(",") if s.strip()] if stages else None
    unknown = sorted(set(selected or []) - set(STAGES))
    if unknown:
        _say("error", "red", f"--stages: unknown stage(s) {', '.join(unknown)}; stages are {', '.join(STAGES)}")
        raise typer.Exit(BAD_INPUT)
    if run_dir is not None and not (run_dir / "manifest.json").is_file():
        _say("error", "red", f"--run-dir: {run_dir} is not a run directory (no manifest.json)")
        raise typer.Exit(BAD_INPUT)
    if run_dir is not None and len(variants) > 1:
        err.print("[red]error[/red] --run-dir resumes one run: pick a sweep grid point with --variant")
        raise typer.Exit(BAD_INPUT)
    for index in variants:
        _run_one(config, selected, run_dir, index)


def _exit_interrupted(config: Path, variant: int | None, stop: KeyboardInterrupt) -> None:
    """One line (which stage, how to resume), exit 130 for Ctrl-C, 143 for SIGTERM."""
    from flows.runtime import Terminated

    signal_name, code = ("SIGTERM", 143) if isinstance(stop, Terminated) else ("Ctrl-C", 130)
    runner = sys.modules.get("tasks.runner.pipeline")  # not imported yet: the run had not started (no slow import now)
    pipeline = runner.Pipeline.active if runner else None
    if pipeline is None:
        err.print(f"interrupted ({signal_name}) before the run started; nothing was recorded", highlight=False)
        raise typer.Exit(code)
    where = f"during {pipeline.current_stage}" if pipeline.current_stage else "between stages"
    again = _resume_command(config, variant, pipeline.run.path)
    err.print(f"interrupted ({signal_name}) {where}; resume with: {again}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _resume_command(config: Path, variant: int | None, run_dir: Path) -> str:
    return f"eagleops run {config} --run-dir {run_dir}" + (f" --variant {variant}" if variant is not None else "")


def _disk_full_line(config: Path, variant: int | None, full: BaseException) -> str:
    """One line: the stage, what filled, where, what is free, and the command that resumes once space is freed."""
    from tasks.runner.stages import DiskFull

    if isinstance(full, DiskFull):
        again = _resume_command(config, variant, full.run_dir)
        return f"[red]disk full[/red] during {full.stage}: {full.detail}; free space, then resume with: {again}"
    from tasks.runner.diskspace import describe_disk_full, disk_full_error

    return f"[red]disk full[/red] {describe_disk_full(disk_full_error(full), Path.cwd())}; free space and run again"


def _variants(config: Path, variant: int | None) -> list[int | None]:
    if not is_sweep(config):
        load_experiment(config, variant)
        return [None]
    count = len(load_sweep(config))
    if variant is not None:
        load_experiment(config, variant)
        return [variant]
    return list(range(count))


def _run_one(config: Path, selected: list[str] | None, run_dir: Path | None, variant: int | None) -> None:
    from flows.runtime import (
        prefect_api,
        redacted_stdio,
        signals_as_exceptions,
        temporary_server,
    )
    from tasks.config.secrets import redact
    from tasks.runner.diskspace import disk_full_error
    from tasks.runner.stages import DiskFull, SelectionError, StageFailed

    if "tasks.runner.pipeline" in sys.modules:  # a sweep's earlier grid point ran in this process
        sys.modules["tasks.runner.pipeline"].Pipeline.active = None
    try:
        with signals_as_exceptions(), temporary_server() as server:
            # imported while the server boots (seconds each, now overlapping); prefect_api waits for it
            with _loading_without_gc():
                from flows.experiment import eagle3_experiment
                from tasks.tracking.views import NO_PREFECT_UI_ENV

            if server is not None:  # a temporary server: its address is no link to keep
                os.environ[NO_PREFECT_UI_ENV] = "1"

            with redacted_stdio(), prefect_api(server):
                result = eagle3_experiment(
                    str(config), stages=selected, run_dir=str(run_dir) if run_dir else None, variant=variant
                )
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (flows.runtime.Terminated)
        _exit_interrupted(config, variant, stop)
    except SelectionError as error:
        err.print(f"[red]error[/red] --stages: {redact(str(error))}", highlight=False, soft_wrap=True)
        raise typer.Exit(BAD_INPUT)
    except DiskFull as full:
        err.print(redact(_disk_full_line(config, variant, full)), highlight=False, soft_wrap=True)
        raise typer.Exit(STAGE_FAILED)
    except StageFailed as failure:
        err.print(f"[red]stage failed[/red] {redact(str(failure))}", highlight=False, soft_wrap=True)
        raise typer.Exit(STAGE_FAILED)
    except ValueError as error:  # bad --run-dir contents, unknown stage
        err.print(f"[red]error[/red] {redact(str(error))}", highlight=False, soft_wrap=True)
        raise typer.Exit(BAD_INPUT)
    except OSError as error:  # the disk filled outside a stage (the run folder's first files)
        if disk_full_error(error) is None:
            raise
        err.print(redact(_disk_full_line(config, variant, error)), highlight=False, soft_wrap=True)
        raise typer.Exit(STAGE_FAILED)
    table = Table(title=f"stages of {config}", box=box.SIMPLE_HEAD)
    table.add_column("stage", no_wrap=True)
    table.add_column("status", no_wrap=True)
    for name, status in result["stages"].items():
        table.add_row(name, str(status))
    out.print(table)
    bench = result.get("results", {}).get("run_benchmark")
    if bench:
        _print_benchmark(bench)
    _print_links(result["mlflow_run_id"], _recorded_tracking_uri(Path(result["run_dir"])), _registered_version(result))
    # Last and alone on its line, never wrapped by Rich: the folder to copy into --run-dir, compare, teardown.
    print("run folder:", flush=True)
    print(result["run_dir"], flush=True)


@contextlib.contextmanager
def _loading_without_gc():
    """The flow's first import (torch, transformers, Prefect, MLflow: about a million objects that live as long
    as the process) without garbage collection, frozen once loaded (gc.freeze: no later collection walks them).
    The collector walked them over and over while they loaded and once more at exit: ~2 s of `eagleops run`'s
    start and end on a 2-core machine. Nothing changes where they are loaded already (a sweep's next point)."""
    if "flows.experiment" in sys.modules or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def _recorded_tracking_uri(run_dir: Path) -> str | None:
    manifest = run_dir / "manifest.json"
    return json.loads(manifest.read_text()).get("mlflow", {}).get("tracking_uri") if manifest.is_file() else None


def _registered_version(result: dict) -> tuple[str, str] | None:
    """(model, version) the export registered in this run; None when it registered none or only journaled it."""
    outputs = result.get("results", {}).get("export_checkpoint", {}).get("outputs", {})
    name, _, version = str(outputs.get("registered_model_version", "")).partition("/")
    return (name, version) if name and version.isdigit() else None


def _print_links(run_id: str, tracking_uri: str | None, registered: tuple[str, str] | None = None) -> None:
    """Where the run is in MLflow: its runs table (headline columns, model-training mode), the same runs as headline
    charts, the run itself and the model version it registered."""
    from tasks.config.secrets import redact
    from tasks.tracking.journal import is_placeholder
    from tasks.tracking.views import model_version_url, run_links, ui_base

    if not tracking_uri or is_placeholder(run_id):
        out.print(f"MLflow parent run: {run_id} (not uploaded yet: eagleops sync RUN_DIR)", highlight=False, soft_wrap=True)
        return
    try:
        links = run_links(tracking_uri, run_id)
    except Exception as error:  # the run finished; a store that stopped answering only costs the links
        out.print(f"MLflow parent run: {run_id} (links unavailable: {redact(str(error).splitlines()[0])})",
                  highlight=False, soft_wrap=True)
        return
    if "serve" in links:
        print(f"MLflow UI: {links['serve']}", flush=True)
    print(f"MLflow runs table: {links['experiment']}", flush=True)
    print(f"MLflow charts: {links['charts']}", flush=True)
    print(f"MLflow parent run: {links['run']}", flush=True)
    if registered:
        print(f"MLflow model: {model_version_url(ui_base(tracking_uri), *registered)}", flush=True)


def _print_benchmark(bench: dict) -> None:
    """The answer, last: tok/s of the baseline and each setting, speedup, accept length online/offline, verdict."""
    from tasks.stages.bench.report import comparison_rows, short_setting, shown

    table = Table(title="benchmark: median tok/s of the timed runs; accept length in tokens per verify step",
                  box=box.SIMPLE_HEAD)
    for column in ("setting", "conc.", "tok/s", "speedup", "accept len online", "offline (sim., at depth)"):
        table.add_column(column, no_wrap=column in ("setting", "tok/s", "speedup"))
    for c in comparison_rows(bench["rows"], bench["offline"]):
        depth = f" (depth {c['offline_depth']})" if c["offline_depth"] else ""
        speculative = c["setting"] != "baseline"
        table.add_row(short_setting(c["setting"]), str(c["concurrency"]), shown(c["tok_s_median"], "tok_s"),
                      shown(c["speedup"], "speedup") if c["speedup"] else "unknown" if speculative else "-",
                      shown(c["accept_length_online"], "accept_length"),
                      shown(c["accept_length_offline"], "accept_length") + depth)
    out.print(table)
    verdict = bench["verdict"]
    colour = {"faster": "green", "faster_with_alarms": "yellow"}.get(verdict["status"], "red")
    out.print(f"[{colour}]verdict[/{colour}]: {verdict['summary']}", highlight=False, soft_wrap=True)


@app.command()
def runs(
    tracking_uri: Optional[str] = typer.Option(None, help="MLflow URI; default sqlite:///runs/mlflow.db."),
    experiment: Optional[str] = typer.Option(None, help="Only this MLflow experiment."),
    limit: int = typer.Option(20, min=1, max=1000, help="How many runs."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON lines instead of a table."),
) -> None:
    """List recent experiment runs from MLflow, newest first."""
    from tasks.config.secrets import redact
    from tasks.stages.bench.report import shown
    from tasks.tracking.runs import recent_runs
    from tasks.tracking.views import default_tracking_uri

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri("runs")
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        err.print(f"no MLflow store at {uri} yet: run an experiment first", highlight=False, soft_wrap=True)
        return
    with _mlflow_lookup(uri, "runs"):
        rows = recent_runs(uri, experiment, limit)
    if as_json:
        for row in rows:
            print(json.dumps(row))
        return
    experiments = sorted({row["experiment"] for row in rows})
    table = Table(title=f"eagleops runs of {', '.join(experiments) or 'no experiment'}, newest first", box=box.SIMPLE_HEAD,
                  caption=f"{redact(uri)}; accept length offline: training's simulated figure at the setting's depth",
                  caption_justify="left", pad_edge=False, collapse_padding=True)
    for column, justify in RUNS_COLUMNS:
        table.add_column(column, justify=justify, no_wrap=True)
    for row in rows:
        started = datetime.fromtimestamp(row["start_time"] / 1000, timezone.utc).strftime("%m-%d %H:%M")
        m = row["metrics"]
        table.add_row(row["run_name"] if len(experiments) == 1 else f"{row['experiment']}/{row['run_name']}", started,
                      row["setting"], row["status"].lower(),
                      shown(m.get("run_benchmark.best_tok_s"), "tok_s"),
                      shown(m.get("run_benchmark.speedup"), "speedup"),
                      shown(m.get("run_benchmark.accept_length_online"), "accept_length"),
                      shown(m.get("run_benchmark.accept_length_offline"), "accept_length"))
    out.print(table)


# `eagleops runs`: the headline figures of the best setting; fits 100 columns with a 27-character run name.
RUNS_COLUMNS = (("run", "left"), ("started", "left"), ("setting", "left"), ("status", "left"), ("tok/s", "right"),
                ("speedup", "right"), ("accept\nonline", "right"), ("accept\noffline", "right"))


@contextlib.contextmanager
def _mlflow_lookup(uri: str, command: str):
    """MLflow reads of a CLI lookup: a server that does not answer, a store without the run or experiment, or
    another refusal is one line naming what was looked up, exit 2, never a traceback."""
    from mlflow.exceptions import MlflowException

    from tasks.config.secrets import redact
    from tasks.tracking.outage import is_outage, probe_tracking_server, short_error

    reason = probe_tracking_server(uri)
    if reason is not None:
        _say("error", "red", f"{command}: MLflow tracking server {redact(uri)} is not reachable ({reason})")
        raise typer.Exit(BAD_INPUT)
    try:
        yield
    except (MlflowException, LookupError, OSError) as error:
        if is_outage(error):
            _say("error", "red", f"{command}: MLflow tracking server {redact(uri)} stopped answering")
        else:
            _say("error", "red", f"{command}: {short_error(error)} ({redact(uri)})")
        raise typer.Exit(BAD_INPUT)


@app.command()
def sync(
    run_dir: Path = typer.Argument(..., help="Run directory whose MLflow journal (mlflow-journal.jsonl) to upload."),
    tracking_uri: Optional[str] = typer.Option(
        None, help="MLflow URI to upload to; default: the one the run folder's manifest records."),
) -> None:
    """Upload what a run recorded while its MLflow server was unreachable (runs, params, metrics, tags,
    artifacts, statuses), in order; placeholder run ids in the manifest become the real ones.
    A second sync uploads nothing. Exit 2 when the folder is not a run folder or the server does not answer,
    exit 1 when it refused entries."""
    from tasks.rundir import MANIFEST, RunDirectory
    from tasks.tracking.outage import TrackingUnavailable
    from tasks.tracking.sync import sync_journal

    manifest_path = run_dir / MANIFEST
    if not manifest_path.is_file():
        _say("error", "red", f"sync: {run_dir} is not a run directory (no {MANIFEST})")
        raise typer.Exit(BAD_INPUT)
    uri = tracking_uri or RunDirectory.open(run_dir).manifest.get("mlflow", {}).get("tracking_uri")  # where it is now
    if not uri:
        _say("error", "red", f"sync: {manifest_path} records no MLflow tracking URI: pass --tracking-uri")
        raise typer.Exit(BAD_INPUT)
    try:
        result = sync_journal(run_dir, uri)
    except TrackingUnavailable as error:
        _say("error", "red", f"sync: {error}; nothing more was uploaded, run sync again once it answers")
        raise typer.Exit(BAD_INPUT)
    except ValueError as error:  # an unreadable journal or state file
        err.print(f"[red]error[/red] {error}", highlight=False, soft_wrap=True)
        raise typer.Exit(BAD_INPUT)
    for refused in result.refused:
        err.print(f"[yellow]refused[/yellow] entry {refused['entry']} ({refused['op']}, run {refused['run']}): "
                  f"{refused['error']}", highlight=False, soft_wrap=True)
    if not result.replayed:
        out.print(f"nothing to sync in {run_dir} ({result.already_done} entries synced earlier)", highlight=False)
        return
    out.print(f"synced {result.replayed} MLflow calls of {run_dir}: {len(result.created)} runs created "
              f"({', '.join(f'{k} -> {v}' for k, v in result.created.items()) or 'none'})", highlight=False, soft_wrap=True)
    if result.refused:
        raise typer.Exit(STAGE_FAILED)


@app.command("deploy-flows")
def deploy_flows(
    prefect_file: Path = typer.Option(Path("infra/prefect.yaml"), "--prefect-file", help="Deployments to register."),
    gpu_queue: Optional[list[str]] = typer.Option(
        None, "--gpu-queue", help="A GPU host's work queue in the gpu pool, limited to one run (repeat per host); "
        "default: the queues prefect.yaml's gpu deployments name."),
    only: Optional[list[str]] = typer.Option(None, "--only", help="Register only this deployment (repeatable)."),
) -> None:
    """Create the cpu and gpu work pools, one gpu queue per GPU host (concurrency limit 1), then register
    the deployments (prefect --no-prompt deploy). Idempotent; needs PREFECT_API_URL."""
    from prefect.client.orchestration import get_client

    from flows.deployments import (
        GPU_POOL,
        ensure_gpu_queues,
        ensure_work_pools,
        missing_entrypoints,
        read_deployments,
        register_deployments,
    )

    if not os.environ.get("PREFECT_API_URL"):
        err.print("[red]error[/red] PREFECT_API_URL is not set: point it at the team's Prefect server, "
                  "e.g. http://127.0.0.1:4200/api")
        raise typer.Exit(BAD_INPUT)
    project_dir = Path.cwd()
    try:
        deployments = read_deployments(prefect_file)
    except (OSError, ValueError) as error:
        err.print(f"[red]error[/red] --prefect-file: {error}", highlight=False, soft_wrap=True)
        raise typer.Exit(BAD_INPUT)
    chosen = [d for d in deployments if not only or d.name in only]
    unknown = sorted(set(only or []) - {d.name for d in deployments})
    missing = missing_entrypoints(chosen, project_dir)
    if unknown or missing:
        problem = f"unknown deployment(s) {unknown}" if unknown else f"entrypoint file missing for {missing}"
        err.print(f"[red]error[/red] {prefect_file}: {problem}", highlight=False, soft_wrap=True)
        raise typer.Exit(BAD_INPUT)
    queues = gpu_queue or sorted({d.queue for d in deployments if d.pool == GPU_POOL and d.queue})
    with get_client(sync_client=True) as client:
        for pool, outcome in ensure_work_pools(client).items():
            out.print(f"work pool {pool}: {outcome}", highlight=False)
        for queue, outcome in ensure_gpu_queues(client, queues).items():
            out.print(f"work queue {GPU_POOL}/{queue} (1 run at a time): {outcome}", highlight=False)
    done = register_deployments(prefect_file, project_dir, [d.name for d in chosen] if only else None)
    if done.returncode != 0:
        err.print(f"[red]error[/red] prefect deploy exited {done.returncode}:")
        err.print((done.stdout + done.stderr)[-3000:], highlight=False, soft_wrap=True, markup=False)
        raise typer.Exit(STAGE_FAILED)
    out.print(f"registered {len(chosen)} deployments from {prefect_file}: {', '.join(d.name for d in chosen)}",
              highlight=False, soft_wrap=True)


@app.command()
def nightly(
    config: Path = typer.Argument(..., help="Experiment YAML with export.registered_model and a nightly section."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Resume this nightly's run directory."),
) -> None:
    """Retrain, benchmark against the registry's champion on the same host and prompts, promote or keep."""
    from flows.runtime import (
        prefect_api,
        redacted_stdio,
        signals_as_exceptions,
        temporary_server,
    )
    from tasks.config.secrets import redact
    from tasks.runner.stages import StageFailed

    try:
        cfg = load_experiment(config)
        with signals_as_exceptions(), temporary_server() as server:
            from flows.nightly import (
                nightly_retrain,  # imported while the temporary server boots
            )

            with redacted_stdio(), prefect_api(server):
                result = nightly_retrain(str(config), run_dir=str(run_dir) if run_dir else None)
    except ConfigError as error:
        _fail_config(error)
    except KeyboardInterrupt as stop:
        _exit_interrupted(config, None, stop)
    except (StageFailed, ValueError) as failure:
        err.print(f"[red]nightly failed[/red] {redact(str(failure))}", highlight=False, soft_wrap=True)
        raise typer.Exit(STAGE_FAILED)
    from tasks.tracking.views import tracking_uri_for

    for line in nightly_outcome(result, tracking_uri_for(cfg)):
        out.print(line, highlight=False, soft_wrap=True)


def nightly_outcome(result: dict, tracking_uri: str) -> list[str]:
    """The nightly's answer in two lines: which version moved to champion (or was refused) and why, then its page
    in the model registry."""
    from tasks.tracking.views import model_version_url, ui_base

    name, version = result["model"], result["challenger"]
    why = result["reason"].split(": ", 1)[-1]  # the recorded reason opens with the decision ("promoted: ...")
    if result["promoted"]:
        decided = f"[green]promoted[/green] {name} version {version} to champion: {why}"
    else:
        decided = (f"[yellow]kept the champion[/yellow] (version {result['champion_before']}); "
                   f"{name} version {version} refused: {why}")
    return [decided, f"MLflow model: {model_version_url(ui_base(tracking_uri), name, version)}"]


hosts_app = typer.Typer(no_args_is_help=True, help="The SSH inventory of a config.")
app.add_typer(hosts_app, name="hosts")


@hosts_app.command("trust")
def hosts_trust(
    name: str = typer.Argument(..., help="hosts[].name in the config."),
    config: Path = typer.Option(..., "--config", "-c", help="Experiment YAML whose hosts list has NAME."),
    yes: bool = typer.Option(False, "--yes", help="Record the key without asking (after checking it elsewhere)."),
) -> None:
    """Show the host key NAME presents now and record it in its known_hosts after you confirm it."""
    from tasks.hosts.remote import RemoteError, host_key_fingerprint, trust_host

    try:
        cfg = load_experiment(config)
    except ConfigError as error:
        _fail_config(error)
    host = next((h for h in cfg.hosts if h.name == name), None)
    if host is None:
        err.print(f"[red]error[/red] {config}: no hosts[] entry named {name!r} ({[h.name for h in cfg.hosts]})")
        raise typer.Exit(BAD_INPUT)
    try:
        key_type, fingerprint = host_key_fingerprint(host, cfg.hosts)
        out.print(f"{name} ({host.address}:{host.port}) presents {key_type} {fingerprint}", highlight=False)
        if not yes and not typer.confirm("Is this the host's key (compare it with the host's own ssh-keygen -lf)?"):
            raise typer.Exit(BAD_INPUT)
        out.print(trust_host(host, cfg.hosts), highlight=False)
    except RemoteError as error:
        err.print(f"[red]error[/red] {error}", highlight=False)
        raise typer.Exit(STAGE_FAILED)


@app.command()
def teardown(
    run_dir: Path = typer.Argument(..., help="Run folder whose servers to stop."),
    config: Optional[Path] = typer.Option(
        None, "--config", "-c", help="Experiment YAML with the hosts inventory; default: the config file the run "
        "was started with, else the run folder's own config.yaml."),
) -> None:
    """Stop every server a run started that is still recorded as running (servers.json), by hand.
    Exit 1 when some could not be stopped (their host does not answer): each is named."""
    from tasks.hosts.teardown import teardown_run, unstopped_servers

    manifest = run_dir / "manifest.json"
    if not manifest.is_file():
        _say("error", "red", f"teardown: {run_dir} is not a run directory (no manifest.json)")
        raise typer.Exit(BAD_INPUT)
    try:
        cfg = _teardown_config(run_dir, config)
    except ConfigError as error:
        _fail_config(error)
    stopped = teardown_run(run_dir, cfg)
    left = unstopped_servers(run_dir)
    if stopped or not left:
        out.print("\n".join(f"stopped {s}" for s in stopped) or "no running server recorded for this run")
    if left:
        _say("error", "red", "still recorded as running (see the warnings above): " + ", ".join(left))
        raise typer.Exit(STAGE_FAILED)


def _teardown_config(run_dir: Path, config: Path | None):
    """The hosts inventory: --config; else the config file the run started with (recorded absolute, so any
    working directory finds it); else, when that moved or no longer loads, the copy the run folder keeps
    (`config.yaml`, secrets masked: a passphrase-protected key then needs --config). None when nothing
    loads: local servers can still be stopped, SSH hosts need the inventory."""
    from tasks.rundir import RunDirectory

    if config is not None:
        return load_experiment(config)
    recorded = RunDirectory.open(run_dir).manifest.get("config_path")
    for candidate in ([Path(recorded)] if recorded else []) + [run_dir / "config.yaml"]:
        if candidate.is_file():
            try:
                return load_experiment(candidate)
            except ConfigError:
                continue  # a sweep file (no variant recorded) or an edited config: try the next one
    return None


# (label, MLflow metric of the parent run, kind of figure): the headline first, each labelled with what it is.
COMPARE_METRICS = (
    ("best tok/s (run_benchmark.best_tok_s)", "run_benchmark.best_tok_s", "tok_s"),
    ("baseline tok/s (run_benchmark.baseline_tok_s)", "run_benchmark.baseline_tok_s", "tok_s"),
    ("speedup (run_benchmark.speedup)", "run_benchmark.speedup", "speedup"),
    ("accept len online (run_benchmark.accept_length_online)", "run_benchmark.accept_length_online", "accept_length"),
    ("accept len offline, sim. at the setting's depth (run_benchmark.accept_length_offline)",
     "run_benchmark.accept_length_offline", "accept_length"),
    ("offline depth (run_benchmark.accept_length_offline_depth)", "run_benchmark.accept_length_offline_depth", "count"),
    ("accept len offline, sim. at full TTT depth (train_draft.simulated_accept_length)",
     "train_draft.simulated_accept_length", "accept_length"),
    ("training steps (train_draft.steps)", "train_draft.steps", "count"),
    ("samples (generate_data.num_samples)", "generate_data.num_samples", "count"),
)
RUN_ID = re.compile(r"[0-9a-f]{32}")


@app.command()
def compare(
    runs: list[str] = typer.Argument(..., help="Run folders or MLflow parent run ids."),
    tracking_uri: Optional[str] = typer.Option(None, help="MLflow URI when giving run ids; default the run folder's."),
) -> None:
    """Print runs side by side from MLflow: their speculative setting, training and benchmark figures."""
    from mlflow.tracking import MlflowClient

    from tasks.stages.bench.report import shown

    resolved = [_parent_of(r, tracking_uri) for r in runs]
    fetched = []
    for (uri, run_id), given in zip(resolved, runs):
        with _mlflow_lookup(uri, f"compare {given}"):
            fetched.append(MlflowClient(uri).get_run(run_id))
    table = Table(title="eagleops compare")
    table.add_column("")
    for run in fetched:
        table.add_column(run.info.run_name)
    rows = [("status", [r.info.status for r in fetched]),
            ("speculative (asked)", [r.data.tags.get("eagleops.speculative", "-") for r in fetched]),
            ("best setting", [r.data.tags.get("eagleops.best_setting", "-") for r in fetched]),
            ("target", [r.data.tags.get("eagleops.target", "-") for r in fetched]),
            ("train.lr", [r.data.params.get("train.lr", "-") for r in fetched])]
    rows += [(label, [shown(r.data.metrics.get(metric), kind) for r in fetched]) for label, metric, kind in COMPARE_METRICS]
    for label, values in rows:
        table.add_row(label, *values)
    out.print(table)


def _parent_of(run: str, tracking_uri: str | None) -> tuple[str, str]:
    """(tracking URI, parent run id) of a run folder or an MLflow run id; a wrong one is one line, exit 2."""
    from tasks.tracking.views import default_tracking_uri

    if Path(run).exists() or os.sep in run:
        if not (Path(run) / "manifest.json").is_file():
            problem = "is not a run folder (no manifest.json)" if Path(run).is_dir() else "does not exist"
            _say("error", "red", f"compare: {run} {problem}; give a run folder or an MLflow run id")
            raise typer.Exit(BAD_INPUT)
        from tasks.rundir import RunDirectory

        recorded = RunDirectory.open(run).manifest.get("mlflow", {})  # the store where the folder is now
        if not recorded.get("parent_run_id") or not (tracking_uri or recorded.get("tracking_uri")):
            _say("error", "red", f"compare: {run}/manifest.json records no MLflow parent run")
            raise typer.Exit(BAD_INPUT)
        return tracking_uri or recorded["tracking_uri"], recorded["parent_run_id"]
    if not RUN_ID.fullmatch(run):
        _say("error", "red", f"compare: {run} is neither a run folder nor an MLflow run id (32 hex digits)")
        raise typer.Exit(BAD_INPUT)
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri("runs")
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        _say("error", "red", f"compare: no MLflow store at {uri} to look run {run} up in; pass --tracking-uri")
        raise typer.Exit(BAD_INPUT)
    return uri, run



if __name__ == "__main__":
    app()
