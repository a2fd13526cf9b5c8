"""A reused stage as the Prefect UI shows it: a task run of the stage's name, Completed as `Cached` (as
Prefect's own cache hits are), its message naming the attempt reused, with a link artifact to that attempt's
MLflow run. Without it a resumed flow run showed only the stages that ran, as if the others never existed.

Nothing runs in the task but the artifact: the stage's outputs come from its run folder (tasks.runner.pipeline).
Outside a flow run (a Pipeline driven directly) there is no UI to show, and nothing is made.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed

from tasks.config.secrets import redact


def reused_message(name: str, attempt: dict[str, Any]) -> str:
    ended = attempt.get("finished") or attempt.get("started") or "earlier"
    return f"{name}: reused attempt {attempt.get('attempt')} (completed {ended}, same inputs); nothing ran"


def show_reused_stage(name: str, attempt: dict[str, Any], mlflow_link: str) -> None:
    """A `Cached` task run for stage `name` in the current flow run (see the module)."""
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is None:
        return
    stage = _reused_stage.with_options(name=name, task_run_name=f"{name} (reused attempt {attempt.get('attempt')})")
    stage(reused_message(name, attempt), mlflow_link, attempt.get("mlflow_run_id") or "")


@task(cache_policy=NO_CACHE)
def _reused_stage(message: str, mlflow_link: str, mlflow_run_id: str):
    if mlflow_link:
        from prefect.artifacts import create_link_artifact

        create_link_artifact(mlflow_link, link_text=f"MLflow run {mlflow_run_id} (the reused attempt)",
                             description=redact(message))
    return Completed(name="Cached", message=redact(message))
