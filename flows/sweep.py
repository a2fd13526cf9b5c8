"""`eagle3-sweep`: a whole speculative-parameter sweep with one click, its grid points as child deployment runs.

The sweep file's grid points (tasks.config.load.load_variants) each become a run of the experiment deployment
that runs one grid point (`spec-sweep` in infra/prefect.yaml: config_path + variant), started with Prefect's
`run_deployment` as a subflow of this one, so the UI lists them under the sweep's flow run and each runs on its
own pool and queue (the GPU host's worker, one GPU stage at a time). Without `run_dir` every grid point is
started at once and its run trains its own draft; with `run_dir` (a finished run whose data, training and export
every grid point reuses, as a spec-only sweep does) they run one after another, since a run folder holds one
run at a time. When all have ended, one markdown artifact compares them from their MLflow experiment runs (the
run tagged `prefect.flow_run_id` that is no stage's child run): tok/s, speedup and accept length of each, the best marked; the sweep fails if any grid
point did not complete, after posting what the others measured.
"""


import time
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.deployments import run_deployment

from flows.params import ConfigPath, RunDir, StageSelection
from tasks.config.load import ConfigError, is_sweep, load_variants
from tasks.config.schema import ExperimentConfig
from tasks.config.secrets import redact
from tasks.log import logger
from tasks.runner.flow_errors import redacted_failures
from tasks.tracking.views import run_links, tracking_uri_for

CHILD_DEPLOYMENT = "eagle3-experiment/spec-sweep"
POLL_S = 5.0
METRICS = {"tok/s": "run_benchmark.best_tok_s", "speedup": "run_benchmark.speedup",
           "accept length": "run_benchmark.accept_length_online"}


class SweepFailed(RuntimeError):
    """Some grid points did not complete; the comparison of the others is posted."""


@flow(name="eagle3-sweep", log_prints=True, flow_run_name="sweep {config_path}")
@redacted_failures  # an exception leaving the body reaches Prefect's state message masked
def sweep_grid(config_path: ConfigPath, run_dir: RunDir = None, stages: StageSelection = None,
               deployment: str = CHILD_DEPLOYMENT) -> dict:
    """Run every grid point of a sweep file as a child run of the grid-point deployment; compare them.

    Args:
        config_path: The sweep YAML (sweep: base, name, grid), a shipped config or a path on the worker.
        run_dir: A finished run every grid point reuses (data, training, export); they then run one at a time.
        stages: The stages each grid point runs (default: all).
        deployment: The deployment that runs one grid point (flow/deployment), given config_path and variant.
    """
    if not is_sweep(config_path):
        raise ConfigError([f"{config_path}: not a sweep file (sweep: base, name, grid); run it with the experiment "
                           "deployment instead"])
    variants = load_variants(config_path)
    parameters = {k: v for k, v in {"config_path": config_path, "run_dir": run_dir, "stages": stages}.items()
                  if v is not None}
    children = _run_grid(deployment, parameters, [name for name, _ in variants], one_at_a_time=run_dir is not None)
    rows = [_measured(cfg, name, child) for (name, cfg), child in zip(variants, children)]
    markdown = comparison_markdown(variants[0][1], rows)
    create_markdown_artifact(redact(markdown), key=_artifact_key(variants[0][1].experiment),
                             description=f"eagleops sweep: {len(rows)} grid points")
    failed = [row for row in rows if row["state"] != "Completed"]
    if failed:
        raise SweepFailed(f"{len(failed)} of {len(rows)} grid points did not complete: "
                          + ", ".join(f"{r['grid_point']} {r['state']}" for r in failed))
    return {"grid_points": rows}


def _run_grid(deployment: str, parameters: dict[str, Any], names: list[str], one_at_a_time: bool) -> list:
    """Start each grid point as a subflow deployment run; wait until all have ended; their final flow runs."""
    started, ended = [], {}
    for index, name in enumerate(names):
        child = run_deployment(deployment, parameters={**parameters, "variant": index}, timeout=0, as_subflow=True)
        logger().info(f"grid point {index} ({name}): flow run {child.name} ({child.id}) started")
        started.append(child)
        if one_at_a_time:
            ended[child.id] = _wait(child, f"grid point {index} ({name})", len(ended), len(names))
    for index, child in enumerate(started):
        if child.id not in ended:
            ended[child.id] = _wait(child, f"grid point {index} ({names[index]})", len(ended), len(names))
    return [ended[child.id] for child in started]


def _wait(child, label: str, done: int, total: int):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(child.id)
            if run.state is not None and run.state.is_final():
                logger().info(f"{label}: {run.state.name} ({done + 1} of {total} ended)")
                return run
            time.sleep(POLL_S)


def _measured(cfg: ExperimentConfig, name: str, child) -> dict[str, Any]:
    """One row of the comparison: the child's state and its MLflow parent run's headline figures."""
    row = {"grid_point": name, "setting": _setting(cfg), "state": child.state.name, "flow_run": str(child.id),
           "mlflow_run_id": None, "link": None, **{label: None for label in METRICS}}
    found = _mlflow_parent_run(cfg, str(child.id))
    if found is not None:
        row["mlflow_run_id"] = found.info.run_id
        row.update({label: found.data.metrics.get(metric) for label, metric in METRICS.items()})
        try:
            row["link"] = run_links(tracking_uri_for(cfg), found.info.run_id)["run"]
        except Exception as err:  # a link is a courtesy
            logger().debug(f"no MLflow link for {found.info.run_id}: {err}")
    return row


def _mlflow_parent_run(cfg: ExperimentConfig, flow_run_id: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri_for(cfg))
    experiment = client.get_experiment_by_name(cfg.tracking.experiment_name or cfg.experiment)
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id], f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
    parents = [run for run in runs if "mlflow.parentRunId" not in run.data.tags]  # its stages' runs carry the tag too
    return parents[0] if parents else None


def _setting(cfg: ExperimentConfig) -> str:
    spec = cfg.deploy.speculative
    return "/".join("auto" if v is None else str(v) for v in (spec.num_steps, spec.eagle_topk, spec.num_draft_tokens))


def comparison_markdown(cfg: ExperimentConfig, rows: list[dict[str, Any]]) -> str:
    """The grid points side by side (steps/topk/draft tokens), the best tok/s in bold."""
    measured = [r for r in rows if r["tok/s"] is not None]
    best = max(measured, key=lambda r: r["tok/s"]) if measured else None
    lines = [f"# Sweep of {cfg.experiment}: {len(rows)} grid points", "",
             "| grid point | steps/topk/draft tokens | state | tok/s | speedup | accept length | MLflow run |",
             "|---|---|---|---:|---:|---:|---|"]
    for row in rows:
        mark = "**" if row is best else ""
        figures = [_figure(row["tok/s"], 1), _figure(row["speedup"], 2, "x"), _figure(row["accept length"], 2)]
        run = f"[{row['mlflow_run_id'][:8]}]({row['link']})" if row["link"] else (row["mlflow_run_id"] or "-")
        lines.append(f"| {mark}{row['grid_point']}{mark} | {row['setting']} | {row['state']} | "
                     + " | ".join(f"{mark}{f}{mark}" if f != "-" else f for f in figures) + f" | {run} |")
    if best is not None:
        lines += ["", f"Best: {best['grid_point']} ({best['setting']}) at {best['tok/s']:.1f} tok/s."]
    return "\n".join(lines) + "\n"


def _figure(value: float | None, digits: int, unit: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def _artifact_key(experiment: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in experiment.lower()) + "-sweep"
