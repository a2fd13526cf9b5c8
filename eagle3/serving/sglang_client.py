"""Benchmark client for SGLang 0.5.23 (and `python -m eagle3.serve`, which speaks the same HTTP API).

Owns: the HTTP side of a benchmark. `SGLangClient` streams `/generate`, `/v1/completions` and
`/v1/chat/completions` into one `RequestResult` shape, and reads `/server_info`, `/flush_cache`,
`/metrics` and `/health`. `run_benchmark` runs warm-up and timed rounds of a prompt set at a
bounded concurrency and collects client figures (tok/s, TTFT, ITL, accept length) next to the
server's own (`avg_spec_accept_length`, `last_gen_throughput`, `/metrics` deltas);
`compare_client_server` says where they disagree; progress goes to an optional `log` callback,
a line per finished round at most every few seconds. Also: the periodic decode log line parser
(reference regex, sglang-eagle3.md §5). The prompt sets are in eagle3.serving.bench_prompts.

Definitions (match `sglang.bench_serving`, transfer-and-serving-perf.md §2.3):
- TTFT: send -> first streamed chunk carrying >= 1 output token.
- ITL: for each later chunk carrying n >= 1 new tokens, (chunk time - previous token chunk time)
  / n, recorded n times. With speculation a chunk carries the tokens accepted by one verify, so
  ITL is a per-token average over each verify, not a per-verify gap.
- accept length: completion_tokens / spec_verify_ct (SGLang's meta_info `spec_accept_length`;
  completion_tokens includes the token sampled at prefill). `decode_accept_length` leaves that
  token out, (completion_tokens - 1) / spec_verify_ct, which is what the server's decode log and
  `avg_spec_accept_length` count (they count decode batches only).
- tok/s of a run: output tokens of all its requests / wall time from first send to last end.

Risk: SGLang changing its stream shape. `/generate` streams cumulative `output_ids` and `text` by
default and per-chunk deltas with `--incremental-streaming-output` (older: `--stream-output`);
`_merge_stream_ids` tells them apart with the chunk's `meta_info.completion_tokens` and a
stream whose ids do not add up to the final completion_tokens raises instead of mis-counting.
The client needs only httpx and the stdlib; prompt helpers import eagle3.data/transformers lazily.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

Endpoint = Literal["generate", "completions", "chat"]
ENDPOINTS: tuple[str, ...] = ("generate", "completions", "chat")
Message = dict[str, str]
LogFn = Callable[[str], None]
# A benchmark prompt: token ids or raw text (/generate, /v1/completions) or chat messages (/v1/chat/completions).
PromptInput = list[int] | str | list[Message]
SSE_DATA = "data:"
SSE_DONE = "[DONE]"


class SGLangError(RuntimeError):
    """The server refused or broke a request: HTTP error status, an error chunk, or an inconsistent stream."""


# --------------------------------------------------------------------------- per-request results


@dataclass
class RequestResult:
    """One generation as the client saw it.

    output_ids: all generated ids ([completion_tokens]); None on the OpenAI endpoints, which
    stream text only. ttft_s / itl_s: see the module docstring (None / [] when not streamed).
    e2e_s: send -> end of the response, client clock. meta_info: the server's final meta_info
    (/generate) or, for the OpenAI endpoints, `usage` + `sglext.spec_tokens_details` flattened.
    """

    prompt_tokens: int
    output_ids: list[int] | None
    completion_tokens: int
    ttft_s: float | None
    itl_s: list[float]
    e2e_s: float
    spec_verify_ct: int | None
    accept_length: float | None
    meta_info: dict
    text: str = ""
    finish_reason: Any = None

    @property
    def decode_accept_length(self) -> float | None:
        """(completion_tokens - 1) / spec_verify_ct: tokens per verify without the prefill token."""
        if not self.spec_verify_ct:
            return None
        return (self.completion_tokens - 1) / self.spec_verify_ct


def _build_result(prompt_tokens: int, output_ids: list[int] | None, completion_tokens: int, clock: _TokenClock,
                  e2e_s: float, meta: dict, text: str, finish_reason: Any) -> RequestResult:
    verify_ct = meta.get("spec_verify_ct") or None
    return RequestResult(
        prompt_tokens=prompt_tokens, output_ids=output_ids, completion_tokens=completion_tokens,
        ttft_s=clock.ttft_s, itl_s=list(clock.itl_s), e2e_s=e2e_s, spec_verify_ct=verify_ct,
        accept_length=completion_tokens / verify_ct if verify_ct else None,
        meta_info=meta, text=text, finish_reason=finish_reason,
    )


class _TokenClock:
    """TTFT and ITL from the times token-carrying chunks arrive (bench_serving's rule).

    Example: sent at t=0; chunks at t=1.0 (1 token), 1.4 (cumulative 3), 1.5 (3 again), 2.0 (4)
    -> ttft 1.0; itl [0.2, 0.2, 0.6] (0.4 s over 2 tokens; the chunk without a new token is
    ignored, so the last gap runs from 1.4).
    """

    def __init__(self, start: float) -> None:
        self.start = start
        self.ttft_s: float | None = None
        self.itl_s: list[float] = []
        self.count = 0
        self._last: float | None = None

    def tokens_so_far(self, total: int, now: float) -> None:
        """Record that `total` tokens (cumulative) had arrived by `now`."""
        new = total - self.count
        if new <= 0:
            return
        if self.ttft_s is None:
            self.ttft_s = now - self.start
        else:
            self.itl_s.extend([(now - self._last) / new] * new)
        self.count, self._last = total, now


def _merge_stream_ids(have: list[int], chunk: list[int], completion_tokens: int | None) -> tuple[list[int], bool]:
    """All ids so far after one /generate stream chunk -> (ids, chunk_was_cumulative).

    Default SGLang chunks repeat every id so far; with --incremental-streaming-output they carry
    only the new ones, and meta_info.completion_tokens is the running total in both modes. An
    incremental chunk satisfies len(have) + len(chunk) == completion_tokens; a cumulative one
    has len(chunk) >= completion_tokens, so both can hold only while `have` is empty, where the
    two readings agree. Without completion_tokens a chunk that extends `have` counts as cumulative.
    Example: have [5, 7], chunk [9] with completion_tokens 3 -> [5, 7, 9] (incremental);
    have [5, 7], chunk [5, 7, 9] with completion_tokens 3 -> [5, 7, 9] (cumulative).
    """
    if not have:
        return list(chunk), True
    if completion_tokens is not None and len(have) + len(chunk) == completion_tokens:
        return have + list(chunk), False
    if chunk[: len(have)] == have and len(chunk) >= len(have):
        return list(chunk), True
    return have + list(chunk), False


class _GenerateStream:
    """Folds /generate SSE chunks into ids, text, timing and the final meta_info."""

    def __init__(self, start: float) -> None:
        self.clock = _TokenClock(start)
        self.ids: list[int] = []
        self.text = ""
        self.meta: dict = {}

    def feed(self, data: dict, now: float) -> None:
        if "error" in data:
            raise SGLangError(f"/generate stream error: {_error_message(data)}")
        meta = data.get("meta_info") or {}
        total = meta.get("completion_tokens")
        cumulative = True
        if data.get("output_ids") is not None:
            self.ids, cumulative = _merge_stream_ids(self.ids, data["output_ids"], total)
        if data.get("text") is not None:
            self.text = data["text"] if cumulative else self.text + data["text"]
        self.meta = meta
        self.clock.tokens_so_far(total if isinstance(total, int) else len(self.ids), now)

    def finish(self, end: float) -> RequestResult:
        meta = self.meta
        reason = meta.get("finish_reason")
        if reason is None:
            raise SGLangError("/generate stream ended without a finishing chunk (no finish_reason)")
        if isinstance(reason, dict) and reason.get("type") == "abort":
            raise SGLangError(f"/generate request aborted by the server: {reason}")
        if len(self.ids) != meta.get("completion_tokens"):
            raise SGLangError(f"/generate stream carried {len(self.ids)} output ids but the final meta_info says "
                              f"completion_tokens={meta.get('completion_tokens')}")
        return _build_result(meta.get("prompt_tokens", 0), self.ids, len(self.ids), self.clock,
                             end - self.clock.start, meta, self.text, reason)


class _OpenAIStream:
    """Folds /v1/completions or /v1/chat/completions SSE chunks (text deltas, usage, sglext).

    Token counts per chunk come from per-chunk `usage` when the server sends it
    (stream_options.continuous_usage_stats); otherwise every chunk with text counts as one
    step, as bench_serving's OpenAI backends do (one ITL entry per chunk).
    """

    def __init__(self, start: float, chat: bool) -> None:
        self.clock = _TokenClock(start)
        self.chat = chat
        self.text = ""
        self.usage: dict | None = None
        self.spec: dict = {}
        self.finish_reason = None
        self.rid = None
        self._text_chunks = 0

    def feed(self, data: dict, now: float) -> None:
        if "error" in data or data.get("object") == "error":
            raise SGLangError(f"OpenAI stream error: {_error_message(data)}")
        self.rid = data.get("id", self.rid)
        details = (data.get("sglext") or {}).get("spec_tokens_details")
        if details:
            self.spec = details[0] if isinstance(details, list) else details
        if data.get("usage"):
            self.usage = data["usage"]
        choices = data.get("choices") or []
        for choice in choices:
            piece = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            if piece:
                self.text += piece
                self._text_chunks += 1
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        if choices and data.get("usage"):
            self.clock.tokens_so_far(data["usage"]["completion_tokens"], now)
        elif choices:
            self.clock.tokens_so_far(self._text_chunks, now)

    def finish(self, end: float) -> RequestResult:
        if self.usage is None:
            raise SGLangError("OpenAI stream ended without a usage chunk (stream_options.include_usage ignored?)")
        meta = {"id": self.rid, "finish_reason": self.finish_reason, **self.usage, **self.spec}
        return _build_result(self.usage.get("prompt_tokens", 0), None, self.usage["completion_tokens"], self.clock,
                             end - self.clock.start, meta, self.text, self.finish_reason)


def _error_message(data: dict) -> str:
    err = data.get("error")
    if isinstance(err, dict):
        return str(err.get("message", err))
    return str(err if err is not None else data.get("message", data))


# --------------------------------------------------------------------------- Prometheus text


@dataclass(frozen=True)
class MetricSample:
    """One Prometheus sample line: `name{labels} value`."""

    name: str
    labels: dict[str, str]
    value: float


_SAMPLE_LINE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')


def parse_prometheus_text(text: str, prefix: str = "sglang:") -> dict[str, list[MetricSample]]:
    """Samples of the Prometheus text format whose name starts with `prefix`, grouped by name.

    Counters appear as `<name>_total`, histograms as `<name>_bucket|_count|_sum` (what
    prometheus_client writes, and SGLang uses prometheus_client).
    """
    out: dict[str, list[MetricSample]] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#") or not line.startswith(prefix):
            continue
        m = _SAMPLE_LINE.match(line)
        if m is None:
            raise ValueError(f"/metrics line {lineno}: not a Prometheus sample: {line[:120]!r}")
        labels = {k: _unescape_label(v) for k, v in _LABEL.findall(m["labels"] or "")}
        out.setdefault(m["name"], []).append(MetricSample(m["name"], labels, float(m["value"])))
    return out


def _unescape_label(value: str) -> str:
    return value.replace(r"\n", "\n").replace(r"\"", '"').replace("\\\\", "\\")


def metric_total(metrics: dict[str, list[MetricSample]], name: str) -> float | None:
    """Sum of a series over its label sets (ranks); None when the server does not export it."""
    samples = metrics.get(name)
    return None if not samples else sum(s.value for s in samples)


# SGLang's forward timings: seconds by ForwardMode category (extend, decode, target_verify, eagle_draft,
# eagle_draft_extend), exported with --enable-metrics and SGLANG_ENABLE_METRICS_DEVICE_TIMER=1.
FORWARD_SECONDS = "sglang:forward_execution_seconds_total"


def forward_seconds(metrics: dict[str, list[MetricSample]] | None) -> dict[str, float]:
    """FORWARD_SECONDS by category, summed over ranks; {} when the server does not export it."""
    out: dict[str, float] = {}
    for sample in (metrics or {}).get(FORWARD_SECONDS, []):
        category = sample.labels.get("category", "")
        out[category] = out.get(category, 0.0) + sample.value
    return out


def run_delta(before: dict[str, list[MetricSample]], after: dict[str, list[MetricSample]]) -> dict[str, Any]:
    """What the server counted over one timed run: forward seconds by category, verify calls, generated
    tokens and finished requests (the increase of each between two /metrics reads)."""
    def rise(name: str) -> float:
        return (metric_total(after, name) or 0.0) - (metric_total(before, name) or 0.0)

    start = forward_seconds(before)
    return {"forward_s": {c: v - start.get(c, 0.0) for c, v in forward_seconds(after).items()},
            "verify_calls": rise("sglang:spec_verify_calls_total"),
            "generation_tokens": rise("sglang:generation_tokens_total"),
            "requests": rise("sglang:e2e_request_latency_seconds_count")}


# --------------------------------------------------------------------------- the client


class SGLangClient:
    """Sync HTTP client for one SGLang (or eagle3.serve) server; thread-safe, so run_benchmark
    can share it between its worker threads.

    Args:
        base_url: e.g. "http://127.0.0.1:30000".
        api_key: sent as `Authorization: Bearer <key>` (SGLang's --api-key).
        timeout: seconds for connect and for each read (the gap between stream chunks).
        max_connections: connection pool size; keep it >= the benchmark concurrency.
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0,
                 max_connections: int = 256) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=httpx.Timeout(timeout, connect=min(timeout, 30.0)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )
        self._model_name: str | None = None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SGLangClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- generation

    def generate(self, prompt: list[int] | str, sampling_params: dict | None = None,
                 stream: bool = True) -> RequestResult:
        """POST /generate with `input_ids` (a list of ids) or `text` (a str)."""
        body: dict[str, Any] = {"input_ids": list(prompt)} if isinstance(prompt, list) else {"text": prompt}
        body["sampling_params"] = dict(sampling_params or {})
        if not stream:
            start = time.perf_counter()
            response = self._http.post("/generate", json=body)
            end = time.perf_counter()
            out = _json_or_raise(response, "/generate")
            meta = out["meta_info"]
            clock = _TokenClock(start)
            return _build_result(meta.get("prompt_tokens", 0), list(out["output_ids"]), meta["completion_tokens"],
                                 clock, end - start, meta, out.get("text", ""), meta.get("finish_reason"))
        body["stream"] = True
        return self._stream("/generate", body, _GenerateStream)

    def completion(self, prompt: list[int] | str, max_tokens: int, temperature: float = 0.0,
                   extra: dict | None = None) -> RequestResult:
        """Streamed POST /v1/completions (usage and sglext spec details requested)."""
        body = {"prompt": list(prompt) if isinstance(prompt, list) else prompt, **self._openai_common(
            max_tokens, temperature, extra)}
        return self._stream("/v1/completions", body, lambda start: _OpenAIStream(start, chat=False))

    def chat(self, messages: Sequence[Message], max_tokens: int, temperature: float = 0.0,
             extra: dict | None = None) -> RequestResult:
        """Streamed POST /v1/chat/completions (usage and sglext spec details requested)."""
        body = {"messages": [dict(m) for m in messages], **self._openai_common(max_tokens, temperature, extra)}
        return self._stream("/v1/chat/completions", body, lambda start: _OpenAIStream(start, chat=True))

    def _openai_common(self, max_tokens: int, temperature: float, extra: dict | None) -> dict:
        return {
            "model": self.model_name(), "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "return_spec_tokens_details": True, **(extra or {}),
        }

    def _stream(self, path: str, body: dict, make_parser: Callable[[float], Any]) -> RequestResult:
        """POST body, fold the SSE `data:` lines into a parser until `[DONE]`."""
        start = time.perf_counter()
        parser = make_parser(start)
        with self._http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                response.read()
                raise SGLangError(f"POST {path}: HTTP {response.status_code}: {response.text[:500]}")
            for line in response.iter_lines():
                now = time.perf_counter()
                if not line.startswith(SSE_DATA):
                    continue  # blank separators, comments, `event:` lines
                payload = line[len(SSE_DATA):].strip()
                if payload == SSE_DONE:
                    break
                parser.feed(json.loads(payload), now)
        return parser.finish(time.perf_counter())

    # ---- server state

    def model_name(self) -> str:
        """The served model name (first entry of /v1/models), cached."""
        if self._model_name is None:
            data = _json_or_raise(self._http.get("/v1/models"), "/v1/models").get("data") or []
            if not data:
                raise SGLangError("/v1/models lists no model")
            self._model_name = data[0]["id"]
        return self._model_name

    def server_info(self) -> dict:
        """GET /server_info (falls back to the deprecated /get_server_info on 404)."""
        response = self._http.get("/server_info")
        if response.status_code == 404:
            response = self._http.get("/get_server_info")
        return _json_or_raise(response, "/server_info")

    def flush_cache(self) -> bool:
        """POST /flush_cache: True if flushed, False if refused (the server was not idle)."""
        response = self._http.post("/flush_cache")
        if response.status_code not in (200, 400):
            raise SGLangError(f"POST /flush_cache: HTTP {response.status_code}: {response.text[:500]}")
        return response.status_code == 200

    def metrics(self) -> dict[str, list[MetricSample]] | None:
        """GET /metrics parsed (sglang:* series); None when the server runs without --enable-metrics."""
        response = self._http.get("/metrics")
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise SGLangError(f"GET /metrics: HTTP {response.status_code}: {response.text[:500]}")
        return parse_prometheus_text(response.text)

    def health(self) -> bool:
        """GET /health is 200 (SGLang runs a 1-token generation for it unless the server is busy)."""
        try:
            return self._http.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    def wait_healthy(self, timeout: float, poll_s: float = 1.0) -> None:
        """Poll /health until 200; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not self.health():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.base_url}/health not 200 within {timeout:.0f} s")
            time.sleep(min(poll_s, max(deadline - time.monotonic(), 0.0)))


def _json_or_raise(response: httpx.Response, what: str) -> Any:
    if response.status_code != 200:
        raise SGLangError(f"{what}: HTTP {response.status_code}: {response.text[:500]}")
    return response.json()


# --------------------------------------------------------------------------- the benchmark runner


def percentile(values: Sequence[float], q: float) -> float | None:
    """q-th percentile (0..100) with linear interpolation (numpy's default); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class RunStats:
    """One round: every prompt once, at the benchmark's concurrency."""

    index: int
    warmup: bool
    wall_s: float
    requests: list[RequestResult] = field(repr=False)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.requests)

    @property
    def output_tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def spec_verify_ct(self) -> int:
        return sum(r.spec_verify_ct or 0 for r in self.requests)

    @property
    def accept_length(self) -> float | None:
        """Token-weighted over requests: sum completion_tokens / sum spec_verify_ct."""
        return self.output_tokens / self.spec_verify_ct if self.spec_verify_ct else None

    @property
    def decode_accept_length(self) -> float | None:
        """(sum completion_tokens - requests) / sum spec_verify_ct: the server's decode-log definition."""
        return (self.output_tokens - self.num_requests) / self.spec_verify_ct if self.spec_verify_ct else None

    def figures(self) -> dict[str, float | None]:
        ttft = [r.ttft_s for r in self.requests if r.ttft_s is not None]
        itl = [x for r in self.requests for x in r.itl_s]
        return {
            "output_tokens": float(self.output_tokens), "wall_s": self.wall_s,
            "output_tok_per_s": self.output_tok_per_s,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
            "accept_length": self.accept_length, "decode_accept_length": self.decode_accept_length,
        }


@dataclass
class ServerFigures:
    """What the server says about the timed runs.

    avg_spec_accept_length: /server_info internal_states[0] after the runs (lifetime since the
    flush; it advances only at decode-log ticks, so it lags by up to one log interval, is None
    before the first tick, and a tick can land just after the last response was sent).
    metrics_delta: counter / histogram-count / -sum increase over the timed runs (only with
    --enable-metrics).
    """

    flushed: bool
    avg_spec_accept_length: float | None
    last_gen_throughput: float | None
    metrics_delta: dict[str, float] | None
    server_info: dict = field(repr=False, default_factory=dict)
    run_deltas: list[dict] = field(default_factory=list)  # run_delta of each timed run (with --enable-metrics)

    @property
    def metrics_accept_length(self) -> float | None:
        """generation_tokens_total / spec_verify_calls_total increase: completion / verifies, server side."""
        if not self.metrics_delta:
            return None
        tokens = self.metrics_delta.get("sglang:generation_tokens_total")
        verifies = self.metrics_delta.get("sglang:spec_verify_calls_total")
        return tokens / verifies if tokens is not None and verifies else None


@dataclass
class BenchResult:
    endpoint: str
    concurrency: int
    max_new_tokens: int
    temperature: float
    num_prompts: int
    warmup: list[RunStats] = field(repr=False)
    runs: list[RunStats] = field(repr=False)
    server: ServerFigures

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.runs)

    @property
    def num_requests(self) -> int:
        return sum(r.num_requests for r in self.runs)

    @property
    def accept_length(self) -> float | None:
        """Token-weighted over all timed requests (completion / verifies)."""
        verifies = sum(r.spec_verify_ct for r in self.runs)
        return self.output_tokens / verifies if verifies else None

    @property
    def decode_accept_length(self) -> float | None:
        verifies = sum(r.spec_verify_ct for r in self.runs)
        return (self.output_tokens - self.num_requests) / verifies if verifies else None

    def summary(self) -> dict[str, dict[str, float]]:
        """{figure: {min, median, max}} over the timed runs (figures a run lacks are left out)."""
        out: dict[str, dict[str, float]] = {}
        per_run = [r.figures() for r in self.runs]
        for name in per_run[0] if per_run else ():
            values = [f[name] for f in per_run if f[name] is not None]
            if values:
                out[name] = {"min": min(values), "median": statistics.median(values), "max": max(values)}
        return out

    def flat_metrics(self) -> dict[str, float]:
        """One flat dict (e.g. for mlflow.log_metrics): `<figure>_<stat>` plus the server figures."""
        flat = {f"{name}_{stat}": v for name, stats in self.summary().items() for stat, v in stats.items()}
        extra = {
            "accept_length": self.accept_length, "decode_accept_length": self.decode_accept_length,
            "server_avg_spec_accept_length": self.server.avg_spec_accept_length,
            "server_last_gen_throughput": self.server.last_gen_throughput,
            "server_metrics_accept_length": self.server.metrics_accept_length,
        }
        flat.update({k: float(v) for k, v in extra.items() if v is not None})
        return flat


