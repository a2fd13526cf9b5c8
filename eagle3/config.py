"""ML-side experiment sections: target, data, train (with the draft shape), export.

Pydantic models, strict (`extra="forbid"`), every field described and bounded. The YAML
loader and the orchestration sections (deploy, bench, tracking, hosts) live in
`tasks/config/schema.py`; this module has no YAML, Prefect or MLflow imports so that `eagle3/`
stays usable from a notebook.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,63}$"  # hosts[].name, and every field that names a host
MAX_SEED = 2**32 - 1  # the widest seed every RNG here takes (torch, random, numpy)
MAX_STEPS = 100_000_000  # optimizer steps (and step intervals): past any run, within every counter
URL_PATTERN = r"^https?://[^\s/@]+(@[^\s/@]+)?(/\S*)?$"  # no spaces or newlines: they would reach a request line
HostName = Annotated[str, Field(pattern=NAME_PATTERN)]


class StrictModel(BaseModel):
    """Base for every config section: unknown keys are errors, defaults are validated, and two rules hold for
    every field of every section (so a new field cannot forget them):
    - a float is finite: `.inf` or `.nan` passes a lone lower bound (rope_theta > 0) and reaches the math;
    - no string holds a NUL byte (keys and list items included): no path, address, name, flag or environment
      value can, and the OS refuses one only when the stage that uses it runs ("embedded null byte").
    Ints are bounded field by field (`le=`); tests/tasks/config/test_config_mutations.py checks that each is."""

    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_nul_byte(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name and not _holds_section(cls, info.field_name) and _has_nul(value):
            raise ValueError("contains a NUL byte (\\0), which no path, address, name or flag can hold")
        return value


@cache
def _holds_section(model: type[BaseModel], field: str) -> bool:
    """Whether the field's type is (or holds) a section: that section's own fields are checked, each at its line."""
    def sections_in(annotation: Any) -> bool:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return True
        return any(sections_in(arg) for arg in get_args(annotation))

    info = model.model_fields.get(field)
    return info is not None and sections_in(info.annotation)


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_has_nul(v) for v in value)
    return False


# --------------------------------------------------------------------------- target


class TinyTargetConfig(StrictModel):
    """Shape and training budget of the embedded tiny target (built locally, never downloaded)."""

    vocab_size: int = Field(1024, ge=300, le=65536, description="BPE vocabulary size of the tiny tokenizer.")
    hidden_size: int = Field(
        64,
        ge=16,
        le=4096,
        description="Hidden width of the tiny Llama (small: a 3-minute CPU budget buys more from tokens than width).",
    )
    intermediate_size: int = Field(176, ge=16, le=16384, description="MLP width of the tiny Llama.")
    num_hidden_layers: int = Field(
        8, ge=7, le=64, description="Decoder layers; >= 7 so SGLang's default aux layers are three distinct ones."
    )
    num_attention_heads: int = Field(2, ge=1, le=64, description="Attention heads.")
    num_key_value_heads: int = Field(1, ge=1, le=64, description="KV heads (GQA); must divide the attention heads.")
    max_position_embeddings: int = Field(1024, ge=64, le=131072, description="Context length of the tiny target.")
    rope_theta: float = Field(10000.0, gt=0, le=1e9, description="RoPE base.")
    corpus_max_bytes: int = Field(
        2_500_000, ge=10_000, le=500_000_000, description="Bytes of Python stdlib source used as training corpus."
    )
    train_steps: int = Field(300, ge=1, le=1_000_000, description="Optimizer steps for the tiny target.")
    batch_size: int = Field(
        8,
        ge=1,
        le=4096,
        description="Sequences per step when training the tiny target (8: the demo's time budget; 16 costs 1.5x "
        "the CPU for held-out loss 4.64 instead of 4.80).",
    )
    seq_len: int = Field(256, ge=16, le=8192, description="Tokens per training sequence of the tiny target.")
    lr: float = Field(6e-3, gt=0, le=1, description="Peak learning rate of the tiny target (warmup 5%, cosine to 10%).")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed for the tiny target's tokenizer and weights.")
    chat_fraction: float = Field(
        0.5, ge=0, le=1, description="Share of each batch that is chat-formatted (snippet prompt -> its continuation)."
    )
    eval_tokens: int = Field(
        32768, ge=64, le=10_000_000, description="Held-out stdlib tokens (never trained on) scored into eval.json."
    )
    precision: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Training math: auto = bf16 autocast where the CPU has native bf16, else fp32."
    )
    num_threads: int = Field(
        0,
        ge=0,
        le=1024,
        description="Torch CPU threads while building (0 = the cores other processes leave idle, re-checked "
        "every 20 steps); not in the cache key.",
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyTargetConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("target.tiny.num_attention_heads must be a multiple of target.tiny.num_key_value_heads")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("target.tiny.hidden_size must be a multiple of target.tiny.num_attention_heads")
        return self


class TargetShape(StrictModel):
    """Declared shape of a target whose weights are not on the orchestrator (e.g. on the GPU host)."""

    architecture: str = Field(..., min_length=1, description="HF `architectures[0]`, e.g. LlamaForCausalLM.")
    num_hidden_layers: int = Field(..., ge=1, le=1024, description="Decoder layers of the target.")
    hidden_size: int = Field(..., ge=1, le=65536, description="Hidden width of the target.")
    vocab_size: int = Field(..., ge=1, le=10_000_000, description="Target vocabulary size.")
    max_position_embeddings: int = Field(..., ge=1, le=10_000_000, description="Target context length.")


DEVICE_PATTERN = r"^(cpu|cuda:\d{1,3})$"


class PlacementConfig(StrictModel):
    """Where `target.engine: hf` puts the target's layers: in order over these devices, each up to its share."""

    devices: list[Annotated[str, Field(pattern=DEVICE_PATTERN)]] | None = Field(
        None,
        min_length=1,
        max_length=64,
        description="Devices that hold the target's layers, in order, e.g. [cuda:0, cuda:1] or [cuda:0, cpu] "
        "(layers past the GPU's share kept in RAM); None = every visible GPU, or the CPU without one. Layers fill "
        "the first device up to its share, then the next, so a target that fits one GPU stays on one "
        "(eagle3/data/placement.py).",
    )
    memory_fraction: float = Field(
        0.85,
        gt=0,
        le=1,
        description="Share of each device's memory (a GPU's total, the CPU's available RAM) the target's weights "
        "may take; the rest is for activations -- and with data.hidden_states: stream, for the training ranks that "
        "share the GPUs.",
    )

    @model_validator(mode="after")
    def _devices_once(self) -> PlacementConfig:
        repeated = sorted({d for d in self.devices or [] if (self.devices or []).count(d) > 1})
        if repeated:
            raise ValueError(f"target.placement.devices {self.devices}: {repeated} listed twice")
        return self


