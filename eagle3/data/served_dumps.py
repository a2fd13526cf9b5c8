"""SGLang's request dumps read safely, and the training samples the served answers make.

Owns the restricted unpickler for SGLang 0.5.23's request-dump files, the reading of one dump
folder into served samples (prompt ids + the target's own output ids, no re-tokenization, each
content-addressed) with every left-out request counted by reason, and writing those samples in
the data stage's `samples.jsonl` format.

What the dump is, as SGLang 0.5.23 writes it (checked in its source):
- `POST /configure_logging` (`srt/entrypoints/http_server.py`, GET or POST) takes a
  `ConfigureLoggingReq` (`srt/managers/io_struct.py`): `log_requests`, `log_requests_level`,
  `log_requests_format`, `log_level`, `dump_requests_folder`, `dump_requests_threshold`,
  `crash_dump_folder`, `dump_requests_exclude_meta_keys`; unknown keys are ignored.
- `TokenizerManager.dump_requests` (`srt/managers/tokenizer_manager.py`) runs for every finished
  request whose `obj.log_metrics` is true (not health checks) while `dump_requests_folder` is set;
  it appends `(obj, out_dict, created_time, finished_time)`: `obj` the request's own
  `GenerateReqInput` (one sub-request of a batch, normalized: `rid` a str, `sampling_params` the
  dict the client sent), `out_dict` what the request answered, both times wall-clock epoch seconds
  (`convert_time_to_realtime`). At `dump_requests_threshold` requests (default 1000)
  `_dump_data_to_file` pickles (protocol 4) `{"server_args", "config_updates", "resolved_config",
  "requests"}` to `<folder>/<%Y-%m-%d_%H-%M-%S>.pkl` from a background thread, NOT atomically: a
  file being written reads as truncated (skipped here, read by a later run). `server_args` is
  the `ServerArgs` record (a dict when watermarking is on, None when it fails to pickle, e.g. some
  --trust-remote-code models); `meta_info` keys in `dump_requests_exclude_meta_keys` (default
  `routed_experts`, `hidden_states`) are dropped. Requests below the threshold at shutdown are
  never written.
- `out_dict` = `{"text", "output_ids", "meta_info"}` (no "text" under --skip-tokenizer-init;
  + `"prompt_token_ids"` only when the request set `return_prompt_token_ids`). `output_ids` are the target's tokens through the stop token
  (`output_ids_through_stop`); `meta_info` has `id`, `finish_reason`, `prompt_tokens`,
  `completion_tokens` (= len(output_ids)), `cached_tokens`, `e2e_latency` and, with speculative
  decoding, `spec_verify_ct`, `spec_accept_length`, ... A streamed request under
  `--incremental-streaming-output` dumps only its last chunk's ids: len(output_ids) !=
  completion_tokens, left out here as "incomplete_output".
- `finish_reason` is `BaseFinishReason.to_json()` (`srt/managers/schedule_batch.py`):
  `{"type": "stop", "matched": id|str}`, `{"type": "length", "length": n}` or `{"type": "abort",
  "message", "status_code", "err_type"}` (errors end as aborts); None while unfinished.
- Prompt ids: `obj.input_ids` when the client sent ids (/generate with input_ids, /v1/completions
  with a token list, /v1/chat/completions on a text-only model: serving_chat passes the chat
  template's ids); a text prompt (/generate text, /v1/completions with a string) is never
  tokenized into `obj`, so it has ids only with `return_prompt_token_ids`; else it is left out
  ("no_token_ids"): re-tokenizing the text could differ from what the target saw.

Pickled globals of a real dump (SGLang's own `dump_requests` on a tiny Llama, listed with
pickletools): `GenerateReqInput` (NEWOBJ + BUILD), `ServerArgs` through `_rebuild_server_args`
(REDUCE), and in ServerArgs' resolution bookkeeping `ModelConfig`, `AttentionArch` (an enum),
`CudaGraphConfig` / `PhaseConfig` (msgspec structs: REDUCE with their values),
`EmbeddingModelSpec` and its enums, torch dtypes, the model's transformers config class and
`GenerationConfig`. ADMITTED names those; the model's own config class varies with the model, so
any `*Config` class of a `transformers.models.<x>.configuration_<x>` or remote-code
`transformers_modules.*.configuration_*` module is admitted too.

Risk: the files are pickles from a server. Nothing here imports or runs SGLang, transformers or
torch code: every admitted name unpickles to an inert stand-in of ours that records its
arguments and state. Any other global refuses the whole file by name before anything runs.
"""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.data.files import LogFn, atomic_write_text
from eagle3.data.samples import SAMPLES_FILE, SAMPLES_FORMAT, SAMPLES_META, write_samples

