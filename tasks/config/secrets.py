"""One masking function for every secret the pipeline handles, applied wherever text leaves it.

Secrets are the `SecretStr` fields of the config (API keys, key passphrases, every `deploy.env`
value) and the credentials written inside any URL (`https://user:pass@host/...`). `redact`
replaces both in a string, in their plain form and in every escaped form a serialiser gives
them (JSON with `\\uXXXX` escapes or raw UTF-8, Python repr, URL encoding), so text serialised
before it was redacted is still clean; structured data is redacted before it is serialised
(`redact_obj`). Everything that writes text somewhere a person or a server can read it calls it:
the log-record factory (stdout, Prefect logs, the Prefect API), the run folder's JSON
(`tasks.rundir.write_json_atomic`), MLflow params, tags and artifacts (`tasks.tracking.RunLogger`),
and the CLI's error lines. Risk: a secret that reaches a sink through a path that skips this
module; the leak-scan test runs the whole flow with every secret set and greps every sink.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import threading
from typing import Any
from urllib.parse import quote, quote_plus, unquote

MASK = "**********"
# scheme://userinfo@ -- userinfo is everything up to the first '@' that has no '/', space or quote.
_URL_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<userinfo>[^/@\s\"'<>]+)@")
# Values shorter than this are not masked on their own: masking "a" would shred every text.
_MIN_SECRET_LENGTH = 4
# Environment variable names that say their value is a credential.
SECRET_NAME = re.compile(r"KEY|TOKEN|PASSWORD|PASSWD|SECRET|PASSPHRASE|CREDENTIAL|AUTH", re.IGNORECASE)
# A value of an environment variable whose name does not look secret is masked in free text only from
# this length: no issued credential is shorter, and masking `INFO`, `true` or `0,1,2,3` (NCCL_DEBUG,
# CUDA_VISIBLE_DEVICES) in every log line would shred the logs. Structured records mask it at any length.
_MIN_UNNAMED_SECRET_LENGTH = 8

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


def is_secret_name(name: str) -> bool:
    """Whether an environment variable's name says it holds a credential (`HF_TOKEN`, `DB_PASSWORD`)."""
    return bool(SECRET_NAME.search(name))


def maskable_env_value(name: str, value: str) -> bool:
    """Whether an environment value is masked in free text too (see _MIN_UNNAMED_SECRET_LENGTH)."""
    return is_secret_name(name) or len(value) >= _MIN_UNNAMED_SECRET_LENGTH


def escaped_forms(value: str) -> set[str]:
    """`value` as it reads after each serialiser that may carry it out: itself, JSON string bodies
    (ASCII-escaped and raw UTF-8), a Python repr body, a shell-quoted body (a logged command line),
    URL encodings, and URL-decoded."""
    forms = {value, json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1], repr(value)[1:-1],
             quote(value, safe=""), quote(value), quote_plus(value)}
    shell = shlex.quote(value)
    if shell != value:  # quoted as '...' (a ' inside becomes '"'"')
        forms.add(shell[1:-1])
    if "%" in value:  # a URL credential found in its encoded form also travels decoded (e.g. in an auth header)
        forms.add(unquote(value))
    return forms


def register_secrets(values: list[str] | set[str]) -> None:
    """Add plain secret values (and their escaped forms) to mask from now on, in this process (idempotent)."""
    global _pattern
    forms = {form for v in values if v and len(v) >= _MIN_SECRET_LENGTH for form in escaped_forms(v)}
    fresh = {f for f in forms if len(f) >= _MIN_SECRET_LENGTH} - _registered
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
