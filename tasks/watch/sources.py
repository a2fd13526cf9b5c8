"""Where the watch reads a server's figures: a Prometheus server (PromQL over the `sglang:*` series) or the
server's own `/metrics` and `/server_info`.

Owns the outside world of the watch and turns every way it can fail into one `SourceError` whose message
is one line: `Unreachable` (nothing answered: refused, timed out, DNS) or `BadAnswer` (an answer the watch
cannot use: an HTTP error status, a page that is not Prometheus text, a query with no series). The
callers decide what each means (tasks/watch/tick.py); nothing here raises anything else for I/O.

Through Prometheus, the last `count` windows are one range query per figure (`step` = the window, so the
windows are back to back and end now): accept length = increase(generation tokens) / increase(verify
calls), as SGLang's own accept length is tokens per verify forward. The endpoint's series are picked by
Prometheus' `instance` label, which a static scrape config sets to the endpoint's host:port.
"""

from __future__ import annotations

import math
import time
from urllib.parse import urlsplit

import httpx

from eagle3.serving.sglang_client import SGLangClient, SGLangError, metric_total, parse_prometheus_text
from tasks.config.secrets import redact
from tasks.watch.rules import (
    ACCEPT_RATE,
    COUNTERS,
    GAUGES,
    GENERATION_TOKENS,
    NUM_DRAFT_TOKENS,
    NUM_STEPS,
    REQUESTS,
    VERIFY_CALLS,
    Reading,
    Window,
)


class SourceError(Exception):
    """A source gave nothing usable; str() is the one line to show."""


class Unreachable(SourceError):
    """Nothing answered."""


class BadAnswer(SourceError):
    """Something answered, but not with what the watch can use."""


def instance_of(endpoint: str) -> str:
    """Prometheus' `instance` label of a server scraped at `endpoint` (host:port, the scheme's port when none)."""
    parts = urlsplit(endpoint)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


def _transport_line(what: str, err: Exception) -> str:
    reason = type(err).__name__ if not str(err) else f"{type(err).__name__}: {err}"
    return redact(f"{what} does not answer ({reason[:200]})")


# ------------------------------------------------------------------ the server itself


def read_server_info(endpoint: str, timeout_s: float) -> dict:
    """GET /server_info; Unreachable or BadAnswer."""
    with SGLangClient(endpoint, timeout=timeout_s) as client:
        try:
            info = client.server_info()
        except httpx.TransportError as err:
            raise Unreachable(_transport_line(f"{endpoint}/server_info", err)) from None
        except (SGLangError, ValueError) as err:  # an error status, or a body that is not JSON
            raise BadAnswer(redact(f"{endpoint}/server_info: {str(err)[:300]}")) from None
    if not isinstance(info, dict):
        raise BadAnswer(redact(f"{endpoint}/server_info: expected a JSON object, found {type(info).__name__}"))
    return info


def scrape_reading(endpoint: str, timeout_s: float) -> Reading:
    """GET /metrics into a Reading (each series summed over its label sets: ranks, streaming or not)."""
    with SGLangClient(endpoint, timeout=timeout_s) as client:
        try:
            series = client.metrics()
        except httpx.TransportError as err:
            raise Unreachable(_transport_line(f"{endpoint}/metrics", err)) from None
        except SGLangError as err:  # an error status
            raise BadAnswer(redact(f"{endpoint}/metrics: {str(err)[:300]}")) from None
        except ValueError as err:
            raise BadAnswer(redact(f"{endpoint}/metrics is not Prometheus text ({str(err)[:200]})")) from None
    if series is None:
        raise BadAnswer(f"{redact(endpoint)}/metrics: 404 (the server runs without --enable-metrics)")
    if not series:  # SGLang makes its request counters at the first finished request, its gauges at start
        raise BadAnswer(f"{redact(endpoint)}/metrics has no sglang:* series (not an SGLang server?)")
    counters = {name: metric_total(series, name) or 0.0 for name in COUNTERS}
    gauges = {name: _max(series, name) for name in GAUGES if series.get(name)}
    return Reading(at=time.time(), counters=counters, gauges=gauges)


def _max(series: dict, name: str) -> float:
    return max(sample.value for sample in series[name])


def parse_reading(text: str, at: float) -> Reading:
    """A Reading from Prometheus text already fetched (tests, tools); ValueError when it is not Prometheus text."""
    series = parse_prometheus_text(text)
    return Reading(at=at, counters={n: metric_total(series, n) or 0.0 for n in COUNTERS},
                   gauges={n: _max(series, n) for n in GAUGES if series.get(n)})


