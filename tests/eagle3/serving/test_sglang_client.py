"""eagle3.serving.sglang_client against a real `python -m eagle3.serve` over HTTP on 127.0.0.1.

One reference server per module (tiny random Llama target + random EAGLE-3 draft, the seed's
speculative flags, `--decode-log-interval 1 --enable-metrics`, log to a file). What the client
reports is checked against what the server counts itself (/metrics counters, its decode log,
/server_info), not against the client's own bookkeeping. SGLang's incremental stream mode,
which eagle3.serve does not implement, is replayed by a scripted loopback SSE server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from test_serve_http import SEED_FLAGS, build_model_dirs, free_port

from eagle3.serving.bench_prompts import builtin_prompts, render_prompts
from eagle3.serving.sglang_client import (
    BenchResult,
    SGLangClient,
    SGLangError,
    _merge_stream_ids,
    _TokenClock,
    compare_client_server,
    metric_total,
    parse_decode_line,
    percentile,
    run_benchmark,
    summarize_decode_log,
)

REPO = Path(__file__).resolve().parents[3]
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


# --------------------------------------------------------------------------- the reference server


class RefServer:
    def __init__(self, url: str, log: Path, target_dir: Path, proc: subprocess.Popen) -> None:
        self.url, self.log, self.target_dir, self.proc = url, log, target_dir, proc

    def log_size(self) -> int:
        return self.log.stat().st_size

    def log_since(self, offset: int) -> str:
        with self.log.open() as fh:
            fh.seek(offset)
            return fh.read()


def launch_reference_server(target_dir: Path, draft_dir: Path, log: Path, extra: list[str],
                            startup_timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """Start eagle3.serve in its own process group on a free loopback port; wait until /health is 200."""
    port = free_port()
    argv = [sys.executable, "-m", "eagle3.serve", "--model-path", str(target_dir), "--host", "127.0.0.1",
            "--port", str(port), "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
            str(draft_dir), *SEED_FLAGS, "--device", "cpu", "--random-seed", "0", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    with SGLangClient(url, timeout=30) as client:
        try:
            client.wait_healthy(startup_timeout, poll_s=0.3)
        except TimeoutError:
            stop_server(proc)
            raise RuntimeError(f"server not healthy:\n{log.read_text()[-3000:]}") from None
    return proc, url


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


@pytest.fixture(scope="module")
def ref_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("client")
    target_dir, draft_dir = build_model_dirs(root)
    log = root / "server.log"
    proc, url = launch_reference_server(target_dir, draft_dir, log, [
        "--max-running-requests", "4", "--decode-log-interval", "1", "--enable-metrics"])
    yield RefServer(url, log, target_dir, proc)
    stop_server(proc)


@pytest.fixture()
def client(ref_server):
    with SGLangClient(ref_server.url, timeout=120) as c:
        yield c


# --------------------------------------------------------------------------- pure parts


def test_token_clock_follows_bench_serving():
    clock = _TokenClock(start=0.0)
    for now, total in ((1.0, 1), (1.4, 3), (1.5, 3), (2.0, 4)):
        clock.tokens_so_far(total, now)
    assert clock.ttft_s == 1.0
    assert clock.itl_s == pytest.approx([0.2, 0.2, 0.6])


def test_stream_ids_cumulative_and_incremental():
    assert _merge_stream_ids([], [5, 7], 2) == ([5, 7], True)
    assert _merge_stream_ids([5, 7], [9], 3) == ([5, 7, 9], False)
    assert _merge_stream_ids([5, 7], [5, 7, 9], 3) == ([5, 7, 9], True)
    # incremental chunk that happens to repeat the ids so far: the running total decides
    assert _merge_stream_ids([5], [5], 2) == ([5, 5], False)
    # cumulative chunk serialized after more tokens arrived (SGLang passes its list by reference)
    assert _merge_stream_ids([5, 7], [5, 7, 9, 4], 3) == ([5, 7, 9, 4], True)
    assert _merge_stream_ids([5, 7], [5, 7, 9], None) == ([5, 7, 9], True)


def test_percentile_interpolates_like_numpy():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)
    assert percentile([], 50) is None


REFERENCE_LINES = [
    "[2026-11-29 10:44:00] Decode batch, #running-req: 1, #token: 1033, token usage: 0.01, accept len: 3.21, "
    "accept rate: 0.55, cuda graph: True, gen throughput (token/s): 215.33, #queue-req: 0",
    "[2026-11-29 10:44:00 TP0] Decode batch, #running-req: 8, #token: 9120, token usage: 0.05, accept len: 2.88, "
    "accept rate: 0.62, cuda graph: True, gen throughput (token/s): 1432.10, #queue-req: 3",
    "[2026-11-29 10:44:00 DP1 TP3] Decode batch [1234], #running-req: 48, #full token: 5000, full token usage: 0.10, "
    "#swa token: 800, swa token usage: 0.20, accept len: 1.68, accept rate: 0.34, cuda graph: True, "
    "gen throughput (token/s): 56.80, #queue-req: 0",
    "[2026-11-29 10:44:00] Decode batch, #running-req: 2, #token: 88, token usage: 0.00, cuda graph: True, "
    "gen throughput (token/s): 90.00, #queue-req: 0",
]


def test_decode_line_regex_on_the_reference_examples():
    first, tp, dp, plain = map(parse_decode_line, REFERENCE_LINES)
    assert (first["running_req"], first["accept_len"], first["accept_rate"], first["gen_throughput"]) == \
        (1, 3.21, 0.55, 215.33)
    assert tp["ranks"] == ["TP0"] and tp["queue_req"] == 3 and tp["gen_throughput"] == 1432.10
    assert dp["ranks"] == ["DP1", "TP3"] and dp["iter"] == 1234 and dp["running_req"] == 48 and dp["accept_len"] == 1.68
    assert plain["accept_len"] is None and plain["graph"] is True and plain["graph_label"] == "cuda"
    assert parse_decode_line("server-1  | " + REFERENCE_LINES[0])["accept_len"] == 3.21
    assert parse_decode_line("[2026-11-29 10:44:00] Prefill batch, #new-seq: 1, #new-token: 8") is None
    summary = summarize_decode_log("\n".join(["noise", *REFERENCE_LINES]))
    assert summary["lines"] == 4 and summary["max_running_req"] == 48 and summary["max_queue_req"] == 3
    assert summary["accept_len_mean"] == pytest.approx((3.21 + 2.88 + 1.68) / 3) and summary["accept_len_last"] == 1.68
    assert summary["gen_throughput_last"] == 90.00


# --------------------------------------------------------------------------- against the reference server


def test_streamed_generate_equals_non_streamed(client):
    prompt = [40, 41, 42, 43, 44, 45]
    streamed = client.generate(prompt, GREEDY, stream=True)
    plain = client.generate(prompt, GREEDY, stream=False)
    meta = plain.meta_info
    assert streamed.output_ids == plain.output_ids and len(streamed.output_ids) == 12
    assert streamed.completion_tokens == len(streamed.output_ids) == meta["completion_tokens"]
    assert streamed.prompt_tokens == len(prompt)
    assert streamed.spec_verify_ct == meta["spec_verify_ct"] >= 1
    assert streamed.accept_length == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])
    assert streamed.accept_length == pytest.approx(meta["spec_accept_length"])
    assert streamed.decode_accept_length == pytest.approx((meta["completion_tokens"] - 1) / meta["spec_verify_ct"])
    assert streamed.text == plain.text
    # eagle3.serve streams the prefill token alone, then one chunk per verify: every later token has an ITL
    assert streamed.ttft_s is not None and 0 < streamed.ttft_s <= streamed.e2e_s
    assert len(streamed.itl_s) == streamed.completion_tokens - 1
    assert plain.ttft_s is None and plain.itl_s == []
    by_text = client.generate("def f(x):\n", GREEDY)
    assert by_text.completion_tokens == 12 and by_text.prompt_tokens > 0


def test_openai_endpoints_give_the_same_result(client, ref_server):
    prompt = [40, 41, 42, 43, 44, 45]
    reference = client.generate(prompt, GREEDY)
    completion = client.completion(prompt, max_tokens=12, temperature=0.0, extra={"ignore_eos": True})
    assert completion.output_ids is None
    assert completion.text == reference.text
    assert (completion.prompt_tokens, completion.completion_tokens) == (6, 12)
    assert completion.spec_verify_ct == reference.spec_verify_ct
    assert completion.accept_length == pytest.approx(reference.accept_length)
    assert completion.meta_info["spec_accept_length"] == pytest.approx(reference.accept_length)
    assert completion.ttft_s is not None and len(completion.itl_s) >= 1

    conversation = builtin_prompts(1, seed=5)[0]
    [ids] = render_prompts([conversation], ref_server.target_dir)
    chat = client.chat(conversation, max_tokens=6, extra={"ignore_eos": True})
    by_ids = client.generate(ids, {**GREEDY, "max_new_tokens": 6})
    assert chat.prompt_tokens == len(ids)  # same template rendering as the server's chat endpoint
    assert chat.text == by_ids.text and chat.completion_tokens == 6
    assert chat.spec_verify_ct == by_ids.spec_verify_ct


def test_server_endpoints(client, ref_server):
    info = client.server_info()
    assert info["speculative_algorithm"] == "EAGLE3" and info["max_running_requests"] == 4
    assert client.model_name() == str(ref_server.target_dir)
    assert client.health()
    metrics = client.metrics()
    assert metrics["sglang:spec_num_draft_tokens"][0].value == 2
    assert metrics["sglang:spec_num_draft_tokens"][0].labels["model_name"] == str(ref_server.target_dir)
    before = metric_total(metrics, "sglang:e2e_request_latency_seconds_count")
    client.generate([7, 8, 9], GREEDY)
    after = metric_total(client.metrics(), "sglang:e2e_request_latency_seconds_count")
    assert after - before == 1
    assert client.flush_cache() is True
    assert "avg_spec_accept_length" not in client.server_info()["internal_states"][0]
    with pytest.raises(SGLangError, match="HTTP 400"):
        client.generate([10 ** 6], GREEDY)
    with pytest.raises(SGLangError, match="HTTP 400"):
        client.generate([10 ** 6], GREEDY, stream=False)


def settled_avg_accept_length(client: SGLangClient, expected: float, polls: int = 50) -> float | None:
    """/server_info avg_spec_accept_length, re-read (bounded) until it equals `expected`; the last value seen."""
    value = None
    for _ in range(polls):
        value = client.server_info()["internal_states"][0].get("avg_spec_accept_length")
        if value is not None and value == pytest.approx(expected, rel=1e-9):
            break
        time.sleep(0.1)
    return value


def test_run_benchmark_counts_requests_and_honours_concurrency(client, ref_server):
    prompts = render_prompts(builtin_prompts(4, seed=7), ref_server.target_dir)
    metrics_before = client.metrics()
    log_offset = ref_server.log_size()
    result = run_benchmark(client, prompts, warmup_runs=1, timed_runs=2, concurrency=2, max_new_tokens=8,
                           temperature=0.0, endpoint="generate", ignore_eos=True)
    metrics_after = client.metrics()

    # the server counted (1 warm-up + 2 timed) x 4 prompts requests and their tokens
    def rise(name: str) -> float:
        return metric_total(metrics_after, name) - metric_total(metrics_before, name)

    assert rise("sglang:e2e_request_latency_seconds_count") == 3 * 4
    assert rise("sglang:generation_tokens_total") == 3 * 4 * 8
    assert len(result.warmup) == 1 and len(result.runs) == 2
    assert [r.num_requests for r in result.runs] == [4, 4] and result.output_tokens == 2 * 4 * 8
    # never more than 2 requests decoding at once (server max is 4), and 2 did run together
    log = summarize_decode_log(ref_server.log_since(log_offset))
    assert log["lines"] > 0 and log["max_running_req"] == 2

    srv = result.server
    assert srv.flushed
    assert srv.metrics_delta["sglang:e2e_request_latency_seconds_count"] == 2 * 4
    assert srv.metrics_accept_length == pytest.approx(result.accept_length, rel=1e-9)
    # the server closes a decode-log window after sending that iteration's tokens, so the
    # /server_info read right after the last response may miss the last window (within tolerance);
    # once it has closed (decode-log interval 1) the lifetime average covers exactly the timed runs
    assert srv.avg_spec_accept_length == pytest.approx(result.decode_accept_length, rel=0.05)
    assert settled_avg_accept_length(client, result.decode_accept_length) == \
        pytest.approx(result.decode_accept_length, rel=1e-9)
    assert result.accept_length == pytest.approx(
        sum(r.completion_tokens for run in result.runs for r in run.requests)
        / sum(r.spec_verify_ct for run in result.runs for r in run.requests))
    flags = compare_client_server(result)
    assert not [f for f in flags if not f.startswith("throughput")], flags

    summary = result.summary()
    for name in ("output_tok_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "accept_length"):
        stats = summary[name]
        assert stats["min"] <= stats["median"] <= stats["max"], name
    flat = result.flat_metrics()
    assert flat["output_tok_per_s_median"] == summary["output_tok_per_s"]["median"]
    assert flat["server_avg_spec_accept_length"] == srv.avg_spec_accept_length


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_run_benchmark_openai_endpoints(client, ref_server, endpoint):
    conversations = builtin_prompts(3, seed=11)
    prompts = conversations if endpoint == "chat" else render_prompts(conversations, ref_server.target_dir)
    before = client.metrics()
    result = run_benchmark(client, prompts, warmup_runs=0, timed_runs=1, concurrency=3, max_new_tokens=5,
                           endpoint=endpoint, ignore_eos=True)
    after = client.metrics()
    assert metric_total(after, "sglang:e2e_request_latency_seconds_count") - \
        metric_total(before, "sglang:e2e_request_latency_seconds_count") == 3
    assert result.output_tokens == 15 and result.accept_length is not None
    assert result.server.metrics_accept_length == pytest.approx(result.accept_length, rel=1e-9)


def test_run_benchmark_logs_a_line_per_round_with_its_tok_s(client):
    lines: list[str] = []
    result = run_benchmark(client, [[20, 21, 22], [23, 24]], warmup_runs=2, timed_runs=3, max_new_tokens=4,
                           ignore_eos=True, log=lines.append, log_every_s=0)
    rounds = result.warmup + result.runs
    assert [line.split(":")[0] for line in lines] == ["warm-up 1/2", "warm-up 2/2", "timed run 1/3", "timed run 2/3",
                                                      "timed run 3/3"]
    for line, run in zip(lines, rounds):
        assert f": {run.output_tok_per_s:.1f} tok/s (2 requests in {run.wall_s:.1f} s" in line
    assert all("s left)" in line for line in lines[:-1]) and lines[-1].endswith(" s)")
    # at most one line every log_every_s: rounds this short give none in an hour
    quiet: list[str] = []
    run_benchmark(client, [[20, 21, 22]], warmup_runs=1, timed_runs=2, max_new_tokens=4, ignore_eos=True,
                  log=quiet.append, log_every_s=3600)
    assert quiet == []


def test_run_benchmark_rejects_bad_arguments(client):
    with pytest.raises(ValueError, match="endpoint 'chat' needs a list of messages"):
        run_benchmark(client, [[1, 2, 3]], endpoint="chat", timed_runs=1)
    with pytest.raises(ValueError, match="needs token ids or a non-empty str"):
        run_benchmark(client, [[{"role": "user", "content": "x"}]], endpoint="generate")
    with pytest.raises(ValueError, match="concurrency must be an int >= 1"):
        run_benchmark(client, [[1, 2]], concurrency=0)
    with pytest.raises(ValueError, match="endpoint must be one of"):
        run_benchmark(client, [[1, 2]], endpoint="v2")


def test_decode_regex_on_the_reference_servers_log(ref_server, client):
    client.generate([3, 4, 5], GREEDY)
    text = ref_server.log.read_text()  # once: the server may still be writing its last decode line
    lines = [ln for ln in text.splitlines() if "Decode batch" in ln]
    assert lines and all(parse_decode_line(ln) is not None for ln in lines)
    summary = summarize_decode_log(text)
    assert summary["lines"] == len(lines) and summary["accept_len_last"] >= 1.0
    assert summary["gen_throughput_last"] > 0


def test_compare_flags_disagreements_with_both_numbers(client):
    result = run_benchmark(client, [[20, 21, 22]], warmup_runs=0, timed_runs=1, max_new_tokens=6, ignore_eos=True)
    assert not [f for f in compare_client_server(result) if not f.startswith("throughput")]
    srv = result.server
    off = replace(result, server=replace(srv, avg_spec_accept_length=srv.avg_spec_accept_length * 1.5,
                                         metrics_delta={**srv.metrics_delta, "sglang:generation_tokens_total": 99.0},
                                         last_gen_throughput=1e9))
    flags = compare_client_server(off)
    client_decode = f"{result.decode_accept_length:.3f}"
    assert any(f.startswith("accept length: client (decode") and client_decode in f
               and f"{srv.avg_spec_accept_length * 1.5:.3f}" in f for f in flags), flags
    assert any(f.startswith("output tokens: client counted 6") and "rose by 99" in f for f in flags), flags
    assert any(f.startswith("throughput:") and "1000000000.0" in f for f in flags), flags
    # No avg_spec_accept_length (no decode-log tick yet): the /metrics ratio still cross-checks, so no flag...
    lagging = replace(result, server=replace(srv, avg_spec_accept_length=None))
    assert not [f for f in compare_client_server(lagging) if "accept" in f]
    # ...but with neither server figure nothing confirms the client's accept length: flagged.
    missing = replace(result, server=replace(srv, avg_spec_accept_length=None, metrics_delta=None))
    assert any("no avg_spec_accept_length" in f for f in compare_client_server(missing))
    assert isinstance(off, BenchResult)


# --------------------------------------------------------------------------- SGLang's incremental stream mode


def _sse(chunks: list[dict]) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def _meta(ct: int, finish=None, **extra) -> dict:
    return {"id": "r", "prompt_tokens": 3, "completion_tokens": ct, "finish_reason": finish, **extra}


FINAL = {"type": "length", "length": 4}
SCRIPTS = {
    # --incremental-streaming-output: deltas of ids and text; 2 tokens in one verify chunk
    "incremental": _sse([{"text": "a", "output_ids": [1], "meta_info": _meta(1)},
                         {"text": "bc", "output_ids": [2, 3], "meta_info": _meta(3)},
                         {"text": "d", "output_ids": [4], "meta_info": _meta(4, FINAL, spec_verify_ct=2)}]),
    "cumulative": _sse([{"text": "a", "output_ids": [1], "meta_info": _meta(1)},
                        {"text": "abc", "output_ids": [1, 2, 3], "meta_info": _meta(3)},
                        {"text": "abcd", "output_ids": [1, 2, 3, 4], "meta_info": _meta(4, FINAL, spec_verify_ct=2)}]),
    "short": _sse([{"text": "a", "output_ids": [1], "meta_info": _meta(1)},
                   {"text": "b", "output_ids": [2], "meta_info": _meta(4, FINAL, spec_verify_ct=2)}]),
    "error": b'data: {"error": {"message": "context too long"}}\n\ndata: [DONE]\n\n',
    "unfinished": _sse([{"text": "a", "output_ids": [1], "meta_info": _meta(1)}]),
}


class _ScriptedSGLang(BaseHTTPRequestHandler):
    """Replays SGLang responses the reference server does not produce; /server_info is 404 as in old releases."""

    def do_GET(self):
        if self.path == "/get_server_info":
            self._send(200, b'{"version": "0.4.0", "internal_states": [{}]}', "application/json")
        else:
            self._send(404, b'{"detail": "Not Found"}', "application/json")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.headers.get("Authorization") == "Bearer sk-test"
        self._send(200, SCRIPTS[body["text"]], "text/event-stream")

    def _send(self, status: int, payload: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def scripted_url():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _ScriptedSGLang)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=5)


def test_incremental_and_cumulative_streams_give_the_same_result(scripted_url):
    with SGLangClient(scripted_url, api_key="sk-test", timeout=10) as client:
        for mode in ("incremental", "cumulative"):
            r = client.generate(mode, {"max_new_tokens": 4})
            assert r.output_ids == [1, 2, 3, 4] and r.text == "abcd", mode
            assert r.completion_tokens == 4 and r.spec_verify_ct == 2 and r.accept_length == 2.0
            # the 2-token chunk gives two equal ITL entries; every token after the first has one
            assert len(r.itl_s) == 3 and r.itl_s[0] == r.itl_s[1]
        with pytest.raises(SGLangError, match="carried 2 output ids but .* completion_tokens=4"):
            client.generate("short")
        with pytest.raises(SGLangError, match="context too long"):
            client.generate("error")
        with pytest.raises(SGLangError, match="without a finishing chunk"):
            client.generate("unfinished")
        assert client.server_info()["version"] == "0.4.0"  # /server_info 404 -> /get_server_info
        assert client.metrics() is None  # no --enable-metrics


def test_wait_healthy_gives_up_on_a_dead_port():
    with SGLangClient(f"http://127.0.0.1:{free_port()}", timeout=2) as client:
        assert client.health() is False
        with pytest.raises(TimeoutError, match="/health not 200"):
            client.wait_healthy(timeout=0.5, poll_s=0.1)
