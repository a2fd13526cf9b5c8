"""`python -m eagle3.serve` over real HTTP on 127.0.0.1: SGLang's endpoints, shapes, logs and metrics.

One server process per test session (the `server` fixture), launched with the seed's flags
`--speculative-num-steps 1 --speculative-eagle-topk 1 --speculative-num-draft-tokens 16`, a tiny
random Llama target with a locally trained BPE tokenizer and chat template, and a random
EAGLE-3 draft exported in SGLang's format by eagle3.export. Error paths that need a failing
engine run in-process in tests/eagle3/serving/test_serve_errors.py.
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

from eagle3.data.target import load_target
from eagle3.data.tiny_target import CorpusFile, stop_token_ids, train_tokenizer
from eagle3.draft.model import DraftModelConfig, Eagle3DraftModel
from eagle3.export import export_sglang
from eagle3.serving.decoding import SamplingParams, SpeculativeEngine, TargetModel
from eagle3.serving.http_api import build_app
from eagle3.serving.scheduler import Scheduler
from eagle3.serving.serve import main as serve_main
from eagle3.serving.settings import ServerSettings, build_settings, load_engine
from eagle3.serving.sglang_args import build_arg_parser, resolve_speculative_args

REPO = Path(__file__).resolve().parents[3]
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
PREFILL_LINE = re.compile(r"Prefill batch, #new-seq: 1, #new-token: (?P<new_token>\d+), #cached-token: 0, "
                          r"token usage: \d+\.\d+, #running-req: (?P<running_req>\d+), #queue-req: (?P<queue_req>\d+)$")
SEED_FLAGS = ["--speculative-num-steps", "1", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "16"]
CONTEXT_LENGTH = 512  # max_position_embeddings of the tiny target
CORPUS_MODULES = ("json/decoder.py", "json/encoder.py", "textwrap.py", "string.py")


def build_model_dirs(root: Path) -> tuple[Path, Path]:
    """Tiny random Llama target (tokenizer + chat template) and a random EAGLE-3 draft in SGLang format."""
    stdlib = Path(json.__file__).parents[1]
    files = [CorpusFile(m, (stdlib / m).read_text()) for m in CORPUS_MODULES]
    tokenizer = train_tokenizer(files, vocab_size=320)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT_LENGTH,
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
    def __init__(self, url: str, log: Path, target_dir: Path, draft_dir: Path, proc: subprocess.Popen,
                 flags: list[str]) -> None:
        self.url, self.log, self.target_dir, self.draft_dir, self.proc = url, log, target_dir, draft_dir, proc
        self.flags = flags  # the launch flags, without `python -m eagle3.serve`

    def log_text(self) -> str:
        return self.log.read_text()

    def log_lines_since(self, offset: int) -> list[str]:
        """Log lines written since `offset` (a len(log_text())), up to everything the worker did so far.

        A response can reach the client before the worker logs the decode line of the iteration
        that finished it; a 1-token request is prefilled only after that line is written, and
        its own prefill line is written before its response, so lines before it are complete.
        """
        marker = post(self, "/generate", {"input_ids": [3], "sampling_params": {"max_new_tokens": 1}})
        assert marker.status_code == 200
        lines = self.log_text()[offset:].splitlines()
        return lines[:max(i for i, ln in enumerate(lines) if "Prefill batch" in ln)]


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    target_dir, draft_dir = build_model_dirs(root)
    port = free_port()
    log = root / "server.log"
    flags = ["--model-path", str(target_dir), "--host", "127.0.0.1", "--port", str(port),
             "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft_dir), *SEED_FLAGS,
             "--max-running-requests", "4", "--decode-log-interval", "1", "--enable-metrics", "--device", "cpu",
             "--random-seed", "0", "--tp-size", "1", "--mem-fraction-static", "0.8"]
    argv = [sys.executable, "-m", "eagle3.serve", *flags]
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
    yield Server(url, log, target_dir, draft_dir, proc, flags)
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


@pytest.fixture(scope="session")
def spec_engine(server):
    """The server's speculative engine rebuilt in this process from the same launch flags."""
    torch.set_num_threads(1)
    engine, _ = load_engine(build_settings(server.flags))
    return engine


def reference_ids(plain_engine, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    engine, _ = plain_engine
    return engine.generate(prompt_ids, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)).output_ids


