"""No secret anywhere: the whole flow run as a user runs it (the CLI in a subprocess), with every secret
field set and a credentialed URL, through every stage that uses them -- HTTP regeneration against a
local server that demands the key, deploy over SSH with a passphrase-protected key and a token in
`deploy.env` (plus a long value under a name that does not look secret), a real MLflow server reached
through `http://user:password@...` -- then every place text goes is grepped, as bytes, for each
secret and each form a serialiser gives it (JSON-escaped, `\\uXXXX`, URL-encoded): stdout/stderr, the
run folder, the serving host's workdir, MLflow params, tags, metric names and artifacts, Prefect logs
and artifacts. The secrets hold a backslash, a double quote and (where the protocol allows it: not in
an HTTP header) a non-ASCII character, the forms json.dumps and URL encoding escape. The server still
gets the real `deploy.env` values: a sitecustomize on its PYTHONPATH records its environment outside
the scanned folders.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote, quote_plus

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from mlflow.tracking import MlflowClient

from tests.helpers import TEST_TARGET_YAML, free_port, serve_in_thread

API_KEY = 'sk-leak\\scan"7f3a9c2e41'  # an HTTP header value: ASCII only
URL_PASSWORD = 'pw-leak"scan\\b81dé6f'  # percent-encoded in the tracking URI
PASSPHRASE = 'pp-leak\\scan"5e2c90'
HF_TOKEN = 'hf_leakscan\\"Zürich-91c4'  # deploy.env under a name that looks secret
SERVE_VALUE = "opaque-€-leakscan-3d7e"  # deploy.env under one that does not
SECRETS = (API_KEY, URL_PASSWORD, PASSPHRASE, HF_TOKEN, SERVE_VALUE)
# The server's environment as it started, recorded by a sitecustomize the deploy's PYTHONPATH adds.
SITECUSTOMIZE = """\
import json, os
with open(os.path.join({out!r}, f"env-{{os.getpid()}}.json"), "w") as f:
    json.dump({{k: os.environ.get(k) for k in ("HF_TOKEN", "SERVE_OPTS")}}, f)
"""

CONFIG = """\
experiment: leakscan
runs_root: {runs}
{target}data:
  num_samples: 12
  max_length: 160
  validation_fraction: 0.25
  draft_vocab_size: 64
  regenerate:
    backend: http
    endpoint: {endpoint}
    api_key: ${{LEAKSCAN_API_KEY}}
    model: tiny
    max_new_tokens: 16
    retries: 0
train: {{ttt_steps: 2, max_steps: 6, batch_size: 4}}
export: {{formats: [sglang, speculators], dtype: float32}}
deploy:
  host: gpu-ssh
  server: reference
  port: {port}
  speculative: {{num_steps: 2, eagle_topk: 1, num_draft_tokens: 3}}
  startup_timeout_s: 240
  env: {{HF_TOKEN: "${{LEAKSCAN_HF_TOKEN}}", SERVE_OPTS: "${{LEAKSCAN_SERVE_VALUE}}", PYTHONPATH: "{probe}"}}
bench: {{prompts: {prompts}, num_prompts: 2, max_new_tokens: 8, warmup_runs: 0, timed_runs: 1}}
tracking: {{uri: "{tracking}"}}
hosts:
  - name: gpu-ssh
    address: 127.0.0.1
    port: {ssh_port}
    user: {user}
    key_file: {key_file}
    key_passphrase: ${{LEAKSCAN_PASSPHRASE}}
    known_hosts: {known_hosts}
    workdir: {workdir}
    python: {python}
