"""`python -m eagle3.serve`: an SGLang-compatible HTTP server around eagle3.decoding, on CPU.

Owns the serving contract SGLang 0.5.23 gives a deploy and a benchmark: its launch flags (via
`eagle3.sglang_args`, so the effective speculative settings and the startup warnings are
SGLang's), its endpoints and response shapes (`/generate`, `/v1/*`, `/server_info`, `/health`,
`/flush_cache`, `/metrics`), and its periodic decode log line. It lets the pipeline deploy and
benchmark against a real process on a machine without a GPU.

Serving design: one worker thread owns the model. Requests wait in a FIFO queue; up to
`max_running_requests` are admitted (prefill) and then decoded round-robin, one target forward
per running request per decode iteration, so streams progress together and `#running-req`
means what it means in SGLang. Extra requests queue, never get rejected. Each request keeps its
own KV caches (batch size 1 per forward). One HTTP call's requests (a batch of prompts, times
`sampling_params.n`, SGLang's parallel sampling, ordered [p0, p1, p0, p1]) enter the queue
together; streamed, their chunks share one SSE stream and carry "index", as in SGLang. A
prompt of >= context-length tokens, or prompt + max_new_tokens > context length, is refused
(SGLang's check when --allow-auto-truncate is off; this server has no truncation).

Errors, per endpoint as SGLang answers them (`srt/entrypoints/http_server.py`,
`openai/serving_base.py`, `managers/tokenizer_manager.py`):
- A body that is not JSON or does not fit the endpoint's schema (FastAPI's
  RequestValidationError in SGLang): 400, the flat OpenAI ErrorResponse
  `{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}`, on
  every endpoint.
- A request refused while handling it (SGLang raises ValueError in the tokenizer manager: no
  input, empty input, prompt past the context length, bad sampling values, invalid unicode):
  400. `/generate` answers `{"error": {"message": ...}}` (http_server `_create_error_response`,
  deliberately not the flat shape: SGLang's /generate does this); `/v1/*` answers the flat
  ErrorResponse with `"type": "BadRequest"`.
- Our own failure (an exception in the worker or a handler): 500, the traceback in the server
  log, the same body shape as that endpoint's 400 with "Internal server error: ..." (`/v1/*`:
  `"type": "InternalServerError"`, as serving_base). SGLang's /generate lets such errors reach
  Starlette's plain-text 500; we keep its JSON shape so a client parses one shape per endpoint.
  The worker survives: only the failing request ends.
- Not loaded yet: 503 in the endpoint's shape (SGLang refuses connections until it is ready).
- Streaming: once the 200 and the SSE headers are sent, an error is one `data: {"error": ...}`
  chunk (`/generate`: `{"message"}`; `/v1/*`: the flat ErrorResponse), then `data: [DONE]`.
Deliberate deviations: a body with both `text` and `input_ids` is refused (SGLang silently
uses `input_ids`); a lone UTF-16 surrogate in any string is a 400 naming the field (SGLang's
tokenizer raises a TypeError there, i.e. a 500); a streaming request is checked before the
stream opens, so a bad one gets the 400 JSON body (SGLang opens the 200 stream first and sends
the refusal as its error chunk).

Risk: drift from SGLang's shapes. Names and formats follow `srt/entrypoints/http_server.py`,
`srt/managers/scheduler_components/metrics_reporter.py` and `srt/observability/
metrics_collector.py`; the decode line is checked against the reference regex in the tests.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import logging
import shlex
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Literal

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from transformers import AutoTokenizer
from transformers.utils import logging as transformers_logging

from eagle3.capture import aux_ids_to_hf_indices
from eagle3.decoding import (
    Eagle3Drafter,
    GenerationResult,
    RequestState,
    SamplingParams,
    SpecConfig,
    SpeculativeEngine,
    TargetModel,
)
from eagle3.export import load_exported
from eagle3.sglang_args import (
    SERVE_IGNORED_FLAGS,
    LaunchArgsError,
    SpecResolution,
    build_arg_parser,
    resolve_speculative_args,
)
from eagle3.tiny_target import load_target

logger = logging.getLogger("eagle3.serve")

SGLANG_VERSION = "0.5.23+eagleops"
READY_MESSAGE = "The server is fired up and ready to roll!"
HEALTH_CHECK_TIMEOUT_S = 20.0
METRIC_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")


# --------------------------------------------------------------------------- request bodies


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SamplingBody(_Body):
    """SGLang `sampling_params` (the fields this server honours)."""

    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1)
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, description="parallel samples per prompt (SGLang parallel sampling)")

    @model_validator(mode="after")
    def _top_k_valid(self) -> SamplingBody:
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return self


class GenerateBody(_Body):
    """/generate's schema (SGLang GenerateReqInput): types only; values are checked while handling."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    rid: str | None = None


class _OpenAIBody(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    seed: int | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=1)
    return_spec_tokens_details: bool = False


class CompletionBody(_OpenAIBody):
    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1)


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatBody(_OpenAIBody):
    messages: list[ChatMessage] = Field(min_length=1)


class RequestError(ValueError):
    """A request refused while handling it -> 400 in the endpoint's error shape."""


