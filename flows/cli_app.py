"""The `eagleops` command line's frame: the Typer app every command module registers on, the two consoles,
the exit codes, and how an expected error is said (one line, exit 2).

Telemetry is turned off here, before any command imports Prefect or MLflow. The commands live by concern:
flows/cli_run.py (validate, run), flows/cli_records.py (runs, ui, sync, teardown, compare),
flows/cli_team.py (deploy-flows, nightly, watch, hosts); flows/cli.py puts them together.

Exit codes: 0 ok, 2 bad input (config, flags, run directory), 1 a stage failed.
"""

from __future__ import annotations

import os

import typer
from rich.console import Console
from rich.text import Text

# Telemetry off before Prefect or MLflow is imported (DO_NOT_TRACK covers Prefect's client,
# PREFECT_SERVER_ANALYTICS_ENABLED its ephemeral server, MLFLOW_DISABLE_TELEMETRY MLflow).
for _key, _value in {
    "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
}.items():
    os.environ.setdefault(_key, _value)

from tasks.config.load import ConfigError  # noqa: E402

app = typer.Typer(add_completion=False, no_args_is_help=True, help="EAGLE-3 draft pipeline: data, training, export, SGLang deploy, benchmark.")
out = Console()
err = Console(stderr=True)

BAD_INPUT, STAGE_FAILED = 2, 1


def _version_callback(value: bool) -> None:
    if value:
        from tasks.tracking.runs import eagleops_version

        out.print(f"eagleops {eagleops_version()}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True, help="Print the version."),
) -> None:
    """eagleops."""


def _say(label: str, style: str, message: str) -> None:
    """`label message` on stderr, the message as written: brackets in it (a regex, a user's string) are text,
    never Rich markup."""
    err.print(Text.assemble((label, style), " ", message), highlight=False, soft_wrap=True)


def _fail_config(error: ConfigError) -> None:
    for message in error.messages:
        _say("error", "red", message)
    raise typer.Exit(BAD_INPUT)
