"""Training metrics handed off the training loop: `on_metrics` queues a row and returns; a thread sends them.

The trainer calls `on_metrics(step, metrics)` from inside its loop (eagle3.training.train), and a relay of
remote nodes from its polling loop (tasks.stages.train.nodes). Sent straight to MLflow, each call would be
an HTTP round trip on the GPU's path: a tracking server answering in 200 ms adds 200 ms to every logging
step, and one in an outage adds its retries. Here the loop only appends `(step, time, metrics)` to a
queue; one daemon thread takes everything queued (waiting up to `LINGER_S` after a row for more to join it)
and sends it as one `RunLogger.log_metric_rows` (a log_batch of up to 1000 values per call), so the slower
the server, the bigger the batches, never the step. Each row keeps the time the loop produced it; a
metric shows in MLflow about `LINGER_S` (plus the server's answer) after the loop logged it.

Order and loss: one thread sends, in queue order, through the RunLogger, so an outage mid-training
journals the rows not yet sent, in order, after those that reached the server (`eagleops sync` replays
them); `close()` (the end of the `handed_off` block) waits until every row is sent or journaled.
Risk: a batch the server refuses (4xx: a deleted run, an invalid value) is not retried: one warning names
the rows lost and the rest keep going, so training never fails on its metrics.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Callable

from tasks.tracking.run_logger import RunLogger

Row = tuple[int, int, dict[str, float]]  # (step, time in ms, metrics)
LINGER_S = 1.0  # how long a queued row waits for others before its batch is sent


class MetricsHandoff:
    """`handoff(step, metrics)` queues a row; a daemon thread sends queued rows to `run` in batches."""

    def __init__(self, run: RunLogger, name: str = "training metrics", linger_s: float = LINGER_S):
        self.run, self.name, self.linger_s = run, name, linger_s
        self.rows_sent = 0
        self.batches_sent = 0
        self.rows_refused = 0
        self._rows: list[Row] = []
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._send_loop, name="eagleops-metrics-handoff", daemon=True)
        self._thread.start()

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        row = (int(step), int(time.time() * 1000), dict(metrics))
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.name}: step {step} logged after the hand-off was closed")
            self._rows.append(row)
            self._cond.notify()

    def close(self) -> None:
        """Send (or journal) everything queued, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._rows or self._closed)
                # A row is there: let the next ones join it for up to linger_s (fewer, bigger batches cost the
                # loop's process less CPU), unless the block is ending.
                self._cond.wait_for(lambda: self._closed, timeout=self.linger_s)
                rows, self._rows = self._rows, []
                if not rows and self._closed:
                    return
            self._send(rows)

    def _send(self, rows: list[Row]) -> None:
        try:
            self.run.log_metric_rows(rows)
        except Exception as err:  # an outage is journaled by RunLogger; this is a refusal: these rows are lost
            self.rows_refused += len(rows)
            logging.getLogger("eagleops").warning(
                f"{self.name}: MLflow refused {len(rows)} rows (steps {rows[0][0]}..{rows[-1][0]}) of run "
                f"{self.run.run_id} ({type(err).__name__}: {str(err)[:300]}); training goes on")
            return
        self.rows_sent += len(rows)
        self.batches_sent += 1


@contextlib.contextmanager
def handed_off(run: RunLogger) -> Iterator[Callable[[int, dict[str, float]], None]]:
    """An `on_metrics(step, metrics)` for the block that never waits on MLflow; everything is sent when it ends."""
    handoff = MetricsHandoff(run)
    try:
        yield handoff
    finally:
        handoff.close()
