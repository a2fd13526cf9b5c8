"""Capture through SGLang's model runner in-process vs the HF capture vs the capture-only HTTP path's
JSON, on the same CPU and the same token rows (run by hand, in the CPU SGLang venv).

    PYTHONPATH=. ~/.cache/eagleops/sglang-cpu-venv/bin/python tests/benchmarks/bench_engine_capture.py \\
        --target runs/cache/targets/tiny-target-<hash> [--rows 32 --length 256 --batch 8]

Figures (tokens/s): `sglang` = eagle3.data.sglang_engine's capture_rows (aux + final state, tensors);
`hf` = TargetFeatureExtractor.capture_rows (transformers + hooks); `json` = what SGLang's
capture-only HTTP mode adds per token on top of its forward: `.tolist()` of the aux rows, `json.dumps`
(the server) and `json.loads` + tensor (the client) -- at the target's width and at Kimi-K2.5's
(3 x 7168, random values of the same dtype). Each figure is the median of --repeats runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def timed(fn, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def json_round_trip(states: torch.Tensor) -> torch.Tensor:
    text = json.dumps(states.tolist())
    return torch.tensor(json.loads(text), dtype=states.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from eagle3.data.capture import TargetFeatureExtractor
    from eagle3.data.sglang_engine import SGLangCaptureSettings, SGLangFeatureExtractor

    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(10, 250, (args.length,), generator=gen).tolist() for _ in range(args.rows)]
    batches = [rows[b : b + args.batch] for b in range(0, len(rows), args.batch)]
    tokens = args.rows * args.length
    sglang = SGLangFeatureExtractor(SGLangCaptureSettings(args.target, None, device="cpu", dtype="float32",
                                                          max_batch_tokens=args.batch * args.length))
    hf = TargetFeatureExtractor(args.target, None, dtype="float32")
    figures = {
        "sglang in-process": tokens / timed(lambda: [sglang.capture_rows(b) for b in batches], args.repeats),
        "hf in-process": tokens / timed(lambda: [hf.capture_rows(b) for b in batches], args.repeats),
    }
    aux, _ = sglang.capture_rows(batches[0])
    figures[f"json path only, width {aux.shape[1]}"] = aux.shape[0] / timed(lambda: json_round_trip(aux), args.repeats)
    kimi = torch.randn(512, 3 * 7168).to(torch.bfloat16).float()
    figures["json path only, Kimi width 3x7168"] = kimi.shape[0] / timed(lambda: json_round_trip(kimi), args.repeats)
    print(json.dumps({"tokens": tokens, "rows": args.rows, "length": args.length, "batch": args.batch,
                      "threads": torch.get_num_threads(), "tokens_per_s": figures}, indent=2))


if __name__ == "__main__":
    main()
