"""eagle3.serve when its own side fails: a 500 in SGLang's shape, the traceback in the log, and
the server keeps serving.

One in-process server for the module: the real app and worker over the tiny model of
test_serve_http, behind uvicorn on 127.0.0.1 in a thread. The one fake is the engine: a prompt
that starts with a poison token makes it raise, in prefill or at the first decode step, every
time. The decode fault is a ValueError on purpose: what the engine raises is our failure (500),
whatever its type; request errors are refused at the HTTP edge before the worker sees them.
"""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
import torch
from test_serve_http import SEED_FLAGS, build_model_dirs

import eagle3.serving.scheduler as scheduler_mod
from eagle3.serving.http_api import build_app
from eagle3.serving.scheduler import Scheduler
from eagle3.serving.settings import build_settings, load_engine
from tests.helpers import serve_in_thread

POISON_PREFILL, POISON_DECODE = 17, 19
TIMEOUT = httpx.Timeout(60.0)
PREFILL_FAULT = "RuntimeError: injected prefill fault"
DECODE_FAULT = "ValueError: injected decode fault"


class FaultyEngine:
    """The real SpeculativeEngine, except for prompts that start with a poison token."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def start(self, prompt_ids, sampling):
        if prompt_ids[0] == POISON_PREFILL:
            raise RuntimeError("injected prefill fault")
        return self._engine.start(prompt_ids, sampling)

    def step(self, state):
        if state.prompt_ids[0] == POISON_DECODE:
            raise ValueError("injected decode fault")
        return self._engine.step(state)




@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """(base URL, scheduler) of a real server whose engine fails on poison prompts."""
    torch.set_num_threads(1)
    target_dir, draft_dir = build_model_dirs(tmp_path_factory.mktemp("serve_errors"))
    settings = build_settings(["--model-path", str(target_dir), "--speculative-algorithm", "EAGLE3",
                                     "--speculative-draft-model-path", str(draft_dir), *SEED_FLAGS,
                                     "--max-running-requests", "4", "--device", "cpu", "--random-seed", "0"])
    real_load = load_engine
    scheduler = Scheduler(settings)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scheduler_mod, "load_engine", lambda s: (lambda engine, tok: (FaultyEngine(engine), tok))(*real_load(s)))
        scheduler.start()
        assert scheduler.ready.wait(timeout=120), scheduler.load_error
    try:
        with serve_in_thread(build_app(scheduler, settings)) as url:
            yield url, scheduler
    finally:
        scheduler.stop()
        scheduler.join(timeout=15)


def generate_body(first_token: int, max_new_tokens: int = 6, **extra) -> dict:
    return {"input_ids": [first_token, 5, 6, 7], **extra,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}


def test_prefill_failure_is_500_with_traceback_then_serving_goes_on(faulty, caplog):
    url, scheduler = faulty
    with caplog.at_level(logging.ERROR, logger="eagle3.serve"):
        r = httpx.post(f"{url}/generate", json=generate_body(POISON_PREFILL), timeout=TIMEOUT)
    assert r.status_code == 500
    assert r.json() == {"error": {"message": f"Internal server error: {PREFILL_FAULT}"}}
    assert "Traceback (most recent call last)" in caplog.text and PREFILL_FAULT in caplog.text
    assert "failed in the worker" in caplog.text
    ok = httpx.post(f"{url}/generate", json=generate_body(23), timeout=TIMEOUT)
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 6
    assert scheduler.counts() == (0, 0)
    assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200


def test_decode_failure_ends_only_its_request(faulty, caplog):
    """A ValueError from the engine is still ours: 500. The requests decoding beside it finish."""
    url, scheduler = faulty

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            return await asyncio.gather(
                client.post("/generate", json=generate_body(POISON_DECODE)),
                *[client.post("/generate", json=generate_body(30 + i, max_new_tokens=12)) for i in range(3)],
                client.post("/v1/completions", json={"prompt": [POISON_DECODE, 5, 6], "max_tokens": 4}))

    with caplog.at_level(logging.ERROR, logger="eagle3.serve"):
        poisoned, *good, completion = asyncio.run(run())
    assert poisoned.status_code == 500
    assert poisoned.json() == {"error": {"message": f"Internal server error: {DECODE_FAULT}"}}
    assert completion.status_code == 500
    assert completion.json() == {"object": "error", "message": f"Internal server error: {DECODE_FAULT}",
                                 "type": "InternalServerError", "param": None, "code": 500}
    assert [r.status_code for r in good] == [200] * 3
    assert [r.json()["meta_info"]["completion_tokens"] for r in good] == [12] * 3
    assert caplog.text.count("Traceback (most recent call last)") == 2 and caplog.text.count(DECODE_FAULT) == 2
    assert scheduler.counts() == (0, 0)


def test_failure_while_streaming_is_one_error_chunk_then_done(faulty):
    """The 200 is already sent: the error travels as a chunk in the endpoint's shape."""
    url, _ = faulty
    with httpx.stream("POST", f"{url}/generate", json=generate_body(POISON_DECODE, stream=True),
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1] == {"error": {"message": f"Internal server error: {DECODE_FAULT}"}}
    assert all("output_ids" in c for c in chunks[:-1])  # the prefill's token came before the failure

    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=TIMEOUT, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200  # a clean chat prompt: the fault needs a poison first token
        assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
    with httpx.stream("POST", f"{url}/v1/completions", timeout=TIMEOUT, json={
            "prompt": [POISON_PREFILL, 5], "max_tokens": 4, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines == ["data: " + json.dumps({"error": {
        "object": "error", "message": f"Internal server error: {PREFILL_FAULT}", "type": "InternalServerError",
        "param": None, "code": 500}}), "data: [DONE]"]
