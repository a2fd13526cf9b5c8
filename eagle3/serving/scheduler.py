"""The reference server's worker: one thread owns the model and decodes every request.

Requests wait in a FIFO queue; up to `max_running_requests` are admitted (prefill) and then
decoded round-robin, one target forward per running request per decode iteration, so streams
progress together and `#running-req` means what it means in SGLang. Extra requests queue, never
get rejected. Each request keeps its own KV caches (batch size 1 per forward). One HTTP call's
requests (a batch of prompts, times `sampling_params.n`, SGLang's parallel sampling, ordered
[p0, p1, p0, p1]) enter the queue together. Also owns SGLang's Prometheus metrics, its
periodic decode log line, and hands each finished request to the request dumper
(`eagle3.serving.request_dumps`, on after `/configure_logging`).

Risk: drift from SGLang's names and formats (`srt/managers/scheduler_components/
metrics_reporter.py`, `srt/observability/metrics_collector.py`); the decode line is checked
against the reference regex in the tests.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from eagle3.serving.decoding import GenerationResult, RequestState, SamplingParams, SpecConfig, SpeculativeEngine
from eagle3.serving.request_dumps import GenerateReqInput, RequestDumper
from eagle3.serving.requests import InternalError
from eagle3.serving.settings import ServerSettings, load_engine

logger = logging.getLogger("eagle3.serve")


READY_MESSAGE = "The server is fired up and ready to roll!"


METRIC_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")


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
    origin: GenerateReqInput | None = None  # what a request dump records; None: never dumped (health checks)
    return_prompt_token_ids: bool = False
    created_time: float = field(default_factory=time.time)  # wall clock, as dumps record it

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
        # SGLang's TokenizerMetricsCollector: counted once per finished request (observe_one_finished_request),
        # labelled model_name + engine_type (+ is_streaming), children made at the first request that needs them.
        tokenizer_labels = ("model_name", "engine_type")
        self.tokenizer_labels = {k: self.labels[k] for k in tokenizer_labels}
        self.spec_verify_calls_total = Counter("sglang:spec_verify_calls_total",
                                               "Number of speculative decoding verification calls.",
                                               tokenizer_labels, registry=r)
        self.generation_tokens_total = Counter("sglang:generation_tokens_total", "Number of generation tokens processed.",
                                               (*tokenizer_labels, "is_streaming"), registry=r)
        self.prompt_tokens_total = Counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.",
                                           (*tokenizer_labels, "is_streaming"), registry=r)
        self.num_requests_total = Counter("sglang:num_requests_total", "Number of requests processed.",
                                          (*tokenizer_labels, "is_streaming"), registry=r)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              ln, registry=r).labels(**self.labels)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                             ln, registry=r).labels(**self.labels)
        # SGLang's device-timer series (with SGLANG_ENABLE_METRICS_DEVICE_TIMER=1): seconds of forward passes by
        # category; here wall seconds of each request's forwards, which run one after another (batch size 1).
        self.forward_execution_seconds_total = Counter(
            "sglang:forward_execution_seconds_total", "Total time that GPU is busy executing model forward passes. "
            "Refer to ForwardMode for category labels.", (*ln, "category"), registry=r)
        if spec is not None:
            self.spec_num_steps.set(spec.num_steps)
            self.spec_num_draft_tokens.set(spec.num_draft_tokens)

    def observe_forward(self, category: str, seconds: float) -> None:
        self.forward_execution_seconds_total.labels(**self.labels, category=category).inc(seconds)

    def observe_finished(self, prompt_tokens: int, generation_tokens: int, verify_ct: int, streaming: bool) -> None:
        """One finished request's counts, as SGLang's observe_one_finished_request adds them."""
        stream_labels = {**self.tokenizer_labels, "is_streaming": "true" if streaming else "false"}
        self.prompt_tokens_total.labels(**stream_labels).inc(prompt_tokens)
        self.generation_tokens_total.labels(**stream_labels).inc(generation_tokens)
        self.num_requests_total.labels(**stream_labels).inc()
        if verify_ct > 0:
            self.spec_verify_calls_total.labels(**self.tokenizer_labels).inc(verify_ct)


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


class Scheduler(threading.Thread):
    """The worker thread: loads the model, admits queued requests, decodes round-robin."""

    def __init__(self, settings: ServerSettings) -> None:
        super().__init__(name="eagle3-scheduler", daemon=True)
        self.settings = settings
        self.metrics = Metrics(settings.served_model_name, settings.spec)
        self.stats = DecodeStats()
        self.dumps = RequestDumper(settings.dump_server_args())
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.on_load_error = lambda: None  # set by main(): stops the HTTP server
        self.on_loaded = lambda: None  # set by main(): the command's garbage collection back on
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

    def cancel(self, reqs: list[ServeRequest]) -> None:
        """Drop one HTTP call's requests (its client went away, or it ended): the waiting ones leave the queue
        now; a running one leaves at the worker's next decode iteration. A no-op for finished requests."""
        with self._cv:
            for req in reqs:
                req.cancelled = True
            if any(req.state is None for req in reqs):  # some never admitted: they may still wait
                dropped = {id(req) for req in reqs}
                self._waiting = collections.deque(r for r in self._waiting if id(r) not in dropped)

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
            self.engine.timer.on_forward = self.metrics.observe_forward  # after the warm-up: served forwards only
        except (OSError, ValueError, RuntimeError, ImportError) as e:
            self.load_error = f"{type(e).__name__}: {e}"
            logger.error(f"Failed to load the model: {self.load_error}")
            self.on_load_error()
            return
        self.on_loaded()
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
        st = req.state
        self.metrics.observe_finished(len(st.prompt_ids), len(st.output_ids), st.stats.verify_ct, req.stream)
        self.metrics.e2e.observe(time.perf_counter() - req.received_at)
        payload = self._payload(req, final=True)
        if req.origin is not None:
            self.dumps.record(req.origin, payload, req.created_time, time.time())
        req.emit("done", payload)

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
        out = {"text": req.text, "output_ids": list(st.output_ids), "meta_info": meta}
        if req.return_prompt_token_ids:  # SGLang adds them to every chunk
            out["prompt_token_ids"] = list(st.prompt_ids)
        return out

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
