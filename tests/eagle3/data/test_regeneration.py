"""Regeneration (eagle3.data.regeneration, eagle3.data.server_pool): the resumable log, HTTP retries over real HTTP, the key never shown."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from test_generate import _data_cfg

from eagle3.config import RegenerateConfig, TargetConfig
from eagle3.data.generate import generate_dataset
from eagle3.data.regeneration import RegenerationLog, regenerate_http, regenerate_local
from eagle3.data.target import load_target
from eagle3.data.server_pool import post_chat_completion
from tests.helpers import serve_in_thread


def test_regeneration_log_cut_mid_line_is_dropped_and_rewritten(tmp_path):
    path = tmp_path / "regenerated.jsonl"
    log = RegenerationLog(path)
    for i in range(3):
        log.add(i, f"answer {i}\nsecond line", [i, i + 1])
    log.close()
    full = path.read_bytes()
    path.write_bytes(full[:-7])  # killed while writing record 2
    log = RegenerationLog(path)
    assert log.done == {0: "answer 0\nsecond line", 1: "answer 1\nsecond line"}
    assert log.token_ids == {0: [0, 1], 1: [1, 2]}
    assert path.read_bytes() == full[: full.index(b'{"i": 2')]  # the partial record is cut off
    log.add(2, "answer 2 again", [7])
    log.add(3, "answer 3")
    log.close()
    again = RegenerationLog(path)
    again.close()
    assert again.done == {0: "answer 0\nsecond line", 1: "answer 1\nsecond line", 2: "answer 2 again",
                          3: "answer 3"}
    assert again.token_ids == {0: [0, 1], 1: [1, 2], 2: [7]}
    lines = path.read_text().splitlines()
    assert [json.loads(line)["i"] for line in lines] == [0, 1, 2, 3]
    # a damaged complete line is not a kill: refused, naming file and line
    path.write_text(lines[0] + "\n" + lines[1][:-1] + "\n" + lines[2] + "\n")
    with pytest.raises(ValueError, match=r"regenerated\.jsonl:2: corrupt regeneration record"):
        RegenerationLog(path)


def _regenerate_at(threads, tiny_target_dir, tmp_path, name, temperature=0.0):
    """regenerate_local over 24 prompts in batches of 4 with torch at `threads` threads -> (answers, ids, the
    threads that reported progress)."""
    model, tokenizer = load_target(tiny_target_dir)
    prompts = [[{"role": "user", "content": f"question {i}: " + "why " * (i % 7)}] for i in range(24)]
    record = RegenerationLog(tmp_path / f"{name}.jsonl")
    reporters = set()

    def progress(stage, done, total):
        reporters.add(threading.current_thread().name)

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        regenerate_local(model, tokenizer, prompts, RegenerateConfig(max_new_tokens=12, batch_size=4,
                                                                     temperature=temperature),
                         128, [tokenizer.eos_token_id], record, progress)
    finally:
        torch.set_num_threads(previous)
        record.close()
    assert torch.get_num_threads() == previous
    return record.done, record.token_ids, reporters


def test_local_regeneration_in_parallel_streams_answers_as_one_stream(tiny_target_dir, tmp_path):
    """On CPU each of the stage's threads decodes its own batches at one thread (issue 38): the same answers,
    the same ids, whichever stream ran a batch; sampled answers stay on one stream (one RNG, taken in turn)."""
    one, one_ids, one_reporters = _regenerate_at(1, tiny_target_dir, tmp_path, "one")
    two, two_ids, two_reporters = _regenerate_at(2, tiny_target_dir, tmp_path, "two")
    assert len(one) == 24 and any(one.values())
    assert two == one and two_ids == one_ids
    caller = threading.current_thread().name  # it reports the answers found done before any batch
    assert one_reporters == {caller}
    streams = two_reporters - {caller}
    assert streams and all(name.startswith("regenerate") for name in streams)
    *_, sampled_reporters = _regenerate_at(2, tiny_target_dir, tmp_path, "sampled", temperature=0.7)
    assert sampled_reporters == {caller}


@pytest.fixture()
def chat_server():
    """A real OpenAI-style server on 127.0.0.1 whose first request fails with 503."""
    state = {"requests": 0, "auth": set(), "bodies": []}
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        state["requests"] += 1
        state["auth"].add(request.headers.get("authorization"))
        state["bodies"].append(body)
        if state["requests"] == 1:
            return JSONResponse({"error": "warming up"}, status_code=503)
        prompt = body["messages"][-1]["content"]
        answer = f"def answer():\n    return {len(prompt)}"
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}]}

    with serve_in_thread(app) as url:
        yield url, state


def test_http_regeneration_retries_and_hides_the_key(chat_server, tiny_target_dir, tmp_path):
    url, state = chat_server
    secret = "sk-test-SECRET-123"
    regen = RegenerateConfig(
        backend="http", endpoint=url, api_key=secret, model="tiny", concurrency=3, retries=2,
        backoff_s=0.01, temperature=0.7, max_new_tokens=20,
    )
    cfg = _data_cfg(num_samples=5, hidden_states="online", regenerate=regen)
    logs = []
    summary = generate_dataset(tiny_target_dir, TargetConfig(), cfg, tmp_path, log=logs.append)
    assert state["requests"] == 6  # 5 prompts + the one 503 that was retried
    assert state["auth"] == {f"Bearer {secret}"}
    assert {(b["model"], b["temperature"], b["max_tokens"]) for b in state["bodies"]} == {("tiny", 0.7, 20)}
    assert any("-> 503; retry 1/2" in m for m in logs)
    assert secret not in "\n".join(logs) and secret not in json.dumps(summary)
    assert summary["regeneration"]["api_key_set"] is True and summary["regeneration"]["backend"] == "http"
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    for s in samples:
        assert s["messages"][-1]["content"] == f"def answer():\n    return {len(s['messages'][0]['content'])}"


def test_http_gives_up_on_client_errors(tmp_path):
    app = FastAPI()
    calls = []

    @app.post("/v1/chat/completions")
    async def chat():
        calls.append(1)
        return JSONResponse({"error": "bad model"}, status_code=400)

    with serve_in_thread(app) as url:
        record = RegenerationLog(tmp_path / "r.jsonl")
        regen = RegenerateConfig(backend="http", endpoint=url, retries=3, backoff_s=0.01)
        with pytest.raises(RuntimeError, match="failed after 1 attempt.*400"):
            regenerate_http([[{"role": "user", "content": "x"}]], regen, record, lambda *a: None, print)
        assert len(calls) == 1


def test_post_retries_timeouts_and_rejects_malformed_replies():
    calls, delays = [], []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.headers.get("authorization"))
        if len(calls) == 1:
            raise httpx.ConnectTimeout("slow", request=request)
        if len(calls) == 2:
            return httpx.Response(429, text="busy")
        if len(calls) == 3:
            return httpx.Response(200, json={"choices": [{"message": {"content": "ok"}}]})
        return httpx.Response(200, text="not json")

    regen = RegenerateConfig(backend="http", endpoint="http://x", retries=2, backoff_s=0.5)
    client = httpx.Client(transport=httpx.MockTransport(handler), headers={"Authorization": "Bearer k"})
    logs = []
    answer = post_chat_completion(client, "http://x/v1/chat/completions", {}, regen, logs.append, delays.append)
    assert answer == "ok" and delays == [0.5, 1.0] and calls == ["Bearer k"] * 3
    assert logs[0].endswith("-> ConnectTimeout; retry 1/2 in 0.50s") and "-> 429; retry 2/2" in logs[1]
    with pytest.raises(RuntimeError, match="malformed chat completion: 'not json'"):
        post_chat_completion(client, "http://x/v1/chat/completions", {}, regen, logs.append, delays.append)