class TargetConfig(StrictModel):
    """The model being accelerated."""

    kind: Literal["tiny", "hf"] = Field("tiny", description="`tiny`: build the embedded target; `hf`: a local HF dir.")
    model_path: str | None = Field(
        None, description="HF model directory (kind=hf); on the GPU host when the stages run there."
    )
    shape: TargetShape | None = Field(
        None, description="Shape facts used when model_path is not readable here (disk estimate, layer defaults)."
    )
    tiny: TinyTargetConfig = Field(default_factory=TinyTargetConfig, description="Tiny target settings (kind=tiny).")
    aux_layer_ids: list[int] | None = Field(
        None,
        min_length=1,
        max_length=8,
        description="Aux hidden-state layer ids as written to the draft's eagle_config, in SGLang's convention "
        "for the target's architecture (Llama family: id k = output of decoder layer k; DeepSeek/Kimi/GLM-Lite "
        "and gpt-oss have their own rules, see eagle3.data.capture); None = SGLang's default for the architecture.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Target dtype: auto = bfloat16 on CUDA, float32 on CPU."
    )
    engine: Literal["hf", "sglang"] = Field(
        "hf",
        description="What computes the target's hidden states: `hf` = transformers in the capturing process, its "
        "layers placed over target.placement's devices; `sglang` = SGLang's own model runner, in-process on the "
        "data host with data.capture.tp ranks -- the engine that serves the target, its layer rule and kernels; the "
        "weights are never loaded in transformers (Kimi-K2.5 int4 and targets past one host's GPU memory in bf16).",
    )
    placement: PlacementConfig = Field(
        default_factory=PlacementConfig,
        description="target.engine hf: the devices the target's layers are placed over (capture, online features).",
    )
    trust_remote_code: bool = Field(
        False, description="Allow the target's own modelling/tokenizer code (SGLang --trust-remote-code; transformers' "
        "trust_remote_code for its model, config and tokenizer)."
    )

    @model_validator(mode="after")
    def _hf_needs_path(self) -> TargetConfig:
        if self.kind == "hf" and not self.model_path:
            raise ValueError("target.model_path is required when target.kind is 'hf'")
        if self.aux_layer_ids is not None and any(i < -1 for i in self.aux_layer_ids):
            raise ValueError("target.aux_layer_ids: ids must be >= -1 (-1 = the embeddings)")
        ids = self.aux_layer_ids or []
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            raise ValueError(f"target.aux_layer_ids {ids}: {repeated} repeated; each id names another layer")
        if ids and self.kind == "tiny" and max(ids) > self.tiny.num_hidden_layers - 2:
            raise ValueError(f"target.aux_layer_ids {ids}: id {max(ids)} is past the tiny target's layers: a Llama id k "
                             f"is layer k's output, so with target.tiny.num_hidden_layers {self.tiny.num_hidden_layers} "
                             f"the ids go up to {self.tiny.num_hidden_layers - 2}")
        if ids and self.shape is not None and max(ids) > self.shape.num_hidden_layers:
            raise ValueError(f"target.aux_layer_ids {ids}: id {max(ids)} is past the target's "
                             f"target.shape.num_hidden_layers {self.shape.num_hidden_layers}")
        return self


