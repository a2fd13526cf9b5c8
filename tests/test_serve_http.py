"""`python -m eagle3.serve` over real HTTP on 127.0.0.1: SGLang's endpoints, shapes, logs and metrics.

One server process per test session (the `server` fixture), launched with the seed's flags
`--speculative-num-steps 1 --speculative-eagle-topk 1 --speculative-num-draft-tokens 16`, a tiny
random Llama target with a locally trained BPE tokenizer and chat template, and a random
EAGLE-3 draft exported in SGLang's format by eagle3.export.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from eagle3 import serve
from eagle3.decoding import SamplingParams, SpeculativeEngine, TargetModel
from eagle3.export import export_sglang
from eagle3.model import DraftModelConfig, Eagle3DraftModel
from eagle3.tiny_target import CorpusFile, load_target, stop_token_ids, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = httpx.Timeout(60.0)
# reference sglang-eagle3.md §5
DECODE_LINE = re.compile(
    r"^\[(?P<ts>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:\.\d{3})?)(?P<ranks>(?: [A-Z_]+\d+)*)\] Decode batch"
    r"(?: \[(?P<iter>\d+)\])?, #running-req: (?P<running_req>\d+), "
    r"(?P<usage>(?:(?!accept len: |cap len: |block accept len: ).)*?)"
    r"(?:accept len: (?P<accept_len>\d+\.\d+), accept rate: (?P<accept_rate>\d+\.\d+), )?"
    r"(?:cap len: (?P<cap_len>\d+\.\d+), )?(?:block accept len: (?P<block_accept_len>\d+\.\d+), )?"
    r"(?P<extra>(?:(?!accept len: |cap len: |block accept len: ).)*?)(?P<graph_label>cuda|cpu|npu|musa) graph: "
    r"(?P<graph>True|False), gen throughput \(token/s\): (?P<gen_throughput>\d+\.\d+), #queue-req: (?P<queue_req>\d+)"
)
SEED_FLAGS = ["--speculative-num-steps", "1", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "16"]
CORPUS_MODULES = ("json/decoder.py", "json/encoder.py", "textwrap.py", "string.py")


def build_model_dirs(root: Path) -> tuple[Path, Path]:
    """Tiny random Llama target (tokenizer + chat template) and a random EAGLE-3 draft in SGLang format."""
    stdlib = Path(json.__file__).parents[1]
    files = [CorpusFile(m, (stdlib / m).read_text()) for m in CORPUS_MODULES]
    tokenizer = train_tokenizer(files, vocab_size=320)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=stop_token_ids(tokenizer),
                      pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    target_dir, draft_dir = root / "target", root / "draft"
    LlamaForCausalLM(cfg).save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir, save_jinja_files=False)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=stop_token_ids(tokenizer),
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(target_dir)
    dcfg = DraftModelConfig.from_target_config(cfg.to_dict(), draft_vocab_size=len(tokenizer), aux_layer_ids=[0, 1, 2])
    draft = Eagle3DraftModel(dcfg)
    export_sglang(draft, json.loads((target_dir / "config.json").read_text()), draft_dir, dtype="float32")
    return target_dir, draft_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, url: str, log: Path, target_dir: Path, draft_dir: Path, proc: subprocess.Popen) -> None:
        self.url, self.log, self.target_dir, self.draft_dir, self.proc = url, log, target_dir, draft_dir, proc

    def log_text(self) -> str:
        return self.log.read_text()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    target_dir, draft_dir = build_model_dirs(root)
    port = free_port()
    log = root / "server.log"
    argv = [sys.executable, "-m", "eagle3.serve", "--model-path", str(target_dir), "--host", "127.0.0.1",
            "--port", str(port), "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft_dir),
            *SEED_FLAGS, "--max-running-requests", "4", "--decode-log-interval", "1", "--enable-metrics",
            "--device", "cpu", "--random-seed", "0", "--tp-size", "1", "--mem-fraction-static", "0.8"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"server not healthy after 90 s:\n{log.read_text()}")
        time.sleep(0.2)
    yield Server(url, log, target_dir, draft_dir, proc)
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


@pytest.fixture(scope="session")
def plain_engine(server):
    torch.set_num_threads(1)
    model, tokenizer = load_target(server.target_dir)
    return SpeculativeEngine(TargetModel(model)), tokenizer


def reference_ids(plain_engine, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    engine, _ = plain_engine
    return engine.generate(prompt_ids, SamplingParams(max_new_tokens=max_new_tokens)).output_ids


def post(server, path: str, body) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=TIMEOUT)


# --------------------------------------------------------------------------- startup and info


def test_startup_log_has_sglang_warnings_and_ready_line(server):
    log = server.log_text()
    assert ("speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when "
            "speculative_eagle_topk == 1") in log
    assert "Overlap schedule is not implemented for speculative decoding on CPU." in log
    assert "Ignoring --tp-size=1" in log and "Ignoring --mem-fraction-static=0.8" in log
    assert "The server is fired up and ready to roll!" in log
    assert log.index("speculative_num_draft_tokens is adjusted") < log.index("The server is fired up")


def test_server_info_reports_resolved_settings(server):
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(f"{server.url}{path}", timeout=TIMEOUT).json()
        assert info["speculative_algorithm"] == "EAGLE3"
        assert (info["speculative_num_steps"], info["speculative_eagle_topk"], info["speculative_num_draft_tokens"]) \
            == (1, 1, 2)
        assert info["max_running_requests"] == 4
        assert info["model_path"] == str(server.target_dir)
        assert info["speculative_draft_model_path"] == str(server.draft_dir)
        assert "--speculative-num-draft-tokens 16" in info["launch_command"]
        assert info["version"].startswith("0.5.23")
        assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 4
    assert "Endpoint '/get_server_info' is deprecated" in server.log_text()


def test_v1_models(server):
    data = httpx.get(f"{server.url}/v1/models", timeout=TIMEOUT).json()["data"]
    assert [m["id"] for m in data] == [str(server.target_dir)]


def test_health_is_503_while_loading():
    """In-process app whose worker has not finished loading."""
    from starlette.testclient import TestClient

    ns = serve.build_arg_parser().parse_args(["--model-path", "/nowhere"])
    res = serve.resolve_speculative_args(ns, detected_device="cpu")
    settings = serve.ServerSettings(argv=[], args=ns, resolution=res, spec=None, max_running_requests=4,
                                    context_length=64, served_model_name="m", random_seed=0)
    scheduler = serve.Scheduler(settings)  # never started: still "loading"
    with TestClient(serve.build_app(scheduler, settings)) as client:
        assert client.get("/health").status_code == 503
        assert client.get("/health_generate").status_code == 503
        assert client.get("/metrics").status_code == 404  # only behind --enable-metrics


def test_cli_errors_mirror_argparse(capsys):
    assert serve.main(["--model-path", "/m", "--bogus-flag", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: eagle3.serve")
    assert "eagle3.serve: error: unrecognized arguments: --bogus-flag 1" in err
    assert serve.main(["--model-path", "/m", "--cuda-graph-max-bs", "8"]) == 2
    assert "error: ambiguous option: --cuda-graph-max-bs could match --cuda-graph-max-bs-decode, " \
           "--cuda-graph-max-bs-prefill" in capsys.readouterr().err


# --------------------------------------------------------------------------- generation


def test_generate_equals_plain_greedy_with_spec_meta(server, plain_engine):
    _, tokenizer = plain_engine
    prompt = "def parse(text):\n    return"
    ids = tokenizer(prompt)["input_ids"]
    expected = reference_ids(plain_engine, ids, 24)
    for body in ({"text": prompt}, {"input_ids": ids}):
        out = post(server, "/generate", {**body, "sampling_params": {"max_new_tokens": 24, "temperature": 0}}).json()
        assert out["output_ids"] == expected
        assert out["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == len(expected)
        assert meta["finish_reason"]["type"] in ("length", "stop")
        assert meta["spec_verify_ct"] >= 1 and meta["e2e_latency"] > 0
        assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])
        assert meta["spec_num_proposed_drafts"] == meta["spec_verify_ct"]  # 2 draft tokens -> 1 draft per verify
        assert meta["spec_accept_rate"] == pytest.approx(meta["spec_num_correct_drafts"] / meta["spec_verify_ct"])


def test_generate_stop_strings_and_batches(server):
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    full = post(server, "/generate", {"input_ids": [11, 12, 13], "sampling_params": params}).json()["text"]
    assert len(full) > 8
    stop = full[4:7]
    out = post(server, "/generate", {"input_ids": [11, 12, 13], "sampling_params": {**params, "stop": [stop]}}).json()
    assert out["text"] == full[: full.find(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    batch = post(server, "/generate", {"input_ids": [[11, 12, 13], [14, 15]], "sampling_params": params}).json()
    assert isinstance(batch, list) and len(batch) == 2 and batch[0]["text"] == full


def test_generate_stream_is_sse_and_ends_with_done(server, plain_engine):
    ids = list(range(5, 17))
    expected = reference_ids(plain_engine, ids, 12)
    with httpx.stream("POST", f"{server.url}/generate", timeout=TIMEOUT,
                      json={"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": 12,
                                                                                  "temperature": 0}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert len(chunks) >= 2
    assert chunks[-1]["output_ids"] == expected and chunks[-1]["meta_info"]["finish_reason"] is not None
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert "spec_verify_ct" in chunks[-1]["meta_info"]


def test_twenty_concurrent_requests_and_a_malformed_one(server, plain_engine):
    prompts = [[7 + i, 20 + 3 * i, 40, 41, 42 + i] for i in range(20)]
    expected = [reference_ids(plain_engine, p, 16) for p in prompts]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
            good = [client.post("/generate", json={"input_ids": p, "sampling_params": {"max_new_tokens": 16,
                                                                                        "temperature": 0}})
                    for p in prompts]
            bad = [client.post("/generate", json={"input_ids": ["x"], "sampling_params": {}}),
                   client.post("/generate", content=b"{not json", headers={"content-type": "application/json"}),
                   client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"top_p": 2.0}}),
                   client.post("/generate", json={"input_ids": [10 ** 6]})]
            return await asyncio.gather(*good[:10], *bad, *good[10:])

    responses = asyncio.run(run())
    good, bad = responses[:10] + responses[14:], responses[10:14]
    for r in bad:
        assert r.status_code == 400
        body = r.json()
        assert body["object"] == "error" and body["code"] == 400 and body["message"]
    assert [r.status_code for r in good] == [200] * 20
    assert [r.json()["output_ids"] for r in good] == expected
    # max_running_requests=4: four decoded together, the rest waited in the queue (none dropped)
    lines = [DECODE_LINE.match(ln) for ln in server.log_text().splitlines() if "Decode batch" in ln]
    assert max(int(m["running_req"]) for m in lines) == 4
    assert any(int(m["queue_req"]) > 0 for m in lines)


def test_openai_completions_and_chat(server, plain_engine):
    _, tokenizer = plain_engine
    out = post(server, "/v1/completions", {"model": "x", "prompt": "import os\n", "max_tokens": 10, "temperature": 0,
                                           "return_spec_tokens_details": True}).json()
    ids = tokenizer("import os\n")["input_ids"]
    expected = reference_ids(plain_engine, ids, 10)
    assert out["object"] == "text_completion"
    assert out["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(expected),
                            "total_tokens": len(ids) + len(expected)}
    details = out["sglext"]["spec_tokens_details"]
    assert details["spec_verify_ct"] >= 1 and details["spec_accept_length"] > 0

    messages = [{"role": "user", "content": "Write a function."}]
    chat = post(server, "/v1/chat/completions", {"model": "x", "messages": messages, "max_tokens": 8,
                                                  "temperature": 0}).json()
    templated = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    chat_ids = tokenizer(templated, add_special_tokens=False)["input_ids"]
    expected = reference_ids(plain_engine, chat_ids, 8)
    assert chat["object"] == "chat.completion" and chat["usage"]["prompt_tokens"] == len(chat_ids)
    assert chat["choices"][0]["message"] == {"role": "assistant",
                                             "content": tokenizer.decode(expected, skip_special_tokens=True)}
    assert chat["choices"][0]["finish_reason"] in ("length", "stop") and "sglext" not in chat

    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=TIMEOUT,
                      json={"messages": messages, "max_tokens": 8, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]) == \
        chat["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"]["completion_tokens"] == chat["usage"]["completion_tokens"]
    assert post(server, "/v1/chat/completions", {"messages": []}).status_code == 400
    assert post(server, "/v1/completions", {"prompt": "x", "top_k": 0}).status_code == 400


# --------------------------------------------------------------------------- stats, metrics, logs


def test_server_stats_agree_with_the_decoder(server):
    assert httpx.post(f"{server.url}/flush_cache", timeout=TIMEOUT).status_code == 200
    info = httpx.get(f"{server.url}/server_info", timeout=TIMEOUT).json()
    assert "avg_spec_accept_length" not in info["internal_states"][0]  # reset by the flush
    metas = [post(server, "/generate", {"input_ids": [30 + i, 31, 32], "sampling_params": {
        "max_new_tokens": 20, "temperature": 0, "ignore_eos": True}}).json()["meta_info"] for i in range(4)]
    verifies = sum(m["spec_verify_ct"] for m in metas)
    # decode-log interval 1: the lifetime counters are current; the prefill token is not a verify token
    expected = sum(m["completion_tokens"] - 1 for m in metas) / verifies
    info = httpx.get(f"{server.url}/server_info", timeout=TIMEOUT).json()
    assert info["internal_states"][0]["avg_spec_accept_length"] == pytest.approx(expected)

    text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
    labels = 'engine_type="unified",model_name="{}",moe_ep_rank="0",pp_rank="0",tp_rank="0"'.format(server.target_dir)
    for name in ("sglang:spec_accept_length", "sglang:spec_accept_rate", "sglang:spec_num_steps",
                 "sglang:spec_num_draft_tokens", "sglang:spec_verify_calls_total", "sglang:gen_throughput",
                 "sglang:generation_tokens_total", "sglang:num_running_reqs", "sglang:num_queue_reqs"):
        assert re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} \S+$", text, re.M), name
    values = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(sglang:\w+)\{[^}]*\} (\S+)$", text, re.M)}
    assert values["sglang:spec_num_draft_tokens"] == 2 and values["sglang:spec_num_steps"] == 1
    assert values["sglang:spec_verify_calls_total"] >= verifies
    assert values["sglang:num_running_reqs"] == 0


def test_decode_log_lines_match_sglang_format(server):
    post(server, "/generate", {"input_ids": [9, 8, 7], "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    lines = [ln for ln in server.log_text().splitlines() if "Decode batch" in ln]
    assert lines
    for line in lines:
        m = DECODE_LINE.match(line)
        assert m, line
        assert m["accept_len"] is not None and float(m["accept_len"]) >= 1.0
        assert m["graph_label"] == "cpu" and m["graph"] == "False" and m["ranks"] == ""
        assert m["usage"].startswith("#token: ") and ", token usage: " in m["usage"]


def test_flush_cache_refused_while_a_request_runs(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
            async with client.stream("POST", "/generate", json={
                    "input_ids": [5, 6, 7], "stream": True,
                    "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}}) as r:
                lines = r.aiter_lines()
                while not (await lines.__anext__()).startswith("data: {"):
                    pass
                status = (await client.post("/flush_cache")).status_code
                async for _ in lines:
                    pass
                return status

    assert asyncio.run(run()) == 400
