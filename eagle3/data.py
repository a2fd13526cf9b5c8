"""Training data for the draft: prompts -> target responses -> chat tokens + loss mask ->
draft vocab -> target hidden states (offline shards) or nothing (online).

Owns the on-disk dataset and the contract the trainer reads:
- `samples.jsonl`: one sample per line, `{"id", "split", "messages", "input_ids", "loss_mask"}`.
- regeneration: in-process HF generate (`local`), or servers of the target (`sglang`: native
  /generate, token ids in and out, so samples carry the target's own token stream; `http`: an
  OpenAI chat endpoint, text only), spread over several servers with retries that move to
  another server; `failed.jsonl` lists the prompts that still failed (never dropped silently).
- `hidden_states/` (offline): safetensors shards, each packing its samples back to back
  (`input_ids` [N_tok] int64, `loss_mask` [N_tok] uint8, `lengths` [N] int64, `sample_ids` [N]
  int64, `aux_hidden_states` [N_tok, k*H], `last_hidden_states` [N_tok, H]) + `manifest.json`.
- `vocab/`: the draft vocabulary (eagle3.vocab).
- `HiddenStateDataset` / `TokenizedDataset` + `collate_hidden_states`, `TargetFeatureExtractor`
  (online mode, from eagle3.capture) and `load_target_head` (teacher logits).

Risks: disk (4 * H * 2 bytes per token in bf16, reference eagle3-training.md (e).4), hence the
estimate and free-space check before writing; and kills mid-dump, hence tmp + atomic rename,
sha256 per shard and resume. The dump must keep pace with the target's forward: device->host
copies overlap the next batch's forward (`_HostCopier`) and shards are written and hashed on
writer threads while the next one is captured (`_capture_and_write`).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import json
import os
import random
import shutil
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import httpx
import torch
from safetensors import safe_open
from torch.utils.data import Dataset
from transformers import AutoTokenizer, GenerationConfig

from eagle3.capture import TargetFeatureExtractor, aux_ids_to_hf_indices, default_aux_layer_ids
from eagle3.chat import (
    Message,
    chat_template_sha256,
    render_chat,
    tokenize_chat,
    tokenize_generated,
    turn_stop_ids,
    validate_messages,
)
from eagle3.config import DataConfig, RegenerateConfig, TargetConfig
from eagle3.environment import hidden_state_bytes as estimate_hidden_state_bytes
from eagle3.tiny_target import cpu_threads, heldout_corpus, load_target, sample_chat_examples
from eagle3.vocab import build_or_load_draft_vocab

__all__ = [
    "HiddenStateDataset",
    "InsufficientDiskSpaceError",
    "TargetFeatureExtractor",
    "TokenizedDataset",
    "collate_hidden_states",
    "estimate_hidden_state_bytes",
    "generate_dataset",
    "load_target_head",
]

ProgressFn = Callable[[str, int, int], None]
LogFn = Callable[[str], None]
T = TypeVar("T")
# Starts the regeneration servers on entry, stops them on exit; yields their base URLs.
OpenEndpoints = Callable[[], contextlib.AbstractContextManager[list[str]]]
FAILED_FILE = "failed.jsonl"
SAMPLES_FILE = "samples.jsonl"
# Bumped when the way samples are built changes (2: the target's own generated ids are kept).
SAMPLES_FORMAT = 2
SAMPLES_META = "samples.meta.json"
MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _noop_progress(stage: str, done: int, total: int) -> None:
    return None


# --------------------------------------------------------------------------- prompts


def builtin_conversations(num_samples: int, seed: int) -> list[list[Message]]:
    """Deterministic single-turn chats from stdlib files the tiny target never trained on.

    Half "Continue this Python code:" snippets, half docstring -> function prompts; each
    carries the true continuation as its assistant message (used when regeneration is off).
    """
    return [ex.messages() for ex in sample_chat_examples(heldout_corpus(), num_samples, seed)]


def _record_messages(record: object, where: str) -> list[Message]:
    """Messages of one jsonl record: {"prompt": str} or {"messages": [...]}."""
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return [{"role": "user", "content": record["prompt"]}]
    if isinstance(record, dict) and "messages" in record:
        return validate_messages(record["messages"], where)
    raise ValueError(f"{where}: expected {{'prompt': str}} or {{'messages': [...]}}, got {str(record)[:120]!r}")


def read_jsonl_records(path: Path, parse: Callable[[object, str], T]) -> list[T]:
    """`parse(record, "file:line")` for every non-empty line of a .jsonl file; bad lines raise
    ValueError naming file and line, an absent file FileNotFoundError, an empty one ValueError."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file not found: {path}")
    parsed = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON ({exc.msg})") from exc
            parsed.append(parse(record, where))
    if not parsed:
        raise ValueError(f"{path}: no prompts")
    return parsed


def read_prompts_jsonl(path: Path) -> list[list[Message]]:
    """All conversations in a .jsonl file; a bad line raises ValueError naming file and line."""
    return read_jsonl_records(path, _record_messages)


def load_conversations(data_cfg: DataConfig, log: LogFn = print) -> list[list[Message]]:
    """data.prompts -> up to num_samples conversations (a seeded subset when the file has more)."""
    if data_cfg.prompts == "builtin":
        return builtin_conversations(data_cfg.num_samples, data_cfg.seed)
    conversations = read_prompts_jsonl(Path(data_cfg.prompts))
    if len(conversations) > data_cfg.num_samples:
        keep = sorted(random.Random(data_cfg.seed).sample(range(len(conversations)), data_cfg.num_samples))
        conversations = [conversations[i] for i in keep]
    elif len(conversations) < data_cfg.num_samples:
        log(f"data: {data_cfg.prompts} has {len(conversations)} conversations (< num_samples={data_cfg.num_samples})")
    return conversations