# --------------------------------------------------------------------------- data


class RegenerationServersConfig(StrictModel):
    """Servers of the target the data stage starts for regeneration and stops when it is done."""

    servers: int = Field(1, ge=1, le=256, description="Baseline servers (no draft) of the target to start.")
    host: str = Field("local", pattern=NAME_PATTERN, description="`local` or a hosts[].name to start them on.")


class RegenerateConfig(StrictModel):
    """Regenerating responses with the target, so training sees the target's own distribution."""

    enabled: bool = Field(True, description="Regenerate responses with the target (recommended).")
    backend: Literal["local", "http", "sglang"] = Field(
        "local",
        description="`local`: HF generate in-process; `http`: an OpenAI-compatible chat endpoint (text only, "
        "re-tokenized); `sglang`: SGLang's native /generate with token ids in and the target's own ids kept.",
    )
    endpoint: str | None = Field(None, pattern=URL_PATTERN, description="Base URL of one server (backend http or "
                                 "sglang).")
    endpoints: list[Annotated[str, Field(pattern=URL_PATTERN)]] = Field(
        default_factory=list, description="Base URLs of several servers of the target (backend http or sglang)."
    )
    deploy: RegenerationServersConfig | None = Field(
        None, description="Start servers of the target for the data stage instead of naming endpoints "
        "(deploy.server picks SGLang or the reference server)."
    )
    api_key: SecretStr | None = Field(None, description="Bearer token for the endpoint; use ${ENV_VAR}.")
    model: str | None = Field(None, description="Served model name sent in requests (backend=http).")
    concurrency: int = Field(8, ge=1, le=4096, description="Requests in flight per server (backend http or sglang).")
    retries: int = Field(3, ge=0, le=50, description="Retries per request on transient errors.")
    timeout_s: float = Field(120.0, gt=0, le=36000, description="Per-request timeout in seconds.")
    temperature: float = Field(0.0, ge=0, le=2, description="Sampling temperature for regeneration.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    max_new_tokens: int = Field(128, ge=1, le=131072, description="Response length cap.")
    batch_size: int = Field(16, ge=1, le=4096, description="Prompts per local generate call (backend=local).")
    backoff_s: float = Field(
        1.0, ge=0, le=600, description="First retry delay in seconds (backend http or sglang); doubles per retry, "
        "capped at 60 s."
    )
    max_failed_fraction: float = Field(
        0.0, ge=0, le=1, description="Share of prompts that may still fail after their retries (each one is "
        "recorded in failed.jsonl and the summary) before the data stage fails; a rerun asks them again."
    )

    @model_validator(mode="after")
    def _servers_named_once(self) -> RegenerateConfig:
        given = [name for name, value in (("endpoint", self.endpoint), ("endpoints", self.endpoints),
                                          ("deploy", self.deploy)) if value]
        if self.backend == "local" and given:
            raise ValueError(f"data.regenerate.{given[0]} needs data.regenerate.backend 'http' or 'sglang' "
                             "(backend 'local' generates in-process)")
        if self.backend != "local" and len(given) != 1:
            raise ValueError(
                f"data.regenerate.endpoint is required when data.regenerate.backend is '{self.backend}': set exactly "
                f"one of data.regenerate.endpoint, data.regenerate.endpoints or data.regenerate.deploy (got "
                f"{', '.join(given) or 'none'})"
            )
        urls = [self.endpoint] if self.endpoint else list(self.endpoints or [])
        if self.api_key is not None and any(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://[^/@]+@", u) for u in urls):
            raise ValueError("data.regenerate.endpoint carries credentials (user:pass@) and data.regenerate.api_key is "
                             "set: both go in the Authorization header, so the key would be dropped; keep one")
        return self

    @property
    def server_urls(self) -> list[str]:
        """The named servers' base URLs (none when the data stage deploys them)."""
        return [self.endpoint] if self.endpoint else list(self.endpoints)


class CaptureEngineConfig(StrictModel):
    """SGLang's model runner as the capture engine (target.engine: sglang)."""

    tp: int = Field(1, ge=1, le=64, description="Tensor-parallel ranks (GPUs) of the runner; tp > 1 needs CUDA.")
    max_batch_tokens: int = Field(
        16384, ge=64, le=10_000_000,
        description="Tokens per capture forward = the runner's KV pool (--max-total-tokens); a batch of "
        "data.capture_batch_size samples must fit, so no capture is ever chunked.",
    )
    mem_fraction_static: float | None = Field(
        None, gt=0, lt=1, description="SGLang --mem-fraction-static for the runner; None = SGLang's choice."
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="More SGLang launch flags for the runner, e.g. [--quantization, w4afp8] or [--ep-size, 8].",
    )


class StreamConfig(StrictModel):
    """`data.hidden_states: stream`: the train split's hidden states captured while training runs."""

    disk_budget_gb: float = Field(
        ...,
        gt=0,
        le=1_000_000,
        description="Most GB (1e9 bytes) the streamed train shards take on data.host's disk at once -- those "
        "written and not yet deleted plus the one being written. The capture side runs ahead of training until "
        "the budget is full; consumed shards are deleted. Must hold at least two shards (data.shard_size x "
        "data.max_length x bytes per token); the validation split is captured once by the data stage, apart.",
    )


class ServedDumpsConfig(StrictModel):
    """`data.source: served`: SGLang request dumps on the data host, and the window of traffic to train on."""

    dumps: str | None = Field(
        None, min_length=1,
        description="Folder of SGLang request-dump files (`*.pkl`, deploy.dump_requests.folder) on the machine that "
        "runs the data stage (data.host); read there, never copied. Required with data.source: served.",
    )
    since: AwareDatetime | None = Field(
        None, description="Start of the window (ISO-8601 with a timezone), inclusive on each request's finished "
        "time; None = open. Exclusive with data.served.newest_days.",
    )
    until: AwareDatetime | None = Field(
        None, description="End of the window (ISO-8601 with a timezone), exclusive; None = open (up to now).",
    )
    newest_days: float | None = Field(
        None, gt=0, le=3650,
        description="Only requests finished in the newest N days before the data stage starts (its clock, on "
        "data.host); exclusive with data.served.since.",
    )
    cache: str | None = Field(
        None, min_length=1,
        description="Folder of the capture cache on data.host (data.hidden_states offline or stream): every "
        "sample's hidden states captured by an earlier night, reused by content (token ids + loss mask) for the "
        "same target, aux layers, dtype and engine; None = `<the host's workdir>/capture-cache` "
        "(data.host local: `<runs_root>/capture-cache`). Never copied off the data host.",
    )
    cache_budget_gb: float = Field(
        500.0, gt=0, le=1_000_000,
        description="Disk the capture cache may take (GB = 1e9 bytes); over it, the shards of the oldest nights "
        "are evicted first, never one the night's training reads.",
    )
    replay_fraction: float = Field(
        0.0, ge=0, le=1,
        description="Share of the cached samples a night did not capture (earlier nights' traffic) trained on "
        "beside its new samples, drawn at random (seeded by data.seed and the night's new samples; recorded).",
    )
    min_new_samples: int = Field(
        1, ge=0, le=100_000_000,
        description="A night with fewer new samples (in the window, not in the capture cache) records \"no new "
        "traffic\" and trains, exports and gates nothing (exit 0); 0 trains even on replayed samples alone.",
    )

    @model_validator(mode="after")
    def _one_start(self) -> ServedDumpsConfig:
        if self.since is not None and self.newest_days is not None:
            raise ValueError("set at most one of data.served.since or data.served.newest_days")
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise ValueError(f"data.served.since {self.since.isoformat()} must be before data.served.until "
                             f"{self.until.isoformat()}")
        return self


class DataConfig(StrictModel):
    """Prompts, regeneration, tokenization and hidden-state storage."""

    host: str = Field(
        "local",
        pattern=NAME_PATTERN,
        description="Where the data stage runs: `local` or a hosts[].name. Regeneration requests, tokenization, "
        "the capture and the shards all stay on that machine (the hidden states never cross the orchestrator); "
        "training reads them there (train.nodes: [the same host]).",
    )

    source: Literal["prompts", "served"] = Field(
        "prompts",
        description="`prompts`: data.prompts answered by the target (data.regenerate); `served`: the target's own "
        "answers from SGLang request dumps (data.served), nothing regenerated.",
    )
    served: ServedDumpsConfig = Field(
        default_factory=ServedDumpsConfig, description="The dump folder and window of data.source: served."
    )
    prompts: str = Field(
        "builtin", min_length=1, description="`builtin` (prompts made from local text) or a .jsonl path "
        "(data.source: prompts)."
    )
    num_samples: int = Field(512, ge=1, le=100_000_000, description="Conversations to use (data.source: served: at "
                             "most this many samples, the newest kept).")
    max_length: int = Field(256, ge=16, le=1_048_576, description="Tokens per sample after the chat template.")
    validation_fraction: float = Field(0.1, ge=0, lt=1, description="Share of samples held out for validation.")
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig, description="Response regeneration.")
    hidden_states: Literal["offline", "online", "stream"] = Field(
        "offline",
        description="`offline`: the data stage dumps every sample's states to shards, read by training; `online`: "
        "computed inside one training process; `stream`: captured on data.host while training runs, at most "
        "data.stream.disk_budget_gb ahead of it, consumed shards deleted, each epoch captured again "
        "(eagle3/training/streaming) -- for datasets larger than the host's disk.",
    )
    stream: StreamConfig | None = Field(None, description="The disk budget of data.hidden_states: stream.")
    shard_size: int = Field(
        256,
        ge=1,
        le=1_000_000,
        description="Samples per offline hidden-state shard; a shard is built in RAM "
        "(about shard_size x max_length x 4 x H x 2 bytes in bf16) and up to 3 are held at once "
        "(one captured, two being written), so lower it for large targets.",
    )
    draft_vocab_size: int = Field(
        512, ge=2, le=1_000_000, description="Draft vocabulary (top-N assistant tokens); <= target vocab."
    )
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed for prompt sampling and splits.")
    hidden_states_dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3"] = Field(
        "bfloat16", description="Dtype of the offline hidden-state dump (2 bytes/value for bf16/fp16). "
        "`float8_e4m3` (opt-in): the aux states as e4m3 with one fp32 scale per token and 128 values of a "
        "layer, the last state (the teacher's input) in bf16; 0.64x the bytes of bf16 (eagle3/data/state_codec.py).",
    )
    capture_batch_size: int = Field(
        8, ge=1, le=4096, description="Samples per target forward when capturing hidden states."
    )
    capture: CaptureEngineConfig = Field(
        default_factory=CaptureEngineConfig, description="SGLang's capture runner (target.engine: sglang)."
    )

    @model_validator(mode="after")
    def _served_dumps(self) -> DataConfig:
        if self.source == "served" and self.served.dumps is None:
            raise ValueError("data.served.dumps is required with data.source: served (the dump folder on data.host)")
        if self.source != "served" and self.served != ServedDumpsConfig():
            raise ValueError("data.served is set but data.source is 'prompts'; set data.source: served or drop "
                             "data.served")
        return self

    @model_validator(mode="after")
    def _stream_budget(self) -> DataConfig:
        if self.hidden_states == "stream" and self.stream is None:
            raise ValueError("data.stream.disk_budget_gb is required with data.hidden_states: stream")
        if self.hidden_states != "stream" and self.stream is not None:
            raise ValueError(f"data.stream is set but data.hidden_states is {self.hidden_states!r}; set "
                             "data.hidden_states: stream or drop data.stream")
        return self


