"""The production watch with real parts on 127.0.0.1: Debian's Prometheus scraping the reference server every
second, a real MLflow server holding the champion (its band recorded as the nightly gate records it), the flow
`eagle3-watch` run window by window in the Prefect harness, its events read back from the Prefect API.

One served story, in order (3 s windows, `watch.for` 2, `watch.min_requests` 4):
steady healthy traffic on the champion -> the draft replaced by a worse one, under too little traffic (no
alarm), then under normal traffic (drift within `for` + 1 judged windows) -> the champion again with other
speculative flags (a change naming each setting and both values) -> Prometheus stopped (one line, the watch
scrapes /metrics) -> the server stopped (unreachable, never a drift). A junk server covers bad input.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file, save_file

from flows.experiment import eagle3_experiment
from flows.watch import watch_production
from eagle3.serving.bench_prompts import builtin_prompts, render_prompts
from tasks.stages.gate.nightly import band_evidence, draft_identity, evidence_tags
from tasks.watch.events import CHANGED, DRIFT, UNREACHABLE
from tests.helpers import TEST_TARGET_YAML, free_port, serve_in_thread
from tests.prometheus_server import PrometheusServer, PrometheusUnavailable

REPO = Path(__file__).resolve().parents[2]
MODEL = "watch-draft"
WINDOW_S, FOR, MIN_REQUESTS = 3.0, 2, 4
SETTING = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
OTHER_SETTING = ["--speculative-num-steps", "2", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3"]
TRAIN_CONFIG = """\
experiment: watch-train
runs_root: {runs}
{target}data: {{num_samples: 32, max_length: 256, validation_fraction: 0.25, regenerate: {{max_new_tokens: 48}},
       draft_vocab_size: 64}}
train: {{ttt_steps: 3, epochs: 20, max_steps: 80, batch_size: 4, lr: 0.003, eval_every: 1000, checkpoint_every: 1000}}
export: {{formats: [sglang], dtype: float32}}
deploy: {{speculative: {{num_steps: 3, eagle_topk: 1, num_draft_tokens: 4}}}}
"""
WATCH_CONFIG = """\
experiment: watch
runs_root: {runs}
{target}data: {{draft_vocab_size: 64}}
export: {{formats: [sglang], registered_model: {model}}}
tracking: {{uri: {tracking}}}
watch:
  endpoints: [{endpoint}]
  prometheus: {prometheus}
  window_s: {window}
  for: {for_}
  min_requests: {min_requests}
  cooldown_s: 3600
  band: {{sigmas: 3, tolerance: 0.15}}
"""

pytestmark = pytest.mark.slow


# ------------------------------------------------------------------ parts


class ReferenceServer:
    """`python -m eagle3.serve` on a fixed port, restartable with another draft or other flags."""

    def __init__(self, target: Path, root: Path) -> None:
        self.target, self.root, self.port = target, root, free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, draft: Path, setting: list[str]) -> None:
        self.stop()
        argv = [sys.executable, "-m", "eagle3.serve", "--model-path", str(self.target), "--host", "127.0.0.1",
                "--port", str(self.port), "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                str(draft), *setting, "--enable-metrics", "--decode-log-interval", "5", "--random-seed", "0"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        with open(self.root / "server.log", "a") as log:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.root / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError("reference server did not come up")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            self.proc.wait(timeout=30)


def served_prompts(target: Path, count: int = 24) -> list[list[int]]:
    """The builtin prompts through the target's chat template: traffic like what the draft was trained on."""
    rendered = render_prompts(builtin_prompts(count, seed=3), target)
    return [ids for ids in rendered if len(ids) <= 200]  # room for the answer in the test target's 256 positions


class Traffic(threading.Thread):
    """Greedy /generate requests back to back, `pause_s` apart; `pause_s` changes the rate while it runs."""

    def __init__(self, url: str, prompts: list[list[int]], pause_s: float) -> None:
        super().__init__(daemon=True)
        self.url, self.prompts, self.pause_s, self.stopped = url, prompts, pause_s, threading.Event()

    def run(self) -> None:
        sent = 0
        with httpx.Client(timeout=30) as http:
            while not self.stopped.is_set():
                prompt = self.prompts[sent % len(self.prompts)]
                sent += 1
                try:
                    http.post(f"{self.url}/generate", json={"input_ids": prompt, "sampling_params": {
                        "max_new_tokens": 24, "temperature": 0, "ignore_eos": True}})
                except httpx.HTTPError:
                    time.sleep(0.2)  # the server is being restarted or stopped
                self.stopped.wait(self.pause_s)


