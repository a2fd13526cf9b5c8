"""Whether the tracking server answers: the probe at a run's start, what counts as an outage (no answer,
never a 4xx), and the per-process record of URIs gone offline, said once in one warning line."""
from __future__ import annotations

import contextlib
import logging
import re
import threading
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

import requests
from mlflow.tracking import MlflowClient

from tasks.config.secrets import redact
from tasks.log import logger

PROBE_TIMEOUT_S = 3.0


# Tracking URIs that stopped answering in this process, with why; a probe at the next run start clears them.
_offline: dict[str, str] = {}


_offline_lock = threading.Lock()


class TrackingUnavailable(RuntimeError):
    """The tracking server did not answer (connection refused/reset, timeout, repeated 5xx)."""


def is_outage(err: BaseException) -> bool:
    """True when the server did not answer, anywhere in the exception chain; False for its 4xx answers.

    MLflow re-raises transport errors as a plain MlflowException whose context holds the
    requests error, so the chain is walked rather than the outer type checked.
    """
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (requests.ConnectionError, requests.Timeout, requests.exceptions.RetryError,
                                ConnectionError, TimeoutError)):
            return True
        current = current.__cause__ or current.__context__
    return False


def short_reason(err: BaseException) -> str:
    """`Connection refused` rather than three lines of urllib3 pool text."""
    text = str(err)
    errno = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text)
    if errno:
        return errno.group(1).strip()
    if "timed out" in text.lower() or "timeout" in type(err).__name__.lower():
        return "no answer before the timeout"
    if "RemoteDisconnected" in text or "Connection aborted" in text:
        return "connection closed without an answer"
    return f"{type(err).__name__}: {redact(text)[:200]}"


def probe_tracking_server(uri: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why `GET <uri>/health` gets no answer (refused, timeout, 5xx), or None: it answers, or the store is local.

    One request, no retries: the point is to learn in seconds. Any 2xx-4xx answer counts as
    reachable (a proxy may not route /health; MLflow's own calls will tell).
    """
    if not uri.startswith(("http://", "https://")):
        return None
    try:
        response = requests.get(f"{uri.rstrip('/')}/health", timeout=timeout_s, allow_redirects=False)
    except requests.RequestException as err:
        return short_reason(err)
    if response.status_code >= 500:
        return f"GET /health answered HTTP {response.status_code}"
    return None


def offline_message(uri: str, reason: str, journal: Path) -> str:
    """The one warning line of an outage: which URI, why, where the calls go, how to get them uploaded."""
    port = urlsplit(uri).port or (443 if uri.startswith("https") else 80)
    return (
        f"MLflow tracking server {redact(uri)} is not usable ({reason}); the run goes on and records its MLflow "
        f"calls in {journal}. Start a server (e.g. mlflow server --backend-store-uri sqlite:///mlflow.db "
        f"--host 127.0.0.1 --port {port}) and upload them with: eagleops sync {journal.parent} "
        f"-- or set tracking.uri: null to track in the local store"
    )


def is_offline(uri: str) -> bool:
    return uri in _offline


def go_offline(uri: str, reason: str, journal: Path) -> None:
    with _offline_lock:
        if uri in _offline:
            return
        _offline[uri] = reason
    logger().warning(offline_message(uri, reason, journal))


def check_tracking_server(uri: str, journal: Path | None) -> bool:
    """Probe at the start of a run: online again if it answers, else offline (one warning line)."""
    reason = probe_tracking_server(uri)
    with _offline_lock:
        _offline.pop(uri, None)
    if reason is not None and journal is not None:
        go_offline(uri, reason, journal)
    return reason is None


def call_online(uri: str, journal: Path | None, call: Callable[[MlflowClient], Any]) -> bool:
    """Make one MLflow call; False when the server did not answer and a journal can take it instead."""
    try:
        call(MlflowClient(uri))
    except Exception as err:
        if journal is None or not is_outage(err):
            raise
        go_offline(uri, short_reason(err), journal)
        return False
    return True


@contextlib.contextmanager
def store_errors_reported_by_caller() -> Iterator[None]:
    """For writes whose failure the caller reports in one line (a stage's failure path, where the disk
    holding a local SQLite store may be full): MLflow's SQL store would first log each failed write at
    ERROR with a full traceback (mlflow.store.db.utils), then raise it anyway."""
    store_logger = logging.getLogger("mlflow.store.db.utils")
    was_disabled, store_logger.disabled = store_logger.disabled, True
    try:
        yield
    finally:
        store_logger.disabled = was_disabled


def short_error(err: BaseException) -> str:
    """The first line of an error, secrets masked: SQLAlchemy appends the statement and its parameters."""
    return redact(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
