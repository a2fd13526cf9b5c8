"""report: the last stage; one table of every stage's status and headline metrics.

Written to the run directory (report.md, summary.json), to the MLflow parent run and as a
Prefect markdown artifact, so the result is readable from either UI or from disk alone.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from prefect import task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from tasks.config.schema import ExperimentConfig
from tasks.config.secrets import redact
from tasks.runner.context import StageContext
from tasks.runner.flow_errors import redacted_failures
from tasks.runner.stages import STAGES
from tasks.stages.bench.report import figure_kind, headline_line, rounded, shown
from tasks.tracking.outage import is_outage, short_error
from tasks.tracking.run_logger import RunLogger
from tasks.tracking.views import prefect_flow_run_url, run_links

# What the parent run's headline metrics are, in its MLflow description (MLflow has no per-metric description).
METRICS_LEGEND = (
    "run_benchmark.best_tok_s / speedup / accept_length_online: the best speculative setting's median output tok/s, "
    "its ratio to the baseline's, and its online accept length (tokens per verify step, from the server); "
    "run_benchmark.accept_length_offline: training's simulated accept length at that setting's depth "
    "(run_benchmark.accept_length_offline_depth draft steps), the figure the online one is held to; "
    "train_draft.simulated_accept_length: the same at the full TTT depth."
)


def render_report(experiment: str, manifest: dict) -> str:
    gpu = manifest.get("gpu_hours") or {}  # this flow run's (tasks.runner.gpu_hours.ThisRunsGpuHours)
    lines = [f"## eagleops run `{manifest['run_id']}` ({experiment})", "",
             "| stage | status | wall s | GPU-h | headline |", "|---|---|---|---|---|"]
    for name in STAGES[:-1]:
        entry = manifest["stages"].get(name, {})
        metrics = entry.get("summary", {}).get("metrics", {})
        headline = _headline(name, entry, metrics) or entry.get("reason", "")
        wall = entry.get("wall_time_s")
        lines.append(f"| {name} | {entry.get('status', 'pending')} | {'' if wall is None else f'{wall:.1f}'} | "
                     f"{_gpu_hours_cell(name, gpu)} | {headline} |")
    if gpu:
        reused = f"; reused stages held {gpu['reused_total']:.4g} when they ran" if gpu.get("reused_total") else ""
        lines += ["", f"**GPU-hours of this run** (before this report): {gpu['total']:.4g}{reused}"]
    verdict = manifest["stages"].get("run_benchmark", {}).get("summary", {}).get("verdict")
    if verdict:
        lines += ["", f"**Verdict:** {verdict['summary']}"]
    return "\n".join(lines) + "\n"


def _gpu_hours_cell(name: str, gpu: dict) -> str:
    """What the stage held in this flow run; a reused one held nothing now (its figure from when it ran beside)."""
    if name in gpu.get("stages", {}):
        return f"{gpu['stages'][name]:.4g}"
    if name in gpu.get("reused", {}):
        return f"0 (reused; {gpu['reused'][name]:.4g} when it ran)"
    return ""


def _headline(name: str, entry: dict, metrics: dict) -> str:
    if name == "run_benchmark" and metrics:
        best = (entry.get("summary", {}).get("verdict", {}).get("best") or {}).get("setting")
        return headline_line(metrics, best)
    return ", ".join(f"{k}={shown(v, figure_kind(k))}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in list(metrics.items())[:4])


def run_description(cfg: ExperimentConfig, manifest: dict, links: dict[str, str]) -> str:
    """The parent run's MLflow description: the config's, the headline and verdict, the links, the legend."""
    bench = manifest["stages"].get("run_benchmark", {}).get("summary", {})
    lines = [cfg.description] if cfg.description else []
    if bench.get("metrics"):
        best = (bench.get("verdict", {}).get("best") or {}).get("setting")
        lines.append(f"**Benchmark:** {headline_line(bench['metrics'], best)}")
    if bench.get("verdict"):
        lines.append(f"**Verdict:** {bench['verdict']['summary']}")
    lines += [f"{label}: {value}" for label, value in links.items()]
    lines.append(f"Metrics: {METRICS_LEGEND}")
    return "\n\n".join(lines)


@task(name="report", cache_policy=NO_CACHE)
@redacted_failures  # its exception reaches the task run's Prefect state message masked
def report(cfg: ExperimentConfig, ctx: StageContext) -> dict:
    manifest = json.loads(Path(ctx.run_dir, "manifest.json").read_text())
    markdown = redact(render_report(cfg.experiment, manifest))
    path = ctx.stage_dir / "report.md"
    path.write_text(markdown)
    parent_id = manifest["mlflow"]["parent_run_id"]
    parent = RunLogger(ctx.tracking_uri, parent_id)
    parent.log_text(markdown, "report.md")
    parent.set_tags({"mlflow.note.content": redact(run_description(cfg, manifest, run_links_of(manifest, ctx.run_dir)))})
    bench = manifest["stages"].get("run_benchmark", {}).get("summary", {})
    parent.log_metrics(display_metrics(bench.get("metrics") or {}))
    describe_version(cfg, manifest, parent, run_links_of(manifest, ctx.run_dir))
    create_markdown_artifact(markdown, key=f"{cfg.experiment.replace('_', '-').replace('.', '-')}-report",
                             description="eagleops stage summary")
    statuses = {n: e.get("status") for n, e in manifest["stages"].items() if n != "report"}
    return {
        "outputs": {"report": str(path)},
        "metrics": {"stages_completed": sum(s == "completed" for s in statuses.values())},
        "stages": statuses,
    }


# The parent run's display figures: short names that sort before every `<stage>.*` metric in MLflow's metrics table
# (the run page's first screen), rounded as shown; the full-precision `run_benchmark.*` series stay beside them.
DISPLAY_METRICS = {"_tok_s": ("best_tok_s", "tok_s"), "_speedup": ("speedup", "speedup"),
                   "_accept_len_online": ("accept_length_online", "accept_length"),
                   "_accept_len_offline": ("accept_length_offline", "accept_length"),
                   "_baseline_tok_s": ("baseline_tok_s", "tok_s")}


def display_metrics(bench_metrics: dict) -> dict[str, float]:
    """{`_tok_s`: 1266.8, `_speedup`: 1.61, ...} from the benchmark's metrics, those it measured."""
    return {name: rounded(bench_metrics[key], kind) for name, (key, kind) in DISPLAY_METRICS.items()
            if isinstance(bench_metrics.get(key), (int, float))}