class SchemaError(RequestError):
    """The body is not JSON or does not fit the schema -> 400, flat ErrorResponse on every endpoint."""


class NotReady(RuntimeError):
    """The model is still loading -> 503."""


class InternalError(RuntimeError):
    """The worker failed on a request (traceback already logged) -> 500."""


# --------------------------------------------------------------------------- serving state


@dataclass
class ServeRequest:
    """One generation handed to the worker; events go back to the asyncio side.

    The requests of one HTTP call share `events`; each event is `(index, kind, payload)`, with
    kind "chunk" (streaming only), "done" (the final payload) or "error" (an InternalError).
    """

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stop_strings: tuple[str, ...]
    stream: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    received_at: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    state: RequestState | None = None
    text: str = ""
    first_token_at: float | None = None
    index: int = 0  # position in its HTTP call's batch

    def emit(self, kind: str, payload: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, kind, payload))


class Metrics:
    """SGLang's Prometheus series (names from srt/observability/metrics_collector.py)."""

    def __init__(self, model_name: str, spec: SpecConfig | None) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0",
                       "moe_ep_rank": "0"}
        r, ln = self.registry, METRIC_LABELS

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ln, registry=r).labels(**self.labels)

        self.spec_accept_length = gauge("sglang:spec_accept_length",
                                        "The average acceptance length of speculative decoding.")
        self.spec_accept_rate = gauge("sglang:spec_accept_rate", "The average acceptance rate of speculative decoding.")
        self.spec_num_steps = gauge("sglang:spec_num_steps", "Speculative decoding steps (draft depth).")
        self.spec_num_draft_tokens = gauge("sglang:spec_num_draft_tokens", "Tokens verified per speculative step.")
        self.gen_throughput = gauge("sglang:gen_throughput", "The generation throughput (token/s).")
        self.num_running_reqs = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.spec_verify_calls = Counter("sglang:spec_verify_calls", "Verify forwards of finished requests.",
                                         ln, registry=r).labels(**self.labels)
        self.generation_tokens = Counter("sglang:generation_tokens", "Number of generation tokens processed.",
                                         ln, registry=r).labels(**self.labels)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              ln, registry=r).labels(**self.labels)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                             ln, registry=r).labels(**self.labels)
        if spec is not None:
            self.spec_num_steps.set(spec.num_steps)
            self.spec_num_draft_tokens.set(spec.num_draft_tokens)


