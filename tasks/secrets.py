"""One masking function for every secret the pipeline handles, applied wherever text leaves it.

Secrets are the `SecretStr` fields of the config (API keys, key passphrases) and the
credentials written inside any URL (`https://user:pass@host/...`). `redact` replaces both in
a string; everything that writes text somewhere a person or a server can read it calls it:
the log-record factory (stdout, Prefect logs, the Prefect API), the run folder's JSON
(`tasks.rundir.write_json_atomic`), MLflow params, tags and artifacts (`tasks.tracking.RunLogger`),
and the CLI's error lines. Risk: a secret that reaches a sink through a path that skips this
module; the leak-scan test runs the whole flow with every secret set and greps every sink.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

MASK = "**********"
# scheme://userinfo@ -- userinfo is everything up to the first '@' that has no '/', space or quote.
_URL_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<userinfo>[^/@\s\"'<>]+)@")
# Values shorter than this are not masked on their own: masking "a" would shred every text.
_MIN_SECRET_LENGTH = 4

_lock = threading.Lock()
_registered: set[str] = set()
_pattern: re.Pattern | None = None


def url_credentials(text: str) -> list[str]:
    """The userinfo parts (`user:pass`, `pass`, a bare token) of every URL in `text`."""
    found = []
    for match in _URL_USERINFO.finditer(text):
        userinfo = match.group("userinfo")
        found.append(userinfo)
        if ":" in userinfo:
            found.append(userinfo.split(":", 1)[1])
    return found


def mask_url_credentials(text: str) -> str:
    """`https://user:pass@host/x` -> `https://**********@host/x`; text without URLs is unchanged."""
    return _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}{MASK}@", text)


def register_secrets(values: list[str] | set[str]) -> None:
    """Add plain secret values to mask from now on, in this process (idempotent)."""
    global _pattern
    fresh = {v for v in values if v and len(v) >= _MIN_SECRET_LENGTH} - _registered
    if not fresh:
        return
    with _lock:
        _registered.update(fresh)
        ordered = sorted(_registered, key=len, reverse=True)  # longest first: no partial leftovers
        _pattern = re.compile("|".join(re.escape(v) for v in ordered))


def redact(text: str) -> str:
    """`text` with every registered secret and every URL credential replaced by the mask."""
    if not isinstance(text, str) or not text:
        return text
    pattern = _pattern
    if pattern is not None:
        text = pattern.sub(MASK, text)
    return mask_url_credentials(text)


def redact_obj(value: Any) -> Any:
    """`redact` applied to every string (keys included) of a JSON-like structure."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {redact_obj(k): redact_obj(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_obj(v) for v in value]
    return value


def _redacting_factory(previous):
    def factory(*args, **kwargs) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # a bad format string: leave it to the handler to report
            return record
        masked = redact(message)
        if masked != message or record.args:
            record.msg, record.args = masked, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        return record

    factory.eagleops_redacting = True  # type: ignore[attr-defined]
    return factory


def install_log_redaction() -> None:
    """Mask secrets in every log record created from now on, whichever logger or handler."""
    current = logging.getLogRecordFactory()
    if not getattr(current, "eagleops_redacting", False):
        logging.setLogRecordFactory(_redacting_factory(current))