# --------------------------------------------------------------------------- train


class DraftShapeConfig(StrictModel):
    """Draft decoder-layer shape; None = take the target's value."""

    hidden_size: int | None = Field(
        None,
        ge=8,
        le=65536,
        description="Draft hidden width; a width other than the target's cannot share the target's frozen "
        "embedding, so the draft then trains and exports its own.",
    )
    intermediate_size: int | None = Field(None, ge=8, le=262144, description="Draft MLP width.")
    num_attention_heads: int | None = Field(None, ge=1, le=256, description="Draft attention heads.")
    num_key_value_heads: int | None = Field(None, ge=1, le=256, description="Draft KV heads.")
    head_dim: int | None = Field(None, ge=4, le=1024, description="Draft head dimension.")
    architecture: Literal["llama", "deepseek_mla"] = Field(
        "llama",
        description="Draft attention: `llama` = GQA (SGLang LlamaForCausalLMEagle3); `deepseek_mla` = DeepSeek-V2 "
        "multi-latent attention with a dense MLP (SGLang Eagle3DeepseekV2ForCausalLM, srt/models/kimi_k25_eagle3.py), "
        "for Kimi-K2.x / DeepSeek-V3 targets: its MLA dims come from the target's config unless set here.",
    )
    fc_norm: bool = Field(False, description="EAGLE-3.1: an RMSNorm per aux hidden state before fc (SGLang `fc_norm`).")
    norm_output: bool = Field(
        False, description="EAGLE-3.1: the next draft step gets the normed output, not the pre-norm one (SGLang "
        "`norm_output`)."
    )
    q_lora_rank: int | None = Field(None, ge=1, le=65536, description="MLA query latent rank (deepseek_mla).")
    kv_lora_rank: int | None = Field(None, ge=1, le=65536, description="MLA key/value latent rank (deepseek_mla).")
    qk_nope_head_dim: int | None = Field(None, ge=1, le=1024, description="MLA per-head q/k width without RoPE.")
    qk_rope_head_dim: int | None = Field(None, ge=2, le=1024, description="MLA RoPE width shared by all heads' keys.")
    v_head_dim: int | None = Field(None, ge=1, le=1024, description="MLA per-head value width.")

    @model_validator(mode="after")
    def _mla_fields(self) -> DraftShapeConfig:
        mla = [n for n in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
               if getattr(self, n) is not None]
        if mla and self.architecture != "deepseek_mla":
            raise ValueError(f"train.draft.{mla[0]} is an MLA dimension: set train.draft.architecture: deepseek_mla "
                             "or drop it")
        if self.architecture == "deepseek_mla" and (self.num_key_value_heads is not None or self.head_dim is not None):
            raise ValueError("train.draft.num_key_value_heads / head_dim do not apply to architecture deepseek_mla "
                             "(every head has its own key; set qk_nope_head_dim, qk_rope_head_dim, v_head_dim)")
        return self


