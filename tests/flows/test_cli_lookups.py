"""CLI lookups answer a wrong path, a wrong id or a server that is down in one line, exit 2, no traceback; `runs`
fits 100 columns with the setting and the four headline figures of each run."""

from __future__ import annotations

import json
import socket

import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from flows.cli import app
from tasks.tracking.journal import Journal, journal_path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def invoke(*args: str, columns: int = 100):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns)})


def assert_one_line_error(result, *needles: str) -> None:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    for needle in needles:
        assert needle in result.output, result.output


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A local MLflow store with one eagleops parent run, its headline figures logged as the benchmark logs them."""
    root = tmp_path_factory.mktemp("store")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("cli-tiny", artifact_location=(root / "artifacts").as_uri())
    run = client.create_run(experiment, run_name="cli-tiny-20261201-143744-aca224",
                            tags={"eagleops.kind": "experiment", "eagleops.speculative": "4/1/5",
                                  "eagleops.best_setting": "4/1/5"})
    for key, value in {"run_benchmark.best_tok_s": 1266.8, "run_benchmark.speedup": 1.61,
                       "run_benchmark.accept_length_online": 3.32, "run_benchmark.accept_length_offline": 3.59,
                       "run_benchmark.baseline_tok_s": 784.9, "check_environment.env_warnings": 0.0,
                       "generate_data.num_samples": 2030.0}.items():
        client.log_metric(run.info.run_id, key, value)
    client.set_terminated(run.info.run_id)
    return uri, run.info.run_id


def test_runs_fits_100_columns_with_the_setting_and_the_four_headline_figures(store):
    uri, _ = store
    result = invoke("runs", "--tracking-uri", uri)
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 100, result.output
    line = next(line for line in result.output.splitlines() if "cli-tiny-20261201-143744-aca224" in line)
    for figure in ("4/1/5", "1266.8", "1.61x", "3.32", "3.59", "finished"):
        assert figure in line, result.output
    assert "…" not in result.output and "run_benchmark." not in result.output


def test_runs_at_a_server_that_is_down(tmp_path):
    assert_one_line_error(invoke("runs", "--tracking-uri", f"http://127.0.0.1:{free_port()}"), "not reachable",
                          "Connection refused")


def test_runs_of_an_unknown_experiment(store):
    uri, _ = store
    assert_one_line_error(invoke("runs", "--tracking-uri", uri, "--experiment", "no-such"), "no-such")


def test_compare_a_path_that_does_not_exist(tmp_path):
    assert_one_line_error(invoke("compare", str(tmp_path / "no" / "such" / "run")), "does not exist")


def test_compare_a_folder_that_is_not_a_run_folder(tmp_path):
    assert_one_line_error(invoke("compare", str(tmp_path)), "not a run folder")


def test_compare_something_that_is_no_run_id(store):
    uri, _ = store
    assert_one_line_error(invoke("compare", "rational-ostrich", "--tracking-uri", uri), "is no run name, run folder")


def test_compare_a_run_id_the_store_does_not_have(store):
    uri, _ = store
    assert_one_line_error(invoke("compare", "0" * 32, "--tracking-uri", uri), "0" * 32)


def test_compare_at_a_server_that_is_down(store):
    _, run_id = store
    assert_one_line_error(invoke("compare", run_id, "--tracking-uri", f"http://127.0.0.1:{free_port()}"),
                          "not reachable")


def test_compare_labels_the_headline_figures(store):
    uri, run_id = store
    result = invoke("compare", run_id, "--tracking-uri", uri, columns=200)
    assert result.exit_code == 0, result.output
    offline = next(line for line in result.output.splitlines() if "run_benchmark.accept_length_offline " in line
                   or "run_benchmark.accept_length_offline)" in line)
    assert "at the setting's depth" in offline and "3.59" in offline


def test_compare_takes_the_run_name_runs_prints(store):
    """What `eagleops runs` prints in its run column, `eagleops compare` accepts (also EXPERIMENT/RUN_NAME, its form
    when several experiments are listed); the samples row holds the data stage's count, not "-"."""
    uri, _ = store
    listed = invoke("runs", "--tracking-uri", uri)
    name = next(line.split()[0] for line in listed.output.splitlines() if line.strip().startswith("cli-tiny-"))
    for given in (name, f"cli-tiny/{name}"):
        result = invoke("compare", given, "--tracking-uri", uri, columns=200)
        assert result.exit_code == 0, result.output
        samples = next(line for line in result.output.splitlines() if "generate_data.num_samples" in line)
        assert "2030" in samples, result.output
    assert_one_line_error(invoke("compare", f"other/{name}", "--tracking-uri", uri), "is no run name")


def test_the_data_stage_logs_its_sample_and_token_counts():
    from tasks.stages.data.host import split_counts

    summary = {"num_samples": {"train": 1827, "validation": 203}, "num_tokens": {"train": 399490, "validation": 44690},
               "num_assistant_tokens": 239818}
    assert split_counts(summary) == {"num_train": 1827, "num_val": 203, "num_samples": 2030, "tokens": 444180,
                                     "assistant_tokens": 239818}
    assert split_counts({}) == {}


def test_sync_and_teardown_of_a_folder_that_is_not_a_run_folder(tmp_path):
    assert_one_line_error(invoke("sync", str(tmp_path)), "not a run directory")
    assert_one_line_error(invoke("teardown", str(tmp_path / "missing")), "not a run directory")


def test_sync_to_a_server_that_is_down(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    down = f"http://127.0.0.1:{free_port()}"
    (run_dir / "manifest.json").write_text(json.dumps({"run_id": "r", "mlflow": {"tracking_uri": down}}))
    Journal(journal_path(run_dir)).append("log_batch", "offline-1", 0, {"metrics": [["m", 1.0, 0, 0]]})
    assert_one_line_error(invoke("sync", str(run_dir)), "not reachable")


def test_a_run_says_how_to_browse_it_afterwards(tmp_path, monkeypatch):
    """`eagleops run`'s last lines name `eagleops ui` for its local store and Prefect database (its temporary Prefect
    server is gone by then); a tracking server needs none."""
    from flows.cli import _ui_command

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    runs = tmp_path / "runs"
    command = _ui_command(runs / "tiny" / "x", f"sqlite:///{runs / 'mlflow.db'}")
    assert command.endswith(f" ui {runs} --prefect-home {tmp_path / 'prefect-home'}"), command
    assert _ui_command(runs / "tiny" / "x", "http://127.0.0.1:5000") is None
