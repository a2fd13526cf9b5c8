"""The served-traffic story end to end on CPU, with the team setup (Prefect server + worker, MLflow server on
PostgreSQL) and the reference server:

* day 1: a first draft (a tiny run on builtin prompts) is deployed by eagleops' deploy stage with
  `deploy.dump_requests` on (the experiment flow's stages, reused up to the deploy, then this module's traffic
  while it serves, then the flow's teardown); it serves day-1 traffic, one kind of prompt built here (Python
  stdlib source code), and the server dumps what it answered: per prompt a probe cut by its length (left out
  by the reader) and the greedy answer ending on a stop token the client chose;
* nightly 1, a deployment run of `eagle3-nightly` through a real gpu-pool worker (the config on the worker's
  disk): trains from those dumps and its draft becomes the first champion;
* day 2: the champion is deployed the same way and the traffic shifts (stdlib prose: docstrings);
* nightly 2 captures only day 2's samples (captured tokens = day-2 tokens, counted here from the server's
  answers and, apart, from the dump files read by this module's own unpickler), starts from the champion, and
  its challenger beats the champion on held-out day-2 prompts by the gate's bound: promoted (champion v2,
  previous v1);
* nightly 3, no new traffic: "no new traffic" in MLflow, Prefect (state message, artifact) and the log,
  nothing trained, Completed.

The target is the test-size tiny target trained 300 steps instead of 10 (at 10 it is near uniform and
answers every prompt with one repeated token: nothing to learn). It answers code and prose much alike, so
night 2's gain on day-2 prompts comes from refining the champion on the new day's samples (20 optimizer steps a
night), not from a change in what the target says; the figures show how much.

One module fixture runs the story once; each test reads what it needs. The figures (tokens captured per
night, accept length and tok/s of champion vs challenger on day-2 prompts, GPU-hours per night) are printed
and written to story.json in the story's tmp folder. The reference server holds no GPU: every GPU-hours
figure here is 0, honestly. The gate's tok/s margin is -0.95 (CPU timing noise on a shared box must not
decide); the decision stands on accept length, which greedy decoding makes deterministic, so "beats by the
gate's bound" means the lower confidence bound of the accept-length gain is above 0.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import json
import pickle
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch
from mlflow.tracking import MlflowClient
from prefect import flow
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL, temporary_settings
from safetensors import safe_open

from eagle3.serving.bench_prompts import render_prompts
from flows.experiment import eagle3_experiment
from tasks.config.load import load_experiment
from tasks.hosts.teardown import teardown_run
from tasks.rundir import RunDirectory
from tasks.runner.pipeline import Pipeline
from tasks.stages.data.stage import generate_data
from tasks.stages.deploy import deploy_server
from tasks.stages.environment import check_environment
from tasks.stages.export import export_checkpoint
from tasks.stages.gate.nightly import draft_identity
from tasks.stages.train.stage import train_draft
from tests.helpers import TEST_TARGET_YAML, free_port, reference_servers_alive, stop_group
from tests.team_servers import REPO, wait_for_run

pytestmark = pytest.mark.slow

MODEL = "served-story-draft"
EXPERIMENT = "servedstory"
PER_DAY = 12  # prompts a day: a probe and an answer each, 2 x PER_DAY requests = the dump threshold (a file a day)
MAX_LENGTH = 128
MAX_NEW_TOKENS = 40
# The tiny target trained for 300 steps (7 s here): at TEST_TARGET_YAML's 10 it is near uniform and answers every
# prompt with one repeated token, so no traffic could teach a draft anything. Its own greedy continuations are
# what a served draft must guess.
TARGET = TEST_TARGET_YAML.replace("train_steps: 10", "train_steps: 300")
GATE_PROMPTS = 4

FIRST_DRAFT = """\
experiment: {experiment}-first
runs_root: {runs}
{target}data:
  num_samples: 8
  max_length: {max_length}
  validation_fraction: 0.25
  regenerate: {{max_new_tokens: 16}}
  draft_vocab_size: 64
