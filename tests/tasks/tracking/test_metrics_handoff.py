"""Training metrics handed off the loop (tasks.tracking.handoff) against the session's real `mlflow server`:
every row arrives, in step order, with the time the loop produced it; the server stopped for real mid-training
journals the rows not sent yet, which `sync_journal` replays after those that arrived; a batch the server
refuses (a run it does not have) is one warning, never an error in the loop. How much the hand-off saves a
loop against a slow server is measured by hand: tests/benchmarks/bench_metrics_handoff.py."""

from __future__ import annotations

import json
import logging
import time

from mlflow.tracking import MlflowClient

from tasks.tracking.handoff import LINGER_S, MetricsHandoff, handed_off
from tasks.tracking.journal import JOURNAL_FILE, journal_path
from tasks.tracking.outage import check_tracking_server, is_offline
from tasks.tracking.run_logger import RunLogger, create_run
from tasks.tracking.sync import sync_journal

STEPS = 60


def rows(step: int) -> dict[str, float]:
    return {"train/loss": 10.0 - step / 10, "train/acc_0": step / 100, "lr": 1e-4}


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float, int]]:
    return sorted((m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, key))


def new_run(uri: str, run_dir, name: str) -> RunLogger:
    run_dir.mkdir(exist_ok=True)
    assert check_tracking_server(uri, journal_path(run_dir))
    return create_run(uri, journal_path(run_dir), name, {}, experiment="metrics-handoff")


def test_every_row_arrives_in_order_with_the_loop_time(mlflow_server, tmp_path):
    mlflow_server.start()
    run = new_run(mlflow_server.uri, tmp_path / "run", "handoff-order")
    produced = []
    with handed_off(run) as on_metrics:
        for step in range(STEPS):
            produced.append(time.time() * 1000)
            on_metrics(step, rows(step))
    assert on_metrics.rows_sent == STEPS and on_metrics.rows_refused == 0
    assert on_metrics.batches_sent < STEPS  # rows queued while a batch was in flight went together
    loss = history(MlflowClient(mlflow_server.uri), run.run_id, "train/loss")
    assert [(s, v) for s, v, _ in loss] == [(s, 10.0 - s / 10) for s in range(STEPS)]
    # each row keeps the time the loop logged it (ms), not the time its batch was sent
    assert all(abs(ts - at) <= 50 for (_, _, ts), at in zip(loss, produced))
    assert not (tmp_path / "run" / JOURNAL_FILE).exists()


def test_server_stopped_mid_training_journals_the_rest_in_order(mlflow_server, tmp_path):
    mlflow_server.start()
    run_dir = tmp_path / "run"
    run = new_run(mlflow_server.uri, run_dir, "handoff-outage")
    try:
        with handed_off(run) as on_metrics:
            for step in range(STEPS):
                if step == STEPS // 3:
                    time.sleep(LINGER_S + 1.0)  # what was logged so far reached the server
                    mlflow_server.stop()
                on_metrics(step, rows(step))
                time.sleep(0.01)
        assert is_offline(mlflow_server.uri)
        journaled = [json.loads(line) for line in (run_dir / JOURNAL_FILE).read_text().splitlines()]
        steps = [m[3] for entry in journaled if entry["op"] == "log_batch" for m in entry["args"]["metrics"]
                 if m[0] == "train/loss"]
        assert steps == list(range(steps[0], STEPS)) and steps[0] >= STEPS // 3  # the rest, in order
        assert on_metrics.rows_refused == 0
    finally:
        mlflow_server.start()
    assert sync_journal(run_dir, mlflow_server.uri).refused == []
    loss = history(MlflowClient(mlflow_server.uri), run.run_id, "train/loss")
    assert [(s, v) for s, v, _ in loss] == [(s, 10.0 - s / 10) for s in range(STEPS)]
    assert [ts for _, _, ts in loss] == sorted(ts for _, _, ts in loss)
    assert check_tracking_server(mlflow_server.uri, journal_path(run_dir))  # online again for the next test


def test_a_refused_batch_is_one_warning_and_the_loop_goes_on(mlflow_server, tmp_path, caplog):
    mlflow_server.start()
    assert check_tracking_server(mlflow_server.uri, journal_path(tmp_path))
    handoff = MetricsHandoff(RunLogger(mlflow_server.uri, "0" * 32, journal_path(tmp_path)))
    with caplog.at_level(logging.WARNING, logger="eagleops"):
        for step in range(5):
            handoff(step, rows(step))
        handoff.close()
    assert handoff.rows_refused == 5 and handoff.rows_sent == 0
    warnings = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert warnings and "training goes on" in warnings[0] and "0" * 32 in warnings[0]
    assert not (tmp_path / JOURNAL_FILE).exists()