def post(server, path: str, body) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=TIMEOUT)


def post_raw(server, path: str, content: bytes) -> httpx.Response:
    """A body httpx's json= cannot write (a lone surrogate escape, broken JSON)."""
    return httpx.post(f"{server.url}{path}", content=content, headers={"content-type": "application/json"},
                      timeout=TIMEOUT)


def assert_generate_error(r: httpx.Response, status: int, *fragments: str) -> None:
    """SGLang /generate's error body: {"error": {"message": ...}} and nothing else."""
    assert r.status_code == status, r.text
    body = r.json()
    assert list(body) == ["error"] and list(body["error"]) == ["message"], body
    for fragment in fragments:
        assert fragment in body["error"]["message"], (fragment, body)


def assert_openai_error(r: httpx.Response, status: int, err_type: str, *fragments: str) -> None:
    """SGLang's flat ErrorResponse."""
    assert r.status_code == status, r.text
    body = r.json()
    assert body["object"] == "error" and body["type"] == err_type and body["code"] == status, body
    assert body["param"] is None and set(body) == {"object", "message", "type", "param", "code"}
    for fragment in fragments:
        assert fragment in body["message"], (fragment, body)


def sse_events(r: httpx.Response) -> tuple[list[dict], str]:
    """(JSON chunks, last line) of an SSE response."""
    lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [json.loads(line[6:]) for line in lines[:-1]], lines[-1]


def assert_idle(server) -> None:
    state = httpx.get(f"{server.url}/server_info", timeout=TIMEOUT).json()["internal_states"][0]
    assert (state["num_running_reqs"], state["num_queue_reqs"]) == (0, 0)


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

    ns = build_arg_parser().parse_args(["--model-path", "/nowhere"])
    res = resolve_speculative_args(ns, detected_device="cpu")
    settings = ServerSettings(argv=[], args=ns, resolution=res, spec=None, max_running_requests=4,
                                    context_length=64, served_model_name="m", random_seed=0)
    scheduler = Scheduler(settings)  # never started: still "loading"
    with TestClient(build_app(scheduler, settings)) as client:
        assert client.get("/health").status_code == 503
        assert client.get("/health_generate").status_code == 503
        assert client.get("/metrics").status_code == 404  # only behind --enable-metrics
        assert_generate_error(client.post("/generate", json={"text": "hi"}), 503, "still loading")
        assert_openai_error(client.post("/v1/completions", json={"prompt": "hi"}), 503, "ServiceUnavailable",
                            "still loading")