train: {{ttt_steps: 3, max_steps: 2, batch_size: 4, lr: 0.003, eval_every: 1000, checkpoint_every: 1000}}
export: {{formats: [sglang], dtype: float32}}
deploy:
  server: reference
  port: {port}
  speculative: {{num_steps: 3, eagle_topk: 1, num_draft_tokens: 4}}
  startup_timeout_s: 240
  baseline: false
  dump_requests: {{enabled: true, folder: {dumps}, threshold: {threshold}}}
tracking: {{uri: {mlflow}}}
"""
NIGHTLY = """\
experiment: {experiment}
runs_root: {runs}
{target}data:
  source: served
  served: {{dumps: {dumps}, replay_fraction: 0.5, min_new_samples: 1}}
  num_samples: 1000
  max_length: {max_length}
  validation_fraction: 0.25
  draft_vocab_size: 64
  hidden_states_dtype: float32
train: {{ttt_steps: 3, epochs: 100, max_steps: {steps}, batch_size: 4, lr: 0.01, eval_every: 1000,
         checkpoint_every: 1000}}
export: {{formats: [sglang], dtype: float32, registered_model: {model}}}
deploy:
  server: reference
  port: {port}
  speculative: {{num_steps: 3, eagle_topk: 1, num_draft_tokens: 4}}
  startup_timeout_s: 240
  baseline: false
  dump_requests: {{enabled: true, folder: {dumps}, threshold: {threshold}}}
