"""The EAGLE-3 experiment flow: the pipeline diagram in code.

    check_environment -> generate_data -> train_draft -> export_checkpoint
                      -> deploy_server -> run_benchmark [-> plan_serving, with bench.plan] -> report

Each stage is a Prefect task in `tasks/`; `Pipeline` (tasks/runner/pipeline.py) gives each one its
run-directory folder and MLflow child run, skips stages that completed earlier with the same
inputs, and stops the run at the first failure.
"""

from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run

from flows.params import (
    DEFAULT_CONFIG,
    ConfigOverrides,
    ConfigPath,
    RunDir,
    StageSelection,
    SweepVariant,
    apply_overrides,
)
from tasks.config.load import load_experiment
from tasks.hosts.teardown import teardown_for_flow_run, teardown_run
from tasks.log import expected_errors_in_one_line
from tasks.rundir import folder_of_flow_run
from tasks.runner.context import is_interrupt
from tasks.runner.flow_errors import redacted_failures
from tasks.runner.pipeline import Pipeline
from tasks.stages.bench.stage import run_benchmark
from tasks.stages.plan.stage import plan_serving
from tasks.stages.data.stage import generate_data
from tasks.stages.deploy import deploy_server
from tasks.stages.environment import check_environment
from tasks.stages.export import export_checkpoint
from tasks.stages.preflight import refuse_before_stages
from tasks.stages.report import link_runs, report
from tasks.stages.train.stage import train_draft


expected_errors_in_one_line()  # a config the flow refuses: one line in its log, no traceback


def _teardown_hook(flow, flow_run, state) -> None:
    """Failure/cancellation/crash hook: stop every server this flow run started, wherever the hook runs."""
    teardown_for_flow_run(flow_run.parameters, str(flow_run.id))


def _flow_run_name() -> str:
    """`<experiment> <num_steps/topk/draft tokens>` (and the sweep variant), so the Prefect UI lists runs by what
    they measure; the config file's name when the config does not load (the flow then reports why)."""
    from prefect.runtime import flow_run as current

    params = current.parameters
    try:
        cfg = apply_overrides(load_experiment(params.get("config_path", DEFAULT_CONFIG), params.get("variant")),
                              params.get("overrides"))
    except Exception:  # noqa: BLE001 -- a name is no place to fail: the flow's first line reports the config error
        return f"eagle3 {Path(str(params.get('config_path', DEFAULT_CONFIG))).stem}"
    spec = cfg.deploy.speculative
    setting = "/".join("auto" if v is None else str(v) for v in (spec.num_steps, spec.eagle_topk, spec.num_draft_tokens))
    variant = f" variant {params['variant']}" if params.get("variant") is not None else ""
    return f"{cfg.experiment} {setting}{variant}"


@flow(name="eagle3-experiment", log_prints=True, flow_run_name=_flow_run_name,
      on_failure=[_teardown_hook], on_cancellation=[_teardown_hook], on_crashed=[_teardown_hook])
@redacted_failures  # an exception leaving the body reaches Prefect's state message masked
def eagle3_experiment(
    config_path: ConfigPath = DEFAULT_CONFIG,
    stages: StageSelection = None,
    run_dir: RunDir = None,
    variant: SweepVariant = None,
    overrides: ConfigOverrides = ConfigOverrides(),
) -> dict:
    """Run (or resume, with run_dir) one experiment; `stages` limits which stages execute.

    The Prefect UI form shows these descriptions; types and bounds are in flows/params.py.

    Args:
        config_path: Experiment or sweep YAML: a shipped config, or a path on the worker (relative to the
            project directory).
        stages: Stages to run (default: all). `report` always runs.
        run_dir: Resume this run directory; completed stages with unchanged inputs are skipped.
        variant: For a sweep file: the grid point to run (0-based); required for sweeps.
        overrides: Replace the config's deploy host or speculative flags for this run (unset: the YAML's).
    """
    cfg = apply_overrides(load_experiment(config_path, variant), overrides)
    # 0. what a stage would refuse from the config and the files it names, before any stage runs
    refuse_before_stages(cfg, config_path, variant, stages)
    if run_dir is None and flow_run.run_count > 1:  # a Retry resumes the folder its earlier attempt wrote
        earlier = folder_of_flow_run(cfg.runs_root, cfg.experiment, str(flow_run.id))
        run_dir = str(earlier) if earlier else None
    pipeline = Pipeline(cfg, config_path, stages, run_dir, flow_run_id=str(flow_run.id))
    with pipeline:  # the run folder is this run's until the teardown ends: a second run on it refuses at once
        try:
            # the MLflow run names the Prefect flow run, the flow run links to the MLflow run
            link_runs(pipeline.cfg, pipeline.run.path, pipeline.parent, str(flow_run.id))
            # 1. can this machine run the experiment? a fail stops here, before anything expensive
            pipeline.run_stage(check_environment)
            # 2. prompts -> target answers -> chat template + loss mask -> hidden states, draft vocab
            pipeline.run_stage(generate_data)
            # 3. training-time-test training of the draft
            pipeline.run_stage(train_draft)
            # 4. SGLang (and vLLM speculators) checkpoint + validation
            pipeline.run_stage(export_checkpoint)
            # 5. preflight, copy the draft to the serving host, start the server, check what it runs
            pipeline.run_stage(deploy_server)
            # 6. timed generations: baseline vs each setting, online vs offline accept length, diagnosis
            pipeline.run_stage(run_benchmark)
            # 6b. opt-in (bench.plan): which setting at which load, predicted from 6, checked by measurement
            if cfg.bench.plan is not None:
                pipeline.run_stage(plan_serving)
            # 7. one table of everything
            pipeline.run_stage(report)
        except BaseException as err:
            pipeline.finish("KILLED" if is_interrupt(err) else "FAILED")
            raise
        finally:
            # 8. no server outlives the flow
            teardown_run(pipeline.run.path, cfg)
        return pipeline.finish("FINISHED")