GENERATE_REQ_INPUT = ("sglang.srt.managers.io_struct", "GenerateReqInput")
SERVER_ARGS = ("sglang.srt.server_args", "ServerArgs")
REBUILD_SERVER_ARGS = ("sglang.srt.server_args", "_rebuild_server_args")
EXCLUSION_REASONS = ("out_of_window", "malformed", "aborted", "length", "unfinished", "no_token_ids",
                     "incomplete_output", "too_long", "duplicate")


class SGLangRecord:
    """An inert stand-in for an object of an admitted class: records how pickle built it.

    `args`/`kwargs`: what pickle passed to the class (NEWOBJ, NEWOBJ_EX, or REDUCE for enums and
    msgspec structs, which pickle as `cls(*values)`); `state`: what BUILD gave (an object's
    `__dict__`, or `(dict, slots)`). `sglang_name` is the (module, name) the file named.
    """

    sglang_name: tuple[str, str] = ("", "")

    def __new__(cls, *args: Any, **kwargs: Any) -> SGLangRecord:
        obj = object.__new__(cls)
        obj.args, obj.kwargs, obj.state = args, kwargs, {}
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def fields(self) -> dict:
        """The recorded attributes: BUILD's dict (slots merged in); what is not a dict counts as empty."""
        parts = self.state if isinstance(self.state, tuple) else (self.state,)
        merged: dict = {}
        for part in parts:
            if isinstance(part, dict):
                merged.update(part)
        return merged

    def __repr__(self) -> str:
        return f"<{'.'.join(self.sglang_name)} stand-in>"


class GenerateReqInputRecord(SGLangRecord):
    """SGLang's GenerateReqInput (a dataclass: NEWOBJ + BUILD with its __dict__)."""

    sglang_name = GENERATE_REQ_INPUT


class ServerArgsRecord(SGLangRecord):
    """SGLang's ServerArgs (a msgspec struct): its fields and its resolution bookkeeping."""

    sglang_name = SERVER_ARGS


def _rebuild_server_args(cls: type, fields: dict, bookkeeping: dict) -> ServerArgsRecord:
    """Stands in for sglang.srt.server_args._rebuild_server_args(cls, fields, bookkeeping)."""
    record = ServerArgsRecord()
    record.state = (fields if isinstance(fields, dict) else {}, bookkeeping if isinstance(bookkeeping, dict) else {})
    return record


@dataclass(frozen=True)
class TorchDtypeRecord:
    """A torch dtype named in the file (torch pickles dtypes as module globals: `torch.float16`)."""

    name: str


def _reconstructor(cls: type, base: type, state: Any) -> SGLangRecord:
    """copyreg._reconstructor (protocols 0 and 1), for our stand-ins only."""
    if not (isinstance(cls, type) and issubclass(cls, SGLangRecord)) or base is not object:
        raise pickle.UnpicklingError(f"copyreg._reconstructor of {cls!r} on {base!r}: not an SGLang dump object")
    obj = cls.__new__(cls)
    if state is not None:
        obj.state = state
    return obj


def _record_class(module: str, name: str) -> type[SGLangRecord]:
    return type(name, (SGLangRecord,), {"sglang_name": (module, name), "__module__": __name__,
                                        "__qualname__": f"stand_in.{name}"})


_SGLANG_CLASSES = [
    ("sglang.srt.configs.model_config", "ModelConfig"),
    ("sglang.srt.configs.model_config", "AttentionArch"),
    ("sglang.srt.model_executor.cuda_graph_config", "CudaGraphConfig"),
    ("sglang.srt.model_executor.cuda_graph_config", "PhaseConfig"),
    ("sglang.srt.configs.embedding_model_spec", "EmbeddingModelSpec"),
    ("sglang.srt.configs.embedding_model_spec", "EmbeddingTask"),
    ("sglang.srt.configs.embedding_model_spec", "EmbeddingExecution"),
    ("sglang.srt.configs.embedding_model_spec", "AttentionPattern"),
    ("sglang.srt.configs.embedding_model_spec", "PoolingStrategy"),
    ("sglang.srt.configs.embedding_model_spec", "BCGPrefillPolicy"),
    ("transformers.generation.configuration_utils", "GenerationConfig"),
]
TORCH_DTYPES = ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2", "int8", "uint8",
                "int16", "int32", "int64", "bool")

