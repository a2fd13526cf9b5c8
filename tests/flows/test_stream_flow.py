"""data.hidden_states: stream through the CLI, as a user meets it: `eagleops run` captures the train split
while training runs; the capture side is killed (-9) mid-run, the run fails in one line naming it, and
`eagleops run --run-dir` resumes: the shards it had written are used, not captured again, and nothing is
left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import TEST_TARGET_YAML

REPO = Path(__file__).resolve().parents[2]
CONFIG = TEST_TARGET_YAML.replace("{", "{{").replace("}", "}}") + """\
experiment: streamed
runs_root: {runs}
data:
  num_samples: 64
  max_length: 256
  validation_fraction: 0.2
  shard_size: 4
  regenerate: {{max_new_tokens: 48, batch_size: 16}}
  draft_vocab_size: 64
  hidden_states_dtype: float32
  hidden_states: stream
  stream: {{disk_budget_gb: 0.0025}}   # ~6 shards of ~0.4 MB; the whole stream is ~7 MB
train:
  ttt_steps: 3
  epochs: 2
  batch_size: 4
  lr: 0.003
  eval_every: 9
  checkpoint_every: 5
  log_every: 1
  num_workers: 0
"""


def eagleops(*args: str) -> subprocess.Popen:
    """The CLI in a subprocess against the test session's Prefect server."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "COLUMNS": "500"}
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], env=env, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def capture_sides(marker: str) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if "eagle3.training.streaming.producer" in " ".join(p.info["cmdline"] or []) and marker in " ".join(p.info["cmdline"])]


def kill_capture_side_when_it_has_written(runs: Path, shards: int, outcome: dict) -> None:
    """SIGKILL the capture side recorded in train_draft's stream.json once its manifest lists `shards` shards."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for record in runs.glob("streamed/*/train_draft/attempt-1/stream.json"):
            manifest = Path(json.loads(record.read_text())["stream_dir"]) / "manifest.json"
            listed = json.loads(manifest.read_text()).get("shards", []) if manifest.is_file() else []
            if len(listed) >= shards:
                pid = json.loads(record.read_text())["pid"]
                os.kill(pid, signal.SIGKILL)
                outcome["killed"] = pid
                return
        time.sleep(0.01)


@pytest.mark.slow
def test_a_killed_capture_side_fails_the_run_in_one_line_and_the_rerun_uses_its_shards(prefect_harness, tmp_path):
    runs = tmp_path / "runs"
    config = tmp_path / "streamed.yaml"
    config.write_text(CONFIG.format(runs=runs))
    outcome: dict = {}
    killer = threading.Thread(target=kill_capture_side_when_it_has_written, args=(runs, 4, outcome), daemon=True)
    killer.start()
    first = eagleops("run", str(config), "--stages", "generate_data,train_draft")
    out, _ = first.communicate(timeout=600)
    killer.join(timeout=5)
    assert "killed" in outcome, out[-3000:]
    assert first.returncode == 1, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert "train_draft failed" in last and "capture side" in last, last
    [run_dir] = runs.glob("streamed/*")
    stream_dir = run_dir / "train_draft" / "attempt-1" / "draft" / "stream"
    written = {e["file"] for e in json.loads((stream_dir / "manifest.json").read_text())["shards"]}

    second = eagleops("run", str(config), "--stages", "generate_data,train_draft", "--run-dir", str(run_dir))
    out, _ = second.communicate(timeout=600)
    assert second.returncode == 0, out[-3000:]
    stage = json.loads((run_dir / "manifest.json").read_text())["stages"]["train_draft"]
    assert stage["status"] == "completed" and stage["attempt"] == 1  # resumed in place
    summary = json.loads((run_dir / "train_draft" / "attempt-1" / "summary.json").read_text())
    streamed = summary["stream"]
    assert streamed["shards_reused"] >= 1 and written, streamed  # written before the kill and not captured again
    assert streamed["disk_high_water_bytes"] <= streamed["budget_bytes"]
    assert summary["finished"] and summary["steps"] == 18
    assert not list(stream_dir.glob("*.safetensors")) and not capture_sides(str(run_dir))
