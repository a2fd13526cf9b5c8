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
