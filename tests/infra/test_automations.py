"""The automations of `eagleops deploy-flows` acting, on the team setup (tests/team_servers.py): the real Prefect
server's triggers and actions, the cpu worker, the `eagleops-oncall` webhook block posting to a local receiver.

A nightly deployment of this test (the registered `nightly`'s flow, entrypoint, pull steps and concurrency
settings, on the cpu pool) stands for a model's nightly; its config names the model and the cooldown, as
infra/prefect.yaml's configs do. The watch's events are sent by the watch's own code (tasks/watch/events.py) from
a process of their own (a Prefect events client is one per process, whatever server it was made for).
Scenarios: (a) a worse draft on two servers -> drift + change + drift -> one nightly run, started through the
worker; (f) that nightly fails -> one notification; the gate's promoted and kept decisions -> one notification each; the cooldown window (the same version's events make one
run, another version's drift starts another); a drift while a nightly holds the deployment's slot -> the new run
is Cancelled, never run beside it.
"""

import json
import subprocess
import sys
import threading
import time
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.automations import PREFIX, automation_specs, ensure_automations, ensure_webhook_block, nightly_deployments
from tasks.watch.events import CHANGED, DRIFT, UNREACHABLE
from tests.team_servers import REPO, free_port, wait_for_run

pytestmark = pytest.mark.slow

MODEL = "watch-test-draft"
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
NAME = "nightly-watch-test"
CONFIG = """\
experiment: watch-automations
runs_root: {runs}
target:
  kind: tiny
export:
  registered_model: {model}
tracking:
  uri: {mlflow}
watch:
  cooldown_s: 3600
"""
# The watch's events, sent by tasks/watch/events.py in a process of its own; each one's id and send time back.
EMIT = """
import json, sys, time
from prefect.events.worker import EventsWorker
from tasks.watch.events import emit, served_resource
sent = []
for e in json.loads(sys.argv[1]):
    at = time.time()
    sent.append({"id": emit(e["event"], served_resource(e["endpoint"], e["model"], e["version"]), e["payload"]),
                 "at": at})
EventsWorker.drain_all(timeout=30)
print(json.dumps(sent))
"""


class Receiver(ThreadingHTTPServer):
    """A webhook receiver on 127.0.0.1: every POST's JSON body, with the time it arrived."""

    def __init__(self) -> None:
        self.received: list[dict] = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(handler) -> None:  # noqa: N805
                body = handler.rfile.read(int(handler.headers.get("Content-Length", 0)))
                self.received.append({"at": time.time(), **json.loads(body or b"{}")})
                handler.send_response(200)
                handler.end_headers()

            def log_message(handler, *args) -> None:  # noqa: N805
                pass

        super().__init__(("127.0.0.1", free_port()), Handler)

    def naming(self, text: str) -> list[dict]:
        return [n for n in self.received if text in n.get("body", "") or text in n.get("subject", "")]


