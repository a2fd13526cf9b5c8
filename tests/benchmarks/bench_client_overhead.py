"""The benchmark harness's own overhead: client-measured tok/s vs the server's own figures.

    PYTHONPATH=$PWD .venv/bin/python tests/benchmarks/bench_client_overhead.py [--target-dir T --draft-dir D]

Starts `python -m eagle3.serve` on 127.0.0.1 (default: the tiny random target + random EAGLE-3
draft the HTTP tests build; or a given target and SGLang-format draft), runs
`eagle3.serving.sglang_client.run_benchmark` at concurrency 1 on the builtin prompts and prints, per
timed run and as medians:
- client tok/s: output tokens / run wall time (what run_benchmark reports);
- server e2e tok/s: output tokens / sum of the server's per-request `meta_info.e2e_latency`
  (at concurrency 1 the requests do not overlap, so this is the server's busy-time rate);
- per-request overhead: mean(client e2e - server e2e_latency), HTTP + SSE parsing + gaps;
- the server's decode-log gen throughput (mean over the timed windows) and `last_gen_throughput`
  (decode only, no prefill: an upper bound for either rate above).
The ratio client / server-e2e is the harness's efficiency. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "eagle3" / "serving")]

from test_serve_http import build_model_dirs  # noqa: E402
from test_sglang_client import launch_reference_server, stop_server  # noqa: E402

from eagle3.serving.bench_prompts import builtin_prompts, render_prompts
from eagle3.serving.sglang_client import (
    RunStats,
    SGLangClient,
    run_benchmark,
    summarize_decode_log,
)


def run_figures(run: RunStats) -> dict[str, float]:
    server_e2e = sum(r.meta_info["e2e_latency"] for r in run.requests)
    overhead = statistics.fmean(r.e2e_s - r.meta_info["e2e_latency"] for r in run.requests)
    return {
        "client_tok_per_s": run.output_tok_per_s,
        "server_e2e_tok_per_s": run.output_tokens / server_e2e,
        "ratio_client_over_server_e2e": run.output_tok_per_s / (run.output_tokens / server_e2e),
        "overhead_per_request_ms": 1000 * overhead,
        "gap_between_requests_ms": 1000 * (run.wall_s - sum(r.e2e_s for r in run.requests)) / run.num_requests,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target-dir", type=Path)
    ap.add_argument("--draft-dir", type=Path)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--decode-log-interval", type=int, default=40)
    args = ap.parse_args()
    if (args.target_dir is None) != (args.draft_dir is None):
        ap.error("give both --target-dir and --draft-dir, or neither")

    with tempfile.TemporaryDirectory(prefix="bench-client-") as tmp:
        root = Path(tmp)
        target_dir, draft_dir = (args.target_dir, args.draft_dir) if args.target_dir else build_model_dirs(root)
        log = root / "server.log"
        proc, url = launch_reference_server(target_dir, draft_dir, log, [
            "--max-running-requests", "4", "--decode-log-interval", str(args.decode_log_interval),
            "--enable-metrics"])
        try:
            prompts = render_prompts(builtin_prompts(args.prompts, seed=1), target_dir)
            with SGLangClient(url, timeout=300) as client:
                offset = log.stat().st_size
                result = run_benchmark(client, prompts, warmup_runs=args.warmup, timed_runs=args.runs,
                                       concurrency=1, max_new_tokens=args.max_new_tokens, ignore_eos=True)
            log_text = log.read_text()[offset:]
        finally:
            stop_server(proc)

    per_run = [run_figures(r) for r in result.runs]
    medians = {k: statistics.median(f[k] for f in per_run) for k in per_run[0]}
    decode = summarize_decode_log(log_text)
    report = {
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "timed_runs": args.runs,
        "prompt_tokens_mean": statistics.fmean(len(p) for p in prompts),
        "accept_length": result.accept_length,
        "per_run": per_run, "median": medians,
        "server_decode_log_gen_throughput_mean": decode["gen_throughput_mean"],
        "server_decode_log_lines": decode["lines"],
        "server_last_gen_throughput": result.server.last_gen_throughput,
        "ttft_p50_ms": 1000 * result.summary()["ttft_p50_s"]["median"],
        "itl_p50_ms": 1000 * result.summary()["itl_p50_s"]["median"],
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