def test_cli_errors_mirror_argparse(capsys):
    assert serve_main(["--model-path", "/m", "--bogus-flag", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: eagle3.serve")
    assert "eagle3.serve: error: unrecognized arguments: --bogus-flag 1" in err
    assert serve_main(["--model-path", "/m", "--cuda-graph-max-bs", "8"]) == 2
    assert "error: ambiguous option: --cuda-graph-max-bs could match --cuda-graph-max-bs-decode, " \
           "--cuda-graph-max-bs-prefill" in capsys.readouterr().err


# --------------------------------------------------------------------------- generation


def test_generate_equals_plain_greedy_with_spec_meta(server, plain_engine, spec_engine):
    """Output equals plain greedy; spec meta equals the engine's own count of its steps, and the decode log."""
    _, tokenizer = plain_engine
    prompt = "def parse(text):\n    return"
    ids = tokenizer(prompt)["input_ids"]
    expected = reference_ids(plain_engine, ids, 24)
    state = spec_engine.start(ids, SamplingParams(max_new_tokens=24))
    step_tokens = []  # tokens committed by each verify forward, counted here
    while not state.finished:
        step_tokens.append(spec_engine.step(state))
    assert state.output_ids == expected  # greedy speculative == greedy plain
    for body in ({"text": prompt}, {"input_ids": ids}):
        offset = len(server.log_text())
        out = post(server, "/generate", {**body, "sampling_params": {"max_new_tokens": 24, "temperature": 0}}).json()
        decode_lines = [ln for ln in server.log_lines_since(offset) if "Decode batch" in ln]
        assert out["output_ids"] == expected
        assert out["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(ids) and meta["e2e_latency"] > 0
        assert meta["completion_tokens"] == len(out["output_ids"]) == 1 + sum(map(len, step_tokens))
        assert meta["finish_reason"] == state.finish_reason
        assert meta["spec_verify_ct"] == len(step_tokens) == len(decode_lines)  # alone: one verify per decode line
        assert meta["spec_accept_length"] == pytest.approx(len(expected) / len(step_tokens))
        assert meta["spec_num_proposed_drafts"] == len(step_tokens)  # 2 draft tokens: 1 draft per verify
        assert meta["spec_num_correct_drafts"] == state.stats.num_correct_drafts
        assert meta["spec_correct_drafts_histogram"] == state.stats.correct_drafts_histogram
        assert meta["spec_accept_rate"] == pytest.approx(state.stats.num_correct_drafts / len(step_tokens))


def test_generate_stop_strings_and_batches(server):
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    full = post(server, "/generate", {"input_ids": [11, 12, 13], "sampling_params": params}).json()["text"]
    assert len(full) > 8
    stop = full[4:7]
    out = post(server, "/generate", {"input_ids": [11, 12, 13], "sampling_params": {**params, "stop": [stop]}}).json()
    assert out["text"] == full[: full.find(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}

    prompts = [[11, 12, 13], [14, 15], [40, 41, 42, 43]]
    singles = [post(server, "/generate", {"input_ids": p, "sampling_params": params}).json() for p in prompts]
    batch = post(server, "/generate", {"input_ids": prompts, "sampling_params": params, "rid": "b"}).json()
    assert isinstance(batch, list) and len(batch) == len(prompts)
    for i, (one, single) in enumerate(zip(batch, singles)):  # greedy: each element is its prompt's single run
        assert (one["text"], one["output_ids"]) == (single["text"], single["output_ids"])
        assert one["meta_info"]["prompt_tokens"] == len(prompts[i]) and one["meta_info"]["id"] == f"b_{i}"


def test_generate_stream_is_sse_and_ends_with_done(server, plain_engine):
    ids = list(range(5, 17))
    expected = reference_ids(plain_engine, ids, 12)
    with httpx.stream("POST", f"{server.url}/generate", timeout=TIMEOUT,
                      json={"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": 12,
                                                                                  "temperature": 0}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks, last = sse_events(r)
    assert last == "data: [DONE]"
    assert len(chunks) >= 2 and all("index" not in c for c in chunks)
    assert chunks[-1]["output_ids"] == expected and chunks[-1]["meta_info"]["finish_reason"] is not None
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert "spec_verify_ct" in chunks[-1]["meta_info"]


def test_generate_stream_of_a_batch_tags_chunks_with_index(server, plain_engine):
    """SGLang streams a batch as one SSE stream whose chunks carry "index" (_handle_batch_request)."""
    prompts = [[21, 22, 23], [24, 25, 26, 27]]
    expected = [reference_ids(plain_engine, p, 10, ignore_eos=True) for p in prompts]
    with httpx.stream("POST", f"{server.url}/generate", timeout=TIMEOUT, json={
            "input_ids": prompts, "stream": True,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}) as r:
        assert r.status_code == 200
        chunks, last = sse_events(r)
    assert last == "data: [DONE]"
    for index, want in enumerate(expected):
        mine = [c for c in chunks if c["index"] == index]
        assert [c["meta_info"]["finish_reason"] is not None for c in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1]["output_ids"] == want
        assert all(want[:len(c["output_ids"])] == c["output_ids"] for c in mine)  # cumulative, in order
    assert {c["index"] for c in chunks} == {0, 1}


def test_parallel_sampling_n_repeats_the_batch(server, plain_engine):
    """sampling_params.n: SGLang returns batch x n outputs, ordered [p0, p1, p0, p1]."""
    prompts = [[31, 32, 33], [34, 35]]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2}
    expected = [reference_ids(plain_engine, p, 6, ignore_eos=True) for p in prompts]
    outs = post(server, "/generate", {"input_ids": prompts, "sampling_params": params, "rid": "par"}).json()
    assert [o["output_ids"] for o in outs] == expected * 2
    assert [o["meta_info"]["id"] for o in outs] == ["par_0", "par_1", "par_2", "par_3"]
    single = post(server, "/generate", {"input_ids": prompts[0], "sampling_params": params}).json()
    assert isinstance(single, list) and [o["output_ids"] for o in single] == [expected[0]] * 2
    assert_generate_error(post(server, "/generate", {"input_ids": [1], "sampling_params": {"n": 0}}), 400,
                          "sampling_params.n")
    assert_openai_error(post(server, "/v1/completions", {"prompt": "x", "n": 2}), 400, "Bad Request", "n")


def test_twenty_concurrent_requests_and_malformed_ones(server, plain_engine):
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

    offset = len(server.log_text())
    responses = asyncio.run(run())
    good, bad = responses[:10] + responses[14:], responses[10:14]
    # the schema layer (FastAPI's RequestValidationError in SGLang) answers the flat ErrorResponse ...
    assert_openai_error(bad[0], 400, "Bad Request", "input_ids")
    assert_openai_error(bad[1], 400, "Bad Request", "invalid JSON body")
    # ... values refused while handling get /generate's own shape
    assert_generate_error(bad[2], 400, "sampling_params.top_p")
    assert_generate_error(bad[3], 400, "input_ids has token ids outside the vocabulary", "1000000")
    assert [r.status_code for r in good] == [200] * 20
    assert [r.json()["output_ids"] for r in good] == expected
    lines = server.log_lines_since(offset)
    decodes = [DECODE_LINE.match(ln) for ln in lines if "Decode batch" in ln]
    assert decodes and max(int(m["running_req"]) for m in decodes) <= 4  # --max-running-requests 4
    assert len([ln for ln in lines if "Prefill batch" in ln]) == 20  # the refused four never reached the worker


def test_batch_admission_follows_max_running_requests(server, plain_engine):
    """One batch is queued at once, so admission is deterministic: 4 run, the rest wait and go in order."""
    prompts = [[50 + i] + [60] * (i + 1) for i in range(10)]  # distinct lengths show the admission order
    expected = [reference_ids(plain_engine, p, 8, ignore_eos=True) for p in prompts]
    assert_idle(server)
    offset = len(server.log_text())
    outs = post(server, "/generate", {"input_ids": prompts, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}).json()
    assert [o["output_ids"] for o in outs] == expected
    lines = server.log_lines_since(offset)
    prefills = [PREFILL_LINE.search(ln) for ln in lines if "Prefill batch" in ln]
    decodes = [DECODE_LINE.match(ln) for ln in lines if "Decode batch" in ln]
    assert [int(m["queue_req"]) for m in prefills] == list(range(9, -1, -1))  # each admission takes one off
    assert [int(m["running_req"]) for m in prefills[:4]] == [0, 1, 2, 3]
    assert all(int(m["running_req"]) <= 3 for m in prefills)  # a slot was free for every later admission
    assert (int(decodes[0]["running_req"]), int(decodes[0]["queue_req"])) == (4, 6)
    assert all(int(m["running_req"]) <= 4 for m in decodes)
    assert [int(m["new_token"]) for m in prefills] == [len(p) for p in prompts]  # FIFO: batch order


def test_context_length_is_refused_as_sglang_does(server, plain_engine):
    """tokenizer_manager._validate_one_request: input >= context, or input + max_new_tokens > context -> 400."""
    long_ids = [5 + i % 200 for i in range(CONTEXT_LENGTH - 12)]
    params = {"temperature": 0, "ignore_eos": True}
    assert_generate_error(post(server, "/generate", {"input_ids": long_ids, "sampling_params": {
        **params, "max_new_tokens": 13}}), 400, "Requested token count exceeds the model's maximum context length "
        f"of {CONTEXT_LENGTH} tokens. You requested a total of {CONTEXT_LENGTH + 1} tokens")
    full = long_ids + [7] * 12
    assert_generate_error(post(server, "/generate", {"input_ids": full}), 400,
                          f"The input ({CONTEXT_LENGTH} tokens) is longer than the model's context length "
                          f"({CONTEXT_LENGTH} tokens).")
    assert_openai_error(post(server, "/v1/completions", {"prompt": full}), 400, "BadRequest", "longer than")
    fits = post(server, "/generate", {"input_ids": long_ids, "sampling_params": {**params, "max_new_tokens": 12}})
    assert fits.status_code == 200 and fits.json()["output_ids"] == reference_ids(plain_engine, long_ids, 12, True)


def test_missing_empty_and_doubled_inputs_are_400(server):
    cases = [({}, "Either text or input_ids should be provided."),
             ({"sampling_params": {"max_new_tokens": 2}}, "Either text or input_ids should be provided."),
             ({"text": "x", "input_ids": [5]}, "not both"),
             ({"text": ""}, "text cannot be empty."),
             ({"text": []}, "text cannot be empty."),
             ({"text": ["ok", ""]}, "text[1] is empty"),
             ({"input_ids": []}, "input_ids cannot be empty."),
             ({"input_ids": [[5, 6], []]}, "input_ids[1] is empty")]
    for body, message in cases:
        assert_generate_error(post(server, "/generate", body), 400, message)
        assert_generate_error(post(server, "/generate", {**body, "stream": True}), 400, message)
    assert_openai_error(post(server, "/v1/completions", {"prompt": ""}), 400, "BadRequest", "prompt is empty")
    assert_openai_error(post(server, "/v1/completions", {"prompt": []}), 400, "BadRequest", "prompt is empty")
    assert post(server, "/generate", {"text": "ok", "sampling_params": {"max_new_tokens": 2}}).status_code == 200


def test_lone_surrogate_is_400_naming_the_field(server):
    """JSON can carry "\\ud800"; no tokenizer or UTF-8 writer takes it (SGLang's tokenizer: a 500)."""
    assert_generate_error(post_raw(server, "/generate", b'{"text": "ab\\ud800"}'), 400,
                          "text is not valid unicode", "at index 2")
    assert_generate_error(post_raw(server, "/generate", b'{"text": ["ok", "\\udfff"]}'), 400, "text[1]")
    assert_generate_error(post_raw(server, "/generate",
                                   b'{"input_ids": [5], "sampling_params": {"stop": ["\\ud800"]}}'), 400,
                          "sampling_params.stop[0] is not valid unicode")
    assert_openai_error(post_raw(server, "/v1/chat/completions",
                                 b'{"messages": [{"role": "user", "content": "\\ud83d"}]}'), 400, "BadRequest",
                        "messages[0].content is not valid unicode")
    assert post_raw(server, "/generate", b'{"text": "\\ud83d\\ude00 ok", "sampling_params": '
                                         b'{"max_new_tokens": 2}}').status_code == 200  # a valid pair is fine


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
                 "sglang:spec_num_draft_tokens", "sglang:gen_throughput", "sglang:num_running_reqs",
                 "sglang:num_queue_reqs"):
        assert re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} \S+$", text, re.M), name
    # SGLang's tokenizer-side counters: per finished request, labelled model_name + engine_type (+ is_streaming)
    model = 'model_name="{}"'.format(server.target_dir)
    for name, streaming in (("sglang:spec_verify_calls_total", ""), ("sglang:generation_tokens_total", 'is_streaming="false",'),
                            ("sglang:prompt_tokens_total", 'is_streaming="false",'),
                            ("sglang:num_requests_total", 'is_streaming="false",')):
        shown = f'engine_type="unified",{streaming}{model}'  # prometheus_client writes labels in name order
        assert re.search(rf"^{re.escape(name)}\{{{re.escape(shown)}\}} \S+$", text, re.M), name
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


# --------------------------------------------------------------------------- abuse: 4xx, cancellation, a fast health check


def server_counts(server) -> tuple[int, int]:
    state = httpx.get(f"{server.url}/server_info", timeout=TIMEOUT).json()["internal_states"][0]
    return state["num_running_reqs"], state["num_queue_reqs"]


def raw_http(server, head: str, body: bytes) -> socket.socket:
    """A client that writes `head` and `body` by hand (and may leave before the answer or the body's end)."""
    port = int(server.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(head.encode() + b"\r\n\r\n" + body)
    return sock


def new_log(server, offset: int, needle: str, timeout: float = 10) -> str:
    """The server log since `offset`, once `needle` is in it."""
    deadline = time.monotonic() + timeout
    while needle not in (text := server.log_text()[offset:]):
        assert time.monotonic() < deadline, f"{needle!r} not logged:\n{text[-3000:]}"
        time.sleep(0.1)
    return text


def test_deep_json_huge_seed_and_n_past_the_cap_are_400_with_a_reason(server):
    from eagle3.serving.http_api import MAX_BODY_DEPTH
    from eagle3.serving.requests import MAX_PARALLEL_SAMPLES

    deep = b"[" * 100_000 + b"]" * 100_000  # past Python's own recursion limit: the parser gives up
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        assert_openai_error(post_raw(server, path, deep), 400, "Bad Request", "nested deeper than")
    nested = {"input_ids": [5], "sampling_params": {"stop": ["x"]}, "extra": json.loads("[" * 80 + "]" * 80)}
    assert_openai_error(post(server, "/generate", nested), 400, "Bad Request", f"nested deeper than {MAX_BODY_DEPTH}")

    one_token = {"max_new_tokens": 1, "temperature": 0}
    assert_generate_error(post(server, "/generate", {"input_ids": [5], "sampling_params": {**one_token, "seed": 2**70}}),
                          400, "sampling_params.seed")
    assert_openai_error(post(server, "/v1/completions", {"prompt": [5], "max_tokens": 1, "seed": 2**70}), 400,
                        "Bad Request", "seed")
    assert_generate_error(post(server, "/generate", {"input_ids": [5], "sampling_params": {
        **one_token, "n": MAX_PARALLEL_SAMPLES + 1}}), 400, "sampling_params.n")
    for seed in (2**63 - 1, -(2**63)):  # the bounds themselves are served
        ok = post(server, "/generate", {"input_ids": [5], "sampling_params": {**one_token, "seed": seed}})
        assert ok.status_code == 200, ok.text
    at_cap = post(server, "/generate", {"input_ids": [5], "sampling_params": {**one_token, "n": MAX_PARALLEL_SAMPLES}})
    assert at_cap.status_code == 200 and len(at_cap.json()) == MAX_PARALLEL_SAMPLES
    assert "Internal error" not in server.log_text()
    assert_idle(server)


def test_a_client_gone_mid_body_is_one_info_line(server):
    offset = len(server.log_text())
    sock = raw_http(server, "POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                            "Content-Length: 100000", b'{"text": "only the start of the body')
    time.sleep(0.3)
    sock.close()
    log = new_log(server, offset, "Request dropped: the client disconnected before its request body was complete")
    assert "Traceback" not in log and "Internal error" not in log
    assert_idle(server)


def test_a_dropped_whole_answer_is_cancelled_queued_and_running(server):
    """A non-streaming call of 64 generations x 300 tokens (~20 s of decoding here) whose client leaves once
    it runs: every request of the call is cancelled within a few seconds, the rest never prefilled."""
    offset = len(server.log_text())
    body = json.dumps({"input_ids": [9, 10, 11], "sampling_params": {
        "max_new_tokens": 300, "temperature": 0, "ignore_eos": True, "n": 64}}).encode()
    sock = raw_http(server, f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                            f"Content-Length: {len(body)}", body)
    deadline = time.monotonic() + 30
    while server_counts(server) != (4, 60):  # --max-running-requests 4: four run, sixty wait
        assert time.monotonic() < deadline, server_counts(server)
        time.sleep(0.05)
    sock.close()
    left = time.monotonic()
    while server_counts(server) != (0, 0):
        assert time.monotonic() - left < 5, f"still {server_counts(server)} (running, queued) after the client left"
        time.sleep(0.1)
    log = new_log(server, offset, "Request dropped: the client disconnected before its answer was ready")
    assert "Traceback" not in log
    assert len([ln for ln in log.splitlines() if "Prefill batch" in ln]) < 64


def test_health_answers_at_once_while_a_huge_prompt_is_tokenized(server):
    """~3 MB of text takes seconds to tokenize; /health must not wait for it (it did: the whole time)."""
    stdlib = Path(json.__file__).parents[1]
    text = "".join((stdlib / m).read_text() for m in CORPUS_MODULES)
    huge = (text * (3_000_000 // len(text) + 1))[:3_000_000]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
            big = asyncio.create_task(client.post("/generate", json={"text": huge}))
            started, waits = time.monotonic(), []
            while not big.done():
                asked = time.monotonic()
                assert (await client.get("/health")).status_code == 200
                waits.append(time.monotonic() - asked)
                await asyncio.sleep(0.2)
            return await big, time.monotonic() - started, waits

    big, took, waits = asyncio.run(run())
    assert_generate_error(big, 400, "longer than the model's context length")
    assert took > 2.0, f"the huge prompt took {took:.1f} s: too little to show anything"
    assert len(waits) >= 5 and max(waits) < 1.5, (took, waits)