def _check_prompts(prompts: Sequence[PromptInput], endpoint: str) -> None:
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {endpoint!r}")
    if not prompts:
        raise ValueError("prompts is empty")
    for i, p in enumerate(prompts):
        is_chat = isinstance(p, list) and bool(p) and all(isinstance(m, dict) for m in p)
        is_ids = isinstance(p, list) and bool(p) and all(isinstance(t, int) for t in p)
        if endpoint == "chat" and not is_chat:
            raise ValueError(f"prompts[{i}]: endpoint 'chat' needs a list of messages, got {str(p)[:80]}")
        if endpoint != "chat" and not (is_ids or (isinstance(p, str) and p)):
            raise ValueError(f"prompts[{i}]: endpoint {endpoint!r} needs token ids or a non-empty str "
                             f"(render chats with render_prompts), got {str(p)[:80]}")


def _check_counts(**named: tuple[int, int]) -> None:
    """name=(value, lowest allowed) -> ValueError naming the first bad argument."""
    for name, (value, low) in named.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _request_fn(client: SGLangClient, endpoint: str, max_new_tokens: int, temperature: float,
                ignore_eos: bool) -> Callable[[PromptInput], RequestResult]:
    if endpoint == "generate":
        params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": ignore_eos}
        return lambda p: client.generate(p, params)
    extra = {"ignore_eos": ignore_eos}
    if endpoint == "completions":
        return lambda p: client.completion(p, max_new_tokens, temperature, extra)
    return lambda p: client.chat(p, max_new_tokens, temperature, extra)


