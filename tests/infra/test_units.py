"""The systemd units in infra/systemd run the same scripts the end-to-end tests start (`serve` mode),
with the environment those scripts read. (No systemd here: this checks the files, the scripts are
exercised by test_team_setup.py.)"""

import configparser
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "infra" / "systemd"
INSTALLED_AT = "/opt/eagleops/"


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # keys are case-sensitive in systemd
    parser.read(UNITS / name)
    return parser


@pytest.mark.parametrize(("name", "script", "mode"), [
    ("eagleops-prefect-server.service", "infra/prefect-server.sh", "serve"),
    ("eagleops-mlflow-server.service", "infra/mlflow-server.sh", "serve"),
    ("eagleops-worker@.service", "infra/prefect-worker.sh", "%i"),
])
def test_each_unit_runs_a_repo_script_in_the_foreground(name, script, mode):
    service = unit(name)["Service"]
    assert service["Type"] == "simple" and service["EnvironmentFile"]
    command = service["ExecStart"]
    assert f"{INSTALLED_AT}{script} {mode}" in command
    assert (REPO / script).is_file()
    assert "Install" in unit(name) and unit(name)["Install"]["WantedBy"] == "multi-user.target"


def test_the_env_file_sets_what_the_scripts_read():
    env_file = (UNITS / "eagleops.env").read_text()
    assigned = set(re.findall(r"^([A-Z_]+)=", env_file, re.M))
    read_by_env_sh = set(re.findall(r'^export ([A-Z_]+)="\$\{\1:-', (REPO / "infra/env.sh").read_text(), re.M))
    assert read_by_env_sh - {"EAGLEOPS_STATE_DIR"} <= assigned
    assert {"PREFECT_API_URL", "PREFECT_SERVER_ANALYTICS_ENABLED", "DO_NOT_TRACK", "MLFLOW_DISABLE_TELEMETRY"} <= assigned
    assert "EAGLEOPS_PROJECT_DIR=/opt/eagleops" in env_file
