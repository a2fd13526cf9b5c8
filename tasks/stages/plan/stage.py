"""plan_serving (opt-in with bench.plan): which setting to serve at which load, predicted and then checked.

After run_benchmark: its rows (step costs per concurrency, acceptance by draft position) calibrate the
prediction of every grid setting at every bench.concurrency (`tasks.stages.plan.build`); the picks within
bench.sla are then measured, with a few held-out grid settings, one server at a time on the deploy host with
the benchmark's own prompts and rounds; a pick whose measured tok/s is off its prediction by more than
bench.plan_tolerance gives way to the measured best (said so). Output: plan.md, plan.json, the adaptive config
JSON and the frontier plot in the stage folder; the stage's MLflow run (table, plot, metrics, the JSONs); a
Prefect markdown artifact.
"""

from __future__ import annotations

import json

from prefect import task
from prefect.cache_policies import NO_CACHE

from eagle3.serving.spec_grid import Setting
from tasks.config.schema import ExperimentConfig, SpeculativeConfig
from tasks.hosts.servers import Placement, launch, open_executor, stop
from tasks.log import logger
from tasks.runner.context import StageContext
from tasks.runner.flow_errors import redacted_failures
from tasks.stages.bench.report import _artifact_key
from tasks.stages.bench.stage import bench_one
from tasks.stages.plan.build import ADAPTIVE_FILE, Plan, frontier_figure, pick_metrics, render_markdown


def measure_checks(cfg: ExperimentConfig, ctx: StageContext, settings: list[Setting]) -> list[dict]:
    """Each setting served and benchmarked at every bench.concurrency as run_benchmark does; its rows."""
    deployed, bench = ctx.upstream["deploy_server"], ctx.upstream["run_benchmark"]
    where = deployed["placement"]
    placement = Placement(open_executor(cfg, ctx.run_dir), None, where["workdir"], where["model_path"],
                          where["draft_path"])
    endpoint, prompts = bench["inputs"]["endpoint"], bench["inputs"]["prompts"]
    rows: list[dict] = []
    for setting in settings:
        spec = SpeculativeConfig(num_steps=setting.num_steps, eagle_topk=setting.eagle_topk,
                                 num_draft_tokens=setting.num_draft_tokens)
        effective = {"num_steps": setting.num_steps, "eagle_topk": setting.eagle_topk,
                     "num_draft_tokens": setting.num_draft_tokens}
        handle = launch(cfg, placement, ctx.run_dir, label=f"speculative {setting.label}", spec=spec,
                        predicted=effective)
        try:
            rows += bench_one(cfg, ctx, handle, endpoint, prompts)
        finally:
            stop(ctx.run_dir, handle)
    return rows


@task(name="plan_serving", cache_policy=NO_CACHE)
@redacted_failures  # its exception reaches the task run's Prefect state message masked
def plan_serving(cfg: ExperimentConfig, ctx: StageContext) -> dict:
    plan = Plan(cfg, ctx.upstream["run_benchmark"]["rows"])
    checks = plan.settings_to_check()
    logger().info(f"plan: {len(plan.grid)} settings predicted at concurrency {plan.predictor.concurrencies}; "
                  f"measuring {[s.label for s in checks]} to check")
    plan.with_check(measure_checks(cfg, ctx, checks))
    summary = log_plan(cfg, ctx, plan)
    for choice in summary["choices"]:
        logger().info(f"plan: concurrency {choice['concurrency']}: serve {choice['setting']} ({choice['why']}; "
                      f"{choice['check']})")
    return summary


def log_plan(cfg: ExperimentConfig, ctx: StageContext, plan: Plan) -> dict:
    """plan.md / plan.json / the adaptive config / the frontier plot here, in MLflow and as a Prefect artifact."""
    from prefect.artifacts import create_markdown_artifact

    data = plan.as_dict()
    markdown = render_markdown(plan, cfg.experiment)
    (ctx.stage_dir / "plan.md").write_text(markdown)
    ctx.write_json("plan.json", data)
    if data["adaptive_config"]:
        (ctx.stage_dir / ADAPTIVE_FILE).write_text(json.dumps(data["adaptive_config"], indent=1) + "\n")
    figure = frontier_figure(plan)
    figure.savefig(ctx.stage_dir / "plan_frontier.png")
    run = ctx.mlflow
    run.log_metrics(pick_metrics(plan))
    run.log_dict(data, "plan/plan.json")
    if data["adaptive_config"]:
        run.log_dict(data["adaptive_config"], f"plan/{ADAPTIVE_FILE}")
    run.log_table({k: [p[k] for p in data["predictions"]] for k in data["predictions"][0]}, "plan/predictions.json")
    run.log_figure(figure, "plots/plan_frontier.png")
    import matplotlib.pyplot as plt

    plt.close(figure)
    create_markdown_artifact(markdown, key=f"{_artifact_key(cfg.experiment)}-plan", description="eagleops serving plan")
    return {**data, "outputs": {"plan": str(ctx.stage_dir / "plan.md")}}
