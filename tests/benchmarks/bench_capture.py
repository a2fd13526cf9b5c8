"""Benchmark the offline hidden-state dump against the target's plain forward, in ONE run.

Target: Llama-3.1-8B shape (H 4096, 32 layers, FFN 14336, 32/8 heads, vocab 128256) with random
bf16 weights on CUDA; samples of T tokens (random ids), capture batch B. Four measurements over
the same samples, each after a one-batch warm-up:
  forward          the target's base model forward alone (what capture cannot beat)
  forward+hooks    eagle3.data.capture's forward with the aux-layer hooks (TargetFeatureExtractor)
  capture          eagle3.data.dump.capture_shard for every shard: + gather of the real tokens and the
                   device->host copies into the shard's host tensors (nothing written)
  dump             eagle3.data.dump.dump_hidden_states end to end: + safetensors writes with sha256 in the
                   writer thread, manifest; fresh directory
With `--dtypes bfloat16,float8_e4m3` capture and dump run once per `data.hidden_states_dtype`
(rows `capture[float8_e4m3]`, `dump[float8_e4m3]`; the first dtype keeps the plain names).
`--per-shard` adds `dump_per_shard` rows: the dump as it was before shards streamed (one capture_shard
per shard, each with its own host copier, then the whole shard written and hashed on a writer thread),
for a before/after in the same run. Each dump starts after `os.sync()` (outside its time), so one
dump's writes never drain to disk during the next; each dump reports its `tail_s`: seconds from the
moment the last shard's states were all on the host to the end of the dump (what is left to write
and hash then), and each shard's writer start/end.
Reports tok/s, the ratio to the plain forward (goal: dump >= 0.90), and the bytes written per
token vs eagle3.environment.hidden_state_bytes (states) plus 9 B/token of ids and loss mask;
then reads each dump back through HiddenStateDataset and checks one sample against a fresh capture
(fp8: the decoded states' error vs the bf16 capture).

    python tests/benchmarks/bench_capture.py                 # CUDA, full shape (skips without CUDA)
    python tests/benchmarks/bench_capture.py --dtypes bfloat16,float8_e4m3
    python tests/benchmarks/bench_capture.py --tiny          # CPU smoke test, tiny target
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from eagle3.config import DataConfig  # noqa: E402
from eagle3.data.capture import TargetFeatureExtractor, capture_hidden_states  # noqa: E402
from eagle3.data.datasets import HiddenStateDataset
from eagle3.data.capture import _right_pad
from eagle3.data.dump import capture_shard, dump_hidden_states
from eagle3.data.shards import STATE_DTYPES, plan_shards  # noqa: E402
from eagle3.environment import hidden_state_bytes  # noqa: E402

LLAMA31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
                  max_position_embeddings=131072)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512, max_position_embeddings=256)


def build_target(shape: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A LlamaForCausalLM with random weights, built directly on `device` in `dtype`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, architectures=["LlamaForCausalLM"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def make_samples(num: int, seq: int, vocab: int, seed: int = 1) -> list[dict]:
    """Samples of the eagle3/data/datasets.py contract: all `train`, T tokens, every token in the loss."""
    g = torch.Generator().manual_seed(seed)
    return [{"id": i, "split": "train", "input_ids": torch.randint(0, vocab, (seq,), generator=g).tolist(),
             "loss_mask": [1] * seq} for i in range(num)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batches(samples: list[dict], batch: int):
    for b in range(0, len(samples), batch):
        yield _right_pad([s["input_ids"] for s in samples[b : b + batch]])


def _capture_and_write_per_shard(extractor, todo, directory, batch_size, dtype, on_written) -> None:
    """eagle3.data.dump._capture_and_write before shards streamed (kept here for the before/after):
    capture_shard per shard (its own copier: every shard boundary waits for the GPU), then the whole
    shard written and hashed by `_write_hidden_shard` on one of two writer threads."""
    from concurrent.futures import ThreadPoolExecutor

    from eagle3.data.shards import _temp_name, _write_hidden_shard

    pending: collections.deque = collections.deque()

    def finish_oldest() -> None:
        name, members, write = pending.popleft()
        digest, size = write.result()
        os.replace(_temp_name(directory / name), directory / name)
        on_written(name, members, digest, size)

    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="shard-writer") as writer:
        for name, members in todo:
            tensors = capture_shard(extractor, members, batch_size, dtype)
            if len(pending) == 2:
                finish_oldest()
            pending.append((name, members, writer.submit(_write_hidden_shard, tensors, directory / name)))
            del tensors
        while pending:
            finish_oldest()


class DumpTimeline:
    """When each shard's states were all on the host and when its writer ran (wraps eagle3.data.dump's
    internals for one dump; times relative to the dump's start)."""

    def __init__(self) -> None:
        self.t0, self.complete, self.writes = 0.0, [], []

    def __enter__(self):
        import eagle3.data.dump as dump_mod

        self.mod, self.saved = dump_mod, (dump_mod._ShardStream.rows_ready, dump_mod._write_streamed_shard,
                                          dump_mod._capture_and_write)
        timeline, (rows_ready, write, capture_and_write) = self, self.saved

        def timed_rows_ready(stream, rows):
            rows_ready(stream, rows)
            if stream.complete():
                timeline.complete.append(time.perf_counter() - timeline.t0)

        def timed_write(stream, path):
            start = time.perf_counter() - timeline.t0
            out = write(stream, path)
            timeline.writes.append({"shard": path.name, "start_s": start, "end_s": time.perf_counter() - timeline.t0})
            return out

        def timed_capture_and_write(*a, **kw):
            timeline.t0 = time.perf_counter()
            return capture_and_write(*a, **kw)

        dump_mod._ShardStream.rows_ready = timed_rows_ready
        dump_mod._write_streamed_shard = timed_write
        dump_mod._capture_and_write = timed_capture_and_write
        return self

    def __exit__(self, *exc) -> None:
        self.mod._ShardStream.rows_ready, self.mod._write_streamed_shard, self.mod._capture_and_write = self.saved


