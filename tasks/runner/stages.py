"""The pipeline's stage names and the errors a stage ends with, apart from the runner (tasks.runner.pipeline).

Light on purpose (no Prefect, MLflow or torch): `eagleops run` checks --stages and sets up its error
handling with these before it starts the temporary Prefect server, and imports the runner (seconds)
while that server boots. tasks.runner.specs' STAGE_SPECS has exactly these names, in this order
(tests/flows/test_pipeline_stages.py checks it).
"""

from __future__ import annotations

from pathlib import Path

STAGES = ["check_environment", "generate_data", "train_draft", "export_checkpoint", "deploy_server", "run_benchmark",
          "plan_serving", "report"]


class StageFailed(RuntimeError):
    """A stage raised; the message names the stage and its error."""

    one_line_in_logs = True  # the stage's task run logged its cause's traceback, if it had one (tasks.log)


class SelectionError(StageFailed):
    """A stage cannot run: an upstream output it needs is not available in this run folder."""


class DiskFull(StageFailed):
    """A stage failed because its disk filled; `detail` says what filled, where and what is free now."""

    def __init__(self, stage: str, detail: str, run_dir: Path, config_path: str):
        self.stage, self.detail, self.run_dir = stage, detail, run_dir
        super().__init__(f"{stage} failed: {detail}; free space, then resume with: "
                         f"eagleops run {config_path} --run-dir {run_dir}")
