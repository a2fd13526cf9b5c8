"""`eagleops plan RUN_DIR`: the serving plan of a finished run, from its benchmark's rows, without a server.

Prints plan.md's page (the pick per concurrency within the SLA, the launch flags, the adaptive config) for the
run's last completed run_benchmark; `--itl-ms-p99` and the like try another SLA than the run's bench.sla;
`--out DIR` also writes plan.json, plan.md and the adaptive config JSON there. Nothing is measured: the plan
is predicted only (the plan_serving stage checks it by measurement).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from flows.cli_app import BAD_INPUT, _fail_config, _say, app, out
from tasks.config.load import ConfigError


def _bench_rows(run_dir: Path) -> list[dict]:
    """The rows of the run's last completed run_benchmark attempt (its bench.json)."""
    from tasks.rundir import RunDirectory

    attempts = [a for a in RunDirectory.open(run_dir).attempts("run_benchmark") if a.get("status") == "completed"]
    if not attempts:
        raise ValueError(f"{run_dir} has no completed run_benchmark attempt: run the benchmark first")
    bench = (run_dir / attempts[-1]["dir"] / "bench.json").resolve()
    if not bench.is_file():
        raise ValueError(f"expected the benchmark's record at {bench}, found nothing")
    return json.loads(bench.read_text())["rows"]


@app.command()
def plan(
    run_dir: Path = typer.Argument(..., help="A finished run folder (its run_benchmark completed)."),
    config: Optional[Path] = typer.Option(
        None, "--config", "-c", help="Experiment YAML (bench.plan's grid, bench.sla); default: the run's own."),
    itl_ms_p50: Optional[float] = typer.Option(None, min=0, help="SLA: median ITL in ms (replaces bench.sla's)."),
    itl_ms_p99: Optional[float] = typer.Option(None, min=0, help="SLA: p99 ITL in ms (replaces bench.sla's)."),
    ttft_ms_p99: Optional[float] = typer.Option(None, min=0, help="SLA: p99 TTFT in ms (replaces bench.sla's)."),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="Also write plan.json, plan.md and the adaptive "
                                           "config here."),
) -> None:
    """Which setting to serve at which load, predicted from a finished run's benchmark (no server started)."""
    from flows.cli_records import _teardown_config
    from tasks.stages.plan.build import ADAPTIVE_FILE, Plan, render_markdown

    if not (run_dir / "manifest.json").is_file():
        _say("error", "red", f"plan: {run_dir} is not a run directory (no manifest.json)")
        raise typer.Exit(BAD_INPUT)
    try:
        cfg = _teardown_config(run_dir, config)
    except ConfigError as error:
        _fail_config(error)
    if cfg is None:
        _say("error", "red", f"plan: no loadable config for {run_dir}; pass --config")
        raise typer.Exit(BAD_INPUT)
    limits = {k: v for k, v in (("itl_ms_p50", itl_ms_p50), ("itl_ms_p99", itl_ms_p99),
                                ("ttft_ms_p99", ttft_ms_p99)) if v is not None}
    if limits:
        cfg = cfg.model_copy(update={"bench": cfg.bench.model_copy(update={"sla": cfg.bench.sla.model_copy(
            update=limits)})})
    try:
        result = Plan(cfg, _bench_rows(run_dir))
    except ValueError as error:
        _say("error", "red", f"plan: {error}")
        raise typer.Exit(BAD_INPUT)
    markdown = render_markdown(result, f"{cfg.experiment} ({run_dir.name}), predicted only")
    out.print(markdown, markup=False, highlight=False)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        data = result.as_dict()
        (out_dir / "plan.json").write_text(json.dumps(data, indent=1))
        (out_dir / "plan.md").write_text(markdown)
        if data["adaptive_config"]:
            (out_dir / ADAPTIVE_FILE).write_text(json.dumps(data["adaptive_config"], indent=1) + "\n")
