"""Where the pipeline's lines go: Prefect's run logger inside a flow or task run (the Prefect UI and the
worker's log), else the `eagleops` logger (the CLI, tests, a notebook)."""

from __future__ import annotations

import logging

from prefect import get_run_logger
from prefect.exceptions import MissingContextError


def logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("eagleops")


class _ExpectedErrorsInOneLine(logging.Filter):
    """Drops the traceback from Prefect's record of an expected error, so "Encountered exception during execution"
    (a flow) and "Task run failed with exception" (a stage) are one line in the worker's log and the UI: a config
    the flow refuses (`ConfigError`), and every error class marked `one_line_in_logs` -- a check before launch, a
    host that refuses the connection or its key, and `StageFailed`, whose cause's traceback the stage's own task
    run has logged already (an unexpected error is logged with its traceback once). Any other keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        from tasks.config.load import ConfigError

        error = record.exc_info[1] if record.exc_info else None
        if error is not None and (isinstance(error, ConfigError) or getattr(error, "one_line_in_logs", False)):
            record.exc_info, record.exc_text = None, None
        return True


def expected_errors_in_one_line() -> None:
    """Install the filter on the loggers Prefect's flow and task engines report exceptions with (once)."""
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _ExpectedErrorsInOneLine) for f in log.filters):
            log.addFilter(_ExpectedErrorsInOneLine())
