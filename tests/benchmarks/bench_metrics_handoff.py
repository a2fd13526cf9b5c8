"""A training loop's step time with its metrics sent from inside the loop vs handed off (tasks.tracking.handoff),
against a real `mlflow server` reached directly and through a local proxy that delays every answer (issue 34).

    .venv/bin/python tests/benchmarks/bench_metrics_handoff.py [--steps 100] [--delay-ms 200] [--step-ms 20]

The loop stands in for eagle3's: a fixed amount of CPU work per step (torch matmuls calibrated to --step-ms;
on a GPU the step is as short or shorter, so the tracking share only grows), then one `on_metrics(step, row)`
with the 12 values the trainer logs at `train.log_every: 1` (loss_k, acc_k for 4 TTT steps, lr, grad norm, ...).
"sync" is what train_draft did before: `RunLogger.log_metrics` per step, one HTTP round trip on the loop's
path; "hand-off" queues the row and returns. Prints mean and p95 step time per mode, the slowdown against no
tracking, and how long the hand-off took at the end to send what was still queued (`close()`). Checks every row
arrived. Not collected by pytest; results in tests/benchmarks/NOTES_metrics_handoff.md.
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from tasks.tracking.handoff import MetricsHandoff  # noqa: E402
from tasks.tracking.outage import check_tracking_server  # noqa: E402
from tasks.tracking.run_logger import create_run  # noqa: E402
from tests.mlflow_server import MlflowServer, free_port  # noqa: E402


class SlowProxy:
    """127.0.0.1:<port> forwarding every request to `upstream_port`, answering `delay_s` late (a slow tracking server)."""

    def __init__(self, upstream_port: int, delay_s: float):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                upstream = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                upstream.request(self.command, self.path, body=body, headers=headers)
                answer = upstream.getresponse()
                data = answer.read()
                time.sleep(proxy.delay_s)
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                upstream.close()

            do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _forward

            def log_message(self, *args) -> None:
                pass

        self.delay_s = delay_s
        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def calibrated_work(step_ms: float):
    """A function doing ~step_ms of torch CPU work (the loop's compute)."""
    torch.set_num_threads(1)
    a = torch.randn(256, 256)

    def work(n: int) -> None:
        for _ in range(n):
            a @ a

    started = time.perf_counter()
    work(50)
    per = (time.perf_counter() - started) / 50
    n = max(1, round(step_ms / 1000 / per))
    return lambda: work(n)


def row(step: int) -> dict[str, float]:
    values = {f"train/loss_{k}": 5.0 / (step + k + 1) for k in range(4)}
    values |= {f"train/acc_{k}": step / (step + k + 10) for k in range(4)}
    return values | {"train/loss": 1.0 / (step + 1), "lr": 1e-4, "grad_norm": 0.5, "tokens_per_s": 1000.0 + step}


def run_loop(mode: str, uri: str | None, steps: int, work) -> dict[str, float]:
    run = create_run(uri, None, f"bench-{mode}", {}, experiment="bench-metrics-handoff") if uri else None
    handoff = MetricsHandoff(run) if run is not None and mode.startswith("hand-off") else None
    times = []
    for step in range(steps):
        started = time.perf_counter()
        work()
        if handoff is not None:
            handoff(step, row(step))
        elif run is not None:
            run.log_metrics(row(step), step=step)
        times.append(time.perf_counter() - started)
    drain = 0.0
    if handoff is not None:
        started = time.perf_counter()
        handoff.close()
        drain = time.perf_counter() - started
    if run is not None:
        arrived = MlflowClient(uri).get_metric_history(run.run_id, "train/loss")
        assert sorted(m.step for m in arrived) == list(range(steps)), f"{mode}: {len(arrived)} of {steps} rows"
    times.sort()
    return {"mean_ms": 1000 * statistics.mean(times), "p95_ms": 1000 * times[int(0.95 * (len(times) - 1))],
            "drain_s": drain, "batches": handoff.batches_sent if handoff else (steps if run else 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--delay-ms", type=float, default=200.0)
    parser.add_argument("--step-ms", type=float, default=20.0)
    args = parser.parse_args()
    work = calibrated_work(args.step_ms)
    with tempfile.TemporaryDirectory() as tmp:
        server = MlflowServer(Path(tmp))
        server.start()
        proxy = SlowProxy(server.port, args.delay_ms / 1000)
        try:
            check_tracking_server(server.uri, None)
            create_run(server.uri, None, "warm-up", {}, experiment="bench-metrics-handoff").log_metrics({"x": 1.0})
            modes = [("no tracking", None), ("sync, direct", server.uri), ("hand-off, direct", server.uri),
                     (f"sync, +{args.delay_ms:.0f} ms", proxy.uri), (f"hand-off, +{args.delay_ms:.0f} ms", proxy.uri)]
            results = {mode: run_loop(mode, uri, args.steps, work) for mode, uri in modes}
        finally:
            proxy.close()
            server.stop()
    base = results["no tracking"]["mean_ms"]
    print(f"{args.steps} steps of ~{args.step_ms:.0f} ms compute, 12 metrics a step, proxy delay {args.delay_ms:.0f} ms")
    print(f"{'mode':<22}{'mean ms':>10}{'p95 ms':>10}{'x base':>8}{'batches':>9}{'drain s':>9}")
    for mode, r in results.items():
        print(f"{mode:<22}{r['mean_ms']:>10.1f}{r['p95_ms']:>10.1f}{r['mean_ms'] / base:>8.2f}{r['batches']:>9}"
              f"{r['drain_s']:>9.2f}")


if __name__ == "__main__":
    main()
