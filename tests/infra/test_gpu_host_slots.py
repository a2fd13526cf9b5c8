"""One GPU stage per GPU host, whatever started the run: the global concurrency limit `eagleops deploy-flows`
makes per GPU host, taken by the stages of two `eagleops run` processes from the CLI (no deployment, no work
queue) against the team's real Prefect server (tests/team_servers.py). The second run waits and says why; the
first killed with SIGKILL frees the slot when its lease runs out; a Ctrl-C'd run gives it back at once."""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.flows.test_interrupts import wait_for_line
from tests.helpers import TEST_TARGET_YAML
from tasks.runner.host_slots import LEASE_S
from tests.team_servers import REPO

pytestmark = pytest.mark.slow

CONFIG = """\
experiment: slots
runs_root: {runs}
{target}data:
  num_samples: 24
  max_length: 96
  validation_fraction: 0.2
  regenerate: {{max_new_tokens: 16}}
  draft_vocab_size: 64
train: {{ttt_steps: 2, max_steps: 100000, epochs: 10000, batch_size: 2, lr: 0.01, warmup_ratio: 0.0, log_every: 1,
         eval_every: 100000, checkpoint_every: 100000, num_workers: 0}}
"""


def limit(api: str, name: str) -> dict:
    return httpx.get(f"{api}/v2/concurrency_limits/{name}", timeout=10).json()


def start_run(workdir: Path, name: str, env: dict) -> tuple[subprocess.Popen, Path]:
    log = workdir / f"{name}.log"
    command = [sys.executable, "-m", "flows.cli", "run", str(workdir / "slots.yaml"), "--stages",
               "generate_data,train_draft"]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return proc, log


def test_deploy_flows_makes_one_limit_per_gpu_host(deployed):
    assert "concurrency limit gpu-host-gpu-1 (1 GPU stage at a time, whatever started it): created" in \
        deployed["output"]


def test_a_second_run_on_the_host_waits_and_a_killed_holder_frees_the_slot(team_servers, deployed, tmp_path):
    api, host = team_servers.prefect_api, f"slots-{uuid.uuid4().hex[:8]}"
    name = f"gpu-host-{host}"
    created = httpx.post(f"{api}/v2/concurrency_limits/", json={"name": name, "limit": 1}, timeout=10)
    assert created.status_code == 201, created.text
    (tmp_path / "slots.yaml").write_text(CONFIG.format(runs=tmp_path / "runs", target=TEST_TARGET_YAML))
    # this machine is the GPU host `host`, as a gpu worker of queue `host` names it; the team's Prefect API
    env = {**team_servers.env, "EAGLEOPS_GPU_HOST": host}
    first, first_log = start_run(tmp_path, "first", env)
    second = None
    try:
        wait_for_line(first_log, r"train_draft.* step \d+/\d+ loss", first)  # training: it holds the host
        assert limit(api, name)["active_slots"] == 1
        second, second_log = start_run(tmp_path, "second", env)
        wait_for_line(second_log, rf"generate_data: waiting for {name} \(one GPU stage per host", second)
        time.sleep(3)
        assert "generate_data: prompts" not in second_log.read_text()  # it has not started its data
        os.killpg(first.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        first.wait(timeout=30)
        wait_for_line(second_log, rf"generate_data: {name} free, going on", second, timeout=LEASE_S * 4)
        freed_after = time.monotonic() - killed_at
        wait_for_line(second_log, r"train_draft.* step \d+/\d+ loss", second)
        assert limit(api, name)["active_slots"] == 1
        os.killpg(second.pid, signal.SIGINT)  # Ctrl-C: the slot comes back with the stage's end
        assert second.wait(timeout=90) == 130, second_log.read_text()[-3000:]
        assert limit(api, name)["active_slots"] == 0
        print(f"\nslot freed {freed_after:.1f} s after the holder's SIGKILL (lease {LEASE_S} s)")
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        httpx.delete(f"{api}/v2/concurrency_limits/{name}", timeout=10)
