"""The flows refuse what a stage would refuse from the config and the files it names before any stage runs, as a
deployment run from the Prefect UI starts them: the flow run's state message and its log say it in one
`file:line: field: check: reason` line, with no traceback; an unexpected error keeps its traceback. A stage that
meets an expected error (a host that refuses) logs it without a traceback too; an unexpected one, once.

Real flow runs under the Prefect harness, the state message and the logs read back from the API.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.logging.handlers import APILogWorker

import flows.experiment
import tasks.stages.environment
from flows.experiment import eagle3_experiment
from flows.nightly import nightly_retrain
from tasks.hosts.remote.errors import ConnectError
from tests.mlflow_server import free_port

CONFIG = """\
experiment: preflight-flow
runs_root: {runs}
target:
  kind: tiny
data:
  max_length: 256
export: {{formats: [sglang], registered_model: preflight-draft}}
tracking: {{uri: "http://127.0.0.1:{port}"}}
deploy:
  extra_args: {extra_args}
bench:
  max_new_tokens: {max_new_tokens}
"""


def write_config(tmp_path: Path, max_new_tokens: int = 64, extra_args: str = "[]") -> Path:
    path = tmp_path / "preflight.yaml"
    path.write_text(CONFIG.format(runs=tmp_path / "runs", port=free_port(), extra_args=extra_args,
                                  max_new_tokens=max_new_tokens))
    return path


def line_of(path: Path, key: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), start=1) if line.strip().startswith(key))


def state_message_and_logs(state) -> tuple[str, str]:
    """The flow run's state message and every log line of it, as the Prefect API has them."""
    APILogWorker.drain_all(timeout=30)  # the run's logs reach the API in the background: send them first
    run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
        run = client.read_flow_run(run_id)
    assert any("Finished in state Failed" in log.message for log in logs), [log.message for log in logs]
    assert run.state.is_failed(), run.state
    return run.state.message, "\n".join(log.message for log in logs)


def test_the_experiment_flow_refuses_a_benchmark_length_before_any_stage(prefect_harness, tmp_path):
    # bench.max_new_tokens 700 with data.max_length 256: the benchmark stage refused it, after the deploy stage's server
    path = write_config(tmp_path, max_new_tokens=700)
    start = time.monotonic()
    state = eagle3_experiment(str(path), return_state=True)
    message, logs = state_message_and_logs(state)
    where = f"{path}:{line_of(path, 'max_new_tokens:')}"
    assert message.startswith(f"Flow run encountered an exception: ConfigError: {where}: bench.max_new_tokens: "
                              "bench_lengths: 700 new tokens after a prompt of at least one token exceed "
                              "data.max_length 256"), message
    assert "\n" not in message
    assert "Traceback" not in logs and "Traceback" not in message, logs
    assert f"{where}: bench.max_new_tokens" in logs  # the log says it too, in its one line
    assert not (tmp_path / "runs").exists()  # no stage ran: not even the run folder was made
    print(f"refused in {time.monotonic() - start:.1f} s: {message}")


def test_the_experiment_flow_refuses_a_draft_that_is_not_json_before_any_stage(prefect_harness, tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"],')  # cut short
    path = write_config(tmp_path, extra_args=json.dumps(["--speculative-draft-model-path", str(draft)]))
    message, logs = state_message_and_logs(eagle3_experiment(str(path), return_state=True))
    assert f"ConfigError: {path}:{line_of(path, 'extra_args:')}: deploy.extra_args: draft_config: {draft}/config.json: " \
           "not a readable JSON config" in message, message
    assert "Traceback" not in logs, logs
    assert not (tmp_path / "runs").exists()


def test_a_stage_selection_without_the_benchmark_is_not_refused_for_it(prefect_harness, tmp_path):
    # the preflight checks what the selected stages need: the benchmark's length does not stop a data-only run
    from tasks.config.load import load_experiment
    from tasks.stages.preflight import preflight_findings

    cfg = load_experiment(write_config(tmp_path, max_new_tokens=700))

    def errors(stages: list[str]) -> list[str]:
        return [f.check for f in preflight_findings(cfg, stages) if f.level == "error"]

    assert errors(["check_environment", "generate_data"]) == []
    assert errors(["deploy_server", "run_benchmark"]) == errors(["run_benchmark"]) == ["bench_lengths"]
    eagle3_experiment(str(write_config(tmp_path, max_new_tokens=700)), stages=["check_environment"])


def test_the_nightly_refuses_before_reading_the_champion(prefect_harness, tmp_path):
    # tracking.uri answers nothing: reading the champion would fail in its own way; the config is refused first
    path = write_config(tmp_path, max_new_tokens=700)
    message, logs = state_message_and_logs(nightly_retrain(str(path), return_state=True))
    assert f"ConfigError: {path}:{line_of(path, 'max_new_tokens:')}: bench.max_new_tokens: bench_lengths" in message
    assert "champion" not in message and "Traceback" not in logs, logs


def test_an_unexpected_error_keeps_its_traceback(prefect_harness, tmp_path, monkeypatch):
    def broken(*_args, **_kwargs):
        raise RuntimeError("a bug in the preflight")

    monkeypatch.setattr(flows.experiment, "refuse_before_stages", broken)
    message, logs = state_message_and_logs(eagle3_experiment(str(write_config(tmp_path)), return_state=True))
    assert "RuntimeError: a bug in the preflight" in message
    assert "Traceback (most recent call last)" in logs, logs


def test_a_stage_meeting_a_host_that_refuses_says_it_without_a_traceback(prefect_harness, tmp_path, monkeypatch):
    def refused(*_args, **_kwargs):
        raise ConnectError("[gpu-1] ops@10.0.0.7:22: authentication refused (the key is not authorized there)")

    monkeypatch.setattr(tasks.stages.environment, "gather_facts", refused)
    state = eagle3_experiment(str(write_config(tmp_path)), stages=["check_environment"], return_state=True)
    message, logs = state_message_and_logs(state)
    assert "check_environment failed: [gpu-1] ops@10.0.0.7:22: authentication refused" in message
    assert "Traceback" not in logs, logs  # neither the task run's record nor the flow run's


def test_an_unexpected_stage_error_is_logged_with_its_traceback_once(prefect_harness, tmp_path, monkeypatch):
    def bug(*_args, **_kwargs):
        raise RuntimeError("a bug in a stage")

    monkeypatch.setattr(tasks.stages.environment, "gather_facts", bug)
    state = eagle3_experiment(str(write_config(tmp_path)), stages=["check_environment"], return_state=True)
    message, logs = state_message_and_logs(state)
    assert "check_environment failed: a bug in a stage" in message
    assert logs.count("Traceback (most recent call last)") == 1, logs  # the task run's; the flow's StageFailed: a line


@pytest.fixture(autouse=True)
def _no_secret_env(monkeypatch):
    monkeypatch.delenv("EAGLEOPS_A", raising=False)