# ------------------------------------------------------------------ Prometheus


def _promql(endpoint: str, window_s: float) -> dict[str, str]:
    selector = f'{{instance="{instance_of(endpoint)}"}}'
    span = f"[{int(math.ceil(window_s))}s]"
    queries = {name: f"sum(increase({name}{selector}{span}))" for name in COUNTERS}
    queries.update({name: f"max({name}{selector})" for name in GAUGES})
    return queries


def prometheus_windows(prometheus: str, endpoint: str, window_s: float, count: int, timeout_s: float,
                       now: float | None = None) -> list[Window]:
    """The last `count` windows of `endpoint` (oldest first) from a Prometheus server; Unreachable or BadAnswer."""
    end = time.time() if now is None else now
    start = end - (count - 1) * window_s
    values: dict[str, dict[float, float]] = {}
    with httpx.Client(base_url=prometheus.rstrip("/"), timeout=timeout_s) as http:
        for name, query in _promql(endpoint, window_s).items():
            values[name] = _range_query(http, prometheus, query, start, end, window_s)
    if not values[GENERATION_TOKENS]:
        _check_scraped(http_get=lambda q: _instant_query(prometheus, q, end, timeout_s), endpoint=endpoint,
                       prometheus=prometheus)
        return []  # scraped, but no request finished yet: SGLang makes the counters at the first one
    return [_window_at(t, window_s, values) for t in sorted(values[GENERATION_TOKENS])]


def _check_scraped(http_get, endpoint: str, prometheus: str) -> None:
    """BadAnswer unless Prometheus scrapes the endpoint and reaches it (its `up` series is 1)."""
    up = http_get(f'max(up{{instance="{instance_of(endpoint)}"}})')
    if up is None:
        raise BadAnswer(redact(f"Prometheus at {prometheus} has no series for instance {instance_of(endpoint)} "
                               f"(is it scraping {endpoint}?)"))
    if up < 1:
        raise BadAnswer(redact(f"Prometheus at {prometheus} cannot scrape {endpoint} (up == 0)"))


def _instant_query(prometheus: str, query: str, at: float, timeout_s: float) -> float | None:
    with httpx.Client(base_url=prometheus.rstrip("/"), timeout=timeout_s) as http:
        try:
            response = http.get("/api/v1/query", params={"query": query, "time": f"{at:.3f}"})
            result = response.json()["data"]["result"]
        except httpx.TransportError as err:
            raise Unreachable(_transport_line(f"Prometheus at {prometheus}", err)) from None
        except (ValueError, KeyError, TypeError):
            raise BadAnswer(redact(f"Prometheus at {prometheus}: not a query answer: {response.text[:200]!r}")) from None
    return float(result[0]["value"][1]) if result else None


def _window_at(t: float, window_s: float, values: dict[str, dict[float, float]]) -> Window:
    def figure(name: str) -> float | None:
        return values[name].get(t)

    steps, tokens = figure(NUM_STEPS), figure(NUM_DRAFT_TOKENS)
    return Window(end=t, seconds=window_s, generation_tokens=figure(GENERATION_TOKENS) or 0.0,
                  verify_calls=figure(VERIFY_CALLS) or 0.0, requests=figure(REQUESTS) or 0.0,
                  num_steps=steps or None, num_draft_tokens=tokens or None, accept_rate=figure(ACCEPT_RATE))


def _range_query(http: httpx.Client, prometheus: str, query: str, start: float, end: float,
                 step: float) -> dict[float, float]:
    """{evaluation time: value} of a one-series range query (empty when Prometheus has no series for it)."""
    params = {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}s"}
    try:
        response = http.get("/api/v1/query_range", params=params)
    except httpx.TransportError as err:
        raise Unreachable(_transport_line(f"Prometheus at {prometheus}", err)) from None
    if response.status_code != 200:
        raise BadAnswer(redact(f"Prometheus at {prometheus}: HTTP {response.status_code} for {query}: "
                               f"{response.text[:200]}"))
    try:
        result = response.json()["data"]["result"]
    except (ValueError, KeyError, TypeError):
        raise BadAnswer(redact(f"Prometheus at {prometheus}: not a query_range answer: {response.text[:200]!r}")) from None
    if not result:
        return {}
    return {float(t): float(v) for t, v in result[0]["values"] if v not in ("NaN", "+Inf", "-Inf")}