def randomised(draft: Path, destination: Path) -> Path:
    """A copy of `draft` with its weights re-drawn (same keys, shapes and vocab maps): a draft lost in a weight sync."""
    shutil.copytree(draft, destination)
    weights = load_file(draft / "model.safetensors")
    generator = torch.Generator().manual_seed(7)
    redrawn = {k: (torch.randn(v.shape, generator=generator) * 0.02).to(v.dtype) if v.is_floating_point() else v
               for k, v in weights.items()}
    save_file(redrawn, destination / "model.safetensors")
    return destination


def measured_band(url: str, prompts: list[list[int]], rounds: int = 3) -> list[dict]:
    """The champion's rows as the gate pools them: one accept-length sample per round (tokens / verifies) over
    held-out prompts (the second half: traffic sends them all)."""
    samples = []
    for _ in range(rounds):
        metas = [httpx.post(f"{url}/generate", timeout=60, json={
            "input_ids": prompt, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
            ).json()["meta_info"] for prompt in prompts[len(prompts) // 2:]]
        samples.append(sum(m["completion_tokens"] for m in metas) / sum(m["spec_verify_ct"] for m in metas))
    effective = {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}
    return [{"concurrency": 1, "accept_length_samples": samples, "accepted_by_position": [], "effective": effective}]


def events_named(name: str, since: float, at_least: int = 0, what: str | None = None) -> list[dict]:
    """The harness server's events of that name emitted after `since` (payload `what` when given), polled until
    there are `at_least` (the server persists events in batches, seconds after they arrive)."""
    from prefect.events.worker import EventsWorker
    from prefect.settings import PREFECT_API_URL

    EventsWorker.drain_all(timeout=10)
    body = {"filter": {"event": {"name": [name]}, "occurred": {"since": _iso(since)}}, "limit": 50}
    deadline = time.monotonic() + 30
    while True:
        found = httpx.post(f"{PREFECT_API_URL.value()}/events/filter", json=body, timeout=10).json()["events"]
        found = [e for e in found if what is None or e["payload"].get("what") == what]
        if len(found) >= at_least or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def _iso(t: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(t, timezone.utc).isoformat()


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    try:
        server = PrometheusServer(tmp_path_factory.mktemp("prometheus"))
        server.start()
    except PrometheusUnavailable as why:
        pytest.skip(str(why))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def drafts(prefect_harness, tmp_path_factory) -> dict[str, Path]:
    """A trained draft (the champion), a re-drawn copy (the worse one) and the test-size target, built once."""
    root = tmp_path_factory.mktemp("watch-drafts")
    config = root / "train.yaml"
    config.write_text(TRAIN_CONFIG.format(runs=root / "runs", target=TEST_TARGET_YAML))
    result = eagle3_experiment(str(config), stages=["check_environment", "generate_data", "train_draft",
                                                    "export_checkpoint"])
    champion = Path(result["results"]["export_checkpoint"]["outputs"]["sglang_dir"])
    target = next((root / "runs" / "cache" / "targets").glob("*/config.json")).parent
    return {"champion": champion, "worse": randomised(champion, root / "worse"), "target": target}


@pytest.fixture(scope="module")
def story(prefect_harness, prometheus, mlflow_server, drafts, tmp_path_factory):
    """The served story (module docstring), watched window by window; what every look returned, and when."""
    root = tmp_path_factory.mktemp("watch")
    server = ReferenceServer(drafts["target"], root)
    server.start(drafts["champion"], SETTING)
    prometheus.set_targets([f"127.0.0.1:{server.port}"])
    prompts = served_prompts(drafts["target"])
    traffic = Traffic(server.url, prompts, pause_s=0.15)
    looks: list[dict] = []
    try:
        register_champion(mlflow_server.uri, drafts["champion"], measured_band(server.url, prompts))
        config = root / "watch.yaml"
        config.write_text(WATCH_CONFIG.format(runs=root / "runs", target=TEST_TARGET_YAML, model=MODEL,
                                              tracking=mlflow_server.uri, endpoint=server.url, prometheus=prometheus.url,
                                              window=WINDOW_S, for_=FOR, min_requests=MIN_REQUESTS))
        prometheus.scraped(f"127.0.0.1:{server.port}")
        traffic.start()

        def look(phase: str, count: int) -> None:
            for _ in range(count):
                started = time.time()
                time.sleep(max(0.0, WINDOW_S - (started - (looks[-1]["at"] if looks else 0.0))))
                result = watch_production(str(config))
                looks.append({"phase": phase, "at": time.time(), **result["endpoints"][0],
                              "run_id": result["monitoring_run_id"], "band": result["band"]})

        marks = {"start": time.time()}
        look("healthy", 10)
        marks["worse"] = time.time()
        traffic.pause_s = 4.0  # about one request per window: below watch.min_requests
        server.start(drafts["worse"], SETTING)
        look("worse, quiet", 3)
        marks["worse_busy"] = time.time()
        traffic.pause_s = 0.15
        look("worse, busy", FOR + 4)  # FOR + 1 judged windows, and room for unjudged ones before them
        marks["flags"] = time.time()
        server.start(drafts["champion"], OTHER_SETTING)
        look("other flags", 2)
        marks["no_prometheus"] = time.time()
        prometheus.stop()
        look("no prometheus", 2)
        marks["down"] = time.time()
        traffic.stopped.set()
        server.stop()
        look("server down", 1)
        (root / "looks.json").write_text(json.dumps({"looks": looks, "marks": marks}, indent=1, default=str))
        yield {"looks": looks, "marks": marks, "config": config, "server": server}
    finally:
        traffic.stopped.set()
        server.stop()
        if prometheus.process is not None and prometheus.process.poll() is not None:
            prometheus.start()  # the module fixture stops it at the end either way


def register_champion(tracking: str, draft: Path, rows: list[dict]) -> None:
    """The champion as a nightly leaves it: a version of MODEL under `champion` with the gate's evidence tags."""
    client = MlflowClient(tracking)
    client.create_registered_model(MODEL)
    weights = draft_identity(draft)["weights"]
    evidence = {"confidence": 0.95, "rounds": {"challenger": len(rows[0]["accept_length_samples"])},
                "identical_weights": False, "order": ["challenger"] * 3, "levels": [],
                "weights_sha256": {"challenger": weights}, "band": band_evidence(rows)}
    experiment = client.create_experiment("watch-champion")
    run = client.create_run(experiment, run_name="export_checkpoint")
    client.log_artifacts(run.info.run_id, str(draft), "sglang")
    client.set_terminated(run.info.run_id)
    version = client.create_model_version(MODEL, source=f"{run.info.artifact_uri}/sglang", run_id=run.info.run_id,
                                          tags=evidence_tags(evidence))
    client.set_registered_model_alias(MODEL, "champion", version.version)


def phase(looks: list[dict], name: str) -> list[dict]:
    return [look for look in looks if look["phase"] == name]


# ------------------------------------------------------------------ the story


def test_a_steady_healthy_server_raises_no_alarm(story):
    healthy = phase(story["looks"], "healthy")
    judged = [look for look in healthy if look["window"] and look["window"].get("requests", 0) >= MIN_REQUESTS]
    accepts = [look["window"]["accept_length"] for look in judged]
    band = healthy[-1]["band"]
    print(f"healthy: {len(judged)} judged windows of {WINDOW_S:.0f} s, accept length {min(accepts):.2f}-"
          f"{max(accepts):.2f} (mean {statistics.fmean(accepts):.2f}, sd {statistics.pstdev(accepts):.3f}); "
          f"band lower {band['lower']:.2f} (center {band['center']:.2f}, spread {band['spread']:.3f})")
    assert len(judged) >= 7
    assert all(look["events"] == [] and look["drift"] == "inactive" and not look["changes"] for look in healthy)
    assert [e for e in events_named(DRIFT, story["marks"]["start"]) if e["occurred"] < _iso(story["marks"]["worse"])] == []


def test_low_traffic_never_alarms(story):
    quiet = phase(story["looks"], "worse, quiet")
    assert all(look["drift"] == "inactive" and DRIFT not in look["events"] for look in quiet)
    assert all(look["window"] is None or look["window"]["requests"] < MIN_REQUESTS for look in quiet[1:])


def test_a_worse_draft_drifts_within_for_windows_and_the_event_carries_the_figures(story):
    busy = phase(story["looks"], "worse, busy")
    # A window with fewer than min_requests requests is not judged (the watch says nothing about it); the first one
    # after traffic came back can be one, when the traffic still waited out its quiet pause or a loaded machine
    # answered slowly. The drift must fire within FOR + 1 of the windows the watch judged.
    judged = [look for look in busy if look["window"] and look["window"]["requests"] >= MIN_REQUESTS]
    fired = next(i for i, look in enumerate(judged) if DRIFT in look["events"])
    delay_s = judged[fired]["at"] - story["marks"]["worse_busy"]
    print(f"drift: fired at the {fired + 1}. judged look after traffic came back ({delay_s:.1f} s, "
          f"{busy.index(judged[fired]) + 1}. look; for={FOR} windows of {WINDOW_S:.0f} s)")
    assert fired + 1 <= FOR + 1
    assert all(DRIFT not in look["events"] for look in busy if look not in judged)  # never on an unjudged window
    events = [e for e in events_named(DRIFT, story["marks"]["worse_busy"], at_least=1)
              if e["occurred"] < _iso(story["marks"]["flags"])]
    assert len(events) == 1  # once per episode (the cooldown is an hour)
    event = events[0]
    assert event["resource"]["eagleops.model"] == MODEL and event["resource"]["eagleops.model.version"] == "1"
    assert event["payload"]["accept_length"] < event["payload"]["band_lower"] and event["payload"]["for"] == FOR
    # the replaced draft is a change too: its digest is not the champion's
    changed = events_named(CHANGED, story["marks"]["worse"], at_least=1)
    assert any(c["setting"] == "draft_sha256" for e in changed for c in e["payload"]["changes"])


def test_other_speculative_flags_are_a_change_naming_both_values(story):
    changed = events_named(CHANGED, story["marks"]["flags"], at_least=1)
    settings = {c["setting"]: (c["expected"], c["served"]) for e in changed for c in e["payload"]["changes"]}
    assert settings["num_steps"] == (3, 2) and settings["num_draft_tokens"] == (4, 3)
    assert "draft_sha256" not in settings  # the champion's own weights again
    assert "num_steps 3 -> 2" in changed[0]["payload"]["summary"]


def test_without_prometheus_the_watch_says_so_in_one_line_and_scrapes(story):
    looks = phase(story["looks"], "no prometheus")
    said = [line for look in looks for line in look["lines"] if "Prometheus" in line]
    assert said and all("cannot see through Prometheus" in line and "scraping" in line for line in said)
    assert all("Traceback" not in line and "\n" not in line for look in looks for line in look["lines"])
    assert looks[-1]["source"] == "scrape" and looks[-1]["window"]["requests"] >= 0
    unreachable = events_named(UNREACHABLE, story["marks"]["no_prometheus"], at_least=1, what="prometheus")
    assert unreachable, "no eagleops.served.unreachable event for Prometheus"


def test_a_server_that_is_down_is_unreachable_never_a_drift(story):
    down = phase(story["looks"], "server down")[-1]
    assert down["unreachable"] and "does not answer" in down["unreachable"]
    assert UNREACHABLE in down["events"] and DRIFT not in down["events"]
    events = events_named(UNREACHABLE, story["marks"]["down"], at_least=1, what="server")
    assert len(events) == 1 and events[0]["resource"]["eagleops.endpoint"] == story["server"].url


def test_mlflow_holds_the_monitoring_series_of_the_champion(story, mlflow_server):
    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(story["looks"][0]["run_id"])
    assert run.data.tags["eagleops.watch.model_version"] == f"{MODEL}/1" and run.info.status == "RUNNING"
    history = client.get_metric_history(run.info.run_id, "accept_length")
    assert len(history) >= 10 and [m.step for m in history] == sorted(m.step for m in history)
    assert {"accept_rate", "tok_s", "request_rate", "band_lower", "num_steps"} <= set(run.data.metrics)
    assert float(run.data.params["band.lower"]) == pytest.approx(story["looks"][0]["band"]["lower"], abs=1e-3)


# ------------------------------------------------------------------ bad input


def junk_server(metrics_status: int, metrics_body: str, info_status: int) -> FastAPI:
    app = FastAPI()

    @app.get("/metrics")
    def metrics():
        return PlainTextResponse(metrics_body, status_code=metrics_status)

    @app.get("/server_info")
    def server_info():
        return PlainTextResponse(json.dumps({"model_path": "/nowhere", "version": "0.5.23"}), status_code=info_status)

    # Prometheus' HTTP API as it answers a query that selects no series (a server it does not scrape)
    @app.get("/api/v1/query_range")
    def no_range_series():
        return {"status": "success", "data": {"resultType": "matrix", "result": []}}

    @app.get("/api/v1/query")
    def no_instant_series():
        return {"status": "success", "data": {"resultType": "vector", "result": []}}

    return app


@pytest.mark.parametrize(("metrics_status", "body", "info_status", "prometheus", "expected"), [
    (200, "<html>this is not prometheus text</html>\nsglang:broken line here\n", 200, "down", "is not Prometheus text"),
    (500, "Internal Server Error", 200, "down", "HTTP 500"),
    (200, "", 500, "down", "HTTP 500"),
    (200, "", 200, "no series", "has no series for instance"),
])
def test_bad_input_is_one_line_and_the_watch_keeps_watching(prefect_harness, tmp_path, metrics_status, body,
                                                           info_status, prometheus, expected):
    with serve_in_thread(junk_server(metrics_status, body, info_status)) as url:
        config = tmp_path / "junk.yaml"
        config.write_text(WATCH_CONFIG.format(runs=tmp_path / "runs", target=TEST_TARGET_YAML, model=MODEL,
                                              tracking=f"sqlite:///{tmp_path / 'mlflow.db'}", endpoint=url,
                                              prometheus=url if prometheus == "no series" else "http://127.0.0.1:9",
                                              window=WINDOW_S, for_=FOR, min_requests=MIN_REQUESTS))
        for _ in range(2):  # twice: the second look works on the first one's memory
            result = watch_production(str(config))["endpoints"][0]
    lines = [line for line in result["lines"] if expected in line]
    assert lines and all("\n" not in line and "Traceback" not in line for line in result["lines"])
