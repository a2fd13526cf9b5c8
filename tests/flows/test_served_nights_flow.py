"""Served nights through the flows, the data stage on a data host over a real sshd on 127.0.0.1 and training
there (train.nodes: [that host]): night 1 captures day 1's traffic into the host's capture cache; night 2, once
day 2's dump came, captures day 2's samples only (its captured tokens counted here from the dumps written) and
trains on them plus the replay fraction of day 1's, read from the cache; night 3 (the nightly flow) has no new
traffic: it records so, trains, exports and gates nothing and ends Completed.

One module fixture runs the three nights once; each test reads what it needs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from prefect.artifacts import Artifact

from eagle3.data.capture_cache import sample_address
from eagle3.data.samples import read_samples
from flows.cli import nightly_outcome
from flows.experiment import eagle3_experiment
from flows.nightly import nightly_retrain
from tasks.rundir import RunDirectory
from tasks.stages.data.served import CACHE_FOLDER
from tests.eagle3.served_nights import day_of_traffic, tokens_of, write_dump
from tests.helpers import TEST_TARGET_YAML, free_port

pytestmark = pytest.mark.slow

MAX_LENGTH = 48
DAY1, DAY2 = day_of_traffic(11, 10), day_of_traffic(12, 6)
REPLAY = 0.5
CONFIG = """\
experiment: servednights
runs_root: {runs}
{target}data:
  host: data-ssh
  source: served
  served: {{dumps: {dumps}, replay_fraction: {replay}, min_new_samples: 1}}
  max_length: {max_length}
  validation_fraction: 0.2
  draft_vocab_size: 64
  hidden_states_dtype: float32
  shard_size: 4
train: {{ttt_steps: 2, max_steps: 2, batch_size: 2, lr: 0.001, eval_every: 2, checkpoint_every: 2, log_every: 1,
         nodes: [data-ssh], rendezvous: "127.0.0.1:{port}", num_workers: 0}}
export: {{formats: [sglang], dtype: float32, registered_model: served-nights-draft}}
bench: {{max_new_tokens: 16}}  # within data.max_length: the nightly's gate benchmarks (checked before it starts)
hosts:
  - {{name: data-ssh, address: 127.0.0.1, port: {ssh_port}, user: {user}, key_file: {key}, known_hosts: {known},
      workdir: {remote}, python: {python}}}
"""


@pytest.fixture(scope="module")
def nights(prefect_harness, sshd, tmp_path_factory):
    root = tmp_path_factory.mktemp("served-nights-flow")
    host = sshd.host_config()
    config = root / "served.yaml"
    config.write_text(CONFIG.format(
        runs=root / "runs", target=TEST_TARGET_YAML, dumps=root / "dumps", replay=REPLAY, max_length=MAX_LENGTH,
        port=free_port(), ssh_port=host.port, user=host.user, key=host.key_file, known=host.known_hosts,
        remote=root / "remote", python=sys.executable))
    stages = ["generate_data", "train_draft"]
    write_dump(root / "dumps", "day1", DAY1)
    first = eagle3_experiment(str(config), stages=stages)
    write_dump(root / "dumps", "day2", DAY2)
    second = eagle3_experiment(str(config), stages=stages)
    third = nightly_retrain(str(config), return_state=True)
    return root, first, second, third


def data_summary(result: dict) -> dict:
    return result["results"]["generate_data"]


def test_the_second_night_captures_only_the_new_days_samples(nights):
    root, first, second, _ = nights
    one, two = data_summary(first)["served"]["cache"], data_summary(second)["served"]["cache"]
    assert one["tokens_captured"] == tokens_of(DAY1, MAX_LENGTH) and one["new_samples"] == len(DAY1)
    assert two["tokens_captured"] == tokens_of(DAY2, MAX_LENGTH)  # captured tokens = day-2 tokens
    assert (two["new_samples"], two["known_samples"]) == (len(DAY2), len(DAY1))
    assert Path(two["dir"]).parent == root / "remote" / CACHE_FOLDER  # on the data host, under its workdir
    shards = [p for p in (root / "runs").rglob("*.safetensors") if p.name.startswith(("train-", "validation-"))]
    assert not shards  # no hidden state crossed to the orchestrator
    for result in (first, second):
        assert result["stages"]["train_draft"] == "completed", result["stages"]


def test_the_second_night_trains_on_its_new_samples_and_the_replay_fraction(nights):
    _, _, second, _ = nights
    summary = data_summary(second)
    record = summary["served"]["cache"]
    assert record["replay_pool"] == len(DAY1) and record["replayed_samples"] == round(REPLAY * len(DAY1))
    samples = read_samples(Path(summary["outputs"]["host_samples"]))
    day1 = {sample_address((p + o)[:MAX_LENGTH], ([0] * len(p) + [1] * len(o))[:MAX_LENGTH]) for p, o in DAY1}
    replayed = [s for s in samples if s.get("replayed")]
    assert len(replayed) == record["replayed_samples"] and {s["address"] for s in replayed} <= day1
    assert len(samples) == len(DAY2) + len(replayed)
    assert sum(summary["num_samples"].values()) == len(samples)
    manifest = json.loads((Path(summary["outputs"]["dataset_dir"]) / "hidden_states" / "manifest.json").read_text())
    listed = sum(e["num_samples"] for e in manifest["shards"])
    assert listed == len(samples) and all(Path(e["file"]).is_relative_to(record["dir"]) for e in manifest["shards"])


def test_a_night_without_new_traffic_trains_nothing_and_completes(nights):
    root, _, second, third = nights
    assert third.is_completed() and third.message.startswith("no new traffic: 0 new samples")
    result = third.result()
    assert result["no_new_traffic"] == third.message and result["promoted"] is False
    stages = RunDirectory.open(result["run_dir"]).manifest["stages"]
    assert stages["generate_data"]["status"] == "completed"
    for name in ("train_draft", "export_checkpoint"):
        assert stages[name]["status"] == "skipped" and stages[name]["reason"].startswith("no new traffic"), stages
    assert not (Path(result["run_dir"]) / "train_draft").exists()
    lines = nightly_outcome(result, "unused")
    assert lines[0].startswith("[yellow]no new traffic[/yellow]: 0 new samples") and "nothing trained" in lines[0]
    summary = json.loads((Path(result["run_dir"]) / "generate_data" / "attempt-1" / "summary.json").read_text())
    assert summary["metrics"]["served_no_new_traffic"] == 1 and summary["metrics"]["served_tokens_captured"] == 0
    assert Artifact.get("no-new-traffic") is not None
    assert data_summary(second)["served"]["cache"]["samples"] == summary["served"]["cache"]["samples"]
