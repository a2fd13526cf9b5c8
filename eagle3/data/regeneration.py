"""Regeneration: the target answers every prompt anew, so the draft learns the target's own
distribution. Backends: in-process HF generate (`local`), SGLang's native /generate (`sglang`:
token ids in and out, so samples carry the target's own token stream) and an OpenAI chat
endpoint (`http`, text only), the last two through `eagle3.data.server_pool`.

Risk: a killed regeneration must resume without asking again what was answered and without
mixing answers of other settings: `RegenerationLog` is an append-only file named by the run's
fingerprint, whose cut last line is dropped on open.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from transformers import GenerationConfig

from eagle3.config import RegenerateConfig
from eagle3.data.chat import Message, render_chat
from eagle3.data.files import LogFn, ProgressFn
from eagle3.data.server_pool import (
    FailureLog,
    ServerPool,
    _answer_all,
    _generated_answer,
    _message_content,
    chat_completions_url,
    check_failures,
    generate_url,
)


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
    done, done_lock = len(prompts) - len(todo), threading.Lock()

    def answer(batch: list[int]) -> None:  # called from several streams at once: record.add holds its own lock
        nonlocal done
        rows = [prompt_ids[i] for i in batch]
        # the batch's longest prompt decides, so no answer runs past max_length (<= the context)
        max_new = min(rcfg.max_new_tokens, max_length - max(len(r) for r in rows))
        for i, (text, ids) in zip(batch, _generate_batch(model, tokenizer, rows, rcfg, max_new, stop_ids), strict=True):
            record.add(i, text, ids)
        with done_lock:
            done += len(batch)
            progress("regenerate", done, len(prompts))

    batches = [todo[b : b + rcfg.batch_size] for b in range(0, len(todo), rcfg.batch_size)]
    with _one_thread_on_cpu(model) as streams:
        # sampled answers take the process's one RNG in turn: only greedy ones stay the same over parallel streams
        _answer_batches(answer, batches, streams if rcfg.temperature == 0 else 1)


@contextlib.contextmanager
def _one_thread_on_cpu(model):
    """HF generate's decode steps are small ops, where a second OpenMP thread costs more than it brings: on the
    2-vCPU machines the demo runs on, 2 threads decoded 3-5x slower than 1 with the machine idle (issue 38).
    Yields how many decode streams may run side by side: on CPU the threads the caller chose, one each (each
    stream's ops run on its own Python thread, which torch leaves while it computes); elsewhere 1."""
    if next(model.parameters()).device.type != "cpu":
        yield 1
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield previous
    finally:
        torch.set_num_threads(previous)


def _answer_batches(answer: Callable[[list[int]], None], batches: list[list[int]], streams: int) -> None:
    """Each batch answered once, `streams` at a time. A batch's answer does not depend on which stream ran it or
    when (greedy, one thread per stream), so 2 streams on 2 idle cores give the 1-stream result ~1.6x sooner
    (issue 38: 1024 prompts x 128 tokens 14.3 -> 8.7 s, the same ids). On an error or Ctrl-C the batches not
    started are dropped and the running ones finish (they are recorded: a resume skips them)."""
    if streams <= 1 or len(batches) <= 1:
        for batch in batches:
            answer(batch)
        return
    pool = ThreadPoolExecutor(max_workers=streams, thread_name_prefix="regenerate")
    try:
        # each in a copy of the caller's context: a progress callback may log through it (a Prefect task's logger)
        for future in [pool.submit(contextvars.copy_context().run, answer, batch) for batch in batches]:
            future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


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