"""


@pytest.fixture()
def authenticated_chat_server():
    """An OpenAI-style server that answers only with the API key, so the run must really use it."""
    seen = {"authorized": 0}
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        if request.headers.get("authorization") != f"Bearer {API_KEY}":
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        seen["authorized"] += 1
        body = await request.json()
        text = "def add(a, b):\n    return a + b\n" if len(body["messages"]) % 2 else "print('ok')\n"
        return {"choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}

    with serve_in_thread(app) as url:
        yield f"{url}/v1", seen


@pytest.fixture()
def locked_key(sshd, tmp_path):
    """A passphrase-protected user key the sshd accepts."""
    key = tmp_path / "locked"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", PASSPHRASE, "-f", str(key)], check=True,
                   capture_output=True)
    authorized = sshd.directory / "authorized_keys"
    original = authorized.read_text()
    authorized.write_text(original + (tmp_path / "locked.pub").read_text())
    yield key
    authorized.write_text(original)


def escaped_forms(secret: str) -> set[str]:
    """What serialisers make of a secret: JSON string bodies (\\uXXXX-escaped and raw UTF-8), URL encodings."""
    return {secret, json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=False)[1:-1], quote(secret, safe=""),
            quote(secret), quote_plus(secret)}


FORBIDDEN = [(secret, form.encode()) for secret in SECRETS for form in escaped_forms(secret)]


def assert_clean(data: str | bytes, where: str) -> None:
    raw = data.encode() if isinstance(data, str) else data
    for secret, form in FORBIDDEN:
        assert form not in raw, f"secret {secret[:6]}... leaked into {where} as {form!r}"


def assert_tree_clean(root: Path, where: str) -> int:
    files = [p for p in root.rglob("*") if p.is_file()]
    for path in files:
        assert_clean(path.read_bytes(), f"{where}: {path}")
    return len(files)


@pytest.mark.slow
def test_no_secret_reaches_any_sink(prefect_harness, sshd, locked_key, authenticated_chat_server, mlflow_server,
                                    tmp_path):
    from prefect.settings import PREFECT_API_URL

    endpoint, seen = authenticated_chat_server
    if not mlflow_server.running:
        mlflow_server.start()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Say hello."}) + "\n" + json.dumps({"prompt": "Count to three."}) + "\n")
    remote = tmp_path / "remote"
    probe, probe_out = tmp_path / "probe", tmp_path / "probe-out"
    probe.mkdir()
    probe_out.mkdir()
    (probe / "sitecustomize.py").write_text(SITECUSTOMIZE.format(out=str(probe_out)))
    host = sshd.host_config()
    config = tmp_path / "leakscan.yaml"
    config.write_text(CONFIG.format(
        target=TEST_TARGET_YAML, runs=tmp_path / "runs", endpoint=endpoint, port=free_port(), ssh_port=host.port,
                                    user=host.user, key_file=locked_key, known_hosts=host.known_hosts,
                                    workdir=remote, python=sys.executable, prompts=prompts, probe=probe,
                                    tracking=mlflow_server.uri.replace(
                                        "http://", f"http://leaker:{quote(URL_PASSWORD, safe='')}@")))
    env = {**os.environ, "LEAKSCAN_API_KEY": API_KEY, "LEAKSCAN_PASSPHRASE": PASSPHRASE,
           "LEAKSCAN_HF_TOKEN": HF_TOKEN, "LEAKSCAN_SERVE_VALUE": SERVE_VALUE,
           "PREFECT_API_URL": PREFECT_API_URL.value(), "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(config)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert seen["authorized"] >= 9  # the key was used: the server refuses requests without it
    started = [json.loads(p.read_text()) for p in probe_out.glob("env-*.json")]
    assert started and all(e == {"HF_TOKEN": HF_TOKEN, "SERVE_OPTS": SERVE_VALUE} for e in started), started
    assert_clean(done.stdout + done.stderr, "the CLI's output")
    validated = subprocess.run([sys.executable, "-m", "flows.cli", "validate", str(config)], env=env,
                               capture_output=True, text=True, timeout=120)
    assert_clean(validated.stdout + validated.stderr, "eagleops validate")

    run_dir = next((tmp_path / "runs" / "leakscan").iterdir())
    assert assert_tree_clean(run_dir, "the run folder") > 10
    assert assert_tree_clean(remote, "the serving host's workdir") > 2  # server logs, uploaded draft

    client = MlflowClient(mlflow_server.uri)
    experiment = client.get_experiment_by_name("leakscan")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) >= 8  # the parent and one child per stage
    for run in runs:
        assert_clean(json.dumps(run.data.params) + json.dumps(run.data.tags) + json.dumps(list(run.data.metrics)),
                     f"MLflow run {run.info.run_name}")
        if client.list_artifacts(run.info.run_id):
            assert_tree_clean(Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / run.info.run_id))),
                              f"MLflow artifacts of {run.info.run_name}")

    flow_run_id = json.loads((run_dir / "manifest.json").read_text())["prefect_flow_run_ids"][-1]
    logs, artifacts = asyncio.run(prefect_records(flow_run_id))
    assert len(logs) > 20
    assert_clean("\n".join(log.message for log in logs), "Prefect logs")
    assert_clean(json.dumps([a.data for a in artifacts], default=str), "Prefect artifacts")


async def prefect_records(flow_run_id: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        LogFilter,
        LogFilterFlowRunId,
    )

    async with get_client() as client:
        logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return logs, artifacts
