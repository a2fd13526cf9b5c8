"""Regeneration through real `python -m eagle3.serve` servers of the tiny target (baseline, no draft)
on 127.0.0.1, over SGLang's native /generate.

Checked: the samples' token ids equal the target's own greedy stream (the local HF-generate path
on the same prompts), requests are spread over both servers; a server SIGKILLed mid-way loses no
prompt (retried on the other server), and a dead server with no retries left is recorded in
failed.jsonl, not dropped; a regeneration process SIGKILLed mid-way resumes without asking the
servers again for the prompts it had finished (counted at the servers' /metrics).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from eagle3.config import DataConfig, RegenerateConfig, TargetConfig
from eagle3.data.generate import _generation_eos, generate_dataset
from eagle3.data.prompts import builtin_conversations, prompt_part
from eagle3.data.regeneration import RegenerationLog, regenerate_sglang
from eagle3.data.samples import read_samples
from eagle3.data.server_pool import FailureLog, _generated_answer
from eagle3.data.target import load_target

REPO = Path(__file__).resolve().parents[3]
NUM_PROMPTS = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One `python -m eagle3.serve` of the target, in its own process group."""

    def __init__(self, target_dir: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        argv = [sys.executable, "-m", "eagle3.serve", "--model-path", str(target_dir), "--host", "127.0.0.1",
                "--port", str(self.port), "--enable-metrics"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        with log.open("w") as out:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def wait_ready(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/health_generate", timeout=10).status_code == 200:
                    return
            time.sleep(0.3)
        self.kill()
        raise RuntimeError(f"server not healthy within {timeout_s}s:\n{self.log.read_text()[-3000:]}")

    def finished_requests(self) -> int:
        """Requests the server finished (its e2e latency histogram's count, health checks included)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return int(float(re.search(r"^sglang:e2e_request_latency_seconds_count\{[^}]*\} (\S+)$", text, re.M)[1]))

    def wait_idle(self, timeout_s: float = 120) -> None:
        """Until nothing runs or waits (requests of a killed client finish on their own)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = httpx.get(f"{self.url}/metrics", timeout=10).text
            busy = re.findall(r"^sglang:num_(?:running|queue)_reqs\{[^}]*\} (\S+)$", text, re.M)
            if busy and all(float(b) == 0 for b in busy):
                return
            time.sleep(0.2)
        raise AssertionError(f"{self.url} still busy after {timeout_s}s")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@contextlib.contextmanager
def started(target_dir: Path, logs: Path, count: int):
    servers = [ServerProcess(target_dir, logs / f"server-{k}.log") for k in range(count)]
    try:
        for s in servers:
            s.wait_ready()
        yield servers
    finally:
        for s in servers:
            s.kill()
        assert all(s.proc.poll() is not None for s in servers)


@pytest.fixture(scope="module")
def two_servers(tiny_target_dir, tmp_path_factory):
    with started(tiny_target_dir, tmp_path_factory.mktemp("regen-servers"), 2) as servers:
        yield servers


def data_cfg(regenerate: RegenerateConfig) -> DataConfig:
    return DataConfig(num_samples=NUM_PROMPTS, max_length=256, validation_fraction=0.25, hidden_states="online",
                      draft_vocab_size=64, regenerate=regenerate)


def sglang_cfg(urls: list[str], **overrides) -> RegenerateConfig:
    fields = dict(backend="sglang", endpoints=urls, concurrency=2, max_new_tokens=24, retries=2, backoff_s=0.05)
    return RegenerateConfig(**(fields | overrides))


@pytest.fixture(scope="module")
def through_servers(two_servers, tiny_target_dir, tmp_path_factory):
    """One uninterrupted regeneration through both servers; -> (dataset dir, summary, requests per server)."""
    out = tmp_path_factory.mktemp("through-servers")
    before = [s.finished_requests() for s in two_servers]
    summary = generate_dataset(tiny_target_dir, TargetConfig(), data_cfg(sglang_cfg([s.url for s in two_servers])),
                               out, log=lambda m: None)
    served = [s.finished_requests() - b for s, b in zip(two_servers, before, strict=True)]
    return out, summary, served


def samples_of(out: Path) -> list[dict]:
    return read_samples(out / "samples.jsonl")


def test_samples_are_the_targets_own_greedy_token_stream(through_servers, tiny_target_dir, tmp_path):
    out, summary, served = through_servers
    local = generate_dataset(tiny_target_dir, TargetConfig(),
                             data_cfg(RegenerateConfig(backend="local", max_new_tokens=24, batch_size=1)),
                             tmp_path / "local", log=lambda m: None)
    assert summary["num_failed"] == 0 and summary["paths"]["failed"] is None
    remote_samples, local_samples = samples_of(out), samples_of(tmp_path / "local")
    assert len(remote_samples) == len(local_samples) > 0
    for remote, mine in zip(remote_samples, local_samples, strict=True):
        assert remote["input_ids"] == mine["input_ids"] and remote["loss_mask"] == mine["loss_mask"]
    assert summary["num_tokens"] == local["num_tokens"]
    # one request per sample (prompts of >= max_length tokens are not sent), spread over both servers
    assert sum(served) == len(remote_samples) and min(served) >= 1


def test_answer_ids_are_not_the_retokenized_text(through_servers, tiny_target_dir):
    """Each sample ends with exactly the ids the target emitted: its own greedy continuation of the
    rendered prompt, stop token included (not the tokenization of the decoded answer text)."""
    out, _, _ = through_servers
    model, tokenizer = load_target(tiny_target_dir)
    for sample in samples_of(out)[:3]:
        ids, start = sample["input_ids"], sample["loss_mask"].index(1)
        answer = ids[start:]
        generated = model.generate(input_ids=torch.tensor([ids[:start]]), do_sample=False,
                                   max_new_tokens=len(answer), eos_token_id=model.generation_config.eos_token_id,
                                   pad_token_id=tokenizer.pad_token_id)[0, start:].tolist()
        assert generated == answer


def test_a_server_killed_mid_way_loses_no_prompt(two_servers, tiny_target_dir, tmp_path):
    with started(tiny_target_dir, tmp_path, 1) as (doomed,):
        prompts, tokenizer, stop_ids = regeneration_inputs(tiny_target_dir)
        urls = [doomed.url, two_servers[0].url]
        record = RegenerationLog(tmp_path / "killed.jsonl")
        failures = FailureLog(tmp_path / "failed.jsonl")
        logs: list[str] = []

        def progress(stage, done, total):
            if done >= 2 and doomed.proc.poll() is None:
                doomed.kill()  # SIGKILL while requests are in flight on it

        cfg = sglang_cfg(urls, concurrency=1, max_new_tokens=40)
        regenerate_sglang(prompts, tokenizer, cfg, 256, stop_ids, record, progress, logs.append, urls,
                                   failures)
        record.close()
    assert doomed.proc.returncode == -signal.SIGKILL
    assert sorted(record.done) == list(range(len(prompts))) and failures.records == []
    assert any(f"POST {doomed.url}/generate -> " in m and "; retry 1/2" in m for m in logs), logs

    # no retries left and a server that is gone from the start: its prompts are recorded, not dropped
    dead = f"http://127.0.0.1:{free_port()}"
    record = RegenerationLog(tmp_path / "dead.jsonl")
    failures = FailureLog(tmp_path / "failed-dead.jsonl")
    cfg = sglang_cfg([dead, two_servers[1].url], retries=0, concurrency=1, max_failed_fraction=1.0)
    regenerate_sglang(prompts, tokenizer, cfg, 256, stop_ids, record, lambda *a: None, lambda m: None,
                               failures=failures)
    failed = [json.loads(line) for line in (tmp_path / "failed-dead.jsonl").read_text().splitlines()]
    assert failed and [f["i"] for f in failed] == [r["i"] for r in failures.records]
    assert all(f["servers"] == [dead] and "ConnectError" in f["error"] for f in failed)
    assert set(record.done).isdisjoint(failures.indices)
    assert sorted([*record.done, *failures.indices]) == list(range(len(prompts)))

    # the same failures over the allowed fraction stop the stage, naming the file
    with pytest.raises(RuntimeError, match=r"prompts failed after their retries \(listed in .*failed-again\.jsonl\)"):
        regenerate_sglang(prompts, tokenizer, cfg.model_copy(update={"max_failed_fraction": 0.0}), 256,
                                   stop_ids, RegenerationLog(tmp_path / "again.jsonl"), lambda *a: None,
                                   lambda m: None, failures=FailureLog(tmp_path / "failed-again.jsonl"))


def regeneration_inputs(target_dir: Path):
    from transformers import AutoTokenizer

    from eagle3.data.chat import turn_stop_ids

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = [prompt_part(c) for c in builtin_conversations(NUM_PROMPTS, 0)]
    return prompts, tokenizer, turn_stop_ids(tokenizer, _generation_eos(target_dir))


REGEN_WORKER = textwrap.dedent(
    """
    import json, sys, threading
    from pathlib import Path
    from eagle3.config import DataConfig, TargetConfig
    from eagle3.data.generate import generate_dataset

    target, out, pause_at, cfg_json = sys.argv[1:5]

    def on_progress(stage, done, total):
        if stage == "regenerate" and done >= int(pause_at):
            print(json.dumps({"paused": done}), flush=True)
            threading.Event().wait()  # until the test's SIGKILL

    generate_dataset(Path(target), TargetConfig(), DataConfig.model_validate_json(cfg_json), Path(out),
                     on_progress=on_progress, log=lambda m: None)
    """
)


def test_killed_regeneration_resumes_without_asking_again(two_servers, through_servers, tiny_target_dir, tmp_path):
    cfg = data_cfg(sglang_cfg([s.url for s in two_servers]))
    out = tmp_path / "killed"
    script = tmp_path / "worker.py"
    script.write_text(REGEN_WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_target_dir), str(out), "3", cfg.model_dump_json()],
                            stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    watchdog = threading.Timer(300, proc.kill)
    watchdog.start()
    try:
        assert json.loads(proc.stdout.readline())["paused"] >= 3
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        watchdog.cancel()
    (log_path,) = out.glob(".regenerated-*.jsonl")
    kept = log_path.read_bytes()
    records = [json.loads(line) for line in kept.splitlines()]
    finished, answered = {r["i"] for r in records}, [r["i"] for r in records if "ids" in r]
    assert 3 <= len(finished) < NUM_PROMPTS and answered

    for s in two_servers:
        s.wait_idle()  # the killed client's last requests finish on their own
    before = [s.finished_requests() for s in two_servers]
    logs: list[str] = []
    generate_dataset(tiny_target_dir, TargetConfig(), cfg, out, log=logs.append)
    asked = sum(s.finished_requests() - b for s, b in zip(two_servers, before, strict=True))
    assert f"regenerate: resuming, {len(finished)}/{NUM_PROMPTS} answers already done" in logs
    uninterrupted, _, served = through_servers
    assert asked == sum(served) - len(answered)  # only the unfinished prompts were asked again
    assert log_path.exists() is False  # consumed into samples.jsonl
    assert (out / "samples.jsonl").read_bytes() == (uninterrupted / "samples.jsonl").read_bytes()


def test_generate_answer_keeps_a_matched_stop_id_and_rejects_malformed_replies():
    def reply(body) -> httpx.Response:
        return httpx.Response(200, json=body) if not isinstance(body, str) else httpx.Response(200, text=body)

    stopped = {"text": "ab", "output_ids": [7, 8], "meta_info": {"finish_reason": {"type": "stop", "matched": 3}}}
    assert _generated_answer(reply(stopped), "u") == ("ab", [7, 8, 3])  # a server that left it out
    kept = stopped | {"output_ids": [7, 8, 3]}
    assert _generated_answer(reply(kept), "u") == ("ab", [7, 8, 3])  # not doubled
    length = {"text": "ab", "output_ids": [7, 8], "meta_info": {"finish_reason": {"type": "length", "length": 2}}}
    assert _generated_answer(reply(length), "u") == ("ab", [7, 8])
    for bad in ("not json", {"text": "ab"}, {"text": "ab", "output_ids": ["7"]}):
        with pytest.raises(RuntimeError, match="POST u: .*/generate response"):
            _generated_answer(reply(bad), "u")


@pytest.mark.parametrize("fields,message", [
    ({"backend": "sglang"}, "set exactly one of data.regenerate.endpoint, data.regenerate.endpoints or "
                            r"data.regenerate.deploy \(got none\)"),
    ({"backend": "sglang", "endpoint": "http://a", "endpoints": ["http://b"]}, r"\(got endpoint, endpoints\)"),
    ({"backend": "local", "deploy": {"servers": 2}}, "data.regenerate.deploy needs data.regenerate.backend"),
])
def test_servers_are_named_exactly_once(fields, message):
    with pytest.raises(ValueError, match=message):
        RegenerateConfig(**fields)
    assert RegenerateConfig(backend="sglang", deploy={"servers": 2}).server_urls == []
    assert RegenerateConfig(backend="http", endpoints=["http://a", "http://b"]).server_urls == ["http://a", "http://b"]