# Every global a dump may name -> what it unpickles to here. Nothing else is ever looked up.
ADMITTED: dict[tuple[str, str], Any] = {
    GENERATE_REQ_INPUT: GenerateReqInputRecord,
    SERVER_ARGS: ServerArgsRecord,
    REBUILD_SERVER_ARGS: _rebuild_server_args,
    **{key: _record_class(*key) for key in _SGLANG_CLASSES},
    **{("torch", dtype): TorchDtypeRecord(dtype) for dtype in TORCH_DTYPES},
    # protocol 0-2 spellings of what protocol 4 writes as opcodes
    ("copyreg", "_reconstructor"): _reconstructor,
    ("builtins", "object"): object,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}
# The served model's own config class (transformers, or --trust-remote-code modules).
MODEL_CONFIG_MODULE = re.compile(r"(transformers\.models\.\w+\.configuration_\w+"
                                 r"|transformers_modules(\.[\w\-]+)+\.configuration_\w+)")
MODEL_CONFIG_NAME = re.compile(r"\w+Config")
_model_config_records: dict[tuple[str, str], type[SGLangRecord]] = {}


class RefusedDump(pickle.UnpicklingError):
    """The file names a global outside SGLang's request-dump format."""

    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"refuses class {_one_line(f'{module}.{name}')} (not part of SGLang's request dump)")


class CorruptDump(ValueError):
    """The file is truncated, corrupt, or not an SGLang request dump."""


class DumpUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only ADMITTED names (and model config classes) to stand-ins."""

    def find_class(self, module: str, name: str) -> Any:
        admitted = ADMITTED.get((module, name))
        if admitted is not None:
            return admitted
        if MODEL_CONFIG_MODULE.fullmatch(module) and MODEL_CONFIG_NAME.fullmatch(name):
            return _model_config_records.setdefault((module, name), _record_class(module, name))
        raise RefusedDump(module, name)


def _one_line(text: str, limit: int = 300) -> str:
    """text as one printable line (a file's names and errors are the file's, not ours), cut at limit."""
    text = text if text.isprintable() else ascii(text)
    return text if len(text) <= limit else text[:limit] + "..."


# What pickle raises on a cut or damaged stream (bad opcodes, bad memo refs, wrong arity, ...).
_CORRUPT_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
                   OverflowError, UnicodeDecodeError, RecursionError, MemoryError)


def load_dump(path: Path) -> dict:
    """One dump file through DumpUnpickler -> its top-level dict; RefusedDump or CorruptDump."""
    try:
        with Path(path).open("rb") as fh:
            data = DumpUnpickler(fh).load()
    except RefusedDump:
        raise
    except _CORRUPT_ERRORS as e:
        raise CorruptDump(_one_line(f"{type(e).__name__}: {e}")) from e
    if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
        found = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise CorruptDump(f"not an SGLang request dump: expected a dict with 'requests', found {found}")
    return data


@dataclass
class ServedSample:
    """One served answer: the prompt ids and the target's output ids, as served."""

    sha256: str  # content address: see sample_sha256
    prompt_ids: list[int]
    output_ids: list[int]
    sampling_params: dict
    finish_reason: dict
    rid: str | None
    created_time: float
    finished_time: float
    file: str
    text: str | None = None  # the prompt text, when the client sent text

    def record(self) -> dict:
        """The JSON-ready provenance kept with each sample."""
        return {"rid": self.rid, "file": self.file, "created_time": self.created_time,
                "finished_time": self.finished_time, "sampling_params": self.sampling_params,
                "finish_reason": self.finish_reason}


