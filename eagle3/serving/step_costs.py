"""Step costs of one setting at one concurrency, from a benchmark's timed rounds: the prediction's inputs.

Owns: what one decode iteration costs while `c` requests decode together (an iteration = one forward step
of the running batch: each request gets one verify, or one plain decode step), split into SGLang's forward
categories where the server reports its own timings, and the spread of each over the timed rounds.

Two sources, the server's first:
- server: `sglang:forward_execution_seconds_total{category}` (SGLang with --enable-metrics and
  SGLANG_ENABLE_METRICS_DEVICE_TIMER=1; the reference server always) per timed round, divided by that
  round's iterations. Iterations = verify calls / c (speculative) or decode steps / c (plain), i.e. every
  iteration is taken to hold c requests: exact for SGLang's batches while the closed-loop client keeps c in
  flight (the last iterations of a round hold fewer, so the per-iteration figure reads a little low), and
  for the reference server, which runs each request's forwards one after another, c per-request costs are
  one iteration. Per iteration: `decode` (baseline step), `target_verify` (the verify forward of
  num_draft_tokens per request), `eagle_draft` (all draft steps; `draft_step_s` = it / num_steps, the cost
  per depth) and `eagle_draft_extend`.
- client (always): the mean gap between token-carrying stream chunks of a request, which is one iteration
  (the sum of its ITL entries over its verifies, or over its decode steps without speculation);
  `other_s` = client iteration - the server's categories (scheduling, sampling, HTTP, streaming).

Each figure is {min, median, max} over the timed rounds. Worked example: c = 2, a round with 40 verify
calls and 0.6 s of target_verify -> 20 iterations -> 0.03 s of verify per iteration.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from eagle3.serving.sglang_client import BenchResult, RunStats

CATEGORIES = ("decode", "target_verify", "eagle_draft", "eagle_draft_extend")


def spread(values: Sequence[float]) -> dict[str, float] | None:
    """{min, median, max} of the values; None when there are none."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def client_iteration_s(run: RunStats, speculative: bool) -> float | None:
    """One round's mean decode iteration as the client saw it: stream time after the first token / iterations."""
    decode_s = sum(sum(r.itl_s) for r in run.requests)
    iterations = run.spec_verify_ct if speculative else sum(len(r.itl_s) for r in run.requests)
    return decode_s / iterations if iterations else None


def server_iteration_s(delta: dict, concurrency: int, speculative: bool) -> dict[str, float]:
    """One round's forward seconds per iteration, by category (see the module docstring); {} without timings."""
    steps = delta["verify_calls"] if speculative else delta["generation_tokens"] - delta["requests"]
    if not delta.get("forward_s") or steps <= 0:
        return {}
    iterations = steps / concurrency
    return {c: delta["forward_s"][c] / iterations for c in CATEGORIES if delta["forward_s"].get(c)}


def measure_step_costs(result: BenchResult, effective: dict | None) -> dict[str, Any]:
    """Step costs of one measured setting (effective num_steps/eagle_topk/num_draft_tokens, None = baseline)."""
    speculative = effective is not None
    concurrency = result.concurrency
    client = [client_iteration_s(run, speculative) for run in result.runs]
    server = [server_iteration_s(d, concurrency, speculative) for d in result.server.run_deltas]
    costs: dict[str, Any] = {"concurrency": concurrency, "iteration_s": spread(client),
                             "source": "server" if any(server) else "client"}
    for category in CATEGORIES:
        figure = spread([s[category] for s in server if category in s])
        if figure:
            costs[f"{category}_s"] = figure
    if speculative and "eagle_draft_s" in costs:
        costs["draft_step_s"] = {k: v / effective["num_steps"] for k, v in costs["eagle_draft_s"].items()}
    if any(server) and len(server) == len(client):
        costs["other_s"] = spread([c - sum(s.values()) for c, s in zip(client, server) if c is not None and s])
    return costs