class DecodeStats:
    """Decode-window and lifetime counters behind the decode log line and /server_info.

    As in SGLang's metrics reporter, the lifetime counters (avg_spec_accept_length) only
    advance at each decode log tick, and /flush_cache resets both.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.window_start = time.perf_counter()
        self.window_tokens = self.window_spec_tokens = self.window_verifies = self.window_correct = 0
        self.lifetime_spec_tokens = self.lifetime_verifies = 0
        self.iterations = 0
        self.last_gen_throughput = 0.0

    def close_window(self) -> tuple[float, float, float]:
        """-> (accept len, correct drafts per verify, gen throughput) of the window; starts a new one."""
        now = time.perf_counter()
        throughput = self.window_tokens / max(now - self.window_start, 1e-9)
        accept_len = self.window_spec_tokens / self.window_verifies if self.window_verifies else 0.0
        self.lifetime_spec_tokens += self.window_spec_tokens
        self.lifetime_verifies += self.window_verifies
        correct, verifies = self.window_correct, self.window_verifies
        self.window_start = now
        self.window_tokens = self.window_spec_tokens = self.window_verifies = self.window_correct = 0
        self.last_gen_throughput = throughput
        return accept_len, (correct / verifies if verifies else 0.0), throughput

    @property
    def avg_spec_accept_length(self) -> float | None:
        return self.lifetime_spec_tokens / self.lifetime_verifies if self.lifetime_verifies else None


# --------------------------------------------------------------------------- worker


class Scheduler(threading.Thread):
    """The worker thread: loads the model, admits queued requests, decodes round-robin."""

    def __init__(self, settings: ServerSettings) -> None:
        super().__init__(name="eagle3-scheduler", daemon=True)
        self.settings = settings
        self.metrics = Metrics(settings.served_model_name, settings.spec)
        self.stats = DecodeStats()
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.on_load_error = lambda: None  # set by main(): stops the HTTP server
        self.engine: SpeculativeEngine | None = None
        self.tokenizer = None
        self._waiting: collections.deque[ServeRequest] = collections.deque()
        self._running: list[ServeRequest] = []
        self._cv = threading.Condition()
        self._stop_requested = False  # not `_stop`: that name is threading.Thread's own method (join calls it)

    # ---- called from the asyncio side

    def submit(self, reqs: list[ServeRequest]) -> None:
        """Queue one HTTP call's requests at once, as SGLang's scheduler receives a batch in one
        message: the worker never sees half a batch, so admission order is deterministic."""
        with self._cv:
            self._waiting.extend(reqs)
            self._cv.notify()

    def counts(self) -> tuple[int, int]:
        with self._cv:
            return len(self._running), len(self._waiting)

    def flush(self) -> bool:
        """Reset counters when fully idle (SGLang's /flush_cache rule)."""
        with self._cv:
            if self._running or self._waiting:
                return False
            self.stats.reset()
            return True

    def stop(self) -> None:
        with self._cv:
            self._stop_requested = True
            self._cv.notify()

    # ---- worker thread

    def run(self) -> None:
        try:
            self.engine, self.tokenizer = load_engine(self.settings)
            self._warmup()
        except (OSError, ValueError, RuntimeError, ImportError) as e:
            self.load_error = f"{type(e).__name__}: {e}"
            logger.error(f"Failed to load the model: {self.load_error}")
            self.on_load_error()
            return
        self.ready.set()
        logger.info(READY_MESSAGE)
        while True:
            with self._cv:
                while not self._stop_requested and not self._waiting and not self._running:
                    self._cv.wait(timeout=1.0)
                if self._stop_requested:
                    return
            self._admit()
            if self._running:
                self._decode_iteration()

    @torch.inference_mode()
    def _warmup(self) -> None:
        self.engine.generate([0], SamplingParams(max_new_tokens=2, ignore_eos=True))

    def _admit(self) -> None:
        while True:
            with self._cv:
                if not self._waiting or len(self._running) >= self.settings.max_running_requests:
                    return
                req = self._waiting.popleft()
                if req.cancelled:
                    continue
                self._running.append(req)  # counted as running from here on (flush_cache sees it)
            req.state = self._guarded(req, lambda: self.engine.start(req.input_ids, req.sampling))
            if req.state is None:
                continue
            self._log_prefill(req)
            self._after_tokens(req, req.state.output_ids[:])

    def _decode_iteration(self) -> None:
        for req in list(self._running):
            if req.cancelled:
                self._remove(req)
                continue
            done_verifies = req.state.stats.verify_ct
            new = self._guarded(req, lambda: self.engine.step(req.state))
            if new is None:
                continue
            if self.engine.speculative:
                accepted = req.state.stats.accepted_per_verify[done_verifies:]
                self.stats.window_verifies += len(accepted)
                self.stats.window_correct += sum(accepted)
                self.stats.window_spec_tokens += len(new)
            self._after_tokens(req, new)
        self.stats.iterations += 1
        running, queued = self.counts()
        self.metrics.num_running_reqs.set(running)
        self.metrics.num_queue_reqs.set(queued)
        if self.stats.iterations % self.settings.decode_log_interval == 0:
            self._report_decode(running, queued)

    def _guarded(self, req: ServeRequest, run: Callable[[], Any]) -> Any:
        """run(); on failure end this request with an InternalError event (None returned), never the worker.

        Every refusable request was refused at the HTTP edge (`_check_prompt`), so whatever the
        engine raises here, ValueError included, is our failure: a 500, never a 400.
        """
        try:
            return run()
        except Exception as e:  # a bug must not take the worker, and every other request, down
            logger.exception(f"Request {req.rid} failed in the worker")
            self._remove(req)
            req.emit("error", InternalError(f"{type(e).__name__}: {e}"))
            return None

    def _after_tokens(self, req: ServeRequest, new: list[int]) -> None:
        """Account new tokens, apply stop strings, stream, finish."""
        self.stats.window_tokens += len(new)
        self.metrics.generation_tokens.inc(len(new))
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
            self.metrics.ttft.observe(req.first_token_at - req.received_at)
        if req.stream or req.stop_strings or req.state.finished:
            req.text = self.tokenizer.decode(req.state.output_ids, skip_special_tokens=True)
            for s in req.stop_strings:
                cut = req.text.find(s)
                if cut >= 0:  # SGLang trims the stop string and reports it as matched
                    req.text = req.text[:cut]
                    req.state.finish_reason = {"type": "stop", "matched": s}
                    break
        if req.state.finished:
            self._finish(req)
        elif req.stream:
            req.emit("chunk", self._payload(req, final=False))

    def _finish(self, req: ServeRequest) -> None:
        self._remove(req)
        self.metrics.spec_verify_calls.inc(req.state.stats.verify_ct)
        self.metrics.e2e.observe(time.perf_counter() - req.received_at)
        req.emit("done", self._payload(req, final=True))

    def _remove(self, req: ServeRequest) -> None:
        with self._cv:
            if req in self._running:
                self._running.remove(req)

    def _payload(self, req: ServeRequest, final: bool) -> dict:
        """SGLang /generate output dict: text, output_ids, meta_info."""
        st = req.state
        meta = {
            "id": req.rid,
            "finish_reason": st.finish_reason,
            "prompt_tokens": len(st.prompt_ids),
            "completion_tokens": len(st.output_ids),
            "cached_tokens": 0,
            "reasoning_tokens": 0,
            "weight_version": "default",
            "num_retractions": 0,
        }
        if final:
            meta["e2e_latency"] = time.perf_counter() - req.received_at
            spec = self.settings.spec
            if spec is not None and st.stats.verify_ct:
                meta.update(spec_meta(self.engine.result(st), spec))
        return {"text": req.text, "output_ids": list(st.output_ids), "meta_info": meta}

    def _log_prefill(self, req: ServeRequest) -> None:
        running, queued = self.counts()
        running -= 1  # SGLang counts the requests already decoding, not the one being prefilled
        logger.info(
            f"Prefill batch, #new-seq: 1, #new-token: {len(req.input_ids)}, #cached-token: 0, "
            f"token usage: {self._token_usage()[1]:.2f}, #running-req: {running}, #queue-req: {queued}"
        )

    def _token_usage(self) -> tuple[int, float]:
        used = sum(len(r.state.prompt_ids) + len(r.state.output_ids) for r in list(self._running))
        return used, used / self.settings.max_total_num_tokens

    def _report_decode(self, running: int, queued: int) -> None:
        """SGLang's decode log line (metrics_reporter.report_decode_stats) and the window gauges."""
        accept_len, accept_rate_per_verify, throughput = self.stats.close_window()
        used, usage = self._token_usage()
        msg = f"Decode batch, #running-req: {running}, #token: {used}, token usage: {usage:.2f}, "
        spec = self.settings.spec
        if spec is not None:
            accept_rate = accept_rate_per_verify / (spec.num_draft_tokens - 1)
            msg += f"accept len: {accept_len:.2f}, accept rate: {accept_rate:.2f}, "
            self.metrics.spec_accept_length.set(accept_len)
            self.metrics.spec_accept_rate.set(accept_rate)
        msg += f"cpu graph: False, gen throughput (token/s): {throughput:.2f}, #queue-req: {queued}"
        self.metrics.gen_throughput.set(throughput)
        logger.info(msg)


def spec_meta(result: GenerationResult, spec: SpecConfig) -> dict:
    """meta_info spec_* fields (tokenizer_manager._calculate_spec_decoding_metrics)."""
    s = result.stats
    return {
        "spec_verify_ct": s.verify_ct,
        "spec_accept_length": result.accept_length,
        "spec_accept_rate": s.num_correct_drafts / s.num_proposed_drafts if s.num_proposed_drafts else 0.0,
        "spec_num_correct_drafts": s.num_correct_drafts,
        "spec_num_proposed_drafts": s.num_proposed_drafts,
        "spec_correct_drafts_histogram": list(s.correct_drafts_histogram),
        "spec_accepted_by_position": list(s.accepted_by_position),
    }


# --------------------------------------------------------------------------- settings and loading


@dataclass
class ServerSettings:
    argv: list[str]
    args: Any  # the parsed launch namespace (kept for /server_info)
    resolution: SpecResolution
    spec: SpecConfig | None
    max_running_requests: int
    context_length: int
    served_model_name: str
    random_seed: int

    @property
    def decode_log_interval(self) -> int:
        return self.args.decode_log_interval

    @property
    def max_total_num_tokens(self) -> int:
        return self.max_running_requests * self.context_length


def build_settings(argv: list[str]) -> ServerSettings:
    """Parse and resolve the launch argv; raises LaunchArgsError / ValueError with SGLang-style messages."""
    ns = build_arg_parser().parse_args(argv)
    if ns.decode_log_interval < 1:
        raise ValueError(f"--decode-log-interval must be >= 1, found {ns.decode_log_interval}")
    res = resolve_speculative_args(ns, detected_device="cpu")
    for level, msg in res.adjustments:
        getattr(logger, level)(msg)
    if res.errors or res.runtime_errors:
        raise ValueError("; ".join(res.errors + res.runtime_errors))
    spec = None
    if res.speculative_algorithm is not None:
        _check_servable(res, ns)
        spec = SpecConfig(res.speculative_num_steps, res.speculative_eagle_topk, res.speculative_num_draft_tokens)
    config = json.loads(Path(ns.model_path, "config.json").read_text())
    seed = ns.random_seed if ns.random_seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
    return ServerSettings(
        argv=list(argv), args=ns, resolution=res, spec=spec,
        max_running_requests=res.max_running_requests or 48,
        context_length=int(config.get("max_position_embeddings", 2048)),
        served_model_name=ns.served_model_name or ns.model_path,
        random_seed=seed,
    )


def _check_servable(res: SpecResolution, ns) -> None:
    """What SGLang would run but this CPU reference server does not implement."""
    if res.speculative_algorithm != "EAGLE3":
        raise ValueError(f"eagle3.serve serves EAGLE3 drafts only, found "
                         f"speculative_algorithm={res.speculative_algorithm}")
    if res.speculative_draft_model_path is None:
        raise ValueError("--speculative-algorithm EAGLE3 needs --speculative-draft-model-path")
    if res.speculative_adaptive:
        raise ValueError("eagle3.serve does not implement --speculative-adaptive")
    if ns.speculative_accept_threshold_single != 1.0 or ns.speculative_accept_threshold_acc != 1.0:
        raise ValueError("eagle3.serve does not implement relaxed acceptance (--speculative-accept-threshold-*)")


def load_engine(settings: ServerSettings):
    """Target (+ EAGLE-3 drafter) from the launch paths. -> (SpeculativeEngine, tokenizer)"""
    ns = settings.args
    model, tokenizer = load_target(ns.model_path, dtype=_dtype_name(ns.dtype), device="cpu")
    if ns.tokenizer_path:
        tokenizer = AutoTokenizer.from_pretrained(ns.tokenizer_path)
    if settings.spec is None:
        return SpeculativeEngine(TargetModel(model), seed=settings.random_seed), tokenizer
    drafter = load_eagle3_drafter(ns.speculative_draft_model_path, model)
    target = TargetModel(model, drafter.aux_hidden_indices)
    return SpeculativeEngine(target, drafter, settings.spec, seed=settings.random_seed), tokenizer


def load_eagle3_drafter(draft_dir: str | Path, target_model: torch.nn.Module) -> Eagle3Drafter:
    """An SGLang-format EAGLE-3 draft dir as a Drafter for this target (embedding shared as SGLang does)."""
    draft = load_exported(draft_dir, target_model.get_input_embeddings().weight)
    draft = draft.to(dtype=next(target_model.parameters()).dtype)
    cfg = target_model.config
    hf_indices = aux_ids_to_hf_indices(cfg.architectures[0], list(draft.config.aux_layer_ids), cfg.num_hidden_layers)
    return Eagle3Drafter(draft, hf_indices)


def _dtype_name(dtype: str) -> str:
    return {"half": "float16", "float": "float32"}.get(dtype, dtype)


# --------------------------------------------------------------------------- HTTP: error shapes


OPENAI_ERROR_TYPES = {400: "BadRequest", 500: "InternalServerError", 503: "ServiceUnavailable"}


def openai_error_body(message: str, status: int, err_type: str | None = None) -> dict:
    """SGLang's flat ErrorResponse (openai/protocol.py), as serving_base.create_error_response sends it."""
    return {"object": "error", "message": message, "type": err_type or OPENAI_ERROR_TYPES[status], "param": None,
            "code": status}


def openai_stream_error_chunk(message: str, status: int) -> dict:
    """serving_base.create_streaming_error_response: the ErrorResponse under "error"."""
    return {"error": openai_error_body(message, status)}


def generate_error_body(message: str, status: int) -> dict:
    """SGLang /generate's error body and stream chunk (http_server._create_error_response)."""
    return {"error": {"message": message}}


ErrorBody = Callable[[str, int], dict]


def _error_status(exc: Exception) -> tuple[int, str]:
    """(HTTP status, message) for what a handler raised; logs the traceback of our own failures."""
    if isinstance(exc, RequestError):
        return 400, str(exc)
    if isinstance(exc, NotReady):
        return 503, str(exc)
    if isinstance(exc, InternalError):  # the worker already logged its traceback
        return 500, f"Internal server error: {exc}"
    logger.error("Internal error while answering a request", exc_info=exc)
    return 500, f"Internal server error: {type(exc).__name__}: {exc}"


async def _answer(handle: Callable[[], Awaitable[Any]], error_body: ErrorBody) -> Any:
    """Run a route's handler; what it raises becomes SGLang's status and that endpoint's error body."""
    try:
        return await handle()
    except SchemaError as e:
        return JSONResponse(openai_error_body(str(e), 400, "Bad Request"), status_code=400)
    except Exception as e:  # every failure must become a response: 4xx for the request, 5xx for us
        status, message = _error_status(e)
        return JSONResponse(error_body(message, status), status_code=status)


async def _sse(chunks: AsyncIterator[dict], error_chunk: ErrorBody) -> AsyncIterator[str]:
    """SSE: `data: {...}` per chunk; a failure after the 200 is one `data: {"error": ...}`; then `data: [DONE]`."""
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
    except Exception as e:  # the status line is sent: the error can only travel as a chunk
        status, message = _error_status(e)
        yield f"data: {json.dumps(error_chunk(message, status))}\n\n"
    yield "data: [DONE]\n\n"


# --------------------------------------------------------------------------- HTTP: request checks


async def _body_of(request: Request, model: type[BaseModel]) -> BaseModel:
    """The JSON body validated against the endpoint's schema (SchemaError), lone surrogates refused."""
    try:
        data = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SchemaError(f"invalid JSON body: {e}") from e
    _reject_lone_surrogates(data, "")
    return _validated(model, data, "", SchemaError)


def _validated(model: type[BaseModel], data: Any, prefix: str, error: type[RequestError] = RequestError) -> Any:
    """model.model_validate(data); a ValidationError becomes `error` naming each bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors(include_url=False):
            where = ".".join([prefix] * bool(prefix) + [str(part) for part in err["loc"]])
            problems.append(f"{where}: {err['msg']}" if where else err["msg"])
        raise error("; ".join(problems)) from e


def _reject_lone_surrogates(value: Any, path: str) -> None:
    """JSON may carry "\\ud800"; Python keeps it as a lone surrogate that no tokenizer or UTF-8 writer takes.

    Example: {"text": "a\\ud800"} -> RequestError("text is not valid unicode: lone surrogate '\\ud800' at index 1").
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(f"{path or 'body'} is not valid unicode: lone surrogate {value[e.start]!r} "
                               f"at index {e.start}") from e
    elif isinstance(value, dict):
        for key, item in value.items():
            _reject_lone_surrogates(key, f"{path}.<key>" if path else "<key>")
            _reject_lone_surrogates(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _reject_lone_surrogates(item, f"{path}[{i}]")


def _loaded(scheduler: Scheduler) -> Scheduler:
    if not scheduler.ready.is_set():
        raise NotReady("The server is still loading the model.")
    return scheduler


def _encode(scheduler: Scheduler, text: str, name: str) -> list[int]:
    if not text:
        raise RequestError(f"{name} is empty")
    return _loaded(scheduler).tokenizer(text)["input_ids"]


def _check_prompt(ids: list[int], name: str, max_new_tokens: int | None, scheduler: Scheduler,
                  settings: ServerSettings) -> list[int]:
    """A prompt SGLang's tokenizer manager would accept (_validate_one_request), else RequestError."""
    vocab_size = _loaded(scheduler).engine.target.vocab_size
    context = settings.context_length
    if not ids:
        raise RequestError(f"{name} is empty")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise RequestError(f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if len(ids) >= context:
        raise RequestError(f"The input ({len(ids)} tokens) is longer than the model's context length "
                           f"({context} tokens).")
    if max_new_tokens is not None and len(ids) + max_new_tokens > context:
        raise RequestError(
            f"Requested token count exceeds the model's maximum context length of {context} tokens. You requested "
            f"a total of {len(ids) + max_new_tokens} tokens: {len(ids)} tokens from the input messages and "
            f"{max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
            f"messages or the completion to fit within the limit."
        )
    return ids


# --------------------------------------------------------------------------- HTTP: routes


def build_app(scheduler: Scheduler, settings: ServerSettings) -> FastAPI:
    """The FastAPI app with SGLang's routes."""
    app = FastAPI(openapi_url=None)
    _add_admin_routes(app, scheduler, settings)
    _add_generation_routes(app, scheduler, settings)
    return app


def _add_admin_routes(app: FastAPI, scheduler: Scheduler, settings: ServerSettings) -> None:
    """/health, /health_generate, /server_info, /get_server_info, /v1/models, /flush_cache, /metrics."""
    started = time.time()

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        if not scheduler.ready.is_set():
            return Response(status_code=503)
        if scheduler.counts()[0]:  # busy decoding: alive (SGLang skips the probe generation too)
            return Response(status_code=200)
        reqs = _submit(scheduler, [f"HEALTH_CHECK_{time.time()}"], [[0]], SamplingParams(max_new_tokens=1), (),
                       False)
        try:
            await asyncio.wait_for(_collect(reqs), timeout=HEALTH_CHECK_TIMEOUT_S)
        except (asyncio.TimeoutError, InternalError):  # _collect's cleanup cancels the probe
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/server_info")
    async def server_info():
        return server_info_dict(scheduler, settings, started)

    @app.get("/get_server_info")
    async def get_server_info():
        logger.warning("Endpoint '/get_server_info' is deprecated and will be removed in a future version. "
                       "Please use '/server_info' instead.")
        return server_info_dict(scheduler, settings, started)

    @app.get("/v1/models")
    async def models():
        card = {"id": settings.served_model_name, "object": "model", "created": int(started), "owned_by": "sglang",
                "root": settings.args.model_path, "max_model_len": settings.context_length}
        return {"object": "list", "data": [card]}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        return Response(content="Cache flushed.\nPlease check backend logs for more details. (When there are running "
                                "or waiting requests, the operation will not be performed.)\n",
                        status_code=200 if scheduler.flush() else 400)

    if settings.args.enable_metrics:
        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(scheduler.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _add_generation_routes(app: FastAPI, scheduler: Scheduler, settings: ServerSettings) -> None:
    """/generate, /v1/completions, /v1/chat/completions."""

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        return await _answer(lambda: _generate(request, scheduler, settings), generate_error_body)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _answer(lambda: _completions(request, scheduler, settings), openai_error_body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _answer(lambda: _chat_completions(request, scheduler, settings), openai_error_body)


async def _generate(request: Request, scheduler: Scheduler, settings: ServerSettings):
    """/generate: one prompt or a batch, each `sampling_params.n` times, answered whole or streamed."""
    body = await _body_of(request, GenerateBody)
    sampling = _validated(SamplingBody, body.sampling_params, "sampling_params")
    batch = _is_batch(body) or sampling.n > 1  # SGLang turns a single prompt with n > 1 into a batch
    prompts = [_check_prompt(ids, name, sampling.max_new_tokens, scheduler, settings)
               for name, ids in _generate_prompts(body, scheduler)]
    prompts = prompts * sampling.n  # SGLang's parallel-sampling order: [p0, p1, p0, p1] for n=2
    sp, stops = _sampling(sampling)
    reqs = _submit(scheduler, _batch_rids(body.rid, len(prompts), batch), prompts, sp, stops, body.stream)
    if body.stream:
        return StreamingResponse(_sse(_generate_chunks(reqs, batch), generate_error_body),
                                 media_type="text/event-stream")
    outs = await _collect(reqs)
    return outs if batch else outs[0]


def _is_batch(body: GenerateBody) -> bool:
    return isinstance(body.text, list) or (bool(body.input_ids) and isinstance(body.input_ids[0], list))


def _generate_prompts(body: GenerateBody, scheduler: Scheduler) -> list[tuple[str, list[int]]]:
    """(field name, token ids) per prompt; messages as GenerateReqInput.normalize_batch_and_arguments."""
    if body.text is None and body.input_ids is None:
        raise RequestError("Either text or input_ids should be provided.")
    if body.text is not None and body.input_ids is not None:
        raise RequestError("Either text or input_ids should be provided, not both.")
    field_name = "text" if body.text is not None else "input_ids"
    value = body.text if body.text is not None else body.input_ids
    if not value:
        raise RequestError(f"{field_name} cannot be empty.")
    if not _is_batch(body):
        return [(field_name, _encode(scheduler, value, field_name) if field_name == "text" else list(value))]
    named = [(f"{field_name}[{i}]", item) for i, item in enumerate(value)]
    return [(name, _encode(scheduler, item, name) if field_name == "text" else list(item)) for name, item in named]


def _batch_rids(rid: str | None, count: int, batch: bool) -> list[str]:
    """GenerateReqInput._normalize_rid: a given rid becomes `{rid}_{i}` across a batch."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    return [f"{rid}_{i}" for i in range(count)] if batch else [rid]


def _sampling(sp: SamplingBody) -> tuple[SamplingParams, tuple[str, ...]]:
    stops = (sp.stop,) if isinstance(sp.stop, str) else tuple(sp.stop or ())
    return SamplingParams(max_new_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p,
                          top_k=sp.top_k, ignore_eos=sp.ignore_eos, stop_token_ids=tuple(sp.stop_token_ids or ()),
                          seed=sp.seed), tuple(s for s in stops if s)


def _submit(scheduler: Scheduler, rids: list[str], prompts: list[list[int]], sp: SamplingParams,
            stops: tuple[str, ...], stream: bool) -> list[ServeRequest]:
    """Queue one HTTP call's requests together; they share one event queue."""
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    reqs = [ServeRequest(rid, ids, sp, stops, stream, loop, events, index=i)
            for i, (rid, ids) in enumerate(zip(rids, prompts))]
    scheduler.submit(reqs)
    return reqs


async def _events(reqs: list[ServeRequest]) -> AsyncIterator[tuple[int, str, dict]]:
    """(index, kind, payload) of one call's requests until all are done; raises the worker's InternalError."""
    events, pending = reqs[0].events, len(reqs)
    try:
        while pending:
            index, kind, payload = await events.get()
            if kind == "error":
                raise payload
            pending -= kind == "done"
            yield index, kind, payload
    finally:
        for req in reqs:  # a no-op once finished; stops the rest after an error or a client gone away
            req.cancelled = True


async def _collect(reqs: list[ServeRequest]) -> list[dict]:
    """The final payload of each request, in batch order."""
    outs: list[dict] = [{} for _ in reqs]
    async for index, kind, payload in _events(reqs):
        if kind == "done":
            outs[index] = payload
    return outs


async def _generate_chunks(reqs: list[ServeRequest], batch: bool) -> AsyncIterator[dict]:
    """/generate stream chunks; in a batch each carries its "index" (tokenizer_manager._handle_batch_request)."""
    async for index, _, payload in _events(reqs):
        yield {**payload, "index": index} if batch else payload


async def _completions(request: Request, scheduler: Scheduler, settings: ServerSettings):
    body = await _body_of(request, CompletionBody)
    ids = list(body.prompt) if isinstance(body.prompt, list) else _encode(scheduler, body.prompt, "prompt")
    return await _openai(scheduler, settings, body, ids, chat=False)


async def _chat_completions(request: Request, scheduler: Scheduler, settings: ServerSettings):
    body = await _body_of(request, ChatBody)
    tok = _loaded(scheduler).tokenizer
    text = tok.apply_chat_template([m.model_dump() for m in body.messages], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return await _openai(scheduler, settings, body, ids, chat=True)


async def _openai(scheduler: Scheduler, settings: ServerSettings, body: _OpenAIBody, ids: list[int], chat: bool):
    """Shared /v1/completions and /v1/chat/completions handling."""
    requested = body.max_completion_tokens or body.max_tokens
    _check_prompt(ids, "messages" if chat else "prompt", requested, scheduler, settings)
    sampling = _validated(SamplingBody, {
        "max_new_tokens": requested or settings.context_length - len(ids), "temperature": body.temperature,
        "top_p": body.top_p, "top_k": body.top_k, "ignore_eos": body.ignore_eos, "stop": body.stop,
        "seed": body.seed}, "")
    sp, stops = _sampling(sampling)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    req = _submit(scheduler, [rid], [ids], sp, stops, body.stream)[0]
    model = body.model or settings.served_model_name
    if body.stream:
        return StreamingResponse(_sse(_openai_chunks(req, body, model, chat), openai_stream_error_chunk),
                                 media_type="text/event-stream")
    out = (await _collect([req]))[0]
    meta = out["meta_info"]
    choice = {"index": 0, "finish_reason": _openai_finish(meta), "matched_stop": _matched(meta)}
    choice.update({"message": {"role": "assistant", "content": out["text"]}} if chat
                  else {"text": out["text"], "logprobs": None})
    resp = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": _usage(meta)}
    if body.return_spec_tokens_details and "spec_verify_ct" in meta:
        resp["sglext"] = {"spec_tokens_details": _spec_details(meta)}
    return resp


async def _openai_chunks(req: ServeRequest, body: _OpenAIBody, model: str, chat: bool) -> AsyncIterator[dict]:
    """OpenAI stream chunks: text deltas, the finish reason, then usage if asked."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    sent, meta = "", None
    async for _, kind, payload in _events([req]):
        text, meta = payload["text"], payload["meta_info"]
        delta, sent = (text[len(sent):], text) if text.startswith(sent) else ("", sent)
        finish = _openai_finish(meta) if kind == "done" else None
        if not delta and finish is None:
            continue
        choice = {"index": 0, "finish_reason": finish}
        choice.update({"delta": {"role": "assistant", "content": delta}} if chat
                      else {"text": delta, "logprobs": None})
        yield {"id": req.rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
    if meta is not None and (body.stream_options or {}).get("include_usage"):
        usage = {"id": req.rid, "object": obj, "created": int(time.time()), "model": model, "choices": [],
                 "usage": _usage(meta)}
        if body.return_spec_tokens_details and "spec_verify_ct" in meta:
            usage["sglext"] = {"spec_tokens_details": _spec_details(meta)}
        yield usage


def server_info_dict(scheduler: Scheduler, settings: ServerSettings, started: float) -> dict:
    """SGLang /server_info: resolved args at top level, launch_command, scheduler info, internal_states."""
    ns, res = settings.args, settings.resolution
    running, queued = scheduler.counts()
    internal = {
        **res.resolved_settings(),
        "world_size": 1,
        "effective_max_running_requests_per_dp": settings.max_running_requests,
        "last_gen_throughput": scheduler.stats.last_gen_throughput,
        "memory_usage": {"token_capacity": settings.max_total_num_tokens},
        "num_running_reqs": running,
        "num_queue_reqs": queued,
    }
    avg = scheduler.stats.avg_spec_accept_length
    if settings.spec is not None and avg is not None:
        internal["avg_spec_accept_length"] = avg
    return {
        **vars(ns),
        **res.resolved_settings(),
        "served_model_name": settings.served_model_name,
        "random_seed": settings.random_seed,
        "launch_command": shlex.join([sys.executable, "-m", "eagle3.serve", *settings.argv]),
        "max_total_num_tokens": settings.max_total_num_tokens,
        "max_req_input_len": settings.context_length - 1,
        "context_len": settings.context_length,
        "startup_time": started,
        "version": SGLANG_VERSION,
        "frontend": "eagle3.serve",
        "kv_events": None,
        "internal_states": [internal],
    }




def _openai_finish(meta: dict) -> str | None:
    fr = meta.get("finish_reason")
    return None if fr is None else ("length" if fr["type"] == "length" else "stop")


def _matched(meta: dict):
    fr = meta.get("finish_reason") or {}
    return fr.get("matched")


def _usage(meta: dict) -> dict:
    return {"prompt_tokens": meta["prompt_tokens"], "completion_tokens": meta["completion_tokens"],
            "total_tokens": meta["prompt_tokens"] + meta["completion_tokens"]}


def _spec_details(meta: dict) -> dict:
    """SGLang SpecTokensDetails (srt/entrypoints/openai/utils.py)."""
    return {
        "spec_accept_rate": meta["spec_accept_rate"],
        "spec_accept_length": meta["spec_accept_length"],
        "spec_cap_length": 0.0,
        "spec_block_accept_length": 0.0,
        "spec_num_correct_drafts": meta["spec_num_correct_drafts"],
        "spec_num_proposed_drafts": meta["spec_num_proposed_drafts"],
        "spec_verify_ct": meta["spec_verify_ct"],
        "spec_correct_drafts_histogram": meta["spec_correct_drafts_histogram"],
        "spec_cap_lens_histogram": None,
    }


# --------------------------------------------------------------------------- entry point


def configure_logging(level: str) -> None:
    """SGLang's prefix: `[%Y-%m-%d %H:%M:%S] message` (TP=1 server: no rank tags)."""
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format="[%(asctime)s] %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S", force=True)


def log_ignored_flags(ns) -> None:
    for name in SERVE_IGNORED_FLAGS:
        value = getattr(ns, name)
        if value not in (None, False):
            logger.info(f"Ignoring --{name.replace('_', '-')}={value}: eagle3.serve runs on CPU without it.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_arg_parser(prog="eagle3.serve")
    try:
        ns = parser.parse_args(argv)
    except LaunchArgsError as e:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    configure_logging(ns.log_level)
    transformers_logging.disable_progress_bar()
    log_ignored_flags(ns)
    # Batch-1 decoding of a small model is latency-bound: one thread per server (OMP_NUM_THREADS to
    # change it). More threads than free cores spin in OpenMP barriers and ran 5-30x slower on 2 cores.
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    try:
        settings = build_settings(argv)
    except (ValueError, FileNotFoundError) as e:
        logger.error(f"Invalid launch arguments: {e}")
        return 1
    logger.info(f"server_args: {json.dumps(settings.resolution.resolved_settings())}")
    scheduler = Scheduler(settings)
    app = build_app(scheduler, settings)
    server = uvicorn.Server(uvicorn.Config(app, host=ns.host, port=ns.port, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5))
    scheduler.on_load_error = lambda: setattr(server, "should_exit", True)
    scheduler.start()
    try:
        server.run()
    finally:
        scheduler.stop()
    return 1 if scheduler.load_error else 0


if __name__ == "__main__":
    sys.exit(main())
