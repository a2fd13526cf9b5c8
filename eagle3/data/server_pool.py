"""Requests to the target's regeneration servers: a pool of servers with `concurrency` slots each,
retries with exponential backoff that move to another server, the response parsers of SGLang's
/generate and the OpenAI chat endpoint, and `failed.jsonl`, which lists the prompts that still
failed (never dropped silently).

Risk: a dead server must not stall or silently shrink the dataset. A server that refuses or
drops a connection is avoided until it answers again; every failure costs its request an
attempt, so retries stay bounded; what fails for good is recorded and counted against
data.regenerate.max_failed_fraction.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import httpx

from eagle3.config import RegenerateConfig
from eagle3.data.files import LogFn, ProgressFn


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
