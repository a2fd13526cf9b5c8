"""The reference server's HTTP API: SGLang's endpoints (`/generate` incl. batches, `n` and
streaming, `/v1/completions`, `/v1/chat/completions`, `/server_info`, `/health`,
`/health_generate`, `/flush_cache`, `/metrics`, `/configure_logging`) and their response and
error shapes.

Request dumps (`eagle3.serving.request_dumps`): `/configure_logging` with `dump_requests_folder`
and `dump_requests_threshold` turns them on; every finished request of `/generate`,
`/v1/completions` and `/v1/chat/completions` is recorded with the GenerateReqInput SGLang's
entrypoint would have built for it: /generate's own fields (`text` or `input_ids`, the
`sampling_params` sent), a completion's string prompt as `text` and token prompt as `input_ids`,
a chat's template ids as `input_ids` (SGLang's serving_chat on a text-only model). /generate's
`return_prompt_token_ids` adds `prompt_token_ids` to its answer (and so to the dump), as in
SGLang. `/configure_logging` answers an empty 200 (SGLang's); a body that does not fit, a bad
`log_level` or a dump folder that cannot be created is a 400 flat ErrorResponse naming it.

A prompt of >= context-length tokens, or prompt + max_new_tokens > context length, is refused
(SGLang's check when --allow-auto-truncate is off; this server has no truncation). Streamed
requests of one HTTP call share one SSE stream and carry "index", as in SGLang.

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
the refusal as its error chunk); `sampling_params.n` and `seed` are bounded (`requests.py`); a body
nested deeper than MAX_BODY_DEPTH levels is a 400 flat ErrorResponse (SGLang's JSON parser raises
RecursionError there: a 500).

Off the event loop, so /health answers at once while a huge prompt is handled: a body is parsed and
validated, and its texts tokenized (chat template included), in worker threads (SGLang's tokenizer
manager tokenizes on its event loop; here a 20 MB text held every health check for ~a minute).
Prompt length is checked before token ids are scanned, as SGLang's `_validate_one_request` does.

A client that goes away: a whole (non-streaming) answer's wait checks for the disconnect every
DISCONNECT_POLL_S (SGLang's `_wait_one_response` checks every 4 s) and then cancels every request
of the call -- queued ones leave the queue at once, running ones at the next decode iteration --
answering a 400 nobody reads, as SGLang does; a stream's requests are cancelled when its response
stops. A disconnect mid-body is one info line, never an internal-error traceback.

Risk: drift from SGLang's shapes; names and formats follow `srt/entrypoints/http_server.py`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
import sys
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from eagle3.serving.decoding import SamplingParams
from eagle3.serving.request_dumps import GenerateReqInput
from eagle3.serving.requests import (
    ChatBody,
    ClientGone,
    CompletionBody,
    ConfigureLoggingBody,
    GenerateBody,
    InternalError,
    NotReady,
    RequestError,
    SamplingBody,
    SchemaError,
    _OpenAIBody,
)
from eagle3.serving.scheduler import Scheduler, ServeRequest
from eagle3.serving.settings import ServerSettings

logger = logging.getLogger("eagle3.serve")


SGLANG_VERSION = "0.5.23+eagleops"


HEALTH_CHECK_TIMEOUT_S = 20.0
DISCONNECT_POLL_S = 1.0  # how often a whole answer's wait looks for a client that went away
MAX_BODY_DEPTH = 64  # JSON nesting levels of a body; the endpoints' own schemas need 4


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
    if isinstance(exc, ClientGone):  # nobody reads the answer: one line, no traceback
        logger.info(f"Request dropped: {exc}")
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


async def _body_of(request: Request, model: type[BaseModel]) -> BaseModel:
    """The JSON body validated against the endpoint's schema (SchemaError), parsed in a worker thread."""
    try:
        raw = await request.body()
    except ClientDisconnect as e:
        raise ClientGone("the client disconnected before its request body was complete") from e
    return await asyncio.to_thread(_parsed_body, raw, model)