def timed(device: torch.device, fn) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def run(args) -> dict:
    device = torch.device("cpu" if args.tiny else "cuda")
    model_dtype = torch.float32 if args.tiny else torch.bfloat16
    shape = TINY if args.tiny else LLAMA31_8B
    model = build_target(shape, device, model_dtype)
    extractor = TargetFeatureExtractor.from_model(model)
    base = getattr(model, model.base_model_prefix)
    samples = make_samples(args.samples, args.seq, shape["vocab_size"])
    tokens = args.samples * args.seq
    dtypes = args.dtypes.split(",")
    configs = {name: DataConfig(num_samples=args.samples, max_length=args.seq, shard_size=args.shard_size,
                                capture_batch_size=args.batch, hidden_states_dtype=name) for name in dtypes}
    plan = plan_shards(samples, args.shard_size)

    def forward():
        with torch.no_grad():
            for ids, mask in _batches(samples, args.batch):
                base(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)

    def hooks():
        for ids, mask in _batches(samples, args.batch):
            extractor(ids, mask)

    def capture(name: str):
        for _, members in plan:
            capture_shard(extractor, members, args.batch, STATE_DTYPES[name])

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-capture-"))
    summaries: dict = {}

    timelines: dict = {}

    def dump(name: str):
        shutil.rmtree(work / name, ignore_errors=True)
        with DumpTimeline() as timeline:
            summaries[name] = dump_hidden_states(extractor, samples, work / name, configs[name], "bench",
                                                 lambda *a: None, lambda m: None)
            end = time.perf_counter() - timeline.t0
        timelines[name] = {"tail_s": end - max(timeline.complete), "dump_s": end,
                           "shard_complete_s": timeline.complete, "writes": timeline.writes}

    def dump_per_shard(name: str):
        import eagle3.data.dump as dump_mod

        directory = work / f"{name}-per-shard"
        shutil.rmtree(directory, ignore_errors=True)
        saved, dump_mod._capture_and_write = dump_mod._capture_and_write, _capture_and_write_per_shard
        try:
            dump_hidden_states(extractor, samples, directory, configs[name], "bench", lambda *a: None, lambda m: None)
        finally:
            dump_mod._capture_and_write = saved
        shutil.rmtree(directory, ignore_errors=True)

    warm = samples[: args.batch]  # cuBLAS/cuDNN set-up and the allocator's first blocks
    with torch.no_grad():
        ids, mask = _right_pad([s["input_ids"] for s in warm])
        base(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
    for name in dtypes:
        capture_shard(extractor, warm, args.batch, STATE_DTYPES[name])
    measures = [("forward", forward), ("forward+hooks", hooks)]
    for i, name in enumerate(dtypes):
        suffix = "" if i == 0 else f"[{name}]"
        measures += [(f"capture{suffix}", lambda n=name: capture(n)), (f"dump{suffix}", lambda n=name: dump(n))]
        if args.per_shard:
            measures.append((f"dump_per_shard{suffix}", lambda n=name: dump_per_shard(n)))
    results = {}
    for measure, fn in measures:
        if measure.startswith("dump"):
            os.sync()  # the last dump's writes drain before this one starts, outside its time
        seconds = timed(device, fn)
        results[measure] = {"seconds": seconds, "tokens_per_s": tokens / seconds}
        print(json.dumps({"measure": measure, **results[measure]}), flush=True)
    for r in results.values():
        r["ratio_to_forward"] = r["tokens_per_s"] / results["forward"]["tokens_per_s"]
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "shape": shape, "seq": args.seq, "batch": args.batch, "samples": args.samples, "shard_size": args.shard_size,
        "tokens": tokens, "results": results, "timelines": timelines,
        "dtypes": {name: dtype_report(name, summaries[name], tokens, work / name, samples[0], extractor)
                   for name in dtypes},
    }
    report.update({key: report["dtypes"][dtypes[0]][key] for key in  # the first dtype's, under the plain names
                   ("bytes_total", "bytes_per_token", "states_bytes_per_token_estimate",
                    "bytes_per_token_estimate_with_ids_and_mask", "check")})
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return report


