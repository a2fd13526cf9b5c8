"""data.source: served through the flow: the reference server serves the run's tiny target with dumping on
(/configure_logging, as SGLang), then generate_data -> train_draft -> export_checkpoint train a draft on
those dumps; the data summary holds the served figures (window, exclusions, sampling settings, files)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from eagle3.config import TinyTargetConfig
from eagle3.data.tiny_target import build_tiny_target
from eagle3.serving.bench_prompts import render_prompts
from flows.experiment import eagle3_experiment
from tests.eagle3.served_traffic import build_random_draft, post, reference_server, stopping_sampling
from tests.helpers import TEST_TARGET_YAML

CONFIG = """\
experiment: served
runs_root: {runs}
{target}
data:
  source: served
  served: {{dumps: {dumps}}}
  max_length: 128
  validation_fraction: 0.25
  draft_vocab_size: 64
  hidden_states_dtype: float32
train:
  ttt_steps: 2
  max_steps: 2
  batch_size: 2
  lr: 0.001
  eval_every: 2
  checkpoint_every: 2
  log_every: 1
export:
  formats: [sglang]
  dtype: float32
"""
PROMPTS = ["def add(a, b):", "class Point:", "import os", "for i in range(3):", "while True:"]


def serve_with_dumps(target_dir: Path, folder: Path, work: Path) -> dict[str, list[int]]:
    """Chat prompts answered by the reference server with dumping on, plus one answer cut by its length;
    returns rid -> prompt + output ids of the clean answers."""
    draft = build_random_draft(target_dir, work / "draft")
    ids = render_prompts([[{"role": "user", "content": p}] for p in PROMPTS], target_dir)
    with reference_server(target_dir, draft) as (url, scheduler):
        sampling = [stopping_sampling(url, {"input_ids": i}) for i in ids]
        resp = post(url, "/configure_logging", {"dump_requests_folder": str(folder),
                                                "dump_requests_threshold": len(ids) + 1})
        assert resp.status_code == 200, resp.text
        served = {}
        for n, (prompt, params) in enumerate(zip(ids, sampling, strict=True)):
            out = post(url, "/generate", {"rid": f"p{n}", "input_ids": prompt, "sampling_params": params}).json()
            served[f"p{n}"] = prompt + out["output_ids"]
        post(url, "/generate", {"rid": "cut", "input_ids": ids[0], "sampling_params": {"max_new_tokens": 2,
                                                                                        "ignore_eos": True}})
        deadline = time.monotonic() + 30
        while not list(folder.glob("*.pkl")) and time.monotonic() < deadline:
            scheduler.dumps.wait(timeout=30)
            time.sleep(0.05)
    assert len(list(folder.glob("*.pkl"))) == 1
    return served


@pytest.mark.slow
def test_a_draft_trains_on_served_dumps_through_the_flow(prefect_harness, tmp_path):
    runs, dumps = tmp_path / "runs", tmp_path / "dumps"
    tiny = TinyTargetConfig(**yaml.safe_load(TEST_TARGET_YAML)["target"]["tiny"])
    target_dir = build_tiny_target(tiny, runs.resolve() / "cache" / "targets")  # the one the flow finds
    served = serve_with_dumps(target_dir, dumps, tmp_path)
    config = tmp_path / "served.yaml"
    config.write_text(CONFIG.format(runs=runs, target=TEST_TARGET_YAML.strip(), dumps=dumps))

    result = eagle3_experiment(str(config), stages=["generate_data", "train_draft", "export_checkpoint"])

    run_dir = Path(result["run_dir"])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert all(manifest["stages"][s]["status"] == "completed"
               for s in ("generate_data", "train_draft", "export_checkpoint")), manifest["stages"]
    summary = json.loads((run_dir / "generate_data" / "attempt-1" / "summary.json").read_text())
    record = summary["served"]
    assert summary["source"] == "served" and record["num_samples"] == len(PROMPTS)
    assert {k: v for k, v in record["excluded"].items() if v} == {"length": 1}
    assert record["files_read"] == [p.name for p in dumps.glob("*.pkl")] and not record["files_refused"]
    assert sum(s["count"] for s in record["sampling_params"]) == len(PROMPTS)
    assert sum(summary["num_samples"].values()) == len(PROMPTS)
    assert sum(summary["num_tokens"].values()) == sum(len(ids) for ids in served.values())
    samples = [json.loads(line) for line in (run_dir / summary["paths"]["samples"]).read_text().splitlines()]
    assert {s["served"]["rid"]: s["input_ids"] for s in samples} == served
