"""The data stage deploys two reference servers of the target over a real sshd on 127.0.0.1 and
regenerates through them (`data.regenerate: {backend: sglang, deploy: {servers: 2, host: ...}}`).

Checked: the flow run is SIGKILLed mid-way (a real subprocess, its servers left running on the
host), then resumed in the same run folder: the prompts answered before the kill are not asked
again (counted in the new servers' logs), every sample's answer is exactly the target's own greedy
token stream, and no server is left running, the killed run's included (ps).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from prefect.settings import PREFECT_API_URL

from eagle3.data.samples import read_samples
from eagle3.data.target import load_target
from flows.experiment import eagle3_experiment
from tasks.rundir import RunDirectory
from tests.helpers import TEST_TARGET_YAML, free_port, reference_servers_alive

REPO = Path(__file__).resolve().parents[2]
NUM_SAMPLES = 16
CONFIG = """\
experiment: regenssh
runs_root: {runs}
{target}data:
  num_samples: {num_samples}
  max_length: 256
  validation_fraction: 0.25
  hidden_states: online
  draft_vocab_size: 64
  regenerate:
    backend: sglang
    deploy: {{servers: 2, host: gpu-ssh}}
    concurrency: 1
    max_new_tokens: 40
    retries: 2
    backoff_s: 0.1
deploy:
  server: reference
  port: {port}
  startup_timeout_s: 240
  env: {{PYTHONPATH: "{repo}", OMP_NUM_THREADS: "1"}}
hosts:
  - {{name: gpu-ssh, address: {address}, port: {ssh_port}, user: {user}, key_file: {key_file},
      known_hosts: {known_hosts}, workdir: {remote}, python: {python}}}
"""
FLOW_WORKER = textwrap.dedent(
    """
    import sys
    from flows.experiment import eagle3_experiment

    eagle3_experiment(sys.argv[1], stages=["generate_data"])
    """
)
PREFILL = re.compile(r"Prefill batch, #new-seq: 1, #new-token: (\d+),")






def regeneration_log(runs: Path) -> Path | None:
    found = list(runs.glob("regenssh/*/generate_data/attempt-*/dataset/.regenerated-*.jsonl"))
    return found[0] if found else None


def answered(log: Path | None) -> list[int]:
    """Prompts with a complete record carrying the target's ids (asked of a server, not skipped as too long)."""
    if log is None:
        return []
    lines = log.read_bytes().split(b"\n")[:-1]  # the last piece is a record cut by the kill, or b""
    return [entry["i"] for entry in map(json.loads, lines) if "ids" in entry]


def kill_when_answered(proc: subprocess.Popen, runs: Path, count: int, timeout_s: float = 400) -> None:
    """SIGKILL the flow's process group once `count` answers are on disk."""
    deadline = time.monotonic() + timeout_s
    try:
        while len(answered(regeneration_log(runs))) < count:
            assert proc.poll() is None, f"the flow ended ({proc.returncode}) before {count} answers"
            assert time.monotonic() < deadline, f"fewer than {count} answers within {timeout_s}s"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def prompts_served(log_files: list[str]) -> int:
    """Prompts the servers prefilled (the 1-token /health_generate probes left out)."""
    return sum(int(n) > 1 for f in log_files for n in PREFILL.findall(Path(f).read_text()))


@pytest.mark.slow
def test_data_stage_regenerates_through_servers_it_deploys_over_ssh(prefect_harness, sshd, tmp_path):
    runs, remote = tmp_path / "runs", tmp_path / "remote-workdir"
    host = sshd.host_config()
    config = tmp_path / "regen.yaml"
    config.write_text(CONFIG.format(
        target=TEST_TARGET_YAML, runs=runs, num_samples=NUM_SAMPLES, port=free_port(), repo=REPO,
                                    address=host.address, ssh_port=host.port, user=host.user, key_file=host.key_file,
                                    known_hosts=host.known_hosts, remote=remote, python=sys.executable))
    worker = tmp_path / "flow_worker.py"
    worker.write_text(FLOW_WORKER)

    # 1. a flow run SIGKILLed while it regenerates; its two servers stay behind on the host
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PREFECT_API_URL": PREFECT_API_URL.value()}
    with (tmp_path / "killed.log").open("w") as out:
        proc = subprocess.Popen([sys.executable, str(worker), str(config)], stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    kill_when_answered(proc, runs, count=3)
    log = regeneration_log(runs)
    before_resume = answered(log)
    (run_dir,) = (runs / "regenssh").iterdir()
    killed_servers = json.loads((run_dir / "servers.json").read_text())
    assert len(killed_servers) == 2 and {s["status"] for s in killed_servers.values()} == {"live"}
    assert len(reference_servers_alive(str(remote))) == 2
    assert not (log.parent / "samples.jsonl").exists()

    # 2. resumed in the same run folder: new servers, only the unanswered prompts are asked
    result = eagle3_experiment(str(config), stages=["generate_data"], run_dir=str(run_dir))
    stage = RunDirectory.open(run_dir).manifest["stages"]["generate_data"]
    summary = stage["summary"]
    assert summary["num_failed"] == 0 and summary["regeneration"]["deploy"] == {"servers": 2, "host": "gpu-ssh"}
    registry = json.loads((run_dir / "servers.json").read_text())
    resumed = [s for key, s in registry.items() if key not in killed_servers]
    samples = read_samples(Path(summary["paths"]["samples"]))
    assert len(resumed) == 2 and prompts_served([s["log_file"] for s in resumed]) == len(samples) - len(before_resume)
    assert result["run_dir"] == str(run_dir)

    # 3. each answer is the target's own greedy token stream, stop token included
    model, tokenizer = load_target(Path(stage["outputs"]["target_dir"]))
    for sample in samples:
        ids, start = sample["input_ids"], sample["loss_mask"].index(1)
        greedy = model.generate(input_ids=torch.tensor([ids[:start]]), do_sample=False,
                                max_new_tokens=len(ids) - start, eos_token_id=model.generation_config.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id)[0, start:].tolist()
        assert greedy == ids[start:]

    # 4. no server left: the resumed run's and the killed run's (stopped by the flow's teardown)
    assert {s["status"] for s in registry.values()} == {"stopped"} and len(registry) == 4
    assert reference_servers_alive(str(remote)) == []