def registered_version(manifest: dict) -> tuple[str, str] | None:
    """(model, version) the export registered in this run; None when none, or only journaled (no number yet)."""
    outputs = manifest["stages"].get("export_checkpoint", {}).get("summary", {}).get("outputs", {})
    name, _, version = str(outputs.get("registered_model_version", "")).partition("/")
    return (name, version) if name and version.isdigit() else None


def version_description(manifest: dict, run_name: str, links: dict[str, str]) -> str:
    """The model version's description: the benchmark's headline and verdict, training's figure, the experiment run
    (the version's source run: MLflow links it, under whichever address serves it), the Prefect flow run, the folder."""
    bench = manifest["stages"].get("run_benchmark", {}).get("summary", {})
    train = manifest["stages"].get("train_draft", {}).get("summary", {}).get("metrics", {})
    lines = []
    if bench.get("metrics"):
        best = (bench.get("verdict", {}).get("best") or {}).get("setting")
        lines.append(f"**Benchmark:** {headline_line(bench['metrics'], best)}")
    if bench.get("verdict"):
        lines.append(f"**Verdict:** {bench['verdict']['summary']}")
    if isinstance(train.get("simulated_accept_length"), (int, float)):
        lines.append(f"**Training:** simulated accept length {shown(train['simulated_accept_length'], 'accept_length')}"
                     " at the full TTT depth")
    lines.append(f"Experiment run: {run_name} (the Source Run above; its description has the verdict and links)")
    lines += [f"{label}: {value}" for label, value in links.items()]
    return "\n\n".join(lines)


def describe_version(cfg: ExperimentConfig, manifest: dict, parent: RunLogger, links: dict[str, str]) -> None:
    """The registered version's description and headline tags (the version page's first screen); a registry that
    does not answer costs the description only (one warning line), the tags are journaled like any write."""
    from mlflow.tracking import MlflowClient

    registered = registered_version(manifest)
    if registered is None or parent.offline:
        return
    bench = manifest["stages"].get("run_benchmark", {}).get("summary", {}).get("metrics") or {}
    parent.set_version_tags(*registered, {f"eagleops.{name.lstrip('_')}": value
                                          for name, value in display_metrics(bench).items()})
    try:
        client = MlflowClient(parent.tracking_uri)
        run_name = client.get_run(parent.run_id).info.run_name
        client.update_model_version(*registered, description=redact(version_description(manifest, run_name, links)))
    except Exception as err:
        if not is_outage(err):
            raise
        logging.getLogger("eagleops").warning(f"no description on {registered[0]} version {registered[1]}: "
                                              f"{short_error(err)}")


def run_links_of(manifest: dict, run_dir: Path) -> dict[str, str]:
    """The run's other places: its Prefect flow run (when a Prefect UI serves it) and its folder."""
    flow_runs = manifest.get("prefect_flow_run_ids") or []
    url = prefect_flow_run_url(flow_runs[-1]) if flow_runs else None
    return {**({"Prefect flow run": url} if url else {}), "Run folder": str(run_dir)}


def link_runs(cfg: ExperimentConfig, run_dir: Path, parent: RunLogger, flow_run_id: str) -> None:
    """Both ways between the two UIs, at the start of a flow run: the MLflow parent run gets the Prefect flow run's
    address (tag `prefect.flow_run_url` and its description) when a Prefect UI serves it; the Prefect flow run gets
    a link artifact to the MLflow run (for a local store: how to serve it, then the address)."""
    manifest = json.loads(Path(run_dir, "manifest.json").read_text())
    url = prefect_flow_run_url(flow_run_id)
    if url:
        parent.set_tags({"prefect.flow_run_url": url})
    parent.set_tags({"mlflow.note.content": redact(run_description(cfg, manifest, run_links_of(manifest, run_dir)))})
    if parent.offline:  # not on the server yet: `eagleops sync` uploads it, and the flow run's log names the folder
        return
    try:
        links = run_links(parent.tracking_uri, parent.run_id)
    except Exception as err:
        if not is_outage(err):
            raise
        logging.getLogger("eagleops").warning(f"no MLflow link for the Prefect flow run: {short_error(err)}")
        return
    key = f"{_artifact_key(cfg.experiment)}-mlflow-run"
    if "serve" in links:
        create_markdown_artifact(redact(
            f"MLflow parent run `{parent.run_id}` is in the local store `{parent.tracking_uri}`. Serve it with "
            f"`{links['serve']}`, then open [the run]({links['run']}) or [the runs table]({links['experiment']})."),
            key=key, description="the MLflow run of this flow run")
    else:
        create_link_artifact(links["run"], link_text=f"MLflow run {parent.run_id}", key=key,
                             description=f"the MLflow run of this flow run; runs table: {links['experiment']}")


def _artifact_key(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-") or "eagleops"
