"""A failed flow run's Prefect state message (what the UI and the API show) carries no secret, whatever raised.

Real flow runs under the Prefect harness, the state message read back from the API:
- the experiment flow failing outside any stage, before the run registered its secrets (its config's
  overrides step) and after its stages (the teardown in its `finally`), with a message that holds the
  config's HF token, its SSH key passphrase and a PostgreSQL password in a store URI;
- the nightly started while the tracking server (a URI with credentials in it) does not answer: the
  champion cannot be read, the nightly refuses to guess it, in one line, and that line has no password;
- a stage failing with such a message: its task run's state message too (the flow's was masked already).
And the rule behind them: every Prefect flow and task of flows/ and tasks/stages/ is wrapped.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client

import flows.experiment
import tasks.stages.environment
from flows.experiment import eagle3_experiment
from flows.nightly import nightly_retrain
from tasks.runner.flow_errors import is_redacting
from tests.mlflow_server import free_port

HF_TOKEN = "hf_StateMessageToken0123456789"
PASSPHRASE = "key-passphrase-in-state-7788"
DB_PASSWORD = "pg-S3cret-in-state-99"
CONFIG = """\
experiment: state-messages
runs_root: {runs}
target:
  kind: tiny
hosts:
  - {{name: gpu-1, address: 127.0.0.1, user: eagle, key_file: /nonexistent/key, key_passphrase: "${{EAGLEOPS_TEST_PASSPHRASE}}"}}
deploy:
  env: {{HF_TOKEN: "${{EAGLEOPS_TEST_HF_TOKEN}}"}}
{extra}"""
SECRETS = (HF_TOKEN, PASSPHRASE, DB_PASSWORD)


@pytest.fixture
def config(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLEOPS_TEST_HF_TOKEN", HF_TOKEN)
    monkeypatch.setenv("EAGLEOPS_TEST_PASSPHRASE", PASSPHRASE)

    def write(extra: str = "") -> Path:
        path = tmp_path / "state-messages.yaml"
        path.write_text(CONFIG.format(runs=tmp_path / "runs", extra=extra))
        return path

    return write


def leaky_error(*_args, **_kwargs):
    raise RuntimeError(f"could not reach postgresql://eagle:{DB_PASSWORD}@db.internal:5432/mlflow with "
                       f"HF_TOKEN={HF_TOKEN}, key passphrase {PASSPHRASE!r}")


def state_message(state) -> str:
    """The flow run's state message as the Prefect API has it (not the local State object)."""
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(state.state_details.flow_run_id)
    assert run.state.is_failed(), run.state
    return run.state.message


def assert_no_secret(message: str) -> None:
    for secret in SECRETS:
        assert secret not in message, message
    assert "**********" in message, message


def test_a_failure_before_any_stage_reaches_prefect_masked(prefect_harness, config, monkeypatch):
    # the overrides step runs before the run folder exists and before the run registers its secrets
    monkeypatch.setattr(flows.experiment, "apply_overrides", leaky_error)
    state = eagle3_experiment(str(config()), stages=["check_environment"], return_state=True)
    message = state_message(state)
    assert message.startswith("Flow run encountered an exception: RuntimeError: could not reach postgresql://")
    assert_no_secret(message)


def test_a_failure_after_the_stages_reaches_prefect_masked(prefect_harness, config, monkeypatch):
    monkeypatch.setattr(flows.experiment, "teardown_run", leaky_error)  # the flow's `finally`
    state = eagle3_experiment(str(config()), stages=["check_environment"], return_state=True)
    message = state_message(state)
    assert "RuntimeError: could not reach" in message
    assert_no_secret(message)


def test_nightly_with_the_registry_down_fails_in_one_masked_line(prefect_harness, config):
    uri = f"http://eagle:{DB_PASSWORD}@127.0.0.1:{free_port()}"  # nothing listens there
    path = config(f"export: {{formats: [sglang], registered_model: state-draft}}\ntracking: {{uri: '{uri}'}}\n")
    start = time.monotonic()
    state = nightly_retrain(str(path), return_state=True)
    message = state_message(state)
    assert_no_secret(message)
    assert "\n" not in message
    assert "the champion of state-draft cannot be read" in message
    print(f"nightly refused in {time.monotonic() - start:.1f} s: {message}")


def test_a_stage_failure_reaches_its_task_runs_state_masked(prefect_harness, config, monkeypatch):
    monkeypatch.setattr(tasks.stages.environment, "gather_facts", leaky_error)  # inside the check_environment task
    state = eagle3_experiment(str(config()), stages=["check_environment"], return_state=True)
    assert_no_secret(state_message(state))
    with get_client(sync_client=True) as client:
        (task_run,) = [run for run in client.read_task_runs() if run.flow_run_id == state.state_details.flow_run_id
                       and run.name.startswith("check_environment")]
    assert task_run.state.is_failed()
    assert task_run.name == "check_environment (attempt 1)"  # by stage and attempt, not Prefect's random suffix
    assert "RuntimeError: could not reach" in task_run.state.message
    assert_no_secret(task_run.state.message)


PREFECT_MODULES = ["flows.experiment", "flows.nightly", "flows.watch", "tasks.stages.environment",
                   "tasks.stages.data.stage", "tasks.stages.train.stage", "tasks.stages.export", "tasks.stages.deploy",
                   "tasks.stages.bench.stage", "tasks.stages.report", "tasks.stages.gate.nightly"]


def test_every_flow_and_stage_task_masks_what_it_raises():
    from prefect import Flow, Task

    found = {f"{name}.{attr}": obj for name in PREFECT_MODULES for attr, obj in vars(importlib.import_module(name)).items()
             if isinstance(obj, (Flow, Task)) and obj.fn.__module__ == name}
    assert len(found) >= 12  # 3 flows, the 7 stages, the gate, the watch's champion read
    assert [name for name, obj in found.items() if not is_redacting(obj.fn)] == []