@dataclass
class ServedDumps:
    """What a read of dump files gave: samples, left-out counts by reason, files by outcome."""

    samples: list[ServedSample] = field(default_factory=list)
    excluded: Counter = field(default_factory=Counter)
    files_read: list[str] = field(default_factory=list)
    files_skipped: list[str] = field(default_factory=list)  # one line each: why
    files_refused: list[str] = field(default_factory=list)  # one line each: the class
    since: float | None = None
    until: float | None = None
    max_length: int = 0

    def summary(self) -> dict:
        """Small JSON-ready figures (the samples' count, not the samples)."""
        return {"num_samples": len(self.samples), "excluded": {r: self.excluded.get(r, 0) for r in EXCLUSION_REASONS},
                "files_read": len(self.files_read), "files_skipped": self.files_skipped,
                "files_refused": self.files_refused, "window": {"since": self.since, "until": self.until},
                "max_length": self.max_length}


def sample_sha256(prompt_ids: list[int], output_ids: list[int]) -> str:
    """Content address of a served answer: sha256 of the JSON `[prompt_ids, output_ids]` (no spaces)."""
    return hashlib.sha256(json.dumps([prompt_ids, output_ids], separators=(",", ":")).encode()).hexdigest()


def dump_files(sources: Path | str | Iterable[Path | str]) -> list[Path]:
    """The `*.pkl` files of a folder (sorted by name: SGLang's names sort by time), or the files given."""
    if isinstance(sources, (str, Path)):
        path = Path(sources)
        if path.is_dir():
            return sorted(p for p in path.glob("*.pkl") if p.is_file())
        sources = [path]
    paths = [Path(p) for p in sources]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"dump files not found: {missing}")
    return paths


def read_served_dumps(sources: Path | str | Iterable[Path | str], max_length: int, since: float | None = None,
                      until: float | None = None, log: LogFn | None = None) -> ServedDumps:
    """Served samples from SGLang request dumps, each left-out request counted by reason.

    Args:
        sources: a dump folder (its `*.pkl`) or dump files.
        max_length: a prompt of >= max_length tokens is left out ("too_long": no answer token fits).
        since, until: the window, epoch seconds, half-open on finished_time: since <= t < until
            (None: open). Consecutive windows partition the traffic: each request is in exactly one.
        log: gets one line per refused or skipped file.
    Returns ServedDumps; samples in file order, first occurrence kept for duplicates.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, found {max_length}")
    log = log or (lambda line: None)
    result = ServedDumps(since=since, until=until, max_length=max_length)
    seen: set[str] = set()
    for path in dump_files(sources):
        data = _load_or_report(path, result, log)
        if data is None:
            continue
        result.files_read.append(str(path))
        for entry in data["requests"]:
            sample, reason = served_sample(entry, path.name, max_length, since, until)
            if sample is not None and sample.sha256 in seen:
                sample, reason = None, "duplicate"
            if sample is None:
                result.excluded[reason] += 1
                continue
            seen.add(sample.sha256)
            result.samples.append(sample)
    return result


def _load_or_report(path: Path, result: ServedDumps, log: LogFn) -> dict | None:
    """load_dump, or None with the file's one line in result and the log."""
    try:
        return load_dump(path)
    except RefusedDump as e:
        line = f"{path.name}: {e}"
        result.files_refused.append(line)
    except CorruptDump as e:
        line = f"{path.name}: truncated or corrupt ({e}); skipped"
        result.files_skipped.append(line)
    except OSError as e:
        line = f"{path.name}: unreadable ({e.strerror or e}); skipped"
        result.files_skipped.append(line)
    log(line)
    return None


def served_sample(entry: Any, file: str, max_length: int, since: float | None,
                  until: float | None) -> tuple[ServedSample | None, str]:
    """One `(GenerateReqInput, out_dict, created_time, finished_time)` -> (sample, "") or (None, reason)."""
    if not (isinstance(entry, tuple) and len(entry) == 4 and isinstance(entry[0], GenerateReqInputRecord)
            and isinstance(entry[1], dict) and all(_is_time(t) for t in entry[2:])):
        return None, "malformed"
    req, out, created, finished = entry[0].fields(), entry[1], float(entry[2]), float(entry[3])
    if (since is not None and finished < since) or (until is not None and finished >= until):
        return None, "out_of_window"
    meta = out.get("meta_info") if isinstance(out.get("meta_info"), dict) else {}
    reason = _unclean_finish(meta.get("finish_reason"))
    if reason:
        return None, reason
    prompt = _token_ids(out.get("prompt_token_ids"))
    prompt = prompt if prompt is not None else _token_ids(req.get("input_ids"))
    output = _token_ids(out.get("output_ids"))
    if not prompt or not output:
        return None, "no_token_ids"
    if meta.get("completion_tokens") not in (None, len(output)):
        return None, "incomplete_output"
    if len(prompt) >= max_length:
        return None, "too_long"
    sampling = req.get("sampling_params")
    return ServedSample(sample_sha256(prompt, output), prompt, output, dict(sampling) if isinstance(sampling, dict)
                        else {}, dict(meta["finish_reason"]), _str_or_none(req.get("rid")), created, finished, file,
                        req.get("text") if isinstance(req.get("text"), str) else None), ""


