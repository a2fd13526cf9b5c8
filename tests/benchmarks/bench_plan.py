"""The serving plan checked against a grid measured in full: prediction error per point, picks vs measured best.

    PYTHONPATH=$PWD .venv/bin/python tests/benchmarks/bench_plan.py --target T --draft D [--samples S] \
        [--out rows.json] [--analyse-only]

T: the tiny demo's target (runs/cache/targets/tiny-target-*), D: its export (export_checkpoint/attempt-N/sglang),
S: its samples.jsonl (benchmark prompts that are training prompts are left out). Serves speculation off and
every grid setting (SGLang's rules: eagle3.serving.spec_grid) with `python -m eagle3.serve`,
all servers up at once, then --passes interleaved passes over every setting and concurrency (a
warm-up and --timed rounds each), and records benchmark rows as run_benchmark does (step costs, acceptance by
draft position; the median over the passes). Then: the prediction calibrated on --calibrate (the settings a benchmark would have measured) only,
its error on total tok/s at every other (held-out) point, the plan's pick per concurrency against the measured
best and its noise (min..max over the timed rounds), and the picks under --sla-itl-p99-ms. --analyse-only reads
--out again instead of measuring. Figures: NOTES_plan.md. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from eagle3.serving.bench_prompts import builtin_prompts, heldout_overlap, render_prompts  # noqa: E402
from eagle3.serving.plan import Sla, adaptive_config, check_points, choose, mean_absolute_error  # noqa: E402
from eagle3.serving.prediction import Measurement, Predictor  # noqa: E402
from eagle3.serving.sglang_client import BenchResult, SGLangClient, ServerFigures, run_benchmark  # noqa: E402
from eagle3.serving.spec_grid import OFF, Setting, resolve_grid  # noqa: E402
from eagle3.serving.step_costs import measure_step_costs  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(target: Path, draft: Path, setting: Setting, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [sys.executable, "-m", "eagle3.serve", "--model-path", str(target), "--host", "127.0.0.1", "--port",
            str(port), "--device", "cpu", "--random-seed", "0", "--enable-metrics", "--max-running-requests", "8"]
    if setting.speculative:
        argv += [*setting.launch_flags(), "--speculative-draft-model-path", str(draft)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    with SGLangClient(url, timeout=30) as client:
        client.wait_healthy(180, poll_s=0.3)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def row_of(setting: Setting, result, accepted: list[float]) -> dict:
    """The fields of a run_benchmark row the prediction reads."""
    summary = result.summary()
    tok_s = summary["output_tok_per_s"]
    effective = None if not setting.speculative else {"num_steps": setting.num_steps, "eagle_topk": setting.eagle_topk,
                                                      "num_draft_tokens": setting.num_draft_tokens}
    return {"setting": setting.label, "speculative": setting.speculative, "concurrency": result.concurrency,
            "effective": effective, "tok_s_median": tok_s["median"], "tok_s_min": tok_s["min"],
            "tok_s_max": tok_s["max"], "ttft_p99_s": summary["ttft_p99_s"]["median"],
            "itl_p50_s": summary["itl_p50_s"]["median"], "itl_p99_s": summary["itl_p99_s"]["median"],
            "accept_length": result.accept_length, "accepted_by_position": accepted,
            "step_costs": measure_step_costs(result, effective)}


def merged(results: list) -> BenchResult:
    """The timed rounds of several passes over one (setting, concurrency) as one result."""
    first = results[0]
    server = ServerFigures(first.server.flushed, None, None, None, {},
                           [d for r in results for d in r.server.run_deltas])
    return BenchResult(first.endpoint, first.concurrency, first.max_new_tokens, first.temperature, first.num_prompts,
                       [], [run for r in results for run in r.runs], server)


def measure_all(args, settings: list[Setting], prompts: list[list[int]]) -> list[dict]:
    """Every server up at once (idle ones wait), then `passes` passes over all settings and concurrencies, each a
    warm-up and one timed round, in a rotated order: a slow phase of a shared machine hits every setting alike."""
    from tasks.stages.bench.stage import accepted_by_position

    logs = Path(args.out).with_suffix(".logs")
    logs.mkdir(parents=True, exist_ok=True)
    servers: dict[Setting, tuple] = {}
    results: dict[tuple[Setting, int], list] = {}
    try:
        for setting in settings:
            servers[setting] = serve(Path(args.target), Path(args.draft), setting,
                                     logs / f"{setting.label.replace('/', '_')}.log")
        for p in range(args.passes):
            start = time.time()
            order = settings[p % len(settings):] + settings[: p % len(settings)]
            for setting in order:
                with SGLangClient(servers[setting][1], timeout=600) as client:
                    for c in args.concurrency:
                        results.setdefault((setting, c), []).append(run_benchmark(
                            client, prompts, warmup_runs=args.warmup, timed_runs=args.timed, concurrency=c,
                            max_new_tokens=args.max_new_tokens, ignore_eos=True))
            print(f"pass {p + 1}/{args.passes}: {time.time() - start:.0f} s", flush=True)
    finally:
        for proc, _ in servers.values():
            stop(proc)
    rows = []
    for (setting, c), parts in results.items():
        result = merged(parts)
        rows.append(row_of(setting, result, accepted_by_position(result, setting.num_steps)
                           if setting.speculative else []))
    Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


def analyse(args, rows: list[dict], grid: list[Setting]) -> None:
    measured = [Measurement.from_row(r) for r in rows]
    calibrate = {Setting.parse(label) for label in args.calibrate.split(",")} | {OFF}
    predictor = Predictor([m for m in measured if m.setting in calibrate], args.max_new_tokens)
    predictions = predictor.grid(grid)
    held_out = [m for m in measured if m.setting not in calibrate]
    points = check_points(predictions, held_out)
    print(f"\ncalibrated on {sorted(s.label for s in calibrate)}; cost source: "
          f"{ {c: 'server' if m.server else 'client' for c, m in predictor.costs.items()} }")
    print("\n| setting | c | measured tok/s (min-max) | predicted | error |\n|---|---|---|---|---|")
    for p in sorted(points, key=lambda p: (p.concurrency, p.setting)):
        lo, hi = p.measured_spread or (p.measured_tok_s, p.measured_tok_s)
        print(f"| {p.setting.label} | {p.concurrency} | {p.measured_tok_s:.1f} ({lo:.1f}-{hi:.1f}) | "
              f"{p.predicted_tok_s:.1f} | {p.error:+.1%} |")
    print(f"\nheld-out points: {len(points)}; mean absolute error on total tok/s: {mean_absolute_error(points):.1%}")
    for c in predictor.concurrencies:
        here = [p for p in points if p.concurrency == c]
        print(f"  c={c}: MAE {mean_absolute_error(here):.1%}")
    report_picks(measured, predictions, predictor.concurrencies, Sla(), "no SLA")
    if args.sla_itl_p99_ms:
        sla = Sla(itl_ms_p99=args.sla_itl_p99_ms)
        report_picks(measured, predictions, predictor.concurrencies, sla, f"itl_ms_p99 <= {args.sla_itl_p99_ms:g}")
        config = adaptive_config(predictions, sla)
        print(f"\nadaptive config under that SLA: {json.dumps(config)}")
        if config:
            Path(args.out).with_suffix(".adaptive.json").write_text(json.dumps(config))


def report_picks(measured: list[Measurement], predictions, concurrencies, sla: Sla, title: str) -> None:
    print(f"\npicks, {title}:\n| c | plan's pick | predicted tok/s | measured tok/s | measured best within SLA (min-max) "
          "| pick within best's noise |\n|---|---|---|---|---|---|")
    for c in concurrencies:
        choice = choose(predictions, sla, c)
        here = {m.setting: m for m in measured if m.concurrency == c}
        within = [m for m in here.values() if not sla.violations(
            {"itl_ms_p50": 1e3 * m.itl_p50_s, "itl_ms_p99": 1e3 * m.itl_p99_s, "ttft_ms_p99": 1e3 * m.ttft_p99_s})]
        best = max(within or here.values(), key=lambda m: m.tok_s)
        pick = here.get(choice.setting)
        lo, hi = best.tok_s_spread or (best.tok_s, best.tok_s)
        ok = pick is not None and (pick.setting == best.setting or pick.tok_s >= lo)
        print(f"| {c} | {choice.setting.label} ({choice.why}) | {choice.prediction.tok_s_total:.1f} | "
              f"{pick.tok_s if pick else float('nan'):.1f} (p99 ITL {1e3 * pick.itl_p99_s if pick else 0:.1f} ms) | "
              f"{best.setting.label} {best.tok_s:.1f} ({lo:.1f}-{hi:.1f}) | {'yes' if ok else 'NO'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="required unless --analyse-only")
    parser.add_argument("--draft", help="required unless --analyse-only")
    parser.add_argument("--samples", default=None)
    parser.add_argument("--out", default="/tmp/bench_plan_rows.json")
    parser.add_argument("--analyse-only", action="store_true")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--steps", default="1,2,3,4,5,6")
    parser.add_argument("--topk", default="1,2,4")
    parser.add_argument("--draft-tokens", default="4,8")
    parser.add_argument("--calibrate", default="2/1/3,5/1/6,4/2/8,3/4/8")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timed", type=int, default=1)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--sla-itl-p99-ms", type=float, default=None)
    args = parser.parse_args()
    if not args.analyse_only and not (args.target and args.draft):
        parser.error("--target and --draft are required to measure")
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    grid, refused = resolve_grid(ints(args.steps), ints(args.topk), ints(args.draft_tokens))
    print(f"grid ({len(grid)} settings as SGLang runs them): {[s.label for s in grid]}; left out: {len(refused)}")
    if args.analyse_only:
        rows = json.loads(Path(args.out).read_text())
    else:
        pool = builtin_prompts(args.num_prompts * 4)
        if args.samples:
            seen = set(heldout_overlap(pool, args.samples))
            pool = [p for i, p in enumerate(pool) if i not in seen]
        prompts = render_prompts(pool[: args.num_prompts], args.target)
        rows = measure_all(args, [OFF, *grid], prompts)
    analyse(args, rows, grid)


if __name__ == "__main__":
    main()
