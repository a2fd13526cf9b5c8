"""Experiment YAML -> validated `ExperimentConfig`, with errors that name file, line and field.

Owns the orchestration sections (deploy, bench, tracking, hosts) and `load_experiment`, the
only place YAML is read. `${ENV_VAR}` (and `${ENV_VAR:-default}`) is expanded in string
values before validation, so secrets live in the environment, never in the file; secret
fields are `SecretStr` and print as `**********` everywhere (dumps, logs, MLflow params).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, SecretStr, ValidationError, model_validator

from eagle3.config import DataConfig, ExportConfig, StrictModel, TargetConfig, TrainConfig
from tasks.secrets import MASK, redact_obj, url_credentials

SECRET_MASK = MASK
NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,63}$"


class ConfigError(Exception):
    """A config that cannot be used; `messages` are `file:line: field.path: reason` lines."""

    def __init__(self, messages: list[str]):
        super().__init__("\n".join(messages))
        self.messages = messages


# --------------------------------------------------------------------------- sections


class HostConfig(StrictModel):
    """One machine of the inventory, reached over SSH."""

    name: str = Field(..., pattern=NAME_PATTERN, description="Inventory name referenced by deploy.host.")
    address: str = Field(..., min_length=1, max_length=253, description="Host name or IP address.")
    port: int = Field(22, ge=1, le=65535, description="SSH port.")
    user: str = Field(..., min_length=1, max_length=64, description="SSH user.")
    key_file: str | None = Field(None, description="Private key file; None = the SSH agent / default keys.")
    key_passphrase: SecretStr | None = Field(None, description="Passphrase of key_file; use ${ENV_VAR}.")
    known_hosts: str | None = Field(
        None, description="known_hosts file used to verify the host key (unknown hosts are rejected)."
    )
    workdir: str = Field("~/eagleops", min_length=1, description="Remote directory for checkpoints and logs.")
    python: str = Field("python3", min_length=1, description="Remote Python that has sglang installed.")
    connect_timeout_s: float = Field(15.0, gt=0, le=600, description="TCP + SSH handshake timeout.")
    connect_retries: int = Field(
        3, ge=0, le=20, description="Reconnect attempts after a network error (with backoff); never after an "
        "authentication or host-key failure."
    )
    jump_host: str | None = Field(
        None,
        pattern=r"^([a-z0-9][a-z0-9_.-]{0,63}|[^@\s]+@[^@\s:]+(:\d{1,5})?)$",
        description="Reach this host through another: a hosts[].name, or user@host[:port] (same key and "
        "known_hosts as this host).",
    )


class SpeculativeConfig(StrictModel):
    """The `--speculative-*` flags handed to SGLang; unset values are left for SGLang to choose."""

    algorithm: Literal["EAGLE3"] = Field("EAGLE3", description="--speculative-algorithm.")
    num_steps: int | None = Field(None, ge=1, le=64, description="--speculative-num-steps (draft depth).")
    eagle_topk: int | None = Field(None, ge=1, le=64, description="--speculative-eagle-topk (branching).")
    num_draft_tokens: int | None = Field(
        None, ge=2, le=1024, description="--speculative-num-draft-tokens (verified tokens incl. the root)."
    )
    allow_adjustments: bool = Field(
        False,
        description="Launch even when SGLang would rewrite the asked values (e.g. topk 1 forces num_draft_tokens = "
        "num_steps + 1); the asked and the effective values are both recorded. Off: the preflight refuses.",
    )


class DeployConfig(StrictModel):
    """Where and how the draft is served."""

    host: str = Field("local", description="`local` or a hosts[].name.")
    server: Literal["reference", "sglang"] = Field(
        "reference", description="`reference`: python -m eagle3.serve; `sglang`: python -m sglang.launch_server."
    )
    port: int = Field(30000, ge=1, le=65535, description="Server port (bound to 127.0.0.1 on the host).")
    model_path: str | None = Field(None, description="Target path on the host; None = the pipeline's target.")
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig, description="Speculative flags.")
    max_running_requests: int | None = Field(None, ge=1, le=65536, description="--max-running-requests.")
    tp: int = Field(1, ge=1, le=128, description="--tp (tensor parallel size).")
    mem_fraction_static: float | None = Field(None, gt=0, lt=1, description="--mem-fraction-static.")
    extra_args: list[str] = Field(default_factory=list, description="Further SGLang flags, passed verbatim.")
    enable_metrics: bool = Field(
        True, description="--enable-metrics: /metrics counters let the benchmark cross-check its accept length and "
        "token counts exactly against the server's."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Environment for the server process.")
    startup_timeout_s: float = Field(900.0, gt=0, le=7200, description="Seconds to wait for /health.")
    baseline: bool = Field(True, description="Also serve without speculation to measure the baseline.")
    preflight: Literal["enforce", "warn"] = Field(
        "enforce", description="`enforce`: a failed preflight check stops the deploy; `warn`: log it and launch "
        "anyway (to reproduce a failure on purpose; the benchmark's diagnosis still names it)."
    )


class BenchConfig(StrictModel):
    """Timed generations against the deployed server."""

    prompts: str = Field("builtin", min_length=1, description="`builtin` or a .jsonl of prompts.")
    num_prompts: int = Field(8, ge=1, le=100_000, description="Prompts per timed run.")
    warmup_runs: int = Field(2, ge=0, le=100, description="Untimed runs first.")
    timed_runs: int = Field(5, ge=1, le=1000, description="Timed runs; the median is reported.")
    max_new_tokens: int = Field(128, ge=1, le=131072, description="Tokens generated per prompt.")
    temperature: float = Field(0.0, ge=0, le=2, description="Sampling temperature.")
    concurrency: list[int] = Field(default_factory=lambda: [1], min_length=1, description="Concurrent requests.")
    min_speedup: float | None = Field(None, gt=0, le=100, description="Fail the run below this speedup.")
    accept_length_tolerance: float = Field(
        0.25, ge=0, le=1, description="Max relative gap between online and offline accept length."
    )
    endpoint: Literal["generate", "chat", "completions"] = Field(
        "generate", description="`generate`: token ids through the target's chat template (needs the tokenizer "
        "here); `chat`/`completions`: the OpenAI endpoints (the server applies its template)."
    )
    sweep: list[SpeculativeConfig] = Field(
        default_factory=list, description="Further (num_steps, eagle_topk, num_draft_tokens) settings, one server "
        "launch each; a setting the server would rewrite runs under its effective values."
    )
    offline_reference: bool = Field(
        True, description="Also run the reference decoder in-process on the same prompts (targets readable here)."
    )

    @model_validator(mode="after")
    def _positive_concurrency(self) -> BenchConfig:
        if any(c < 1 or c > 4096 for c in self.concurrency):
            raise ValueError("bench.concurrency: each value must be between 1 and 4096")
        return self


class TrackingConfig(StrictModel):
    """MLflow destination."""

    uri: str | None = Field(
        None, description="MLflow tracking URI; None = sqlite:///<runs_root>/mlflow.db (artifacts beside it)."
    )
    experiment_name: str | None = Field(None, min_length=1, description="MLflow experiment; None = `experiment`.")
    log_system_metrics: bool = Field(False, description="Sample CPU/GPU/memory metrics into the parent run.")

    @model_validator(mode="after")
    def _known_scheme(self) -> TrackingConfig:
        if self.uri and not re.match(r"^(sqlite:///|https?://|postgresql(\+\w+)?://|databricks)", self.uri):
            raise ValueError("tracking.uri must start with sqlite:///, http://, https:// or postgresql://")
        return self


class NightlyConfig(StrictModel):
    """The nightly retrain (flows/nightly.py): where training starts and the gate a new draft must pass
    against the current champion (same host, prompts and speculative setting) to replace it."""

    start_from: Literal["scratch", "champion"] = Field(
        "scratch", description="`scratch`: a fresh init; `champion`: train.init_checkpoint = the downloaded "
        "`@champion` version (scratch while there is none). The champion must share the draft vocabulary."
    )
    min_tok_s_gain: float = Field(
        0.02, ge=-1, le=10, description="Relative tok/s gain over the champion needed to promote (0.02 = 2% faster), "
        "at every bench.concurrency level; a negative value tolerates a slowdown."
    )
    accept_length_tolerance: float = Field(
        0.0, ge=0, le=1, description="Relative online accept-length drop vs the champion still accepted "
        "(0 = must not lose), at every bench.concurrency level."
    )
    min_accept_length: float = Field(
        1.1, ge=1, le=64, description="Floor on the new draft's online accept length, champion or not: a first "
        "draft below it does not become champion (1.0 = any draft that serves)."
    )


class ExperimentConfig(StrictModel):
    """One experiment: every section of a `configs/*.yaml` file."""

    experiment: str = Field(..., pattern=NAME_PATTERN, description="Name used for runs/<experiment>/ and MLflow.")
    description: str = Field("", max_length=2000, description="Free text, shown in MLflow.")
    runs_root: str = Field("runs", min_length=1, description="Where run directories and the local MLflow store go.")
    target: TargetConfig = Field(default_factory=TargetConfig, description="The model being accelerated.")
    data: DataConfig = Field(default_factory=DataConfig, description="Data generation.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Draft training.")
    export: ExportConfig = Field(default_factory=ExportConfig, description="Checkpoint export.")
    deploy: DeployConfig = Field(default_factory=DeployConfig, description="Serving.")
    bench: BenchConfig = Field(default_factory=BenchConfig, description="Benchmark.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow.")
    hosts: list[HostConfig] = Field(default_factory=list, description="SSH inventory.")
    nightly: NightlyConfig = Field(default_factory=NightlyConfig, description="Nightly retrain and champion gate.")

    @model_validator(mode="after")
    def _cross_section_rules(self) -> ExperimentConfig:
        names = [h.name for h in self.hosts]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"hosts: duplicate host names {duplicates}")
        if self.deploy.host != "local" and self.deploy.host not in names:
            raise ValueError(f"deploy.host '{self.deploy.host}' is neither 'local' nor one of hosts[].name {names}")
        unknown_nodes = [n for n in self.train.nodes if n != "local" and n not in names]
        if unknown_nodes:
            raise ValueError(f"train.nodes {unknown_nodes} are neither 'local' nor hosts[].name {names}")
        if self.train.nodes and self.data.hidden_states == "online":
            raise ValueError("train.nodes needs data.hidden_states: offline (online features load the target in "
                             "the orchestrating process)")
        if self.target.kind == "tiny" and self.data.draft_vocab_size > self.target.tiny.vocab_size:
            raise ValueError(
                f"data.draft_vocab_size ({self.data.draft_vocab_size}) exceeds the target vocabulary "
                f"target.tiny.vocab_size ({self.target.tiny.vocab_size})"
            )
        if self.target.shape and self.data.draft_vocab_size > self.target.shape.vocab_size:
            raise ValueError(
                f"data.draft_vocab_size ({self.data.draft_vocab_size}) exceeds target.shape.vocab_size "
                f"({self.target.shape.vocab_size})"
            )
        return self

    @property
    def mlflow_experiment(self) -> str:
        return self.tracking.experiment_name or self.experiment

    def host(self, name: str) -> HostConfig:
        return next(h for h in self.hosts if h.name == name)


# --------------------------------------------------------------------------- loading

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def load_experiment(path: str | Path, variant: int | None = None) -> ExperimentConfig:
    """Read, interpolate and validate one experiment file; raise ConfigError naming file:line: field.

    For a sweep file, `variant` picks one expanded grid point (0-based).
    """
    data, lines, shown = _read_yaml(Path(path))
    if "sweep" in data:
        variants = load_sweep(path)
        if variant is None or not 0 <= variant < len(variants):
            raise ConfigError([f"{shown}: sweep file with {len(variants)} variants; choose one with variant 0..{len(variants) - 1}"])
        return variants[variant][1]
    if variant is not None:
        raise ConfigError([f"{shown}: not a sweep file, so it has no variant {variant}"])
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError([_format_error(e, shown, lines) for e in err.errors()]) from None


def is_sweep(path: str | Path) -> bool:
    data, _, _ = _read_yaml(Path(path))
    return "sweep" in data


def load_sweep(path: str | Path) -> list[tuple[str, ExperimentConfig]]:
    """Expand a sweep file (`sweep: {base, name, grid}`) into named, validated variants.

    Each grid entry maps dotted field paths to values that replace the base's, e.g.
    `{deploy.speculative: {num_steps: 3, eagle_topk: 1, num_draft_tokens: 4}}`. An error in an
    overridden field points at the grid entry's line; any other at the base file's line.
    """
    path = Path(path)
    data, lines, shown = _read_yaml(path)
    sweep = data.get("sweep")
    if not isinstance(sweep, dict) or set(sweep) - {"base", "name", "grid"} or "base" not in sweep:
        raise ConfigError([f"{shown}:1: sweep: expected a mapping with keys base, name, grid"])
    grid = sweep.get("grid")
    if not isinstance(grid, list) or not grid or not all(isinstance(g, dict) for g in grid):
        raise ConfigError([f"{shown}:{_line_of(('sweep', 'grid'), lines)}: sweep.grid: expected a non-empty list"])
    base_path = (path.parent / str(sweep["base"])).resolve()
    base, base_lines, base_shown = _read_yaml(base_path)
    variants, errors = [], []
    for i, overrides in enumerate(grid):
        grid_line = _line_of(("sweep", "grid", i), lines)
        variant = _apply_overrides(base, overrides)
        try:
            cfg = ExperimentConfig.model_validate(variant)
        except ValidationError as err:
            for e in err.errors():
                hit = any(".".join(map(str, e["loc"])).startswith(key) for key in overrides)
                where = (shown, {tuple(e["loc"]): grid_line}) if hit else (base_shown, base_lines)
                errors.append(f"sweep.grid[{i}]: " + _format_error(e, *where))
            continue
        variants.append((f"{sweep.get('name', 'sweep')}-{i}", cfg))
    if errors:
        raise ConfigError(errors)
    return variants


def _apply_overrides(base: dict, overrides: dict) -> dict:
    variant = json.loads(json.dumps(base))
    for dotted, value in overrides.items():
        node = variant
        *parents, leaf = str(dotted).split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return variant


def _read_yaml(path: Path) -> tuple[dict, dict[tuple, int], str]:
    """Parsed + interpolated mapping, its key-path -> line index, and the path as shown in errors."""
    shown = _display_path(path)
    if not path.is_file():
        raise ConfigError([f"{shown}: file not found"])
    text = path.read_text(encoding="utf-8")
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{shown}:{mark.line + 1}" if mark else shown
        raise ConfigError([f"{where}: invalid YAML: {getattr(err, 'problem', None) or err}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{shown}:1: the file must be a mapping of sections (experiment, target, data, ...)"])
    lines = _line_index(root)
    return _interpolate(data, (), shown, lines), lines, shown


def _display_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _line_index(node: yaml.Node | None, prefix: tuple = ()) -> dict[tuple, int]:
    """Map every key path, e.g. ('train', 'ttt_steps') or ('hosts', 0, 'port'), to its 1-based line."""
    index: dict[tuple, int] = {}
    if node is None:
        return index
    index[prefix] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = prefix + (key_node.value,)
            index.update(_line_index(value_node, path))
            index[path] = key_node.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            index.update(_line_index(item, prefix + (i,)))
    return index


def _line_of(loc: tuple, lines: dict[tuple, int]) -> int:
    """Line of the deepest existing prefix of `loc` (a missing key reports its parent's line)."""
    for end in range(len(loc), -1, -1):
        if loc[:end] in lines:
            return lines[loc[:end]]
    return 1


def _interpolate(value: Any, loc: tuple, shown: str, lines: dict[tuple, int]) -> Any:
    if isinstance(value, dict):
        return {k: _interpolate(v, loc + (k,), shown, lines) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, loc + (i,), shown, lines) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def expand(match: re.Match) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        field = ".".join(str(p) for p in loc)
        raise ConfigError([f"{shown}:{_line_of(loc, lines)}: {field}: environment variable {name} is not set"])

    return _ENV_REF.sub(expand, value)


def _format_error(error: dict, shown: str, lines: dict[tuple, int]) -> str:
    loc = tuple(error["loc"])
    field = ".".join(str(p) for p in loc)
    reason = _reason(error, loc)
    line = _line_of(loc, lines)
    if error["type"] == "value_error":
        line = _line_of_named_field(reason, lines) or line
    if not field or any(reason.startswith(field + sep) for sep in (" ", ":", ".")):
        return f"{shown}:{line}: {reason}"
    return f"{shown}:{line}: {field}: {reason}"


def _line_of_named_field(reason: str, lines: dict[tuple, int]) -> int | None:
    """Cross-field rules name their fields ("deploy.host '...' is ..."): point at the first one present."""
    leading = re.match(r"^([a-z_]+):", reason)
    for dotted in ([leading.group(1)] if leading else []) + re.findall(r"\b[a-z_]+(?:\.[a-z_]+)+\b", reason):
        path = tuple(dotted.split("."))
        if path in lines:
            return lines[path]
    return None


def _reason(error: dict, loc: tuple) -> str:
    kind, ctx, given = error["type"], error.get("ctx") or {}, error.get("input")
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return f"must be {bounds[kind]} {limit} (got {given!r})"
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        allowed = _allowed_fields(loc[:-1])
        return f"unknown field (allowed: {', '.join(allowed)})" if allowed else "unknown field"
    if kind == "value_error":
        return error["msg"].removeprefix("Value error, ")
    message = error["msg"].replace("Input should be", "must be").replace("String should", "must")
    if isinstance(given, (str, int, float, bool)) or given is None:
        return f"{message} (got {given!r})"
    return message


def _allowed_fields(parent: tuple) -> list[str]:
    """Field names of the section at `parent`, for 'unknown field' messages."""
    model: Any = ExperimentConfig
    for part in parent:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if isinstance(model, type) else None
        if field is None:
            return []
        model = _model_type(field.annotation)
        if model is None:
            return []
    return list(model.model_fields)


def _model_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_type(arg)
        if found:
            return found
    return None


# --------------------------------------------------------------------------- views


def masked_dict(cfg: BaseModel) -> dict:
    """JSON-able dump with every secret replaced by the mask: `SecretStr` fields (pydantic dumps
    them masked) and credentials inside URL strings (`https://user:pass@host` -> `https://****@host`)."""
    return redact_obj(cfg.model_dump(mode="json"))


def masked_yaml(cfg: BaseModel) -> str:
    return yaml.safe_dump(masked_dict(cfg), sort_keys=False)


def config_hash(cfg: BaseModel) -> str:
    """Stable short hash of the validated config (secrets masked, so rotating a key keeps the hash)."""
    payload = json.dumps(masked_dict(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def section_hash(cfg: ExperimentConfig, sections: list[str]) -> str:
    dump = masked_dict(cfg)
    payload = json.dumps({s: dump[s] for s in sections}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """{"train": {"lr": 1e-4}} -> {"train.lr": "0.0001"}; lists become JSON strings."""
    if isinstance(value, dict):
        flat: dict[str, str] = {}
        for key, item in value.items():
            flat.update(flatten(item, f"{prefix}{key}."))
        return flat
    rendered = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)
    return {prefix.rstrip("."): rendered}


def secret_values(cfg: BaseModel) -> list[str]:
    """Every secret's plain value (non-empty): `SecretStr` fields and URL credentials, for
    `tasks.secrets.register_secrets` and for tests that assert none of them leak."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, SecretStr):
            if value.get_secret_value():
                found.append(value.get_secret_value())
        elif isinstance(value, str):
            found.extend(url_credentials(value))
        elif isinstance(value, BaseModel):
            for name in type(value).model_fields:
                walk(getattr(value, name))
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)

    walk(cfg)
    return found