def prompt_part(messages: Sequence[Message], where: str = "conversation") -> list[Message]:
    """Messages up to and including the last user message: what the target answers anew."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        raise ValueError(f"{where}: no user message to answer")
    return list(messages[: last_user + 1])


# --------------------------------------------------------------------------- regeneration


class RegenerationLog:
    """Append-only record of finished responses, so a killed regeneration resumes where it stopped.

    File lines are {"i": prompt index, "response": str[, "ids": [int]]}; the file name carries
    the run's fingerprint, so answers from other settings or another target are never mixed in.
    `ids` are the target's own generated token ids (local and sglang backends): see `tokenize_generated`.

    A kill can cut the last record mid-line (no newline yet: json.dumps escapes newlines, so a
    record's only raw newline is its terminator). That tail is cut off the file on open, so its
    prompt is answered again and the new record starts on a line of its own; appending after the
    cut bytes would glue the two into one unreadable line and hide every later record.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: dict[int, str] = {}
        self.token_ids: dict[int, list[int]] = {}
        if path.is_file():
            complete_bytes = self._read_records(path)
            if complete_bytes < path.stat().st_size:
                os.truncate(path, complete_bytes)
        self._lock = threading.Lock()
        self._fh = path.open("a", encoding="utf-8")

    def _read_records(self, path: Path) -> int:
        """Load every newline-terminated record; returns their total length in bytes."""
        complete = 0
        for lineno, line in enumerate(path.read_bytes().splitlines(keepends=True), start=1):
            if not line.endswith(b"\n"):
                break  # the last record, cut by a kill before its newline
            try:
                entry = json.loads(line)
                index, response = int(entry["i"]), entry["response"]
            except (ValueError, KeyError, TypeError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                raise ValueError(
                    f"{path}:{lineno}: corrupt regeneration record ({exc}); a kill only cuts the last line, "
                    "so this file was changed by something else: delete it to answer every prompt again"
                ) from exc
            self.done[index] = response
            if entry.get("ids") is not None:
                self.token_ids[index] = entry["ids"]
            complete += len(line)
        return complete

    def add(self, index: int, response: str, ids: list[int] | None = None) -> None:
        with self._lock:
            self.done[index] = response
            entry: dict = {"i": index, "response": response}
            if ids is not None:
                self.token_ids[index] = ids
                entry["ids"] = ids
            self._fh.write(json.dumps(entry) + "\n")
            self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def _local_generation_config(rcfg: RegenerateConfig, max_new_tokens: int, stop_ids: list[int], pad_id: int):
    """Greedy at temperature 0, else sampling with temperature/top_p."""
    sampling = rcfg.temperature > 0
    return GenerationConfig(
        do_sample=sampling,
        temperature=rcfg.temperature if sampling else None,
        top_p=rcfg.top_p if sampling else None,
        top_k=None,
        max_new_tokens=max_new_tokens,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
    )


def _left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompt ids for batched generation. -> input_ids, attention_mask [B, T]"""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids, mask


@torch.no_grad()
def _generate_batch(model, tokenizer, rows, rcfg, max_new, stop_ids) -> list[tuple[str, list[int]]]:
    """One batched HF generate call -> (answer text, generated ids incl. the stop token) per row.

    The ids are kept because a model's token stream is often not the canonical tokenization of
    its own decoded text; training on re-tokenized text would show the draft contexts the
    target never produces when serving.
    """
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    ids, mask = _left_pad(rows, pad_id)
    device = next(model.parameters()).device
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        generation_config=_local_generation_config(rcfg, max_new, stop_ids, pad_id),
    )
    answers = []
    for row in out[:, ids.shape[1] :].tolist():
        cut = next((k for k, t in enumerate(row) if t in stop_ids), len(row))
        answers.append((tokenizer.decode(row[:cut], skip_special_tokens=True), row[: cut + 1]))
    return answers


def regenerate_local(
    model, tokenizer, prompts: list[list[Message]], rcfg: RegenerateConfig, max_length: int,
    stop_ids: list[int], record: RegenerationLog, progress: ProgressFn, seed: int = 0,
) -> None:
    """Answer every prompt not yet in `record` with HF generate, in length-sorted batches.

    Prompts of >= max_length tokens get "" (they would leave no room for an answer and are
    dropped later); new tokens are capped so every prompt + answer fits max_length.
    """
    if rcfg.temperature > 0:
        torch.manual_seed(seed)
    rendered = [render_chat(tokenizer, p, add_generation_prompt=True) for p in prompts]
    prompt_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    todo = [i for i in range(len(prompts)) if i not in record.done]
    for i in [i for i in todo if len(prompt_ids[i]) >= max_length]:
        record.add(i, "")
    todo = sorted((i for i in todo if len(prompt_ids[i]) < max_length), key=lambda i: len(prompt_ids[i]))
    progress("regenerate", len(prompts) - len(todo), len(prompts))
    for b in range(0, len(todo), rcfg.batch_size):
        batch = todo[b : b + rcfg.batch_size]
        rows = [prompt_ids[i] for i in batch]
        # the batch's longest prompt decides, so no answer runs past max_length (<= the context)
        max_new = min(rcfg.max_new_tokens, max_length - max(len(r) for r in rows))
        for i, (answer, ids) in zip(batch, _generate_batch(model, tokenizer, rows, rcfg, max_new, stop_ids), strict=True):
            record.add(i, answer, ids)
        progress("regenerate", len(prompts) - len(todo) + b + len(batch), len(prompts))


def chat_completions_url(endpoint: str) -> str:
    """OpenAI-compatible chat URL for a base URL with or without a trailing /v1."""
    base = endpoint.rstrip("/")
    return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")


def generate_url(endpoint: str) -> str:
    """SGLang's native /generate for a base URL with or without a trailing /v1."""
    base = endpoint.rstrip("/")
    return (base[: -len("/v1")] if base.endswith("/v1") else base) + "/generate"


class FailureLog:
    """`failed.jsonl`: one line per prompt that still failed after its retries, never dropped silently.

    Lines are {"i": prompt index, "error": str, "attempts": int, "servers": [url]}. The file is
    started afresh by each regeneration pass: a prompt that failed earlier is not in the
    regeneration log, so it is asked again, and only what fails again is written again.
    `path=None` keeps the records in memory only.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.records: list[dict] = []
        self._lock = threading.Lock()
        if path is not None:
            path.write_text("", encoding="utf-8")

    def add(self, index: int, error: str, attempts: int, servers: list[str]) -> None:
        entry = {"i": index, "error": error, "attempts": attempts, "servers": servers}
        with self._lock:
            self.records.append(entry)
            if self.path is not None:
                with self.path.open("a", encoding="utf-8") as fh:
                    fh.write(json.dumps(entry) + "\n")

    @property
    def indices(self) -> list[int]:
        return sorted(r["i"] for r in self.records)


class ServerPool:
    """The servers answering regeneration requests: `concurrency` slots each, and which are reachable.

    A request takes a slot on the least busy reachable server, preferring one other than the
    server its previous attempt failed on, so a retry moves off a dead server. A server that
    refuses or drops a connection is marked unreachable until it answers again; when every
    server is unreachable they are all tried (each failure still costs the request an attempt,
    so this stays bounded).
    """

    def __init__(self, urls: Sequence[str], concurrency: int) -> None:
        if not urls:
            raise ValueError("regeneration needs at least one server URL")
        self.urls, self.concurrency = list(urls), concurrency
        self._busy = [0] * len(self.urls)
        self._unreachable: set[int] = set()
        self._cv = threading.Condition()

    def _candidates(self, avoid: int | None) -> list[int]:
        everyone = range(len(self.urls))
        reachable = [k for k in everyone if k not in self._unreachable]
        preferred = [k for k in reachable if k != avoid]
        return preferred or reachable or list(everyone)

    def acquire(self, avoid: int | None = None) -> int:
        """Index of the server the next attempt goes to (blocks while its candidates are all busy)."""
        with self._cv:
            while True:
                free = [k for k in self._candidates(avoid) if self._busy[k] < self.concurrency]
                if free:
                    k = min(free, key=lambda s: self._busy[s])
                    self._busy[k] += 1
                    return k
                self._cv.wait(timeout=1.0)

    def release(self, k: int, reachable: bool) -> None:
        with self._cv:
            self._busy[k] -= 1
            if reachable:
                self._unreachable.discard(k)
            else:
                self._unreachable.add(k)
            self._cv.notify_all()


def _is_transient(exc: Exception) -> bool:
    """Timeouts, connection errors, 5xx and 429 are retried; other errors are not."""
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code >= 500 or exc.response.status_code == 429
    return isinstance(exc, (httpx.TimeoutException, httpx.TransportError))


def _is_unreachable(exc: Exception) -> bool:
    """The server is gone (refused or dropped the connection), not merely slow or refusing the request."""
    return isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError))


def _message_content(response: httpx.Response, url: str) -> str:
    """choices[0].message.content of an OpenAI chat response; RuntimeError if malformed."""
    try:
        content = response.json()["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise RuntimeError(f"POST {url}: malformed chat completion: {response.text[:300]!r}") from exc
    if not isinstance(content, str):
        raise RuntimeError(f"POST {url}: chat completion without text content: {response.text[:300]!r}")
    return content


def _generated_answer(response: httpx.Response, url: str) -> tuple[str, list[int]]:
    """(text, output_ids) of an SGLang /generate response; RuntimeError if malformed.

    A stop token matched by id ends the ids: if a server reports it in `finish_reason.matched`
    but leaves it out of `output_ids`, it is appended, since the draft must learn to propose it.
    """
    try:
        body = response.json()
        text, ids, finish = body["text"], body["output_ids"], body.get("meta_info", {}).get("finish_reason")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RuntimeError(f"POST {url}: malformed /generate response: {response.text[:300]!r}") from exc
    if not isinstance(text, str) or not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise RuntimeError(f"POST {url}: /generate response without text and integer output_ids: "
                           f"{response.text[:300]!r}")
    matched = finish.get("matched") if isinstance(finish, dict) and finish.get("type") == "stop" else None
    if isinstance(matched, int) and not isinstance(matched, bool) and (not ids or ids[-1] != matched):
        ids = [*ids, matched]
    return text, ids


class RequestFailed(RuntimeError):
    """A request that failed for good: the message names the last URL and the error."""

    def __init__(self, message: str, attempts: int, servers: list[str]) -> None:
        super().__init__(message)
        self.attempts, self.servers = attempts, servers


def post_with_failover(
    client: httpx.Client, pool: ServerPool, route: Callable[[str], str], payload: dict,
    parse: Callable[[httpx.Response, str], object], rcfg: RegenerateConfig, log: LogFn, sleep=time.sleep,
) -> object:
    """POST one request, retrying transient errors (exponential backoff) on another server when there is one.

    Returns `parse(response, url)`; raises RuntimeError naming the last URL, the attempts and the
    error once the retries are spent or on a non-transient error (4xx, malformed answer). The
    Authorization header lives on the client; nothing here logs headers.
    """
    failed_on, tried = None, []
    for attempt in range(rcfg.retries + 1):
        k = pool.acquire(avoid=failed_on)
        url = route(pool.urls[k])
        tried.append(pool.urls[k])
        try:
            response = client.post(url, json=payload)
            response.raise_for_status()
            answer = parse(response, url)
        except (httpx.HTTPStatusError, httpx.TimeoutException, httpx.TransportError) as exc:
            pool.release(k, reachable=not _is_unreachable(exc))
            status = exc.response.status_code if isinstance(exc, httpx.HTTPStatusError) else type(exc).__name__
            if not _is_transient(exc) or attempt == rcfg.retries:
                body = exc.response.text[:300] if isinstance(exc, httpx.HTTPStatusError) else str(exc)[:300]
                raise RequestFailed(f"POST {url} failed after {attempt + 1} attempt(s): {status} {body}",
                                    attempt + 1, tried) from exc
            delay = min(rcfg.backoff_s * 2**attempt, 60.0)
            log(f"regenerate: POST {url} -> {status}; retry {attempt + 1}/{rcfg.retries} in {delay:.2f}s")
            failed_on = k
            sleep(delay)
            continue
        except RuntimeError as exc:  # a malformed answer: the server is up but this is not retried
            pool.release(k, reachable=True)
            raise RequestFailed(str(exc), attempt + 1, tried) from exc
        except BaseException:
            pool.release(k, reachable=True)
            raise
        pool.release(k, reachable=True)
        return answer
    raise AssertionError("unreachable")


def post_chat_completion(
    client: httpx.Client, url: str, payload: dict, rcfg: RegenerateConfig, log: LogFn, sleep=time.sleep
) -> str:
    """POST one chat completion to `url` with retries (exponential backoff) on transient errors."""
    return post_with_failover(client, ServerPool([url], 1), lambda u: u, payload, _message_content, rcfg, log, sleep)


def _answer_all(
    requests: dict[int, dict], pool: ServerPool, route: Callable[[str], str], parse: Callable, rcfg: RegenerateConfig,
    on_answer: Callable[[int, object], None], failures: FailureLog, progress: ProgressFn, total: int, log: LogFn,
) -> None:
    """Every request through the pool, `concurrency` per server; each answer or final failure is recorded."""
    headers = {"Authorization": f"Bearer {rcfg.api_key.get_secret_value()}"} if rcfg.api_key else {}
    done = total - len(requests)
    progress("regenerate", done, total)
    workers = max(1, min(len(requests), rcfg.concurrency * len(pool.urls)))
    limits = httpx.Limits(max_connections=workers)
    with httpx.Client(headers=headers, timeout=rcfg.timeout_s, limits=limits) as client, \
            ThreadPoolExecutor(workers) as threads:
        futures = {threads.submit(post_with_failover, client, pool, route, payload, parse, rcfg, log): i
                   for i, payload in requests.items()}
        for future in as_completed(futures):
            index = futures[future]
            try:
                on_answer(index, future.result())
            except RequestFailed as err:
                failures.add(index, str(err), err.attempts, err.servers)
                log(f"regenerate: prompt {index} failed: {err}")
            done += 1
            progress("regenerate", done, total)


def check_failures(failures: FailureLog, total: int, rcfg: RegenerateConfig) -> None:
    """RuntimeError when more prompts failed than data.regenerate.max_failed_fraction allows."""
    if not failures.records or len(failures.records) <= rcfg.max_failed_fraction * total:
        return
    where = f" (listed in {failures.path})" if failures.path else ""
    raise RuntimeError(
        f"regenerate: {len(failures.records)}/{total} prompts failed after their retries{where}, more than "
        f"data.regenerate.max_failed_fraction={rcfg.max_failed_fraction}; rerun to ask only those again. "
        f"First error: {failures.records[0]['error']}"
    )


def regenerate_http(
    prompts: list[list[Message]], rcfg: RegenerateConfig, record: RegenerationLog, progress: ProgressFn, log: LogFn,
    urls: Sequence[str] | None = None, failures: FailureLog | None = None,
) -> None:
    """Answer every prompt not yet in `record` through /v1/chat/completions (text only).

    Args:
        urls: base URLs of the servers (default: data.regenerate.endpoint / endpoints).
        failures: where prompts that still fail after their retries go (default: memory only).
    Raises RuntimeError when more than data.regenerate.max_failed_fraction of the prompts failed.
    """
    failures = failures if failures is not None else FailureLog(None)
    pool = ServerPool(list(urls or rcfg.server_urls), rcfg.concurrency)
    requests = {i: _http_payload(prompts[i], rcfg) for i in range(len(prompts)) if i not in record.done}
    _answer_all(requests, pool, chat_completions_url, _message_content, rcfg, record.add, failures, progress,
                len(prompts), log)
    check_failures(failures, len(prompts), rcfg)


def regenerate_sglang(
    prompts: list[list[Message]], tokenizer, rcfg: RegenerateConfig, max_length: int, stop_ids: list[int],
    record: RegenerationLog, progress: ProgressFn, log: LogFn,
    urls: Sequence[str] | None = None, failures: FailureLog | None = None,
) -> None:
    """Answer every prompt not yet in `record` through SGLang's /generate, keeping the target's own ids.

    Each prompt goes as token ids, rendered exactly as `tokenize_generated` renders it (chat
    template + generation prompt, no extra special tokens), and each answer is recorded with its
    `output_ids`, so a sample is the token stream the target produced. As in `regenerate_local`,
    prompts of >= max_length tokens get "" and new tokens are capped so prompt + answer fit
    max_length. Args and raises as `regenerate_http`.
    """
    failures = failures if failures is not None else FailureLog(None)
    pool = ServerPool(list(urls or rcfg.server_urls), rcfg.concurrency)
    rendered = [render_chat(tokenizer, p, add_generation_prompt=True) for p in prompts]
    prompt_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    todo = [i for i in range(len(prompts)) if i not in record.done]
    for i in [i for i in todo if len(prompt_ids[i]) >= max_length]:
        record.add(i, "")
    requests = {
        i: _generate_payload(prompt_ids[i], min(rcfg.max_new_tokens, max_length - len(prompt_ids[i])), rcfg, stop_ids)
        for i in todo if len(prompt_ids[i]) < max_length
    }

    def on_answer(index: int, answer) -> None:
        text, ids = answer
        record.add(index, text, ids)

    _answer_all(requests, pool, generate_url, _generated_answer, rcfg, on_answer, failures, progress,
                len(prompts), log)
    check_failures(failures, len(prompts), rcfg)


def _http_payload(messages: list[Message], rcfg: RegenerateConfig) -> dict:
    """OpenAI chat-completions request body."""
    return {
        "model": rcfg.model or "default",
        "messages": messages,
        "temperature": rcfg.temperature,
        "top_p": rcfg.top_p,
        "max_tokens": rcfg.max_new_tokens,
    }


def _generate_payload(prompt_ids: list[int], max_new_tokens: int, rcfg: RegenerateConfig, stop_ids: list[int]) -> dict:
    """SGLang /generate request body: token ids in, the target's turn-end ids as stop ids."""
    return {
        "input_ids": list(prompt_ids),
        "sampling_params": {
            "max_new_tokens": max_new_tokens,
            "temperature": rcfg.temperature,
            "top_p": rcfg.top_p,
            "stop_token_ids": list(stop_ids),
        },
    }


def _masked_url(url: str) -> str:
    parsed = httpx.URL(url)
    return str(parsed.copy_with(userinfo=b"***")) if parsed.userinfo else url


def regeneration_settings(rcfg: RegenerateConfig) -> dict:
    """The settings that shape the responses, for summaries and fingerprints (no secrets).

    The API key is reduced to a flag and any user:password in an endpoint URL is masked.
    """
    settings = rcfg.model_dump(exclude={"api_key"}) | {"api_key_set": rcfg.api_key is not None}
    if rcfg.endpoint:
        settings["endpoint"] = _masked_url(rcfg.endpoint)
    settings["endpoints"] = [_masked_url(u) for u in rcfg.endpoints]
    return settings


# --------------------------------------------------------------------------- samples


def split_ids(num: int, validation_fraction: float, seed: int) -> set[int]:
    """Seeded choice of validation sample indices (at least 1 when the fraction is > 0 and num > 1)."""
    n_val = round(num * validation_fraction)
    if validation_fraction > 0 and num > 1:
        n_val = min(max(n_val, 1), num - 1)
    return set(random.Random(seed).sample(range(num), n_val)) if n_val else set()


def build_samples(
    tokenizer, conversations: list[list[Message]], data_cfg: DataConfig, stop_ids: list[int], progress: ProgressFn,
    answer_ids: dict[int, list[int]] | None = None,
) -> tuple[list[dict], int]:
    """Tokenize + mask every conversation; drop those with no assistant token; split train/validation.

    answer_ids: the target's generated ids of conversation n's final answer, used as they are
    (prompt rendered exactly as it was for generation) instead of re-tokenizing the text.
    Returns (samples, dropped); sample = {"id", "split", "messages", "input_ids", "loss_mask"}.
    """
    kept, answer_ids = [], answer_ids or {}
    for n, messages in enumerate(conversations):
        if n in answer_ids:
            tokenized = tokenize_generated(tokenizer, messages[:-1], answer_ids[n], data_cfg.max_length)
        else:
            tokenized = tokenize_chat(tokenizer, messages, data_cfg.max_length, stop_ids)
        if tokenized.num_assistant_tokens:
            kept.append({"messages": messages, "input_ids": tokenized.input_ids, "loss_mask": tokenized.loss_mask})
        if (n + 1) % 256 == 0 or n + 1 == len(conversations):
            progress("tokenize", n + 1, len(conversations))
    validation = split_ids(len(kept), data_cfg.validation_fraction, data_cfg.seed)
    samples = [{"id": i, "split": "validation" if i in validation else "train", **s} for i, s in enumerate(kept)]
    return samples, len(conversations) - len(kept)


def _atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file + rename, so readers never see a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def file_sha256(path: Path) -> str:
    """sha256 of a file, streamed."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_samples(samples: list[dict], path: Path) -> str:
    """samples.jsonl (atomically); returns its sha256."""
    _atomic_write_text(path, "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in samples))
    return file_sha256(path)


def read_samples(path: Path, split: str | None = None) -> list[dict]:
    """Samples of samples.jsonl, optionally only one split."""
    if not path.is_file():
        raise FileNotFoundError(f"samples file not found: {path}")
    with path.open(encoding="utf-8") as fh:
        samples = [json.loads(line) for line in fh if line.strip()]
    return [s for s in samples if split is None or s["split"] == split]


# --------------------------------------------------------------------------- hidden-state shards


class InsufficientDiskSpaceError(OSError):
    """The offline hidden states would not fit on the destination filesystem."""


def _dump_bytes(num_tokens: int, num_samples: int, hidden_size: int, num_aux: int, dtype_bytes: int) -> int:
    """Shard bytes: hidden states + int64 ids + uint8 mask per token + int64 length/id per sample."""
    states = estimate_hidden_state_bytes(num_tokens, hidden_size, num_aux, dtype_bytes)
    return states + 9 * num_tokens + 16 * num_samples


def check_disk_space(directory: Path, need: int, log: LogFn) -> None:
    """Raise InsufficientDiskSpaceError unless need (+5% and 100 MiB headroom) fits in free space."""
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    required = int(need * 1.05) + (100 << 20)
    log(
        f"hidden states: need {need / 1e9:.3f} GB (+headroom {required / 1e9:.3f} GB), "
        f"free {free / 1e9:.3f} GB at {directory}"
    )
    if required > free:
        raise InsufficientDiskSpaceError(
            f"offline hidden states need {need} bytes ({need / 1e9:.3f} GB; {required} with headroom) "
            f"but only {free} bytes ({free / 1e9:.3f} GB) are free at {directory}; free space, lower "
            "data.num_samples / data.max_length, or use data.hidden_states: online"
        )


def plan_shards(samples: list[dict], shard_size: int) -> list[tuple[str, list[dict]]]:
    """(file name, samples) per shard: each split in id order, shard_size samples per shard."""
    plan = []
    for split in ("train", "validation"):
        members = [s for s in samples if s["split"] == split]
        for n, start in enumerate(range(0, len(members), shard_size)):
            plan.append((f"{split}-{n:05d}.safetensors", members[start : start + shard_size]))
    return plan


def _right_pad(rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ids with 0. -> input_ids, attention_mask [B, T]"""
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


def _real_token_rows(lengths: Sequence[int], width: int) -> torch.Tensor:
    """Flat row indices of the real tokens of a right-padded [B, width] batch, in sample order.

    Example: lengths [3, 1], width 3 -> [0, 1, 2, 3] (row 1 keeps only its first position).
    """
    return torch.cat([torch.arange(i * width, i * width + n) for i, n in enumerate(lengths)])


class _HostCopier:
    """Device -> host copies of captured states that overlap the next batch's forward.

    Each batch's packed states are copied (non_blocking, on a side stream) into one of two
    staging buffers, page-locked on CUDA so the copy is real DMA; the previous batch's buffer is
    then moved into the shard's host tensors while the GPU runs the current forward. The only
    waits are on a copy queued one batch earlier, never a sync per sample. On CPU the same
    ring runs with plain buffers and synchronous copies.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.slots: list[list[torch.Tensor]] = [[], []]
        self.pending: list[tuple[int, object, list[torch.Tensor]] | None] = [None, None]
        self.turn = 0

    def _staging(self, slot: int, sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        buffers = self.slots[slot]
        if len(buffers) != len(sources) or any(b.shape[0] < s.shape[0] for b, s in zip(buffers, sources, strict=True)):
            buffers = [torch.empty(s.shape, dtype=s.dtype, pin_memory=self.cuda) for s in sources]
            self.slots[slot] = buffers
        return [b[: s.shape[0]] for b, s in zip(buffers, sources, strict=True)]

    def copy(self, sources: Sequence[torch.Tensor], destinations: Sequence[torch.Tensor]) -> None:
        """Queue sources (device tensors) -> destinations (host tensors of the same shapes)."""
        slot, self.turn = self.turn, 1 - self.turn
        self._drain(slot)  # this slot's previous batch (two batches ago) must be out of it
        staging = self._staging(slot, sources)
        event = None
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(sources[0].device))  # sources are computed
            with torch.cuda.stream(self.stream):
                for dst, src in zip(staging, sources, strict=True):
                    dst.copy_(src, non_blocking=True)
                    src.record_stream(self.stream)  # keep src's memory until the copy has run
                event = torch.cuda.Event()
                event.record(self.stream)
        else:
            for dst, src in zip(staging, sources, strict=True):
                dst.copy_(src)
        self.pending[slot] = (slot, event, list(destinations))
        self._drain(1 - slot)  # the previous batch: its copy was queued before this forward ran

    def _drain(self, slot: int) -> None:
        if self.pending[slot] is None:
            return
        _, event, destinations = self.pending[slot]
        if event is not None:
            event.synchronize()
        for dst, src in zip(destinations, self.slots[slot], strict=True):
            dst.copy_(src[: dst.shape[0]])
        self.pending[slot] = None

    def finish(self) -> None:
        """Wait for every queued copy; the destinations are complete after this."""
        for slot in (self.turn, 1 - self.turn):
            self._drain(slot)


def capture_shard(extractor: TargetFeatureExtractor, members: list[dict], batch_size: int, dtype: torch.dtype) -> dict:
    """Hidden states of one shard's samples, packed back to back (see module docstring).

    Per batch: one forward, the real tokens gathered on the device, converted to `dtype` there
    ([n_real, k*H] and [n_real, H]), and one asynchronous copy of each into the shard's host
    tensors (`_HostCopier`), so copying batch b overlaps the forward of batch b + 1.
    """
    lengths = [len(s["input_ids"]) for s in members]
    k, hidden = len(extractor.hf_indices), extractor.hidden_size
    aux_out = torch.empty((sum(lengths), k * hidden), dtype=dtype)  # [N_tok, k*H]
    last_out = torch.empty((sum(lengths), hidden), dtype=dtype)  # [N_tok, H]
    copier, offset = _HostCopier(extractor.device), 0
    for b in range(0, len(members), batch_size):
        rows = [s["input_ids"] for s in members[b : b + batch_size]]
        ids, mask = _right_pad(rows)
        aux, last = extractor(ids, mask)  # [B, T, k*H], [B, T, H]
        keep = _real_token_rows([len(r) for r in rows], ids.shape[1])
        keep = (keep.pin_memory() if copier.cuda else keep).to(aux.device, non_blocking=True)
        packed = [aux.flatten(0, 1).index_select(0, keep).to(dtype), last.flatten(0, 1).index_select(0, keep).to(dtype)]
        n = keep.shape[0]
        copier.copy(packed, [aux_out[offset : offset + n], last_out[offset : offset + n]])
        offset += n
    copier.finish()
    return {
        "input_ids": torch.tensor([t for s in members for t in s["input_ids"]], dtype=torch.long),
        "loss_mask": torch.tensor([t for s in members for t in s["loss_mask"]], dtype=torch.uint8),
        "lengths": torch.tensor(lengths, dtype=torch.long),
        "sample_ids": torch.tensor([s["id"] for s in members], dtype=torch.long),
        "aux_hidden_states": aux_out,
        "last_hidden_states": last_out,
    }


_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64",
                       torch.uint8: "U8"}
_WRITE_BLOCK = 64 << 20
_SHARD_WRITERS = 2


def _safetensors_blocks(tensors: dict[str, torch.Tensor]) -> Iterator[memoryview | bytes]:
    """A safetensors file as byte blocks: 8-byte header length, JSON header, then each tensor's
    bytes back to back in dict order (little-endian, as safetensors stores them)."""
    meta, offset = {}, 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        meta[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                      "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(meta, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # data starts 8-byte aligned, as safetensors pads it
    yield struct.pack("<Q", len(header)) + header
    for tensor in tensors.values():
        raw = memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
        for start in range(0, len(raw), _WRITE_BLOCK):
            yield raw[start : start + _WRITE_BLOCK]


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def _write_shard(tensors: dict, path: Path) -> tuple[str, int]:
    """Save to a hidden temp name, then rename: a kill never leaves a partial shard visible."""
    digest, size = _write_hidden_shard(tensors, path)
    os.replace(_temp_name(path), path)
    return digest, size


def _write_hidden_shard(tensors: dict, path: Path) -> tuple[str, int]:
    """Write the shard to its hidden temp name (`_temp_name`); returns (sha256, bytes).

    The sha256 is of the bytes as they are written (no second read of the file). Block i is
    hashed on a second thread while it is written, so a shard costs max(hash, write) time, not
    their sum (sha256 ~0.5 s/GB: alone it is about as slow as an 8B target's forward makes
    states). Both release the GIL, so this also runs beside the next shard's capture.
    """
    digest, size = hashlib.sha256(), 0
    with _temp_name(path).open("wb") as fh, ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-hash") as hasher:
        hashed = None
        for block in _safetensors_blocks(tensors):
            if hashed is not None:
                hashed.result()  # blocks must reach the digest in file order
            hashed = hasher.submit(digest.update, block)
            fh.write(block)
            size += len(block)
        hashed.result()
    return digest.hexdigest(), size


def _verified_shards(directory: Path, fingerprint: str) -> dict[str, dict]:
    """Shard entries of an earlier run with the same fingerprint whose files still match their sha256."""
    path = directory / MANIFEST
    if not path.is_file():
        return {}
    manifest = json.loads(path.read_text())
    if manifest.get("fingerprint") != fingerprint:
        return {}
    good = {}
    for entry in manifest.get("shards", []):
        shard = directory / entry["file"]
        if shard.is_file() and shard.stat().st_size == entry["bytes"] and file_sha256(shard) == entry["sha256"]:
            good[entry["file"]] = entry
    return good


def _clear_stale(directory: Path, keep: set[str]) -> None:
    """Remove shards and temp files not in `keep` (left by a different or killed run)."""
    for path in directory.glob("*.safetensors"):
        if path.name not in keep:
            path.unlink()
    for path in directory.glob(".*.tmp"):
        path.unlink()


def dump_hidden_states(
    extractor: TargetFeatureExtractor, samples: list[dict], directory: Path, data_cfg: DataConfig,
    fingerprint: str, progress: ProgressFn, log: LogFn,
) -> dict:
    """Write (or resume) the offline shards + manifest.json; returns a small summary.

    Shards already written by a run with the same fingerprint and intact sha256 are kept;
    free space is checked for the remaining ones before anything is computed.
    """
    directory.mkdir(parents=True, exist_ok=True)
    dtype = _DTYPES[data_cfg.hidden_states_dtype]
    plan = plan_shards(samples, data_cfg.shard_size)
    done = _verified_shards(directory, fingerprint)
    _clear_stale(directory, set(done))
    todo = [(name, members) for name, members in plan if name not in done]
    todo_tokens = sum(len(s["input_ids"]) for _, members in todo for s in members)
    k, hidden = len(extractor.hf_indices), extractor.hidden_size
    need = _dump_bytes(todo_tokens, sum(len(m) for _, m in todo), hidden, k, dtype.itemsize)
    check_disk_space(directory, need, log)
    manifest = _manifest_header(extractor, data_cfg, fingerprint, samples)
    entries = dict(done)
    counts = {"written": 0, "finished": sum(len(m) for name, m in plan if name in done)}
    progress("hidden_states", counts["finished"], len(samples))

    def on_written(name: str, members: list[dict], digest: str, size: int) -> None:
        entries[name] = _shard_entry(name, members, digest, size)
        counts["written"] += size
        counts["finished"] += len(members)
        _write_manifest(directory, manifest, [entries[n] for n, _ in plan if n in entries], complete=False)
        progress("hidden_states", counts["finished"], len(samples))

    _capture_and_write(extractor, todo, directory, data_cfg.capture_batch_size, dtype, on_written)
    _write_manifest(directory, manifest, [entries[n] for n, _ in plan], complete=True)
    total = sum(e["bytes"] for e in entries.values())
    return {"estimate_bytes": need, "bytes_written": counts["written"], "bytes_total": total,
            "shards": len(plan), "shards_reused": len(done)}


def _capture_and_write(
    extractor: TargetFeatureExtractor, todo: list[tuple[str, list[dict]]], directory: Path, batch_size: int,
    dtype: torch.dtype, on_written: Callable[[str, list[dict], str, int], None],
) -> None:
    """Capture every shard of `todo` and write it on writer threads; `on_written(name, members,
    sha256, bytes)` runs in plan order once a shard's file is renamed into place.

    Writer threads write and hash shards n and n + 1 while shard n + 2 is captured (at most
    _SHARD_WRITERS + 1 shards in RAM): one sha256 stream (~1-2 GB/s) is about what an 8B
    target's forward produces, two keep up with margin. Files stay hidden until renamed here in
    plan order, right before `on_written` lists them: the visible shards are always those the
    manifest lists (plus, for an instant, the one being added).
    """
    pending: collections.deque = collections.deque()

    def finish_oldest() -> None:
        name, members, write = pending.popleft()
        digest, size = write.result()
        os.replace(_temp_name(directory / name), directory / name)
        on_written(name, members, digest, size)

    with ThreadPoolExecutor(max_workers=_SHARD_WRITERS, thread_name_prefix="shard-writer") as writer:
        for name, members in todo:
            tensors = capture_shard(extractor, members, batch_size, dtype)
            if len(pending) == _SHARD_WRITERS:
                finish_oldest()
            pending.append((name, members, writer.submit(_write_hidden_shard, tensors, directory / name)))
            del tensors  # the writer holds the only reference: freed once written
        while pending:
            finish_oldest()


def _shard_entry(name: str, members: list[dict], digest: str, size: int) -> dict:
    return {
        "file": name,
        "split": name.split("-")[0],
        "num_samples": len(members),
        "num_tokens": sum(len(s["input_ids"]) for s in members),
        "sha256": digest,
        "bytes": size,
    }


def _manifest_header(
    extractor: TargetFeatureExtractor, data_cfg: DataConfig, fingerprint: str, samples: list[dict]
) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "architecture": extractor.architecture,
        "num_hidden_layers": extractor.num_hidden_layers,
        "hidden_size": extractor.hidden_size,
        "aux_layer_ids": extractor.aux_layer_ids,
        "hf_indices": extractor.hf_indices,
        "num_aux": len(extractor.hf_indices),
        "dtype": data_cfg.hidden_states_dtype,
        "max_length": data_cfg.max_length,
        "num_samples": {sp: sum(s["split"] == sp for s in samples) for sp in ("train", "validation")},
        "num_tokens": {
            sp: sum(len(s["input_ids"]) for s in samples if s["split"] == sp) for sp in ("train", "validation")
        },
    }


def _write_manifest(directory: Path, header: dict, shards: list[dict], complete: bool) -> None:
    _atomic_write_text(directory / MANIFEST, json.dumps({**header, "complete": complete, "shards": shards}, indent=2))


# --------------------------------------------------------------------------- datasets


def _manifest_dir(offline_dir: Path) -> Path:
    """Accept the hidden_states dir itself or the dataset dir that contains it."""
    offline_dir = Path(offline_dir)
    if (offline_dir / MANIFEST).is_file():
        return offline_dir
    if (offline_dir / "hidden_states" / MANIFEST).is_file():
        return offline_dir / "hidden_states"
    raise FileNotFoundError(f"no {MANIFEST} in {offline_dir} or {offline_dir / 'hidden_states'}")


class HiddenStateDataset(Dataset):
    """Offline samples: dicts of `input_ids` [T] int64, `loss_mask` [T] int64 (1 = assistant),
    `aux_hidden_states` [T, k*H_t] and `last_hidden_states` [T, H_t] (dtype as stored).

    Reads lazily from the shards (safetensors slices), reopening files after a fork so it
    works with DataLoader workers. The manifest (`self.manifest`) must be complete.
    """

    def __init__(self, offline_dir: Path | str, split: str = "train") -> None:
        if split not in ("train", "validation"):
            raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
        self.directory = _manifest_dir(Path(offline_dir))
        self.manifest = json.loads((self.directory / MANIFEST).read_text())
        if not self.manifest.get("complete"):
            raise ValueError(f"{self.directory / MANIFEST} is incomplete; rerun generate_dataset to resume the dump")
        self.split = split
        self.index: list[tuple[str, int, int]] = []  # (shard file, token offset, length)
        for entry in self.manifest["shards"]:
            if entry["split"] == split:
                with safe_open(str(self.directory / entry["file"]), framework="pt") as fh:
                    lengths = fh.get_tensor("lengths").tolist()
                offsets = [0, *itertools.accumulate(lengths)][:-1]
                self.index.extend((entry["file"], o, n) for o, n in zip(offsets, lengths, strict=True))
        self._handles: dict[str, object] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.index)

    def _handle(self, name: str):
        if self._pid != os.getpid():
            self._handles, self._pid = {}, os.getpid()
        if name not in self._handles:
            self._handles[name] = safe_open(str(self.directory / name), framework="pt")
        return self._handles[name]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        name, start, length = self.index[i]
        fh = self._handle(name)

        def rows(key: str) -> torch.Tensor:
            return fh.get_slice(key)[start : start + length]

        return {
            "input_ids": rows("input_ids").long(),
            "loss_mask": rows("loss_mask").long(),
            "aux_hidden_states": rows("aux_hidden_states"),
            "last_hidden_states": rows("last_hidden_states"),
        }


class TokenizedDataset(Dataset):
    """Online-mode samples: dicts of `input_ids` [T] int64 and `loss_mask` [T] int64."""

    def __init__(self, samples_path: Path | str, split: str = "train") -> None:
        path = Path(samples_path)
        path = path / SAMPLES_FILE if path.is_dir() else path
        self.samples = [
            (torch.tensor(s["input_ids"], dtype=torch.long), torch.tensor(s["loss_mask"], dtype=torch.long))
            for s in read_samples(path, split)
        ]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        input_ids, loss_mask = self.samples[i]
        return {"input_ids": input_ids, "loss_mask": loss_mask}


def collate_hidden_states(items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad every key to the batch's longest sample and add `attention_mask` [B, T] (1 = real).

    Pads are 0 (ids, mask, states). Works for both datasets: hidden keys are padded when present.
    """
    width = max(len(it["input_ids"]) for it in items)
    batch = {}
    for key in items[0]:
        first = items[0][key]
        out = torch.zeros((len(items), width, *first.shape[1:]), dtype=first.dtype)
        for i, it in enumerate(items):
            out[i, : len(it[key])] = it[key]
        batch[key] = out
    batch["attention_mask"] = torch.zeros((len(items), width), dtype=torch.long)
    for i, it in enumerate(items):
        batch["attention_mask"][i, : len(it["input_ids"])] = 1
    return batch


# --------------------------------------------------------------------------- target head


def _safetensors_index(target_dir: Path) -> dict[str, Path]:
    """Tensor name -> file, from model.safetensors.index.json or the single model.safetensors."""
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: target_dir / file for name, file in weight_map.items()}
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {target_dir}")
    names = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            names.update({k: f for k in fh.keys()})
    return names


def _pick(names: dict[str, Path], suffix: str) -> str | None:
    """The shortest tensor name ending in suffix (the text model's, not a vision tower's)."""
    matches = sorted((n for n in names if n.endswith(suffix)), key=len)
    return matches[0] if matches else None


def load_target_head(target_dir: Path | str) -> dict:
    """`{"lm_head": [V, H], "embed_tokens": [V, H], "config": dict}` straight from safetensors.

    Teacher logits = last_hidden_states @ lm_head.T (plus any config-declared softcapping).
    With tied embeddings and no stored lm_head, lm_head is the embedding matrix.
    """
    target_dir = Path(target_dir)
    config = json.loads((target_dir / "config.json").read_text())
    names = _safetensors_index(target_dir)
    embed_name, head_name = _pick(names, "embed_tokens.weight"), _pick(names, "lm_head.weight")
    if embed_name is None:
        raise ValueError(f"{target_dir}: no '*embed_tokens.weight' tensor in the safetensors files")
    tied = config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings", False))
    if head_name is None and not tied:
        raise ValueError(f"{target_dir}: no 'lm_head.weight' and tie_word_embeddings is false")

    def read(name: str) -> torch.Tensor:
        with safe_open(str(names[name]), framework="pt") as fh:
            return fh.get_tensor(name)

    embed = read(embed_name)
    return {"lm_head": read(head_name) if head_name else embed, "embed_tokens": embed, "config": config}


# --------------------------------------------------------------------------- stage entry


def _target_identity(target_dir: Path) -> str:
    """Hash of the target's config and weight files (names and sizes) plus its tokenizer files."""
    h = hashlib.sha256((target_dir / "config.json").read_bytes())
    for path in sorted(target_dir.glob("*.safetensors")) + sorted(target_dir.glob("tokenizer*.json")):
        h.update(f"{path.name}:{path.stat().st_size}".encode())
    return h.hexdigest()


def _prompts_identity(data_cfg: DataConfig) -> str:
    if data_cfg.prompts == "builtin":
        return "builtin:" + hashlib.sha256("\n".join(f.relpath for f in heldout_corpus()).encode()).hexdigest()
    return "file:" + file_sha256(Path(data_cfg.prompts))


def samples_fingerprint(target_dir: Path, data_cfg: DataConfig) -> str:
    """What decides samples.jsonl: target, prompts, sizes, split, regeneration settings."""
    rcfg = regeneration_settings(data_cfg.regenerate)
    # Where the target is served does not decide its answers (its identity is in "target").
    for unrelated in ("concurrency", "retries", "timeout_s", "batch_size", "backoff_s", "api_key_set", "endpoints",
                      "deploy", "max_failed_fraction"):
        rcfg.pop(unrelated)
    payload = {
        "format": SAMPLES_FORMAT,
        "target": _target_identity(target_dir),
        "prompts": _prompts_identity(data_cfg),
        "data": data_cfg.model_dump(include={"num_samples", "max_length", "validation_fraction", "seed"}),
        "regenerate": rcfg,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _generation_eos(target_dir: Path) -> int | list[int] | None:
    path = target_dir / "generation_config.json"
    return json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None


def _final_conversations(
    conversations: list[list[Message]], data_cfg: DataConfig, load_model: Callable, tokenizer,
    stop_ids: list[int], out_dir: Path, fingerprint: str, progress: ProgressFn, log: LogFn,
    open_endpoints: OpenEndpoints | None = None,
) -> tuple[list[list[Message]], dict[int, list[int]], list[int]]:
    """Conversations with the target's answers (regeneration on) or as given (off), the target's
    generated token ids per returned conversation where the backend returns them (local, sglang),
    and the indices of the prompts that failed for good (left out of the conversations)."""
    rcfg = data_cfg.regenerate
    if not rcfg.enabled:
        for n, c in enumerate(conversations):
            if c[-1]["role"] != "assistant":
                raise ValueError(f"data.regenerate.enabled is false but conversation {n} has no final assistant answer")
        return conversations, {}, []
    prompts = [prompt_part(c, f"conversation {n}") for n, c in enumerate(conversations)]
    record = RegenerationLog(out_dir / f".regenerated-{fingerprint[:16]}.jsonl")
    if record.done:
        log(f"regenerate: resuming, {len(record.done)}/{len(prompts)} answers already done")
    failures = FailureLog(None)
    try:
        if rcfg.backend == "local":
            model = load_model()
            regenerate_local(
                model, tokenizer, prompts, rcfg, data_cfg.max_length, stop_ids, record, progress, data_cfg.seed
            )
        elif len(record.done) < len(prompts):
            failures = FailureLog(out_dir / FAILED_FILE)  # what failed in an earlier pass is asked again
            with _servers(rcfg, open_endpoints) as urls:
                log(f"regenerate: {len(prompts) - len(record.done)} prompts through {len(urls)} server(s), "
                    f"{rcfg.concurrency} in flight each")
                if rcfg.backend == "sglang":
                    regenerate_sglang(prompts, tokenizer, rcfg, data_cfg.max_length, stop_ids, record, progress, log,
                                      urls, failures)
                else:
                    regenerate_http(prompts, rcfg, record, progress, log, urls, failures)
    finally:
        record.close()
    answered = [i for i in range(len(prompts)) if i in record.done]
    final = [prompts[i] + [{"role": "assistant", "content": record.done[i]}] for i in answered]
    answer_ids = {n: record.token_ids[i] for n, i in enumerate(answered) if i in record.token_ids}
    return final, answer_ids, failures.indices


def _servers(rcfg: RegenerateConfig, open_endpoints: OpenEndpoints | None) -> contextlib.AbstractContextManager:
    """The named servers, or the ones `open_endpoints` starts (and stops on exit)."""
    if rcfg.server_urls:
        return contextlib.nullcontext(rcfg.server_urls)
    if open_endpoints is None:
        raise ValueError("data.regenerate.deploy: the servers are started by the data stage (tasks.data); "
                         "called directly, generate_dataset needs open_endpoints or data.regenerate.endpoints")
    return open_endpoints()


def _prepare_samples(
    target_dir: Path, data_cfg: DataConfig, tokenizer, stop_ids: list[int], load_model: Callable,
    out_dir: Path, progress: ProgressFn, log: LogFn, open_endpoints: OpenEndpoints | None = None,
) -> tuple[list[dict], dict]:
    """samples.jsonl from a previous identical run, or prompts -> answers -> tokens -> split."""
    fingerprint = samples_fingerprint(target_dir, data_cfg)
    meta_path, samples_path = out_dir / SAMPLES_META, out_dir / SAMPLES_FILE
    if meta_path.is_file() and samples_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("fingerprint") == fingerprint and meta.get("sha256") == file_sha256(samples_path):
            log(f"data: reusing {samples_path} (same target, prompts and settings)")
            return read_samples(samples_path), meta
    progress("prompts", 0, 1)
    conversations = load_conversations(data_cfg, log)
    progress("prompts", 1, 1)
    final, answer_ids, failed = _final_conversations(
        conversations, data_cfg, load_model, tokenizer, stop_ids, out_dir, fingerprint, progress, log, open_endpoints
    )
    if failed:
        log(f"regenerate: {len(failed)} prompt(s) failed after their retries and are left out: {out_dir / FAILED_FILE}")
    samples, dropped = build_samples(tokenizer, final, data_cfg, stop_ids, progress, answer_ids)
    if not any(s["split"] == "train" for s in samples):
        raise ValueError(f"no usable training sample: all {len(final)} conversations had no assistant token "
                         f"within data.max_length={data_cfg.max_length}")
    meta = {"fingerprint": fingerprint, "sha256": write_samples(samples, samples_path), "dropped": dropped,
            "num_conversations": len(final), "failed": failed}
    _atomic_write_text(meta_path, json.dumps(meta, indent=2))
    (out_dir / f".regenerated-{fingerprint[:16]}.jsonl").unlink(missing_ok=True)
    return samples, meta


def _dump_fingerprint(samples_sha: str, aux_ids: list[int], target_dir: Path, data_cfg: DataConfig) -> str:
    """What decides the shards' content: samples, layers, target, dtype, shard size."""
    payload = [samples_sha, aux_ids, _target_identity(target_dir), data_cfg.hidden_states_dtype, data_cfg.shard_size]
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()


def _token_stats(samples: list[dict]) -> dict:
    tokens = {sp: sum(len(s["input_ids"]) for s in samples if s["split"] == sp) for sp in ("train", "validation")}
    assistant = sum(sum(s["loss_mask"]) for s in samples)
    total = sum(tokens.values())
    return {
        "num_samples": {sp: sum(s["split"] == sp for s in samples) for sp in ("train", "validation")},
        "num_tokens": tokens,
        "num_assistant_tokens": assistant,
        "loss_mask_fraction": assistant / total if total else 0.0,
    }


def _target_facts(target_dir: Path, target_cfg: TargetConfig, data_cfg: DataConfig) -> dict:
    """Architecture, sizes and resolved layer ids from config.json; rejects impossible settings."""
    config = json.loads((target_dir / "config.json").read_text())
    text = config.get("text_config", config)
    facts = {
        "architecture": config["architectures"][0],
        "num_hidden_layers": text["num_hidden_layers"],
        "hidden_size": text["hidden_size"],
        "vocab_size": text["vocab_size"],
    }
    context = text.get("max_position_embeddings", data_cfg.max_length)
    if data_cfg.max_length > context:
        raise ValueError(
            f"data.max_length={data_cfg.max_length} exceeds the target context (max_position_embeddings={context})"
        )
    if data_cfg.draft_vocab_size > facts["vocab_size"]:
        raise ValueError(
            f"data.draft_vocab_size={data_cfg.draft_vocab_size} exceeds the target vocab ({facts['vocab_size']})"
        )
    arch, layers = facts["architecture"], facts["num_hidden_layers"]
    facts["hf_indices"] = aux_ids_to_hf_indices(arch, target_cfg.aux_layer_ids, layers)
    facts["aux_layer_ids"] = target_cfg.aux_layer_ids or default_aux_layer_ids(arch, layers)
    return facts


def _log_disk_bound(facts: dict, data_cfg: DataConfig, log: LogFn) -> None:
    """Upper bound of the dump before any work (every sample at max_length); the exact need
    is known, and checked against free space, once the samples are tokenized."""
    k, width = len(facts["hf_indices"]), _DTYPES[data_cfg.hidden_states_dtype].itemsize
    bound = estimate_hidden_state_bytes(data_cfg.num_samples * data_cfg.max_length, facts["hidden_size"], k, width)
    log(
        f"hidden states: at most {bound / 1e9:.3f} GB = {data_cfg.num_samples} samples x {data_cfg.max_length} "
        f"tokens x ({k}+1) states x H={facts['hidden_size']} x {width} B"
    )


def _summary(samples, meta, facts, dump, data_cfg: DataConfig, tokenizer, vocab_info, out_dir: Path) -> dict:
    """The JSON-able result of generate_dataset (no secrets)."""
    dump = dump or {"bytes_total": 0, "bytes_written": 0, "estimate_bytes": 0, "shards_reused": 0}
    return {
        **_token_stats(samples),
        "num_dropped": meta["dropped"],
        "num_failed": len(meta.get("failed", [])),
        **{k: facts[k] for k in ("architecture", "hidden_size", "aux_layer_ids", "hf_indices")},
        "hidden_states": data_cfg.hidden_states,
        "hidden_states_dtype": data_cfg.hidden_states_dtype,
        "hidden_states_bytes": dump["bytes_total"],
        "bytes_written": dump["bytes_written"],
        "hidden_states_estimate_bytes": dump["estimate_bytes"],
        "shards_reused": dump["shards_reused"],
        "chat_template_sha256": chat_template_sha256(tokenizer),
        "regeneration": regeneration_settings(data_cfg.regenerate),
        "vocab": vocab_info,
        "paths": {
            "samples": str(out_dir / SAMPLES_FILE),
            "vocab": str(out_dir / "vocab"),
            "hidden_states": str(out_dir / "hidden_states") if data_cfg.hidden_states == "offline" else None,
            "failed": str(out_dir / FAILED_FILE) if meta.get("failed") else None,
        },
    }


def generate_dataset(
    target_dir: Path,
    target_cfg: TargetConfig,
    data_cfg: DataConfig,
    out_dir: Path,
    on_progress: ProgressFn | None = None,
    log: LogFn = print,
    open_endpoints: OpenEndpoints | None = None,
) -> dict:
    """Prompts -> regenerated answers -> samples.jsonl -> vocab/ -> hidden_states/ (offline).

    Args:
        target_dir: HF dir of the target (the tiny target's build dir, or target.model_path).
        target_cfg: aux layer ids and dtype of the target.
        data_cfg: prompts, regeneration, sizes, storage mode.
        out_dir: dataset directory (created; reruns resume or reuse what matches).
        on_progress: (stage, done, total) with stages prompts, regenerate, tokenize,
            vocab, hidden_states.
        log: one-line messages (never contains the API key).
        open_endpoints: starts the target's servers for data.regenerate.deploy (called only when
            prompts are left to answer) and stops them when its context exits.
    Returns:
        JSON-able summary: counts, tokens, layer ids, bytes, template hash, settings, paths.
    """
    started = time.perf_counter()
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    progress = on_progress or _noop_progress
    out_dir.mkdir(parents=True, exist_ok=True)
    facts = _target_facts(target_dir, target_cfg, data_cfg)
    if data_cfg.hidden_states == "offline":
        _log_disk_bound(facts, data_cfg, log)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    stop_ids = turn_stop_ids(tokenizer, _generation_eos(target_dir))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded: dict = {}

    def load_model():  # only when needed: http + online never loads the weights
        if "model" not in loaded:
            loaded["model"] = load_target(target_dir, target_cfg.dtype, device)[0]
        return loaded["model"]

    # CPU: as many threads as there are idle cores (oversubscribed OpenMP is 30x slower here).
    with cpu_threads() if device == "cpu" else contextlib.nullcontext():
        samples, meta = _prepare_samples(target_dir, data_cfg, tokenizer, stop_ids, load_model, out_dir, progress, log,
                                         open_endpoints)
        vocab_info, dump = _vocab_and_states(
            samples, meta, facts, load_model, target_dir, data_cfg, out_dir, progress, log
        )
    summary = _summary(samples, meta, facts, dump, data_cfg, tokenizer, vocab_info, out_dir)
    return summary | {"wall_s": time.perf_counter() - started}


def _vocab_and_states(samples, meta, facts, load_model, target_dir, data_cfg, out_dir, progress, log):
    """Draft vocab from the train split, then the offline dump (None when online)."""
    progress("vocab", 0, 1)
    train = [s for s in samples if s["split"] == "train"]
    _, vocab_info = build_or_load_draft_vocab(
        [s["input_ids"] for s in train], [s["loss_mask"] for s in train], data_cfg.draft_vocab_size,
        facts["vocab_size"], out_dir / "vocab",
    )
    progress("vocab", 1, 1)
    dump = None
    if data_cfg.hidden_states == "offline":
        extractor = TargetFeatureExtractor.from_model(load_model(), facts["aux_layer_ids"])
        fingerprint = _dump_fingerprint(meta["sha256"], facts["aux_layer_ids"], target_dir, data_cfg)
        dump = dump_hidden_states(extractor, samples, out_dir / "hidden_states", data_cfg, fingerprint, progress, log)
    return vocab_info, dump
