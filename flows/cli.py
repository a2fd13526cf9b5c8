"""`eagleops` command line: the commands of flows/cli_run.py, flows/cli_records.py, flows/cli_team.py and
flows/cli_plan.py on the
one Typer app of flows/cli_app.py (see there for the exit codes). `eagleops = flows.cli:app`; `python -m flows.cli`.
"""

# Each module registers its commands on the app; `eagleops --help` lists them in this order.
from flows import cli_run  # noqa: F401, I001
from flows import cli_records  # noqa: F401
from flows import cli_team  # noqa: F401
from flows import cli_plan  # noqa: F401
from flows.cli_app import app
from flows.cli_run import _ui_command as _ui_command  # noqa: F401  (tests import these from here)
from flows.cli_team import nightly_outcome as nightly_outcome  # noqa: F401

__all__ = ["app"]

if __name__ == "__main__":
    app()