def _one_run(index: int, warmup: bool, prompts: Sequence[PromptInput], send: Callable[[PromptInput], RequestResult],
             concurrency: int) -> RunStats:
    """All prompts, at most `concurrency` in flight (a worker thread per slot)."""
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="bench") as pool:
        start = time.perf_counter()
        futures = [pool.submit(send, p) for p in prompts]
        results = []
        for i, fut in enumerate(futures):
            try:
                results.append(fut.result())
            except (SGLangError, httpx.HTTPError) as e:
                for other in futures:
                    other.cancel()
                kind = "warm-up" if warmup else "timed"
                raise SGLangError(f"{kind} run {index}, prompt {i}: {type(e).__name__}: {e}") from e
        wall = time.perf_counter() - start
    return RunStats(index=index, warmup=warmup, wall_s=wall, requests=results)


class _RoundProgress:
    """A line per finished round to `log` (its tok/s, its wall time and the time left at the mean pace of the
    rounds so far), at most one line every `every_s` seconds so that many fast rounds do not flood the log."""

    def __init__(self, log: LogFn | None, warmup_runs: int, timed_runs: int, every_s: float) -> None:
        self.log, self.every_s = log, every_s
        self.totals = {True: warmup_runs, False: timed_runs}
        self.walls: list[float] = []
        self.last_line = time.monotonic()

    def __call__(self, run: RunStats) -> RunStats:
        self.walls.append(run.wall_s)
        now = time.monotonic()
        if self.log is None or now - self.last_line < self.every_s:
            return run
        self.last_line = now
        left = (sum(self.totals.values()) - len(self.walls)) * statistics.mean(self.walls)
        kind = "warm-up" if run.warmup else "timed run"
        eta = f", ~{left:.0f} s left" if left > 0 else ""
        self.log(f"{kind} {run.index + 1}/{self.totals[run.warmup]}: {run.output_tok_per_s:.1f} tok/s "
                 f"({run.num_requests} requests in {run.wall_s:.1f} s{eta})")
        return run