def _is_time(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _unclean_finish(finish_reason: Any) -> str:
    """"" for a clean stop; else the exclusion reason ("aborted", "length", "unfinished")."""
    if not isinstance(finish_reason, dict) or "type" not in finish_reason:
        return "unfinished"
    kind = finish_reason["type"]
    if kind == "stop":
        return ""
    return {"abort": "aborted", "length": "length"}.get(kind, "unfinished")


def _token_ids(value: Any) -> list[int] | None:
    """A flat list (or tuple: crash dumps freeze ids) of non-negative ints, else None."""
    if not isinstance(value, (list, tuple)):
        return None
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        return None
    return list(value)


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


# --------------------------------------------------------------------------- samples.jsonl


def build_served_samples(served: list[ServedSample], max_length: int, validation_fraction: float) -> list[dict]:
    """samples.jsonl records (`eagle3.data.samples` format) from served answers.

    input_ids = prompt ids + output ids, cut at max_length as `tokenize_generated` cuts; loss_mask
    covers the output ids only. Example: prompt [1, 7, 9] + output [4, 5, 2], max_length 5 ->
    input_ids [1, 7, 9, 4, 5], loss_mask [0, 0, 0, 1, 1].
    The split follows each sample's content address (sha256 as a fraction of 2^256 below
    validation_fraction -> validation), so a sample keeps its split whichever night reads it;
    with a fraction > 0 and > 1 samples, at least one lands in each split.
    Extra keys: "sha256", "num_prompt_tokens", "served" (rid, file, times, sampling, finish reason).
    """
    samples = []
    for i, s in enumerate(served):
        ids = (s.prompt_ids + s.output_ids)[:max_length]
        mask = ([0] * len(s.prompt_ids) + [1] * len(s.output_ids))[:max_length]
        messages = [{"role": "user", "content": s.text}] if s.text else []
        samples.append({"id": i, "split": _split_of(s.sha256, validation_fraction), "messages": messages,
                        "input_ids": ids, "loss_mask": mask, "sha256": s.sha256,
                        "num_prompt_tokens": len(s.prompt_ids), "served": s.record()})
    _keep_both_splits(samples, validation_fraction)
    return samples


def _split_of(sha256: str, validation_fraction: float) -> str:
    return "validation" if int(sha256, 16) / 2**256 < validation_fraction else "train"


def _keep_both_splits(samples: list[dict], validation_fraction: float) -> None:
    """Move the sample nearest the boundary when a split came out empty (tiny sets only)."""
    if validation_fraction <= 0 or len(samples) < 2:
        return
    by_hash = sorted(samples, key=lambda s: s["sha256"])
    if not any(s["split"] == "validation" for s in samples):
        by_hash[0]["split"] = "validation"
    if not any(s["split"] == "train" for s in samples):
        by_hash[-1]["split"] = "train"


def write_served_samples(dumps: ServedDumps, out_dir: Path, validation_fraction: float) -> dict:
    """samples.jsonl + samples.meta.json in out_dir, as the data stage writes regenerated samples.

    The meta's fingerprint is the sha256 of the sorted content addresses with max_length and the
    split fraction, so the same served samples give the same fingerprint. Returns the meta.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    samples = build_served_samples(dumps.samples, dumps.max_length, validation_fraction)
    key = json.dumps([sorted(s.sha256 for s in dumps.samples), dumps.max_length, validation_fraction, SAMPLES_FORMAT])
    meta = {"fingerprint": hashlib.sha256(key.encode()).hexdigest(),
            "sha256": write_samples(samples, out_dir / SAMPLES_FILE), "dropped": sum(dumps.excluded.values()),
            "num_conversations": len(samples) + sum(dumps.excluded.values()), "failed": [], "source": "served",
            **dumps.summary()}
    atomic_write_text(out_dir / SAMPLES_META, json.dumps(meta, indent=2))
    return meta
