"""The commands that read or tidy what runs left: `runs` (the recent runs from MLflow), `ui` (both UIs on a local
store), `sync` (what a run journaled in an outage), `teardown` (servers a run left running), `compare`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.table import Table

from flows.cli_app import BAD_INPUT, STAGE_FAILED, _fail_config, _say, app, err, out
from tasks.config.load import ConfigError, load_experiment


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


@app.command()
def ui(
    runs_root: Path = typer.Argument(Path("runs"), help="The runs root whose MLflow store (mlflow.db) to serve."),
    prefect_home: Optional[Path] = typer.Option(
        None, help="The Prefect home whose database holds the flow runs; default $PREFECT_HOME, else Prefect's own."),
    mlflow_port: Optional[int] = typer.Option(None, min=1, max=65535, help="Default: a free port."),
    prefect_port: Optional[int] = typer.Option(None, min=1, max=65535, help="Default: a free port (not 4200)."),
) -> None:
    """Serve the MLflow UI on a runs root's store and the Prefect UI on the flow runs' database; Ctrl-C stops both."""
    from flows.runtime import signals_as_exceptions
    from flows.ui import exited, links, serve_ui

    store = runs_root.resolve() / "mlflow.db"
    if not store.is_file():
        _say("error", "red", f"ui: no MLflow store at {store}: run an experiment first (make demo), or name its runs root")
        raise typer.Exit(BAD_INPUT)
    home = (prefect_home or Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect")).resolve()
    out.print(f"starting MLflow on {store} and Prefect on {home / 'prefect.db'} (~30 s) ...", highlight=False,
              soft_wrap=True)
    try:
        with signals_as_exceptions(), serve_ui(store, home, mlflow_port, prefect_port) as servers:
            for label, address in links(servers, f"sqlite:///{store}"):
                print(f"{label}: {address}", flush=True)
            print("Ctrl-C stops both servers.", flush=True)
            while (stopped := exited(servers)) is None:
                time.sleep(1.0)
            _say("error", "red", f"ui: {stopped}")
            raise typer.Exit(STAGE_FAILED)
    except KeyboardInterrupt:
        out.print("stopped both servers", highlight=False)
    except RuntimeError as error:  # a server that did not start: its log's tail
        _say("error", "red", f"ui: {error}")
        raise typer.Exit(STAGE_FAILED)



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
        with _holding_folder(run_dir, "sync"):  # a live run syncs its own journal
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
    with _holding_folder(run_dir, "teardown"):  # a live run's servers are its own teardown's
        stopped = teardown_run(run_dir, cfg)
        left = unstopped_servers(run_dir)
    if stopped or not left:
        out.print("\n".join(f"stopped {s}" for s in stopped) or "no running server recorded for this run")
    if left:
        _say("error", "red", "still recorded as running (see the warnings above): " + ", ".join(left))
        raise typer.Exit(STAGE_FAILED)


@contextlib.contextmanager
def _holding_folder(run_dir: Path, command: str):
    """The run folder held for a command that writes it (as a run holds it); held by a live run: one line naming
    it, exit 2."""
    from tasks.run_lock import RunFolderHeld, acquire_run_folder

    try:
        lock = acquire_run_folder(run_dir, None)
    except RunFolderHeld as held:
        _say("error", "red", f"{command}: {held}")
        raise typer.Exit(BAD_INPUT)
    if (line := lock.takeover_line()) is not None:
        _say("note", "yellow", line)
    try:
        yield
    finally:
        lock.release()


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
    ("samples, train + validation (generate_data.num_samples)", "generate_data.num_samples", "count"),
)
RUN_ID = re.compile(r"[0-9a-f]{32}")
RUN_NAME_IN_EXPERIMENT = re.compile(r"[^/.][^/]*/[^/]+")  # `eagleops runs`' EXPERIMENT/RUN_NAME, not a path


@app.command()
def compare(
    runs: list[str] = typer.Argument(..., help="Run names as `eagleops runs` prints them, run folders or MLflow parent run ids."),
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

    if Path(run).exists() or (os.sep in run and not RUN_NAME_IN_EXPERIMENT.fullmatch(run)):
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
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri("runs")
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        _say("error", "red", f"compare: no MLflow store at {uri} to look run {run} up in; pass --tracking-uri")
        raise typer.Exit(BAD_INPUT)
    if RUN_ID.fullmatch(run):
        return uri, run
    from tasks.tracking.runs import parent_run_ids

    with _mlflow_lookup(uri, f"compare {run}"):
        found = parent_run_ids(uri, run)
    if len(found) != 1:
        problem = "is no run name, run folder or MLflow run id" if not found else f"names {len(found)} runs"
        _say("error", "red", f"compare: {run} {problem} in {uri} (eagleops runs lists them; run ids: --json)")
        raise typer.Exit(BAD_INPUT)
    return uri, found[0]