def _flush_when_idle(client: SGLangClient, attempts: int = 50, pause_s: float = 0.2) -> bool:
    """/flush_cache, retried while the server finishes what it still runs (bounded)."""
    for _ in range(attempts):
        if client.flush_cache():
            return True
        time.sleep(pause_s)
    return False


def _counter_delta(before: dict[str, list[MetricSample]], after: dict[str, list[MetricSample]]) -> dict[str, float]:
    """Increase of every counter and histogram count/sum series (gauges are not deltas)."""
    delta = {}
    for name in after:
        if name.endswith(("_total", "_count", "_sum")):
            delta[name] = (metric_total(after, name) or 0.0) - (metric_total(before, name) or 0.0)
    return delta


def run_benchmark(
    client: SGLangClient,
    prompts: Sequence[PromptInput],
    *,
    warmup_runs: int = 2,
    timed_runs: int = 5,
    concurrency: int = 1,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    endpoint: Endpoint = "generate",
    ignore_eos: bool = False,
    flush_cache: bool = True,
    log: LogFn | None = None,
    log_every_s: float = 5.0,
) -> BenchResult:
    """`warmup_runs` then `timed_runs` rounds of all prompts, at most `concurrency` requests in flight.

    Between warm-up and timed rounds, with the server idle: /flush_cache (so the server's
    avg_spec_accept_length covers only the timed requests; it also clears the prefix cache)
    and a /metrics snapshot, then one after each timed round (its forward seconds and counts:
    `ServerFigures.run_deltas`); after the timed rounds: /server_info and /metrics again. Any
    failed request raises SGLangError naming the run and prompt. `log` gets a progress line after
    each round (`timed run 3/5: 41.2 tok/s (4 requests in 12.4 s, ~25 s left)`), at most one
    every `log_every_s` seconds.
    """
    _check_prompts(prompts, endpoint)
    _check_counts(warmup_runs=(warmup_runs, 0), timed_runs=(timed_runs, 1), concurrency=(concurrency, 1),
                  max_new_tokens=(max_new_tokens, 1))
    send = _request_fn(client, endpoint, max_new_tokens, temperature, ignore_eos)
    progress = _RoundProgress(log, warmup_runs, timed_runs, log_every_s)
    warmup = [progress(_one_run(i, True, prompts, send, concurrency)) for i in range(warmup_runs)]
    flushed = _flush_when_idle(client) if flush_cache else False
    before = client.metrics()
    runs, snapshots = [], [before]
    for i in range(timed_runs):
        runs.append(progress(_one_run(i, False, prompts, send, concurrency)))
        if before is not None:  # the server is idle between rounds: each round's own counts
            snapshots.append(client.metrics())
    info = client.server_info()
    after = client.metrics()
    state = (info.get("internal_states") or [{}])[0]
    server = ServerFigures(
        flushed=flushed, avg_spec_accept_length=state.get("avg_spec_accept_length"),
        last_gen_throughput=state.get("last_gen_throughput"),
        metrics_delta=_counter_delta(before, after) if before is not None and after is not None else None,
        server_info=info, run_deltas=[run_delta(a, b) for a, b in zip(snapshots, snapshots[1:])],
    )
    return BenchResult(endpoint=endpoint, concurrency=concurrency, max_new_tokens=max_new_tokens,
                       temperature=temperature, num_prompts=len(prompts), warmup=warmup, runs=runs, server=server)