def dtype_report(name: str, summary: dict, tokens: int, directory: Path, first: dict,
                 extractor: TargetFeatureExtractor) -> dict:
    k, hidden = len(extractor.hf_indices), extractor.hidden_size
    states_estimate = hidden_state_bytes(1, hidden, k, dtype=name)
    return {"bytes_total": summary["bytes_total"], "bytes_per_token": summary["bytes_total"] / tokens,
            "states_bytes_per_token_estimate": states_estimate,
            "bytes_per_token_estimate_with_ids_and_mask": states_estimate + 9,
            "check": check_dump(directory, first, extractor)}


def check_dump(directory: Path, first: dict, extractor: TargetFeatureExtractor) -> dict:
    """Read sample 0 back through the trainer's dataset (fp8: decoded) and compare with a fresh capture."""
    data = HiddenStateDataset(directory, "train")
    item = data[0]
    ids = torch.tensor([first["input_ids"]])
    aux, last = capture_hidden_states(extractor.model, ids.to(extractor.device), torch.ones_like(ids).to(extractor.device),
                                      extractor.aux_layer_ids)
    aux_ref, got = aux[0].float().cpu(), item["aux_hidden_states"].float()
    return {"samples": len(data), "ids_equal": item["input_ids"].tolist() == first["input_ids"],
            "aux_max_abs_diff": float((got - aux_ref).abs().max()),
            "aux_rel_rms_error": float((got - aux_ref).norm() / aux_ref.norm()),
            "last_max_abs_diff": float((item["last_hidden_states"].float() - last[0].float().cpu()).abs().max())}


def print_table(report: dict) -> None:
    print(f"\n{report['device']}, torch {report['torch']}, H {report['shape']['hidden_size']}, "
          f"{report['shape']['num_hidden_layers']} layers, T {report['seq']}, batch {report['batch']}, "
          f"{report['samples']} samples ({report['tokens']} tokens), shard {report['shard_size']} samples")
    print(f"{'measure':<22}{'seconds':>9}{'tok/s':>11}{'vs forward':>12}")
    for name, r in report["results"].items():
        print(f"{name:<22}{r['seconds']:>9.2f}{r['tokens_per_s']:>11.0f}{r['ratio_to_forward']:>11.1%}")
    for name, t in report.get("timelines", {}).items():
        writes = ", ".join(f"{w['shard']} {w['start_s']:.2f}-{w['end_s']:.2f}" for w in t["writes"])
        print(f"dump[{name}] timeline: shards complete at {', '.join(f'{c:.2f}' for c in t['shard_complete_s'])} s; "
              f"tail {t['tail_s']:.2f} s of {t['dump_s']:.2f} s; writers {writes}")
    for name, d in report["dtypes"].items():
        print(f"{name}: {d['bytes_per_token']:.1f} B/token written; estimate {d['states_bytes_per_token_estimate']} "
              f"B/token of states + 9 B/token ids and mask = {d['bytes_per_token_estimate_with_ids_and_mask']}; "
              f"read back: {json.dumps(d['check'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny target on CPU (smoke test)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8, help="capture batch (data.capture_batch_size)")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--shard-size", type=int, default=32, help="samples per shard (data.shard_size)")
    parser.add_argument("--work-dir", default=None, help="where the dump goes (default: a tmp dir, removed)")
    parser.add_argument("--keep", action="store_true", help="keep the dump")
    parser.add_argument("--dtypes", default="bfloat16", help="comma list of data.hidden_states_dtype values to dump")
    parser.add_argument("--per-shard", action="store_true",
                        help="also time the dump as it was before shards streamed (dump_per_shard rows)")
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    args = parser.parse_args(argv)
    if args.tiny:
        args.seq, args.batch = min(args.seq, 64), min(args.batch, 4)
        args.samples, args.shard_size = min(args.samples, 24), min(args.shard_size, 8)
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        print("bench_capture: CUDA not available; the full shape needs a GPU (use --tiny on CPU). Skipped.")
        return 0
    report = run(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    print_table(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
