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
own KV caches (batch size 1 per forward).

Risk: drift from SGLang's shapes. Names and formats follow `srt/entrypoints/http_server.py`,
`srt/managers/scheduler_components/metrics_reporter.py` and `srt/observability/
metrics_collector.py`; the decode line is checked against the reference regex in the tests.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import shlex
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

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

    @model_validator(mode="after")
    def _top_k_valid(self) -> SamplingBody:
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return self


class GenerateBody(_Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingBody = Field(default_factory=SamplingBody)
    stream: bool = False
    rid: str | None = None

    @model_validator(mode="after")
    def _one_input(self) -> GenerateBody:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        return self


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


class BadRequest(ValueError):
    """Client error -> HTTP 400 with SGLang's error body."""


# --------------------------------------------------------------------------- serving state


@dataclass
class ServeRequest:
    """One generation handed to the worker; events go back to the asyncio side."""

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

    def emit(self, kind: str, payload: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))


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
        self._stop = False

    # ---- called from the asyncio side

    def submit(self, req: ServeRequest) -> None:
        with self._cv:
            self._waiting.append(req)
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
            self._stop = True
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
                while not self._stop and not self._waiting and not self._running:
                    self._cv.wait(timeout=1.0)
                if self._stop:
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
        """run(); on failure end this request with an error event (None returned), never the worker."""
        try:
            return run()
        except ValueError as e:  # a request the engine refuses (context length, token ids)
            message = str(e)
        except Exception as e:  # a bug must not take the worker, and every other request, down
            logger.exception(f"Request {req.rid} failed")
            message = f"{type(e).__name__}: {e}"
        self._remove(req)
        req.emit("error", message)
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


# --------------------------------------------------------------------------- HTTP


def build_app(scheduler: Scheduler, settings: ServerSettings) -> FastAPI:
    """The FastAPI app with SGLang's routes."""
    app = FastAPI(openapi_url=None)

    @app.exception_handler(BadRequest)
    async def _bad_request(request: Request, exc: BadRequest):
        return _error_response(str(exc))

    _add_admin_routes(app, scheduler, settings)
    _add_generation_routes(app, scheduler, settings)
    return app


def _error_response(message: str, status: int = 400) -> JSONResponse:
    """SGLang's ErrorResponse body (http_server.validation_exception_handler)."""
    return JSONResponse({"object": "error", "message": message, "type": "Bad Request", "param": None,
                         "code": status}, status_code=status)