def _relative_gap(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compare_client_server(result: BenchResult, accept_rel_tol: float = 0.05,
                          throughput_rel_tol: float = 0.5) -> list[str]:
    """Disagreements between the client's figures and the server's, each with both numbers.

    - decode accept length (client) vs /server_info avg_spec_accept_length (flushed before the
      timed runs; lags by up to one decode-log interval, hence the tolerance);
    - accept length (client) vs /metrics generation_tokens / spec_verify_calls increase;
    - output tokens and request count (client) vs /metrics generation_tokens_total and
      e2e_request_latency_seconds_count increase: exact unless other traffic hit the server;
    - median tok/s (client, whole run incl. prefill and HTTP) vs last_gen_throughput (server,
      decode only, last log window): loose tolerance, it flags gross disagreement only.
    """
    flags: list[str] = []
    srv = result.server
    client_decode = result.decode_accept_length
    if client_decode is not None and srv.avg_spec_accept_length is None and srv.metrics_accept_length is None:
        flags.append(f"server reported no avg_spec_accept_length (flushed={srv.flushed}; no decode-log tick "
                     f"since the flush?); client decode accept length {client_decode:.3f}")
    elif client_decode is not None and srv.avg_spec_accept_length is not None \
            and _relative_gap(client_decode, srv.avg_spec_accept_length) > accept_rel_tol:
        flags.append(f"accept length: client (decode tokens / verifies) {client_decode:.3f} vs server "
                     f"avg_spec_accept_length {srv.avg_spec_accept_length:.3f} (tolerance {accept_rel_tol:.0%})")
    metrics_accept = srv.metrics_accept_length
    if result.accept_length is not None and metrics_accept is not None \
            and _relative_gap(result.accept_length, metrics_accept) > accept_rel_tol:
        flags.append(f"accept length: client {result.accept_length:.3f} vs /metrics generation_tokens / "
                     f"spec_verify_calls {metrics_accept:.3f} (tolerance {accept_rel_tol:.0%})")
    delta = srv.metrics_delta or {}
    for series, client_value, what in (("sglang:generation_tokens_total", result.output_tokens, "output tokens"),
                                       ("sglang:e2e_request_latency_seconds_count", result.num_requests, "requests")):
        if series in delta and round(delta[series]) != client_value:
            flags.append(f"{what}: client counted {client_value}, server /metrics {series} rose by "
                         f"{delta[series]:.0f} (other traffic on the server?)")
    tok_s = result.summary().get("output_tok_per_s", {}).get("median")
    if tok_s is not None and srv.last_gen_throughput and \
            _relative_gap(tok_s, srv.last_gen_throughput) > throughput_rel_tol:
        flags.append(f"throughput: client median {tok_s:.1f} tok/s vs server last_gen_throughput "
                     f"{srv.last_gen_throughput:.1f} tok/s (tolerance {throughput_rel_tol:.0%})")
    return flags


# --------------------------------------------------------------------------- decode log


# reference sglang-eagle3.md §5, without the `^` anchor so lines behind a container or
# journald prefix ("server-1  | [2026-...] Decode batch, ...") still parse.
DECODE_LINE = re.compile(
    r"\[(?P<ts>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:\.\d{3})?)(?P<ranks>(?: [A-Z_]+\d+)*)\] Decode batch"
    r"(?: \[(?P<iter>\d+)\])?, #running-req: (?P<running_req>\d+), "
    r"(?P<usage>(?:(?!accept len: |cap len: |block accept len: ).)*?)"
    r"(?:accept len: (?P<accept_len>\d+\.\d+), accept rate: (?P<accept_rate>\d+\.\d+), )?"
    r"(?:cap len: (?P<cap_len>\d+\.\d+), )?(?:block accept len: (?P<block_accept_len>\d+\.\d+), )?"
    r"(?P<extra>(?:(?!accept len: |cap len: |block accept len: ).)*?)(?P<graph_label>cuda|cpu|npu|musa) graph: "
    r"(?P<graph>True|False), gen throughput \(token/s\): (?P<gen_throughput>\d+\.\d+), #queue-req: (?P<queue_req>\d+)"
)
_INT_FIELDS = ("iter", "running_req", "queue_req")
_FLOAT_FIELDS = ("accept_len", "accept_rate", "cap_len", "block_accept_len", "gen_throughput")


def parse_decode_line(line: str) -> dict | None:
    """SGLang's periodic decode log line -> its fields (ints/floats/bools; absent optional ones None)."""
    m = DECODE_LINE.search(line)
    if m is None:
        return None
    fields: dict[str, Any] = m.groupdict()
    for name in _INT_FIELDS:
        fields[name] = None if fields[name] is None else int(fields[name])
    for name in _FLOAT_FIELDS:
        fields[name] = None if fields[name] is None else float(fields[name])
    fields["graph"] = fields["graph"] == "True"
    fields["ranks"] = fields["ranks"].split()
    return fields


def summarize_decode_log(text: str) -> dict:
    """Decode lines of a server log -> {lines, accept_len_mean, accept_len_last, gen_throughput_mean,
    gen_throughput_last, max_running_req, max_queue_req} (None where no line has the field).

    Means are over log windows, unweighted (as one would read them off the log).
    """
    parsed = [d for d in map(parse_decode_line, text.splitlines()) if d is not None]
    accept = [d["accept_len"] for d in parsed if d["accept_len"] is not None]
    throughput = [d["gen_throughput"] for d in parsed]
    return {
        "lines": len(parsed),
        "accept_len_mean": statistics.fmean(accept) if accept else None,
        "accept_len_last": accept[-1] if accept else None,
        "gen_throughput_mean": statistics.fmean(throughput) if throughput else None,
        "gen_throughput_last": throughput[-1] if throughput else None,
        "max_running_req": max((d["running_req"] for d in parsed), default=None),
        "max_queue_req": max((d["queue_req"] for d in parsed), default=None),
    }
