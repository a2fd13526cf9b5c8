"""The EAGLE-3 experiment flow: the pipeline diagram in code.

    check_environment -> generate_data -> train_draft -> export_checkpoint
                      -> deploy_server -> run_benchmark -> report

Each stage is a Prefect task in `tasks/`; `Pipeline` (tasks/pipeline.py) gives each one its
run-directory folder and MLflow child run, skips stages that completed earlier with the same
inputs, and stops the run at the first failure.
"""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run

from tasks.config import load_experiment
from tasks.bench import run_benchmark
from tasks.data import generate_data
from tasks.deploy import deploy_server, teardown_for_flow_run, teardown_run
from tasks.env import check_environment
from tasks.export import export_checkpoint
from tasks.pipeline import Pipeline, is_interrupt
from tasks.report import report
from tasks.train import train_draft


def _teardown_hook(flow, flow_run, state) -> None:
    """Failure/cancellation/crash hook: stop every server this flow run started, wherever the hook runs."""
    teardown_for_flow_run(flow_run.parameters, str(flow_run.id))


@flow(name="eagle3-experiment", log_prints=True,
      on_failure=[_teardown_hook], on_cancellation=[_teardown_hook], on_crashed=[_teardown_hook])
def eagle3_experiment(
    config_path: str, stages: list[str] | None = None, run_dir: str | None = None, variant: int | None = None
) -> dict:
    """Run (or resume, with run_dir) one experiment; `stages` limits which stages execute.

    `variant` picks one grid point when config_path is a sweep file.
    """
    cfg = load_experiment(config_path, variant)
    pipeline = Pipeline(cfg, config_path, stages, run_dir, flow_run_id=str(flow_run.id))
    try:
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
        # 7. one table of everything
        pipeline.run_stage(report)
    except BaseException as err:
        pipeline.finish("KILLED" if is_interrupt(err) else "FAILED")
        raise
    finally:
        # 8. no server outlives the flow
        teardown_run(pipeline.run.path, cfg)
    return pipeline.finish("FINISHED")