bench: {{prompts: {gate_prompts}, num_prompts: {num_gate}, max_new_tokens: 48, warmup_runs: 1, timed_runs: 1}}
tracking: {{uri: {mlflow}}}
nightly: {{min_tok_s_gain: -0.95, accept_length_tolerance: 0.0, min_accept_length: 1.0, rounds: 2}}
"""
TRAIN_STEPS = 20


# ------------------------------------------------------------------ traffic, built locally


def code_prompts(n: int) -> list[str]:
    """Python standard-library source: each prompt the first lines of one function."""
    import argparse
    import textwrap

    found = []
    for module in (textwrap, argparse):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.FunctionDef) and len(found) < n:
                lines = ast.get_source_segment(inspect.getsource(module), node).splitlines()[:3]
                found.append("Continue:\n" + "\n".join(lines)[:40])
    assert len(found) == n, f"only {len(found)} code prompts"
    return found


def prose_prompts(n: int) -> list[str]:
    """Python standard-library prose: the first sentence of docstrings."""
    import collections
    import json as json_module
    import string

    found = []
    for module in (collections, string, json_module):
        for obj in [module, *(getattr(module, k) for k in sorted(vars(module)) if not k.startswith("_"))]:
            doc = inspect.getdoc(obj) if callable(obj) or inspect.ismodule(obj) else None
            if doc and len(found) < n:
                sentence = " ".join(doc.split())[:40]
                if sentence not in found and not sentence.startswith((">>>", "Continue")):
                    found.append("Explain: " + sentence)
    assert len(found) == n, f"only {len(found)} prose prompts"
    return found


def send_day(url: str, prompt_ids: list[list[int]], seed: int) -> list[dict]:
    """One day's traffic, one request after another, as a client that wants the target's greedy answer cut at a
    token of its choosing: a probe (MAX_NEW_TOKENS, no stop: the reader leaves it out as cut by length), then the
    answer stopping on the probe's first token from position 12 on that did not occur before it. A probe that only
    repeats itself from there on (the tiny target falls into one token on some prompts, which ones depends on the
    CPU's float rounding while it trains) stops on its token at position 12, at that token's first occurrence."""
    answers = []
    for n, ids in enumerate(prompt_ids):
        greedy = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS}
        probe = httpx.post(f"{url}/generate", json={"rid": f"probe{seed}-{n}", "input_ids": ids,
                                                    "sampling_params": {**greedy, "ignore_eos": True}}, timeout=120)
        assert probe.status_code == 200, probe.text
        said = probe.json()["output_ids"]
        stop = next((t for i, t in enumerate(said) if i >= 12 and t not in said[:i]), said[12])
        body = {"rid": f"day{seed}-{n}", "input_ids": ids, "sampling_params": {**greedy, "stop_token_ids": [stop]}}
        resp = httpx.post(f"{url}/generate", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        answers.append({"prompt_ids": ids, "output_ids": out["output_ids"],
                        "finish": out["meta_info"]["finish_reason"]["type"]})
    return answers


def clean_tokens(answers: list[dict]) -> int:
    """Tokens of the training samples a day's answers make: clean stops only, prompt + output, cut at MAX_LENGTH."""
    return sum(min(len(a["prompt_ids"]) + len(a["output_ids"]), MAX_LENGTH) for a in answers if a["finish"] == "stop")


class _Stub:
    """Stands in for SGLang's GenerateReqInput: pickle's BUILD sets its attributes."""


class _DumpUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module.startswith("sglang"):
            return _Stub
        return super().find_class(module, name)


def tokens_in_dump(path: Path) -> int:
    """This module's own reading of one dump file: clean stops' prompt + output ids, cut at MAX_LENGTH."""
    with path.open("rb") as f:
        payload = _DumpUnpickler(f).load()
    total = 0
    for obj, out, *_ in payload["requests"]:
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            total += min(len(obj.input_ids) + len(out["output_ids"]), MAX_LENGTH)
    return total


# ------------------------------------------------------------------ a day of serving


@flow(name="served-story-day")
def serve_a_day(config_path: str, run_dir: str, prompts: list[str], seed: int) -> dict:
    """The experiment flow's deploy stage (deploy.dump_requests on) on `run_dir`'s exported draft, the day's
    traffic while it serves, then the flow's own teardown; -> the answers and the deploy summary."""
    cfg = load_experiment(config_path)
    pipeline = Pipeline(cfg, config_path, ["deploy_server"], run_dir, flow_run_id=str(flow_run.id))
    try:
        for stage in (check_environment, generate_data, train_draft, export_checkpoint):
            pipeline.run_stage(stage)  # not selected: their completed attempts are reused, as the experiment flow does
        deployed = pipeline.run_stage(deploy_server)
        target_dir = RunDirectory.open(run_dir).manifest["stages"]["export_checkpoint"]["outputs"]["target_dir"]
        ids = render_prompts([[{"role": "user", "content": p}] for p in prompts], target_dir)
        answers = send_day(deployed["outputs"]["local_url"], ids, seed)
        folder = Path(deployed["dump_requests"]["folder"])
        deadline = time.monotonic() + 60
        while not _written_after(folder, deployed) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _written_after(folder, deployed), f"no dump file in {folder} 60 s after the day's last answer"
    finally:
        teardown_run(pipeline.run.path, cfg)
    pipeline.finish("FINISHED")
    pipeline.release_folder()  # the run folder is free for the nightly that trains on this day
    return {"answers": answers, "deploy": {k: deployed[k] for k in ("dump_requests", "placement")}}


def _written_after(folder: Path, deployed: dict) -> list[Path]:
    launched = deployed["server"]["launched_at"]
    return [p for p in folder.glob("*.pkl") if p.stat().st_mtime >= launched]


# ------------------------------------------------------------------ the worker and the nightly runs


@contextlib.contextmanager
def gpu_worker(team_servers, log_path: Path):
    """infra/prefect-worker.sh gpu gpu-1: the worker the nightly deployment's runs go to."""
    env = {**team_servers.env, "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "1"}
    with open(log_path, "w") as log:
        worker = subprocess.Popen(["bash", str(REPO / "infra/prefect-worker.sh"), "gpu", "gpu-1"], env=env,
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield log_path
    finally:
        stop_group(worker.pid, grace_s=5, leader=worker)


def run_nightly(api: str, config: Path, worker_log: Path) -> dict:
    """A run of the nightly deployment with the config on the worker's disk, as the UI's Custom run starts it."""
    found = httpx.get(f"{api}/deployments/name/eagle3-nightly/nightly", timeout=10)
    assert found.status_code == 200, found.text
    created = httpx.post(f"{api}/deployments/{found.json()['id']}/create_flow_run", timeout=30,
                         json={"state": {"type": "SCHEDULED", "message": "served story"},
                               "parameters": {"config_path": str(config)}})
    assert created.status_code == 201, created.text
    return wait_for_run(api, created.json()["id"], worker_log, timeout_s=600)


def new_parent_run(client: MlflowClient, before: set[str]) -> dict:
    """The one experiment parent run of EXPERIMENT that appeared since `before`: the night's."""
    experiment = client.get_experiment_by_name(EXPERIMENT)
    parents = [r for r in client.search_runs([experiment.experiment_id], "tags.`eagleops.kind` = 'experiment'")
               if r.info.run_id not in before]
    assert len(parents) == 1, [(r.info.run_id, r.info.run_name) for r in parents]
    return parents[0]


def parent_ids(client: MlflowClient) -> set[str]:
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is None:
        return set()
    return {r.info.run_id for r in client.search_runs([experiment.experiment_id], "tags.`eagleops.kind` = 'experiment'")}


def night_figures(client: MlflowClient, parent, flow_run: dict) -> dict:
    run_dir = Path(parent.data.tags["eagleops.run_dir"])
    manifest = RunDirectory.open(run_dir).manifest
    data = manifest["stages"]["generate_data"]
    cache = data["summary"]["served"]["cache"]
    fresh = client.get_run(parent.info.run_id).data
    gate_file = run_dir / "nightly_gate" / "gate.json"
    return {"flow_run": flow_run, "run_dir": str(run_dir), "manifest": manifest, "cache": cache,
            "parent_run_id": parent.info.run_id, "gpu_hours_total": fresh.metrics.get("gpu_hours_total"),
            "data_run_id": data["mlflow_run_id"],
            "gate": json.loads(gate_file.read_text()) if gate_file.is_file() else None,
            "outcome": json.loads((run_dir / "nightly_gate" / "outcome.json").read_text())
            if (run_dir / "nightly_gate" / "outcome.json").is_file() else None}


def write_gate_prompts(path: Path, prompts: list[str]) -> None:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))


@pytest.fixture(scope="module")
def story(team_servers, deployed, tmp_path_factory):
    root = tmp_path_factory.mktemp("served-story")
    api, client = team_servers.prefect_api, MlflowClient(team_servers.mlflow)
    dumps, gate_prompts = root / "dumps", root / "gate-prompts.jsonl"
    code, prose = code_prompts(PER_DAY + GATE_PROMPTS), prose_prompts(PER_DAY + GATE_PROMPTS)
    fields = dict(experiment=EXPERIMENT, runs=root / "runs", target=TARGET, max_length=MAX_LENGTH,
                  port=free_port(), dumps=dumps, threshold=2 * PER_DAY, mlflow=team_servers.mlflow, model=MODEL,
                  steps=TRAIN_STEPS, gate_prompts=gate_prompts, num_gate=GATE_PROMPTS)
    first_config, nightly_config = root / "first-draft.yaml", root / "nightly.yaml"
    first_config.write_text(FIRST_DRAFT.format(**fields))
    nightly_config.write_text(NIGHTLY.format(**fields))
    started = time.monotonic()
    with temporary_settings({PREFECT_API_URL: api}), gpu_worker(team_servers, root / "worker.log") as worker_log:
        # day 1: a first draft, deployed with dumping on, answers code
        first = eagle3_experiment(str(first_config), stages=["generate_data", "train_draft", "export_checkpoint"])
        day1 = serve_a_day(str(first_config), first["run_dir"], code[:PER_DAY], 1)
        write_gate_prompts(gate_prompts, code[PER_DAY:])  # the team's held-out prompts of today's traffic
        before = parent_ids(client)
        run1 = run_nightly(api, nightly_config, worker_log)
        night1 = night_figures(client, new_parent_run(client, before), run1)
        # day 2: the champion (nightly 1's export) deployed with dumping on, the traffic shifts to prose
        day2 = serve_a_day(str(nightly_config), night1["run_dir"], prose[:PER_DAY], 2)
        write_gate_prompts(gate_prompts, prose[PER_DAY:])
        before = parent_ids(client)
        run2 = run_nightly(api, nightly_config, worker_log)
        night2 = night_figures(client, new_parent_run(client, before), run2)
        # nightly 3: nothing served since
        before = parent_ids(client)
        run3 = run_nightly(api, nightly_config, worker_log)
        night3 = night_figures(client, new_parent_run(client, before), run3)
        elapsed = time.monotonic() - started
    result = {"root": root, "api": api, "client": client, "worker_log": worker_log, "dumps": dumps,
              "day1": day1, "day2": day2, "nights": [night1, night2, night3], "elapsed_s": elapsed,
              "first_run_dir": first["run_dir"]}
    result["figures"] = figures_of(result)
    (root / "story.json").write_text(json.dumps(result["figures"], indent=2))
    print("\nserved story figures:\n" + json.dumps(result["figures"], indent=2))
    return result


def figures_of(story: dict) -> dict:
    nights = story["nights"]
    figures = {"elapsed_s": round(story["elapsed_s"], 1),
               "day_tokens": {"day1": clean_tokens(story["day1"]["answers"]),
                              "day2": clean_tokens(story["day2"]["answers"])},
               "nights": []}
    for n, night in enumerate(nights, 1):
        entry = {"night": n, "state": night["flow_run"]["state"]["type"],
                 "message": night["flow_run"]["state"].get("message"),
                 "tokens_captured": night["cache"].get("tokens_captured"),
                 "new_samples": night["cache"].get("new_samples"), "known_samples": night["cache"].get("known_samples"),
                 "replayed_samples": night["cache"].get("replayed_samples"),
                 "gpu_hours_total": night["gpu_hours_total"]}
        if night["gate"]:
            entry["gate"] = {role: [{"concurrency": r["concurrency"], "accept_length": r["accept_length"],
                                     "tok_s_median": r["tok_s_median"]} for r in night["gate"]["rows"][label]]
                             for role, label in night["gate"]["labels"].items()}
            entry["decision"] = night["gate"]["reason"]
        figures["nights"].append(entry)
    return figures


# ------------------------------------------------------------------ the tests


def test_each_day_was_served_by_the_deployed_draft_and_dumped_where_the_nightly_reads(story):
    dumps = story["dumps"]
    for day in ("day1", "day2"):
        recorded = story[day]["deploy"]["dump_requests"]
        assert recorded["folder"] == str(dumps) and recorded["threshold"] == 2 * PER_DAY
        finishes = [a["finish"] for a in story[day]["answers"]]
        assert finishes.count("stop") >= PER_DAY - 2, finishes  # nearly every answer is a training sample
    files = sorted(dumps.glob("*.pkl"))
    assert len(files) == 2, files  # one file a day (threshold = the day's requests)
    by_file = [tokens_in_dump(p) for p in files]
    assert by_file == [clean_tokens(story["day1"]["answers"]), clean_tokens(story["day2"]["answers"])]
    assert not reference_servers_alive(str(story["root"]))


def test_nightly_1_trains_the_first_champion_from_day_1s_dumps(story):
    night = story["nights"][0]
    assert night["flow_run"]["state"]["type"] == "COMPLETED", story["worker_log"].read_text()[-3000:]
    assert night["cache"]["tokens_captured"] == clean_tokens(story["day1"]["answers"])
    assert night["cache"]["known_samples"] == 0
    assert night["manifest"]["stages"]["train_draft"]["status"] == "completed"
    assert night["outcome"]["promoted"] is True and night["gate"]["reason"].startswith("promoted: first champion")
    assert night["outcome"]["challenger"] == "1" and night["outcome"]["champion_before"] is None
    tags = story["client"].get_model_version(MODEL, "1").tags
    assert tags["eagleops.gate"].startswith("promoted: first champion")


def test_day_2_served_the_champion(story):
    """The draft deployed on day 2 is nightly 1's export, the weights the registry's version 1 records."""
    night1 = story["nights"][0]
    sglang_dir = night1["manifest"]["stages"]["export_checkpoint"]["outputs"]["sglang_dir"]
    tags = story["client"].get_model_version(MODEL, "1").tags
    assert draft_identity(sglang_dir)["weights"] == tags["eagleops.gate.challenger_weights_sha256"]
    placed = story["day2"]["deploy"]["placement"]
    assert Path(placed["draft_path"]).name == Path(sglang_dir).name or placed["draft_path"] == sglang_dir


def test_nightly_2_captures_only_day_2_and_its_challenger_beats_the_champion_on_day_2_prompts(story):
    night = story["nights"][1]
    assert night["flow_run"]["state"]["type"] == "COMPLETED", story["worker_log"].read_text()[-3000:]
    day2 = clean_tokens(story["day2"]["answers"])
    assert night["cache"]["tokens_captured"] == day2  # captured tokens = day-2 tokens
    day1_samples = sum(a["finish"] == "stop" for a in story["day1"]["answers"])
    assert night["cache"]["known_samples"] == day1_samples
    assert night["cache"]["new_samples"] == sum(a["finish"] == "stop" for a in story["day2"]["answers"])
    # trained from the champion (nightly.start_from's default on served traffic), keeping its draft vocabulary
    entry = night["manifest"]["stages"]["train_draft"]
    attempt = next(a for a in entry["attempts"] if a["attempt"] == entry["current_attempt"])
    assert entry["status"] == "completed"
    assert Path(attempt["inputs"]["config"]["train.init_checkpoint"]).name == f"{MODEL}-v1"
    exports = [Path(n["manifest"]["stages"]["export_checkpoint"]["outputs"]["sglang_dir"]) / "model.safetensors"
               for n in story["nights"][:2]]
    d2t = [safe_open(str(path), framework="pt").get_tensor("d2t") for path in exports]
    assert torch.equal(d2t[0], d2t[1])
    gate = night["gate"]
    assert set(gate["labels"]) == {"champion", "challenger"}
    (level,) = gate["comparisons"]
    assert level["accept_length"] > level["champion_accept_length"], level
    assert level["accept_length_gain_low"] > 0, level  # the gate's bound, not a difference of medians
    assert gate["promote"] is True and gate["reason"].startswith("promoted:"), gate["reason"]
    client = story["client"]
    assert client.get_model_version_by_alias(MODEL, "champion").version == "2"
    assert client.get_model_version_by_alias(MODEL, "previous").version == "1"


def test_nightly_3_without_new_traffic_records_so_trains_nothing_and_completes(story):
    night, api = story["nights"][2], story["api"]
    state = night["flow_run"]["state"]
    assert state["type"] == "COMPLETED" and state["message"].startswith("no new traffic: 0 new samples"), state
    stages = night["manifest"]["stages"]
    assert stages["generate_data"]["status"] == "completed"
    for name in ("train_draft", "export_checkpoint"):
        assert stages[name]["status"] == "skipped" and stages[name]["reason"].startswith("no new traffic"), stages
    assert night["cache"]["tokens_captured"] == 0 and night["gate"] is None
    client = story["client"]
    assert client.get_run(night["data_run_id"]).data.tags.get("eagleops.no_new_traffic") == "true"
    artifacts = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"key": {"any_": ["no-new-traffic"]}}},
                           timeout=10).json()
    assert len(artifacts) == 1 and "no new traffic" in artifacts[0]["description"]
    assert "no new traffic: 0 new samples" in story["worker_log"].read_text()
    assert client.get_model_version_by_alias(MODEL, "champion").version == "2"
    assert [v.version for v in client.search_model_versions(f"name = '{MODEL}'")].count("3") == 0


def test_the_figures_are_recorded(story):
    figures = json.loads((story["root"] / "story.json").read_text())
    assert [n["tokens_captured"] for n in figures["nights"]] == \
        [figures["day_tokens"]["day1"], figures["day_tokens"]["day2"], 0]
    for night in figures["nights"][:2]:
        assert night["gpu_hours_total"] == 0  # the reference server and CPU training hold no GPU
