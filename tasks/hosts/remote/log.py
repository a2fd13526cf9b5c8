"""The one logger of tasks.hosts.remote: Prefect's run logger inside a run, else `eagleops.remote`."""

from __future__ import annotations

import logging
import sys


def logger() -> logging.Logger | logging.LoggerAdapter:
    """Prefect's run logger inside a flow or task run, else the `eagleops.remote` logger."""
    if "prefect" in sys.modules:  # no run context can exist before prefect was imported
        from prefect import get_run_logger
        from prefect.exceptions import MissingContextError

        try:
            return get_run_logger()
        except MissingContextError:
            pass
    return logging.getLogger("eagleops.remote")