def _parsed_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """JSON -> nesting and lone surrogates checked -> the endpoint's schema."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SchemaError(f"invalid JSON body: {e}") from e
    except RecursionError as e:  # the parser's own stack ran out: far past MAX_BODY_DEPTH
        raise SchemaError(f"invalid JSON body: nested deeper than {MAX_BODY_DEPTH} levels") from e
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
    Walked with a stack of its own (never Python's: a deep body is a SchemaError past MAX_BODY_DEPTH).

    Example: {"text": "a\\ud800"} -> RequestError("text is not valid unicode: lone surrogate '\\ud800' at index 1").
    """
    stack = [(value, path, 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_BODY_DEPTH:
            raise SchemaError(f"invalid JSON body: nested deeper than {MAX_BODY_DEPTH} levels (at {path})")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RequestError(f"{path or 'body'} is not valid unicode: lone surrogate {value[e.start]!r} "
                                   f"at index {e.start}") from e
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):  # reversed onto the stack: checked in document order
                stack.append((item, f"{path}.{key}" if path else key, depth + 1))
                stack.append((key, f"{path}.<key>" if path else "<key>", depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in reversed(list(enumerate(value))))


def _loaded(scheduler: Scheduler) -> Scheduler:
    if not scheduler.ready.is_set():
        raise NotReady("The server is still loading the model.")
    return scheduler


async def _encode(scheduler: Scheduler, text: str, name: str) -> list[int]:
    """The text's token ids, tokenized in a worker thread (the event loop keeps answering)."""
    if not text:
        raise RequestError(f"{name} is empty")
    tokenizer = _loaded(scheduler).tokenizer
    return await asyncio.to_thread(lambda: tokenizer(text)["input_ids"])


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _check_prompt(ids: list[int], name: str, max_new_tokens: int | None, scheduler: Scheduler,
                  settings: ServerSettings) -> list[int]:
    """A prompt SGLang's tokenizer manager would accept (_validate_one_request), else RequestError.
    Lengths first: a prompt past the context is refused before its ids are scanned."""
    vocab_size = _loaded(scheduler).engine.target.vocab_size
    context = settings.context_length
    if not ids:
        raise RequestError(f"{name} is empty")
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
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise RequestError(f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return ids


def build_app(scheduler: Scheduler, settings: ServerSettings) -> FastAPI:
    """The FastAPI app with SGLang's routes."""
    app = FastAPI(openapi_url=None)
    _add_admin_routes(app, scheduler, settings)
    _add_generation_routes(app, scheduler, settings)
    return app


def _add_admin_routes(app: FastAPI, scheduler: Scheduler, settings: ServerSettings) -> None:
    """/health, /health_generate, /server_info, /get_server_info, /v1/models, /flush_cache, /metrics,
    /configure_logging."""
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
            await asyncio.wait_for(_collect(reqs, scheduler), timeout=HEALTH_CHECK_TIMEOUT_S)
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

    @app.api_route("/configure_logging", methods=["GET", "POST"])
    async def configure_logging(request: Request):
        return await _answer(lambda: _configure_logging(request, scheduler), openai_error_body)

    if settings.args.enable_metrics:
        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(scheduler.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _configure_logging(request: Request, scheduler: Scheduler) -> Response:
    """SGLang's TokenizerManager.configure_logging: set what the body sets; request logging is not
    implemented here (its fields are accepted and logged), the dump fields are."""
    body = await _body_of(request, ConfigureLoggingBody)
    level = _log_level(body.log_level) if body.log_level is not None else None
    if body.dump_requests_folder:
        await asyncio.to_thread(_make_dump_folder, body.dump_requests_folder)
    scheduler.dumps.configure(body.dump_requests_folder, body.dump_requests_threshold,
                              body.dump_requests_exclude_meta_keys)
    if level is not None:
        logging.getLogger().setLevel(level)
    fields = ", ".join(f"{k}={v!r}" for k, v in body.model_dump().items())
    logger.info(f"Config logging: obj=ConfigureLoggingReq({fields})")
    return Response(status_code=200)


def _log_level(name: str) -> int:
    level = logging.getLevelName(name.upper())
    if not isinstance(level, int):
        raise RequestError(f"log_level: unknown level {name!r}; expected one of debug, info, warning, error, "
                           f"critical")
    return level


def _make_dump_folder(folder: str) -> None:
    """Create the dump folder now, so a folder that cannot exist is the request's 400 (SGLang finds out
    only when its first dump fails in the background)."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise RequestError(f"dump_requests_folder: cannot create {folder!r}: {e.strerror or e}") from e


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
    named = await _generate_prompts(body, scheduler)
    prompts = [_check_prompt(ids, name, sampling.max_new_tokens, scheduler, settings) for name, ids, _ in named]
    prompts = prompts * sampling.n  # SGLang's parallel-sampling order: [p0, p1, p0, p1] for n=2
    texts = [text for _, _, text in named] * sampling.n
    sp, stops = _sampling(sampling)
    rids = _batch_rids(body.rid, len(prompts), batch)
    reqs = _submit(scheduler, rids, prompts, sp, stops, body.stream, _generate_origins(body, rids, prompts, texts),
                   body.return_prompt_token_ids)
    if body.stream:
        return StreamingResponse(_sse(_generate_chunks(reqs, scheduler, batch), generate_error_body),
                                 media_type="text/event-stream")
    outs = await _collect(reqs, scheduler, request)
    return outs if batch else outs[0]


def _is_batch(body: GenerateBody) -> bool:
    return isinstance(body.text, list) or (bool(body.input_ids) and isinstance(body.input_ids[0], list))


async def _generate_prompts(body: GenerateBody, scheduler: Scheduler) -> list[tuple[str, list[int], str | None]]:
    """(field name, token ids, the text or None) per prompt; messages as
    GenerateReqInput.normalize_batch_and_arguments."""
    if body.text is None and body.input_ids is None:
        raise RequestError("Either text or input_ids should be provided.")
    if body.text is not None and body.input_ids is not None:
        raise RequestError("Either text or input_ids should be provided, not both.")
    field_name = "text" if body.text is not None else "input_ids"
    value = body.text if body.text is not None else body.input_ids
    if not value:
        raise RequestError(f"{field_name} cannot be empty.")
    named = [(f"{field_name}[{i}]", item) for i, item in enumerate(value)] if _is_batch(body) else [(field_name, value)]
    if field_name == "text":
        return [(name, await _encode(scheduler, item, name), item) for name, item in named]
    return [(name, list(item), None) for name, item in named]


def _generate_origins(body: GenerateBody, rids: list[str], prompts: list[list[int]],
                      texts: list[str | None]) -> list[GenerateReqInput]:
    """What SGLang's tokenizer manager holds per sub-request (`obj[i]`): its text, or its ids when sent as ids."""
    return [GenerateReqInput(rid=rid, text=text, input_ids=None if text is not None else ids,
                             sampling_params=body.sampling_params, stream=body.stream,
                             return_prompt_token_ids=body.return_prompt_token_ids, received_time=time.time())
            for rid, ids, text in zip(rids, prompts, texts)]


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
            stops: tuple[str, ...], stream: bool, origins: list[GenerateReqInput] | None = None,
            return_prompt_token_ids: bool = False) -> list[ServeRequest]:
    """Queue one HTTP call's requests together; they share one event queue. origins: what a request dump
    records per request (None: never dumped)."""
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    origins = origins or [None] * len(rids)
    reqs = [ServeRequest(rid, ids, sp, stops, stream, loop, events, index=i, origin=origin,
                         return_prompt_token_ids=return_prompt_token_ids)
            for i, (rid, ids, origin) in enumerate(zip(rids, prompts, origins))]
    scheduler.submit(reqs)
    return reqs


async def _events(reqs: list[ServeRequest], scheduler: Scheduler,
                  request: Request | None = None) -> AsyncIterator[tuple[int, str, dict]]:
    """(index, kind, payload) of one call's requests until all are done; raises the worker's InternalError,
    or ClientGone when `request`'s client disconnected while waiting."""
    events, pending = reqs[0].events, len(reqs)
    try:
        while pending:
            index, kind, payload = await _next_event(events, request)
            if kind == "error":
                raise payload
            pending -= kind == "done"
            yield index, kind, payload
    finally:  # a no-op once finished; stops the rest after an error or a client gone away
        scheduler.cancel(reqs)


async def _next_event(events: asyncio.Queue, request: Request | None) -> tuple[int, str, Any]:
    """The next event; with `request`, its client checked every DISCONNECT_POLL_S meanwhile."""
    if request is None:
        return await events.get()
    while True:
        try:
            return await asyncio.wait_for(events.get(), timeout=DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                raise ClientGone("the client disconnected before its answer was ready; its requests were "
                                 "cancelled") from None


async def _collect(reqs: list[ServeRequest], scheduler: Scheduler, request: Request | None = None) -> list[dict]:
    """The final payload of each request, in batch order (cancelled when `request`'s client goes away)."""
    outs: list[dict] = [{} for _ in reqs]
    async for index, kind, payload in _events(reqs, scheduler, request):
        if kind == "done":
            outs[index] = payload
    return outs


async def _generate_chunks(reqs: list[ServeRequest], scheduler: Scheduler, batch: bool) -> AsyncIterator[dict]:
    """/generate stream chunks; in a batch each carries its "index" (tokenizer_manager._handle_batch_request)."""
    async for index, _, payload in _events(reqs, scheduler):
        yield {**payload, "index": index} if batch else payload


async def _completions(request: Request, scheduler: Scheduler, settings: ServerSettings):
    body = await _body_of(request, CompletionBody)
    ids = list(body.prompt) if isinstance(body.prompt, list) else await _encode(scheduler, body.prompt, "prompt")
    text = body.prompt if isinstance(body.prompt, str) else None
    return await _openai(request, scheduler, settings, body, ids, chat=False, text=text)


async def _chat_completions(request: Request, scheduler: Scheduler, settings: ServerSettings):
    body = await _body_of(request, ChatBody)
    tok = _loaded(scheduler).tokenizer
    ids = await asyncio.to_thread(_chat_ids, tok, [m.model_dump() for m in body.messages])
    return await _openai(request, scheduler, settings, body, ids, chat=True)


async def _openai(request: Request, scheduler: Scheduler, settings: ServerSettings, body: _OpenAIBody,
                  ids: list[int], chat: bool, text: str | None = None):
    """Shared /v1/completions and /v1/chat/completions handling (text: a completion's string prompt)."""
    requested = body.max_completion_tokens or body.max_tokens
    _check_prompt(ids, "messages" if chat else "prompt", requested, scheduler, settings)
    sampling_params = {
        "max_new_tokens": requested or settings.context_length - len(ids), "temperature": body.temperature,
        "top_p": body.top_p, "top_k": body.top_k, "ignore_eos": body.ignore_eos, "stop": body.stop,
        "seed": body.seed}
    sp, stops = _sampling(_validated(SamplingBody, sampling_params, ""))
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    origin = GenerateReqInput(rid=rid, text=text, input_ids=None if text is not None else ids,
                              sampling_params=sampling_params, stream=body.stream, received_time=time.time())
    req = _submit(scheduler, [rid], [ids], sp, stops, body.stream, [origin])[0]
    model = body.model or settings.served_model_name
    if body.stream:
        return StreamingResponse(_sse(_openai_chunks(req, scheduler, body, model, chat), openai_stream_error_chunk),
                                 media_type="text/event-stream")
    out = (await _collect([req], scheduler, request))[0]
    meta = out["meta_info"]
    choice = {"index": 0, "finish_reason": _openai_finish(meta), "matched_stop": _matched(meta)}
    choice.update({"message": {"role": "assistant", "content": out["text"]}} if chat
                  else {"text": out["text"], "logprobs": None})
    resp = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": _usage(meta)}
    if body.return_spec_tokens_details and "spec_verify_ct" in meta:
        resp["sglext"] = {"spec_tokens_details": _spec_details(meta)}
    return resp


async def _openai_chunks(req: ServeRequest, scheduler: Scheduler, body: _OpenAIBody, model: str,
                         chat: bool) -> AsyncIterator[dict]:
    """OpenAI stream chunks: text deltas, the finish reason, then usage if asked."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    sent, meta = "", None
    async for _, kind, payload in _events([req], scheduler):
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
