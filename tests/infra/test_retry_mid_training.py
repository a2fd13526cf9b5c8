"""The UI's Retry of a deployment run whose first attempt failed mid-training, on the team setup
(tests/team_servers.py): the `tiny` deployment started as the UI's Custom run, run by the real cpu worker; its
runs root on a tmpfs that fills once training has written its first checkpoint (a disk that really fills, as in
tests/flows/test_disk_full.py), so train_draft fails; the space freed, Retry (AwaitingRetry, as the UI sets it):
the same flow run resumes the same run folder, the data stage reused and training resumed from its checkpoint."""

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.flows.test_disk_full import fill
from tests.helpers import TEST_TARGET_YAML, mounted_tmpfs
from tests.team_servers import wait_for_run

pytestmark = pytest.mark.slow

CONFIG = """\
experiment: retrymid
runs_root: {runs}
{target}data:
  num_samples: 24
  max_length: 96
  validation_fraction: 0.2
  regenerate: {{max_new_tokens: 16}}
  draft_vocab_size: 64
train: {{ttt_steps: 2, max_steps: 120, epochs: 1000, batch_size: 2, lr: 0.01, warmup_ratio: 0.0, log_every: 1,
         eval_every: 1000, checkpoint_every: 20, num_workers: 0}}
tracking: {{uri: {mlflow}}}
"""
STAGES = ["generate_data", "train_draft"]


def checkpoints(runs: Path) -> list[Path]:
    return sorted(runs.glob("retrymid/*/train_draft/attempt-*/**/checkpoints/step_*"))


def test_a_retry_after_a_failure_mid_training_resumes_its_folder_from_the_checkpoint(team_servers, deployed,
                                                                                     cpu_worker, tmp_path):
    api = team_servers.prefect_api
    with mounted_tmpfs(tmp_path / "disk", "192m") as disk:
        runs = disk / "runs"
        config = tmp_path / "retrymid.yaml"
        config.write_text(CONFIG.format(runs=runs, target=TEST_TARGET_YAML, mlflow=team_servers.mlflow))
        # the disk fills (another job on it) once training has saved its first checkpoint
        filled = {}

        def fill_after_first_checkpoint() -> None:
            deadline = time.monotonic() + 400
            while not checkpoints(runs) and time.monotonic() < deadline:
                time.sleep(0.05)
            filled["file"] = fill(disk)

        filler = threading.Thread(target=fill_after_first_checkpoint, daemon=True)
        filler.start()
        tiny = httpx.get(f"{api}/deployments/name/eagle3-experiment/tiny", timeout=10).json()
        created = httpx.post(f"{api}/deployments/{tiny['id']}/create_flow_run", timeout=30, json={
            "state": {"type": "SCHEDULED", "message": "Run from the Prefect UI"},
            "parameters": {"config_path": str(config), "stages": STAGES}})
        assert created.status_code == 201, created.text
        flow_run_id = created.json()["id"]
        first = wait_for_run(api, flow_run_id, cpu_worker, timeout_s=420)
        filler.join(timeout=30)
        assert first["state"]["type"] == "FAILED", first["state"]
        assert "train_draft" in first["state"]["message"], first["state"]["message"]
        [run_dir] = [p.parent for p in runs.glob("retrymid/*/manifest.json")]
        manifest = json.loads((run_dir / "manifest.json").read_text())
        assert manifest["stages"]["generate_data"]["status"] == "completed"
        saved = [int(p.name.removeprefix("step_")) for p in checkpoints(runs)]
        assert saved and max(saved) < 120, saved  # it failed mid-training, after a checkpoint

        filled["file"].unlink()  # the space back
        retried = httpx.post(f"{api}/flow_runs/{flow_run_id}/set_state", timeout=10, json={
            "state": {"type": "SCHEDULED", "name": "AwaitingRetry", "message": "Retry from the UI"}, "force": True})
        assert retried.status_code == 201, retried.text
        second = wait_for_run(api, flow_run_id, cpu_worker, timeout_s=420)
        assert second["state"]["type"] == "COMPLETED", (second["state"], cpu_worker.read_text()[-3000:])
        assert second["run_count"] == 2
        assert [p.parent for p in runs.glob("retrymid/*/manifest.json")] == [run_dir]  # the same folder, no new one
        manifest = json.loads((run_dir / "manifest.json").read_text())
        train = manifest["stages"]["train_draft"]
        assert train["status"] == "completed" and len(manifest["stages"]["generate_data"]["attempts"]) == 1
        text = cpu_worker.read_text()  # the flow run processes' output, as the worker relays it
        assert "generate_data: completed earlier with the same inputs" in text
        assert f"step_{max(saved):08d} at step {max(saved)}" in text and "resumed from" in text, text[-3000:]
        print(f"\nfirst attempt failed after checkpoint step {max(saved)}; the Retry resumed there and completed")
