"""The request bodies of SGLang's endpoints (`/generate`, `/v1/completions`,
`/v1/chat/completions`, `/configure_logging`) as the reference server checks them, and the errors raised while
answering a request (each maps to one HTTP status in `eagle3.serving.http_api`).

Bounds SGLang does not set (deliberate: each is a 400 naming the field instead of what SGLang
does): `sampling_params.n` <= MAX_PARALLEL_SAMPLES (SGLang queues any n: one small body could
ask for millions of generations); `seed` within a signed 64-bit integer (what a torch generator
takes, as vLLM bounds it; past it the worker failed: a 500).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_PARALLEL_SAMPLES = 128  # sampling_params.n: parallel samples per prompt in one call
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


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
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    n: int = Field(1, ge=1, le=MAX_PARALLEL_SAMPLES, description="parallel samples per prompt (SGLang parallel sampling)")

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
    return_prompt_token_ids: bool = False


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
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
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


class ConfigureLoggingBody(_Body):
    """/configure_logging's schema: SGLang's ConfigureLoggingReq (srt/managers/io_struct.py); None = unchanged.

    Deliberately stricter than SGLang: a threshold below 1 is a 400 (SGLang takes it and dumps
    on every request); log_level is checked while handling (SGLang's setLevel raises: a 500).
    """

    log_requests: bool | None = None
    log_requests_level: int | None = None
    log_requests_format: str | None = None
    log_level: str | None = None
    dump_requests_folder: str | None = None
    dump_requests_threshold: int | None = Field(None, ge=1)
    crash_dump_folder: str | None = None
    dump_requests_exclude_meta_keys: list[str] | None = None


class RequestError(ValueError):
    """A request refused while handling it -> 400 in the endpoint's error shape."""


class SchemaError(RequestError):
    """The body is not JSON or does not fit the schema -> 400, flat ErrorResponse on every endpoint."""


class ClientGone(Exception):
    """The client went away (mid-body, or while its answer was generated): nothing to answer, nothing to log."""


class NotReady(RuntimeError):
    """The model is still loading -> 503."""


class InternalError(RuntimeError):
    """The worker failed on a request (traceback already logged) -> 500."""
