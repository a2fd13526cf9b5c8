"""Credentials as Prefect Secret blocks, end to end on the team setup (tests/team_servers.py): `eagleops
deploy-flows` saves the blocks infra/prefect.yaml's gpu deployments reference from its environment without
printing them, the registered deployments keep the references (not the values `prefect deploy` alone stores),
and a real worker hands the values to the run's process. A reference with neither a variable nor a block is
refused in one line before anything is registered."""

import hashlib
import json
import subprocess
import sys

import httpx
import pytest

from tests.team_servers import REPO, wait_for_run

pytestmark = pytest.mark.slow

HF = "{{ prefect.blocks.secret.eagleops-hf-token }}"
PASSPHRASE = "{{ prefect.blocks.secret.eagleops-ssh-key-passphrase }}"


def digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def test_deploy_flows_saves_the_blocks_and_registers_only_references(team_servers, deployed):
    api, token = team_servers.prefect_api, deployed["credentials"]["HF_TOKEN"]
    assert "secret block eagleops-hf-token: saved from $HF_TOKEN" in deployed["output"]
    assert "secret block eagleops-ssh-key-passphrase: saved from $EAGLEOPS_SSH_KEY_PASSPHRASE (empty)" in \
        deployed["output"]
    assert token not in deployed["output"]
    for name in ("data-train", "deploy-benchmark", "environment-check"):
        found = httpx.get(f"{api}/deployments/name/eagle3-experiment/{name}", timeout=10).json()
        assert found["job_variables"]["env"] == {"HF_TOKEN": HF, "EAGLEOPS_SSH_KEY_PASSPHRASE": PASSPHRASE}, found
        assert token not in json.dumps(found)
    block = httpx.get(f"{api}/block_types/slug/secret/block_documents/name/eagleops-hf-token",
                      params={"include_secrets": "true"}, timeout=10).json()
    assert block["data"]["value"] == token
    shown = httpx.get(f"{api}/block_types/slug/secret/block_documents/name/eagleops-hf-token", timeout=10).json()
    assert token not in json.dumps(shown)  # what the UI's Blocks page reads: obfuscated


def test_a_worker_hands_the_values_to_the_run_and_logs_none(team_servers, deployed, cpu_worker, tmp_path):
    """A probe flow deployed with the gpu deployments' job variables, run by the cpu worker."""
    api, token = team_servers.prefect_api, deployed["credentials"]["HF_TOKEN"]
    gpu = httpx.get(f"{api}/deployments/name/eagle3-experiment/data-train", timeout=10).json()
    flow_id = httpx.post(f"{api}/flows/", json={"name": "eagleops-secret-probe"}, timeout=10).json()["id"]
    created = httpx.post(f"{api}/deployments/", timeout=10, json={
        "name": "secret-probe", "flow_id": flow_id, "entrypoint": "tests/infra/secret_probe.py:secret_probe",
        "pull_steps": gpu["pull_steps"], "job_variables": gpu["job_variables"], "work_pool_name": "cpu",
        "work_queue_name": "default"})
    assert created.status_code in (200, 201), created.text
    out_file = tmp_path / "seen.txt"
    run = httpx.post(f"{api}/deployments/{created.json()['id']}/create_flow_run", timeout=10, json={
        "parameters": {"names": ["HF_TOKEN", "EAGLEOPS_SSH_KEY_PASSPHRASE"], "out_file": str(out_file)}}).json()
    ended = wait_for_run(api, run["id"], cpu_worker)
    assert ended["state"]["type"] == "COMPLETED", ended["state"]
    seen = dict(line.split() for line in out_file.read_text().splitlines())
    assert seen == {"HF_TOKEN": digest(token), "EAGLEOPS_SSH_KEY_PASSPHRASE": digest("")}
    logs = httpx.post(f"{api}/logs/filter", json={"logs": {"flow_run_id": {"any_": [run["id"]]}}},
                      timeout=10).json()
    assert logs and token not in json.dumps(logs)
    assert token not in cpu_worker.read_text()
    assert token not in json.dumps(httpx.get(f"{api}/flow_runs/{run['id']}", timeout=10).json())


def test_a_reference_with_neither_variable_nor_block_is_refused_before_registering(team_servers, tmp_path):
    prefect_file = tmp_path / "prefect.yaml"
    prefect_file.write_text(json.dumps({"deployments": [{
        "name": "needs-a-secret", "entrypoint": "flows/experiment.py:eagle3_experiment",
        "work_pool": {"name": "cpu", "job_variables": {"env": {
            "EAGLEOPS_TEST_NOWHERE": "{{ prefect.blocks.secret.eagleops-test-nowhere }}"}}}}]}))
    env = {k: v for k, v in team_servers.env.items() if k != "EAGLEOPS_TEST_NOWHERE"}
    done = subprocess.run([sys.executable, "-m", "flows.cli", "deploy-flows", "--prefect-file", str(prefect_file)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    out = (done.stdout + done.stderr).strip()
    assert done.returncode == 2 and "Traceback" not in out, out
    assert "eagleops-test-nowhere ($EAGLEOPS_TEST_NOWHERE)" in out and "registered" not in out, out
    gone = httpx.post(f"{team_servers.prefect_api}/deployments/filter", timeout=10,
                      json={"deployments": {"name": {"any_": ["needs-a-secret"]}}}).json()
    assert gone == []
