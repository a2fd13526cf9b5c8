"""`eagleops validate` and `eagleops run`: a config checked and explained, and the experiment flow run from the
terminal (its temporary Prefect server, Ctrl-C and SIGTERM as one line, the links and the benchmark printed last).

Prefect and MLflow are imported only inside `run`, so `validate` and `--version` answer at once.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.table import Table

from flows.cli_app import BAD_INPUT, STAGE_FAILED, _fail_config, _say, app, err, out
from tasks.config.load import ConfigError, is_sweep, load_experiment, load_sweep, load_variants


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
        draft_config_findings,
        effective_settings,
        launch_args,
        model_config_findings,
        predict,
        target_architecture,
    )

    spec = cfg.deploy.speculative
    asked = "/".join("auto" if v is None else str(v) for v in (spec.num_steps, spec.eagle_topk, spec.num_draft_tokens))
    if any(f.level == "error" for f in model_config_findings(cfg) + draft_config_findings(cfg)):
        return f"{asked} -> unknown (SGLang's rules read a model folder that is not readable: see the errors below)"
    try:
        args = launch_args(cfg, model_path=cfg.deploy.model_path or cfg.target.model_path or "TARGET", draft_path="DRAFT",
                           port=cfg.deploy.port)
        effective = effective_settings(spec, predict(cfg, args, target_architecture(cfg, cfg.deploy.model_path)))
    except (ValueError, OSError) as error:  # the findings below say why
        return f"{asked} -> unknown ({str(error).splitlines()[0][:80]})"
    ran = "/".join("?" if effective[k] is None else str(effective[k]) for k in ("num_steps", "eagle_topk", "num_draft_tokens"))
    return f"{asked} -> {ran}" + ("" if asked == ran else " (rewritten)")


def _print_launch_findings(config: Path, index: int | None, variant: str | None, cfg) -> int:
    """Each preflight finding (`tasks.stages.preflight`: launch flags, model and draft folders, lengths, input
    files) as `file:line: [variant: ]field: check: message`, at the line that sets the field."""
    from tasks.stages.preflight import finding_line, preflight_findings

    findings = preflight_findings(cfg)
    style = {"error": "red", "warning": "yellow", "info": "dim"}
    for finding in findings:
        _say(finding.level, style[finding.level], finding_line(config, index, finding, variant))
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
    if run_dir is not None:
        _refuse_held_folder(run_dir)
    _refuse_before_stages(config, variants, selected)
    for index in variants:
        _run_one(config, selected, run_dir, index)


def _refuse_held_folder(run_dir: Path, command: str = "--run-dir") -> None:
    """Another live run holds the folder: one line naming it (pid, host, flow run, since), exit 2, before anything
    starts. The flow takes the folder itself (tasks.run_lock); this only answers at once."""
    from tasks.run_lock import RunFolderHeld, refuse_if_held

    try:
        refuse_if_held(run_dir)
    except RunFolderHeld as held:
        _say("error", "red", f"{command}: {held}")
        raise typer.Exit(BAD_INPUT)


def _refuse_before_stages(config: Path, variants: list[int | None], selected: list[str] | None) -> None:
    """What the flow's first step would refuse (`tasks.stages.preflight`), answered before Prefect starts:
    one line per error, every variant's, exit 2."""
    from tasks.stages.preflight import refuse_before_stages

    loaded = load_variants(config)  # once: a sweep's variants each loaded on their own would expand it each time
    messages = []
    for index in variants:
        try:
            refuse_before_stages(loaded[index or 0][1], config, index, selected)
        except ConfigError as error:
            messages += error.messages
    if messages:
        _fail_config(ConfigError(list(dict.fromkeys(messages))))


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
    except ConfigError as error:  # a file the config names changed since the check before the run
        _fail_config(error)
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
    table.add_column("GPU-h", justify="right", no_wrap=True)  # held in this run; a reused stage: 0
    gpu = result.get("gpu_hours") or {}
    for name, status in result["stages"].items():
        held = gpu.get("stages", {}).get(name, 0.0 if name in gpu.get("reused", {}) else None)
        table.add_row(name, str(status), "" if held is None else f"{held:.4g}")
    out.print(table)
    bench = result.get("results", {}).get("run_benchmark")
    if bench:
        _print_benchmark(bench)
    _print_links(result["mlflow_run_id"], _recorded_tracking_uri(Path(result["run_dir"])), _registered_version(result))
    browse = _ui_command(Path(result["run_dir"]), _recorded_tracking_uri(Path(result["run_dir"])))
    if browse:  # this run's temporary Prefect server is gone: its flow run stays in the database
        print(f"browse MLflow and Prefect after this run: {browse}", flush=True)
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


def _ui_command(run_dir: Path, tracking_uri: str | None) -> str | None:
    """`eagleops ui` for this run's local store and Prefect database, None for a tracking server."""
    from tasks.tracking.store import sqlite_file

    store = sqlite_file(tracking_uri)
    if store is None or store.name != "mlflow.db":
        return None
    home = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").resolve()
    command = sys.argv[0] if Path(sys.argv[0]).name == "eagleops" else "eagleops"
    return f"{command} ui {store.parent} --prefect-home {home}"