async def _body_of(request: Request, model: type[BaseModel]) -> BaseModel:
    try:
        data = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"invalid JSON body: {e}") from e
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise BadRequest(str(e)) from e


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
        req = _new_request(scheduler, f"HEALTH_CHECK_{time.time()}", [0], SamplingParams(max_new_tokens=1), (), False)
        try:
            await asyncio.wait_for(_final(req), timeout=HEALTH_CHECK_TIMEOUT_S)
        except (asyncio.TimeoutError, BadRequest):
            req.cancelled = True
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
        body = await _body_of(request, GenerateBody)
        prompts = _generate_prompts(body, scheduler)
        sp, stops = _sampling(body.sampling_params)
        if body.stream:
            if len(prompts) != 1:
                raise BadRequest("stream supports a single prompt")
            req = _new_request(scheduler, body.rid or uuid.uuid4().hex, prompts[0], sp, stops, True)
            return StreamingResponse(_sse(req), media_type="text/event-stream")
        rids = [body.rid] if body.rid is not None and len(prompts) == 1 else [uuid.uuid4().hex for _ in prompts]
        reqs = [_new_request(scheduler, rid, p, sp, stops, False) for rid, p in zip(rids, prompts)]
        try:
            outs = [await _final(r) for r in reqs]
        except BadRequest as e:  # SGLang's _create_error_response shape
            return JSONResponse({"error": {"message": str(e)}}, status_code=400)
        return outs if _is_batch(body) else outs[0]

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _body_of(request, CompletionBody)
        ids = body.prompt if isinstance(body.prompt, list) else _encode(scheduler, body.prompt)
        return await _openai(scheduler, settings, body, _check_ids(ids, scheduler), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _body_of(request, ChatBody)
        tok = _tokenizer(scheduler)
        text = tok.apply_chat_template([m.model_dump() for m in body.messages], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        return await _openai(scheduler, settings, body, _check_ids(ids, scheduler), chat=True)


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


def _tokenizer(scheduler: Scheduler):
    if scheduler.tokenizer is None:
        raise BadRequest("the server is still loading the model")
    return scheduler.tokenizer


def _encode(scheduler: Scheduler, text: str) -> list[int]:
    return _tokenizer(scheduler)(text)["input_ids"]


def _check_ids(ids: list[int], scheduler: Scheduler) -> list[int]:
    vocab = len(_tokenizer(scheduler))
    if not ids:
        raise BadRequest("the prompt is empty")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise BadRequest(f"input_ids out of range [0, {vocab}): {bad[:5]}")
    return ids


def _is_batch(body: GenerateBody) -> bool:
    return isinstance(body.text, list) or (bool(body.input_ids) and isinstance(body.input_ids[0], list))


def _generate_prompts(body: GenerateBody, scheduler: Scheduler) -> list[list[int]]:
    if body.text is not None:
        texts = body.text if isinstance(body.text, list) else [body.text]
        return [_check_ids(_encode(scheduler, t), scheduler) for t in texts]
    ids = body.input_ids if _is_batch(body) else [body.input_ids]
    return [_check_ids(list(x), scheduler) for x in ids]


def _sampling(sp: SamplingBody) -> tuple[SamplingParams, tuple[str, ...]]:
    stops = (sp.stop,) if isinstance(sp.stop, str) else tuple(sp.stop or ())
    return SamplingParams(max_new_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p,
                          top_k=sp.top_k, ignore_eos=sp.ignore_eos, stop_token_ids=tuple(sp.stop_token_ids or ()),
                          seed=sp.seed), tuple(s for s in stops if s)


def _new_request(scheduler: Scheduler, rid: str, ids: list[int], sp: SamplingParams, stops: tuple[str, ...],
                 stream: bool) -> ServeRequest:
    req = ServeRequest(rid, ids, sp, stops, stream, asyncio.get_running_loop(), asyncio.Queue())
    scheduler.submit(req)
    return req


async def _final(req: ServeRequest) -> dict:
    """Wait for the finished payload; BadRequest if the worker refused the request."""
    try:
        while True:
            kind, payload = await req.events.get()
            if kind == "done":
                return payload
            if kind == "error":
                raise BadRequest(payload)
    except asyncio.CancelledError:
        req.cancelled = True
        raise


async def _events(req: ServeRequest):
    try:
        while True:
            kind, payload = await req.events.get()
            if kind == "error":
                raise BadRequest(payload)
            yield kind, payload
            if kind == "done":
                return
    finally:
        req.cancelled = True  # a no-op once finished; stops decoding for a client that went away


async def _sse(req: ServeRequest):
    """/generate streaming: `data: {...}` per chunk, then `data: [DONE]`."""
    try:
        async for _, payload in _events(req):
            yield f"data: {json.dumps(payload)}\n\n"
    except BadRequest as e:
        yield f"data: {json.dumps({'error': {'message': str(e)}})}\n\n"
    yield "data: [DONE]\n\n"


async def _openai(scheduler: Scheduler, settings: ServerSettings, body: _OpenAIBody, ids: list[int], chat: bool):
    """Shared /v1/completions and /v1/chat/completions handling."""
    max_new = body.max_completion_tokens or body.max_tokens or max(settings.context_length - len(ids), 1)
    try:
        sampling = SamplingBody(max_new_tokens=max_new, temperature=body.temperature, top_p=body.top_p,
                                top_k=body.top_k, ignore_eos=body.ignore_eos, stop=body.stop, seed=body.seed)
    except ValidationError as e:
        raise BadRequest(str(e)) from e
    sp, stops = _sampling(sampling)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    req = _new_request(scheduler, rid, ids, sp, stops, body.stream)
    model = body.model or settings.served_model_name
    if body.stream:
        return StreamingResponse(_openai_stream(req, body, model, chat), media_type="text/event-stream")
    out = await _final(req)
    meta = out["meta_info"]
    choice = {"index": 0, "finish_reason": _openai_finish(meta), "matched_stop": _matched(meta)}
    choice.update({"message": {"role": "assistant", "content": out["text"]}} if chat
                  else {"text": out["text"], "logprobs": None})
    resp = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": _usage(meta)}
    if body.return_spec_tokens_details and "spec_verify_ct" in meta:
        resp["sglext"] = {"spec_tokens_details": _spec_details(meta)}
    return resp


async def _openai_stream(req: ServeRequest, body: _OpenAIBody, model: str, chat: bool):
    obj = "chat.completion.chunk" if chat else "text_completion"
    sent, meta = "", None
    try:
        async for kind, payload in _events(req):
            text, meta = payload["text"], payload["meta_info"]
            delta, sent = (text[len(sent):], text) if text.startswith(sent) else ("", sent)
            finish = _openai_finish(meta) if kind == "done" else None
            if not delta and finish is None:
                continue
            choice = {"index": 0, "finish_reason": finish}
            choice.update({"delta": {"role": "assistant", "content": delta}} if chat
                          else {"text": delta, "logprobs": None})
            chunk = {"id": req.rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
            yield f"data: {json.dumps(chunk)}\n\n"
    except BadRequest as e:
        yield f"data: {json.dumps({'error': {'message': str(e)}})}\n\n"
    if meta is not None and (body.stream_options or {}).get("include_usage"):
        usage = {"id": req.rid, "object": obj, "created": int(time.time()), "model": model, "choices": [],
                 "usage": _usage(meta)}
        if body.return_spec_tokens_details and "spec_verify_ct" in meta:
            usage["sglext"] = {"spec_tokens_details": _spec_details(meta)}
        yield f"data: {json.dumps(usage)}\n\n"
    yield "data: [DONE]\n\n"


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