class TrainConfig(StrictModel):
    """EAGLE-3 training-time-test (TTT) training of the draft."""

    ttt_steps: int = Field(7, ge=1, le=32, description="Training-time-test unroll length.")
    step_decay: float = Field(0.8, gt=0, le=1, description="Loss weight of TTT step k is step_decay**k.")
    epochs: int = Field(1, ge=1, le=10_000, description="Passes over the training split.")
    max_steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="Stop after this many optimizer steps.")
    batch_size: int = Field(8, ge=1, le=65536, description="Sequences per micro-batch per device.")
    grad_accum: int = Field(1, ge=1, le=4096, description="Micro-batches per optimizer step.")
    lr: float = Field(1e-4, gt=0, le=1, description="Peak learning rate (AdamW).")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay.")
    warmup_ratio: float = Field(0.015, ge=0, lt=1, description="Share of steps with linear warmup.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Cosine floor as a fraction of lr.")
    grad_clip: float = Field(0.5, gt=0, le=1e6, description="Max global grad norm.")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="auto = bf16 autocast on CUDA, fp32 on CPU.")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed for init, shuffling and dropout.")
    checkpoint_every: int = Field(200, ge=1, le=MAX_STEPS, description="Optimizer steps between checkpoints.")
    eval_every: int = Field(200, ge=1, le=MAX_STEPS, description="Optimizer steps between validation passes.")
    log_every: int = Field(10, ge=1, le=MAX_STEPS, description="Optimizer steps between metric reports.")
    devices: int = Field(1, ge=1, le=1024, description="Processes (GPUs) per node, launched with torchrun when > 1.")
    nodes: list[HostName] = Field(
        default_factory=list,
        description="Machines to train on, one torchrun node each with `devices` ranks: hosts[].name entries "
        "(reached over SSH) or `local`. Empty = this machine, as a single process or one `--standalone` node.",
    )
    rendezvous: str | None = Field(
        None,
        pattern=r"^[^\s:]+:\d{1,5}$",
        description="address:port where node 0 hosts torchrun's store, reachable from every node; default: node "
        "0's inventory address and port 29500 (the next free one when taken); for a `local` node 0, the address the "
        "remote nodes' SSH servers see this machine connect from (127.0.0.1 when every node is local). One node "
        "without it runs torchrun --standalone, on a port the OS hands out.",
    )
    stall_timeout_s: float = Field(
        1800.0,
        gt=0,
        le=7 * 86400,
        description="With train.nodes: fail the stage when, for this long, no node's log grew and no metrics row "
        "came while the launchers still run (a hung rank or rendezvous); the error names the node silent longest. "
        "On every rank: the longest its DataLoader workers may take to hand over a micro-batch before the rank "
        "fails with their stacks in its log (not for a stream, whose workers wait for its capture side).",
    )
    strategy: Literal["ddp", "fsdp"] = Field("ddp", description="Multi-device strategy.")
    attention: Literal["fast", "dense"] = Field(
        "fast",
        description="TTT attention: `fast` = causal flash + analytic diagonal merge; `dense` = SDPA with the "
        "dense EAGLE-3 mask (reference, O(ttt_steps * T^2) memory).",
    )
    compile: bool = Field(True, description="torch.compile the draft layer and loss chunks on CUDA (ignored on CPU).")
    cuda_graphs: bool = Field(
        True,
        description="Replay each optimizer step (teacher, forward, backward, clip, AdamW) as a CUDA graph, so the "
        "host's kernel launches leave the step: one GPU, compile on, stored hidden states (else ignored). A step's "
        "micro-batches are padded to a multiple of cuda_graph_bucket tokens; each bucket is captured after 2 eager "
        "steps and keeps its own graph. A step that cannot be captured stops the run with an error naming this "
        "field: set it false and resume.",
    )
    cuda_graph_bucket: int = Field(
        256, ge=8, le=1_048_576,
        description="With cuda_graphs: micro-batches are padded to a multiple of this many tokens (fewer graphs "
        "and captures vs more padded positions computed for nothing).",
    )
    loss_chunk_tokens: int = Field(
        8192, ge=16, le=1_048_576, description="Rows per chunk of the teacher logits and of the fused draft loss."
    )
    num_workers: int = Field(
        2,
        ge=0,
        le=64,
        description="DataLoader worker processes per rank: they read and collate the next micro-batches while the "
        "current one trains (0 = load on the training thread, which stalls every step). Evaluation has as many "
        "of its own, started at the first evaluation and idle between evaluations until training ends.",
    )
    prefetch_factor: int = Field(
        4, ge=1, le=64, description="Micro-batches each DataLoader worker keeps ready ahead (with num_workers > 0)."
    )
    keep_checkpoints: int = Field(2, ge=1, le=1000, description="Most recent step checkpoints kept on disk.")
    eval_max_batches: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="Validation batches per rank per evaluation; None = the whole split."
    )
    draft: DraftShapeConfig = Field(default_factory=DraftShapeConfig, description="Draft layer shape.")
    init_checkpoint: str | None = Field(
        None,
        min_length=1,
        description="Start from this draft's weights (a train_draft checkpoint or an exported sglang folder of "
        "the same shape) instead of a fresh init, keeping its draft vocabulary (d2t) over the data's; its content "
        "is part of the training stage's inputs.",
    )

    @model_validator(mode="after")
    def _betas_in_range(self) -> TrainConfig:
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError("train.betas: each beta must be in [0, 1)")
        if self.rendezvous and not 1 <= int(self.rendezvous.rsplit(":", 1)[1]) <= 65535:
            raise ValueError(f"train.rendezvous {self.rendezvous}: the port must be between 1 and 65535")
        return self


# --------------------------------------------------------------------------- export


class ExportConfig(StrictModel):
    """Checkpoint formats written after training."""

    formats: list[Literal["sglang", "speculators"]] = Field(
        default_factory=lambda: ["sglang"], min_length=1, description="Formats to write."
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="Weight dtype on disk.")
    registered_model: str | None = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="MLflow registered model name for the export."
    )
    speculative_tokens: int = Field(
        3, ge=1, le=16, description="Draft tokens per step written to the speculators config (vLLM's default k)."
    )
    verifier_name_or_path: str | None = Field(
        None, min_length=1, description="Verifier named in the speculators config; None = the target directory."
    )