def emit_events(env: dict, events: list[dict]) -> list[dict]:
    done = subprocess.run([sys.executable, "-c", EMIT, json.dumps(events)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    sent = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(s["id"] for s in sent), f"an event was not sent: {done.stderr[-2000:]}"
    return sent


def watch_event(event: str, endpoint: str, version: str, **payload) -> dict:
    return {"event": event, "endpoint": endpoint, "model": MODEL, "version": version, "payload": payload}


def runs_of(api: str, deployment_id: str) -> list[dict]:
    body = {"deployments": {"id": {"any_": [deployment_id]}}, "sort": "EXPECTED_START_TIME_ASC"}
    return httpx.post(f"{api}/flow_runs/filter", json=body, timeout=10).json()

# The nightly gate's decisions, sent by its own code (emit_champion_decision) from a process of their own.
DECIDE = """
import json, sys
from prefect.events.worker import EventsWorker
from tasks.watch.events import emit_champion_decision
ids = [emit_champion_decision(**d) for d in json.loads(sys.argv[1])]
EventsWorker.drain_all(timeout=30)
print(json.dumps(ids))
"""


def wait_until(what: str, probe, timeout_s: float, every_s: float = 0.5):
    """Poll `probe` until it returns something truthy; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s")


def seconds(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


@pytest.fixture(scope="module")
def automated(team_servers, deployed, cpu_worker, tmp_path_factory):
    """This test's nightly deployment (a copy of the registered `nightly` on the cpu pool), the webhook block
    pointing at a local receiver, and the automations deploy-flows makes for them; all removed at the end."""
    api = team_servers.prefect_api
    real = httpx.get(f"{api}/deployments/name/eagle3-nightly/nightly", timeout=10).json()
    folder = tmp_path_factory.mktemp("automations")
    config = folder / "nightly.yaml"
    config.write_text(CONFIG.format(runs=folder / "runs", model=MODEL, mlflow=team_servers.mlflow))
    prefect_file = folder / "prefect.yaml"
    prefect_file.write_text(json.dumps({"deployments": [{
        "name": NAME, "entrypoint": real["entrypoint"], "parameters": {"config_path": str(config)}}]}))
    limit = real["global_concurrency_limit"]["limit"]
    created = httpx.post(f"{api}/deployments/", timeout=10, json={
        "name": NAME, "flow_id": real["flow_id"], "entrypoint": real["entrypoint"], "pull_steps": real["pull_steps"],
        "parameter_openapi_schema": real["parameter_openapi_schema"], "enforce_parameter_schema": True,
        "parameters": {"config_path": str(config)}, "work_pool_name": "cpu", "work_queue_name": "default",
        "concurrency_limit": limit, "concurrency_options": real["concurrency_options"]})
    assert created.status_code in (200, 201), created.text
    receiver = Receiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    with temporary_settings({PREFECT_API_URL: api}):
        from prefect.client.orchestration import get_client

        block_id = ensure_webhook_block(f"http://127.0.0.1:{receiver.server_port}/hook")
        with get_client(sync_client=True) as client:
            nightlies = nightly_deployments(client, prefect_file, REPO)
        assert [(n.name, n.model, n.cooldown_s) for n in nightlies] == [(NAME, MODEL, 3600.0)]
        specs = automation_specs(nightlies, block_id)
        ensure_automations(specs)
    # The model's config is broken after deploy-flows (a typo): every nightly run of it fails at once, on the worker.
    config.write_text(config.read_text() + "nightly:\n  rounds_typo: 3\n")
    try:
        yield {"api": api, "deployment": created.json(), "receiver": receiver, "env": team_servers.env,
               "worker_log": cpu_worker}
    finally:
        receiver.shutdown()
        receiver.server_close()
        with temporary_settings({PREFECT_API_URL: api}):
            for spec in specs:
                from prefect.automations import Automation

                Automation.read(name=spec.name).delete()


def test_a_drift_starts_the_nightly_once_and_its_failure_is_one_notification(automated):
    api, deployment, receiver = automated["api"], automated["deployment"], automated["receiver"]
    assert deployment["concurrency_options"]["collision_strategy"] == "CANCEL_NEW"  # copied from infra/prefect.yaml
    # (a) a worse draft behind two servers of the fleet: one look sends a drift and a draft change, the other a drift
    sent = emit_events(automated["env"], [
        watch_event(DRIFT, "http://127.0.0.1:31001", "7", accept_length=[1.4, 1.3], lower=2.1),
        watch_event(CHANGED, "http://127.0.0.1:31001", "7", changes={"draft_sha256": ["aa", "bb"]}),
        watch_event(DRIFT, "http://127.0.0.1:31002", "7", accept_length=[1.5, 1.2], lower=2.1),
        # then a server that stops answering: its notification says the events before it were evaluated
        watch_event(UNREACHABLE, "http://127.0.0.1:31003", "7", error="connection refused")])
    first = wait_until("a nightly run started by the drift automation", lambda: runs_of(api, deployment["id"]), 60)[0]
    assert first["created_by"] and first["created_by"]["type"] == "AUTOMATION", first["created_by"]
    wait_until("the unreachable server's notification", lambda: receiver.naming("31003"), 60)
    ended = wait_until("the nightly run(s) to end on the worker", lambda: [
        r for r in [runs_of(api, deployment["id"])] if all(x["state"]["type"] in FINAL for x in r)], 180)[0]
    # The cooldown window: the three events of version 7 made one run (without it, three were made and the
    # deployment's concurrency limit cancelled two of them).
    assert len(ended) == 1, [(r["state"]["name"], r["state"]["message"]) for r in ended]
    run = ended[0]
    assert run["state"]["type"] == "FAILED", run["state"]
    assert "rounds_typo" in run["state"]["message"] or "rounds_typo" in automated["worker_log"].read_text()
    # (f) the failed nightly: one notification, naming the run
    failed = wait_until("the failed nightly's notification", lambda: receiver.naming(first["id"]), 60)
    assert "Failed" in failed[0]["subject"] and failed[0]["source"] == "eagleops-oncall", failed[0]
    # Nothing else was on its way: the unreachable server's notification came from an event sent after the three,
    # and the run has since lived its whole life.
    assert [r["id"] for r in runs_of(api, deployment["id"])] == [first["id"]]
    assert len(receiver.naming(first["id"])) == 1 and len(receiver.naming("31003")) == 1
    print(f"\nautomation latency: event -> nightly run created {seconds(first['created']) - sent[0]['at']:.1f} s, "
          f"-> running {seconds(run['start_time']) - sent[0]['at']:.1f} s, -> failed-notification "
          f"{failed[0]['at'] - sent[0]['at']:.1f} s; notifications {len(receiver.received)}")


def test_a_drift_while_a_nightly_runs_starts_no_second_one(automated):
    """A nightly holds the deployment's slot (PENDING, as a worker sets it); a drift of another version (its own
    cooldown window) makes a run, and the worker's attempt to start it is answered Cancelled."""
    api, deployment, receiver = automated["api"], automated["deployment"], automated["receiver"]
    later = datetime.fromtimestamp(time.time() + 3600).astimezone().isoformat()  # no worker picks it up itself
    holder = httpx.post(f"{api}/deployments/{deployment['id']}/create_flow_run", timeout=10,
                        json={"state": {"type": "SCHEDULED", "state_details": {"scheduled_time": later}}}).json()
    before = {r["id"] for r in runs_of(api, deployment["id"])}
    try:
        taken = httpx.post(f"{api}/flow_runs/{holder['id']}/set_state", json={"state": {"type": "PENDING"}},
                           timeout=10).json()
        assert taken["status"] == "ACCEPT", taken
        slot = httpx.get(f"{api}/deployments/{deployment['id']}", timeout=10).json()["global_concurrency_limit"]
        assert (slot["limit"], slot["active_slots"]) == (1, 1)
        emit_events(automated["env"], [watch_event(DRIFT, "http://127.0.0.1:31001", "8", accept_length=[1.1],
                                                   lower=2.0)])
        new = wait_until("a run for version 8's drift", lambda: [
            r for r in runs_of(api, deployment["id"]) if r["id"] not in before], 60)
        assert len(new) == 1, [(r["name"], r["state"]["type"]) for r in new]
        # The worker asks to start it; the server answers Cancelled (ENQUEUE would answer AwaitingConcurrencySlot).
        ended = wait_until("the worker's attempt at version 8's run", lambda: [
            run for run in [httpx.get(f"{api}/flow_runs/{new[0]['id']}", timeout=10).json()]
            if run["state"]["type"] != "SCHEDULED" or run["state"]["name"] != "Scheduled"], 60)[0]
        assert ended["state"]["type"] == "CANCELLED", (ended["state"], automated["worker_log"].read_text()[-2000:])
        assert "concurrency limit" in ended["state"]["message"]
        history = httpx.get(f"{api}/flow_run_states/", params={"flow_run_id": new[0]["id"]}, timeout=10).json()
        assert "RUNNING" not in [s["type"] for s in history], history  # it never ran
    finally:
        done = httpx.post(f"{api}/flow_runs/{holder['id']}/set_state", json={"state": {"type": "CANCELLED"}},
                          timeout=10).json()
    assert done["status"] == "ACCEPT", done
    slot = httpx.get(f"{api}/deployments/{deployment['id']}", timeout=10).json()["global_concurrency_limit"]
    assert slot["active_slots"] == 0  # the holder's end gave the slot back
    assert receiver.naming(new[0]["id"]) == [] and receiver.naming(holder["id"]) == []  # cancelled: no page


def test_each_champion_decision_is_one_notification_and_starts_nothing(automated):
    api, deployment, receiver = automated["api"], automated["deployment"], automated["receiver"]
    before = {r["id"] for r in runs_of(api, deployment["id"])}
    decisions = [
        {"model": MODEL, "challenger": "21", "champion_before": "20", "promoted": True,
         "reason": "accept length +31% (95% bounds +12..+50%)"},
        {"model": MODEL, "challenger": "22", "champion_before": "21", "promoted": False,
         "reason": "tok/s -4% below the margin"}]
    done = subprocess.run([sys.executable, "-c", DECIDE, json.dumps(decisions)], cwd=REPO, env=automated["env"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and all(json.loads(done.stdout.strip().splitlines()[-1])), done.stderr[-3000:]
    promoted = wait_until("the promotion's notification", lambda: receiver.naming("eagleops.champion.promoted"), 60)
    kept = wait_until("the kept champion's notification", lambda: receiver.naming("eagleops.champion.kept"), 60)
    time.sleep(3)  # a second notification of either would arrive as soon as the first did
    assert len(receiver.naming("eagleops.champion.promoted")) == 1
    assert len(receiver.naming("eagleops.champion.kept")) == 1
    assert f"eagleops.model.{MODEL}" in promoted[0]["body"] and "+31%" in promoted[0]["body"], promoted[0]
    assert "below the margin" in kept[0]["body"] and kept[0]["source"] == "eagleops-oncall", kept[0]
    assert {r["id"] for r in runs_of(api, deployment["id"])} == before  # a decision is news, not a retrain
