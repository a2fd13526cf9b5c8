"""report: the last stage; one table of every stage's status and headline metrics.

Written to the run directory (report.md, summary.json), to the MLflow parent run and as a
Prefect markdown artifact, so the result is readable from either UI or from disk alone.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from tasks.config import ExperimentConfig
from tasks.pipeline import STAGES, StageContext
from tasks.secrets import redact
from tasks.tracking import RunLogger


def render_report(experiment: str, manifest: dict) -> str:
    lines = [f"## eagleops run `{manifest['run_id']}` ({experiment})", "", "| stage | status | wall s | headline |", "|---|---|---|---|"]
    for name in STAGES[:-1]:
        entry = manifest["stages"].get(name, {})
        metrics = entry.get("summary", {}).get("metrics", {})
        headline = ", ".join(f"{k}={_fmt(v)}" for k, v in list(metrics.items())[:4]) or entry.get("reason", "")
        wall = entry.get("wall_time_s")
        lines.append(f"| {name} | {entry.get('status', 'pending')} | {'' if wall is None else f'{wall:.1f}'} | {headline} |")
    verdict = manifest["stages"].get("run_benchmark", {}).get("summary", {}).get("verdict")
    if verdict:
        lines += ["", f"**Verdict:** {verdict['summary']}"]
    return "\n".join(lines) + "\n"


def _fmt(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


@task(name="report", cache_policy=NO_CACHE)
def report(cfg: ExperimentConfig, ctx: StageContext) -> dict:
    manifest = json.loads(Path(ctx.run_dir, "manifest.json").read_text())
    markdown = redact(render_report(cfg.experiment, manifest))
    path = ctx.stage_dir / "report.md"
    path.write_text(markdown)
    parent_id = manifest["mlflow"]["parent_run_id"]
    RunLogger(ctx.tracking_uri, parent_id).log_text(markdown, "report.md")
    create_markdown_artifact(markdown, key=f"{cfg.experiment.replace('_', '-').replace('.', '-')}-report",
                             description="eagleops stage summary")
    statuses = {n: e.get("status") for n, e in manifest["stages"].items() if n != "report"}
    return {
        "outputs": {"report": str(path)},
        "metrics": {"stages_completed": sum(s == "completed" for s in statuses.values())},
        "stages": statuses,
    }
