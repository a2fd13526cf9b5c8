"""Plain greedy vs EAGLE-3 speculative decoding in the same engine, side by side, on CPU.

    .venv/bin/python tests/benchmarks/bench_spec_decode.py --draft runs/<exp>/<run>/export_checkpoint/sglang

The target defaults to the embedded tiny target (eagle3.data.tiny_target.build_tiny_target with the
default TinyTargetConfig, built or reused under --cache-root); --draft is the SGLang-format
export of a draft trained for it. Prompts are the builtin held-out chat prompts under the
target's chat template; --exclude-samples (the draft's samples.jsonl) drops those the draft
trained on. Each prompt is decoded by the plain engine and by every speculative setting in
turn (interleaved, so load changes on a shared machine hit all of them alike); greedy
outputs must be identical. Reports tok/s, speedup over plain, accept length (SGLang's
completion_tokens / verify forwards) and acceptance by draft position. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from eagle3.config import TinyTargetConfig  # noqa: E402
from eagle3.data.prompts import builtin_conversations, prompt_part  # noqa: E402
from eagle3.data.target import load_target  # noqa: E402
from eagle3.data.tiny_target import build_tiny_target
from eagle3.serving.decoding import (  # noqa: E402
    SamplingParams,
    SpecConfig,
    SpeculativeEngine,
    TargetModel,
)
from eagle3.serving.settings import load_eagle3_drafter  # noqa: E402

DEFAULT_SETTINGS = "3/1/4,5/1/6,7/1/8,5/4/8,4/2/6"


def parse_settings(text: str) -> list[SpecConfig]:
    """'3/1/4,5/4/8' -> SpecConfigs (steps/topk/draft tokens)."""
    return [SpecConfig(*map(int, item.split("/"))) for item in text.split(",") if item]


def build_prompts(tokenizer, n: int, seed: int, exclude: set[str] = frozenset()) -> list[list[int]]:
    """n builtin chat prompts (held out from the target's corpus), templated with add_generation_prompt.

    exclude: prompts (json of the message list) the draft was trained on; they are skipped.
    """
    prompts = []
    for conversation in builtin_conversations(4 * n, seed):
        messages = prompt_part(conversation)
        if json.dumps(messages) in exclude:
            continue
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(prompts) == n:
            return prompts
    raise ValueError(f"only {len(prompts)} builtin prompts outside the draft's training data; ask for fewer")


def training_prompts(samples_jsonl: Path | None) -> set[str]:
    """Prompts of the draft's training samples (eagle3.data samples.jsonl), as json message lists."""
    if samples_jsonl is None:
        return set()
    with open(samples_jsonl) as f:
        return {json.dumps(prompt_part(json.loads(line)["messages"])) for line in f if line.strip()}


def run(target_dir: Path, draft_dir: Path, settings: list[SpecConfig], prompts_n: int, max_new_tokens: int,
        seed: int, exclude: set[str]) -> dict:
    model, tokenizer = load_target(target_dir)
    prompts = build_prompts(tokenizer, prompts_n, seed, exclude)
    drafter = load_eagle3_drafter(draft_dir, model)
    target = TargetModel(model, drafter.aux_hidden_indices)
    engines = {"plain": SpeculativeEngine(TargetModel(model))}
    engines.update({f"{s.num_steps}/{s.topk}/{s.num_draft_tokens}": SpeculativeEngine(target, drafter, s)
                    for s in settings})
    sampling = SamplingParams(max_new_tokens=max_new_tokens)
    for engine in engines.values():  # warm-up: allocator, first-call paths
        engine.generate(prompts[0], SamplingParams(max_new_tokens=16))
    rows = {name: {"tokens": 0, "seconds": 0.0, "verify": 0, "correct": 0, "by_pos": None, "mismatch": 0}
            for name in engines}
    for prompt in prompts:
        reference = None
        for name, engine in engines.items():
            t0 = time.perf_counter()
            result = engine.generate(prompt, sampling)
            row = rows[name]
            row["seconds"] += time.perf_counter() - t0
            row["tokens"] += len(result.output_ids)
            if reference is None:
                reference = result.output_ids
            row["mismatch"] += result.output_ids != reference
            if engine.speculative:
                s = result.stats
                row["verify"] += s.verify_ct
                row["correct"] += s.num_correct_drafts
                row["by_pos"] = [a + b for a, b in zip(row["by_pos"] or [0] * len(s.accepted_by_position),
                                                       s.accepted_by_position)]
    return summarize(rows, len(prompts), max_new_tokens, target_dir, draft_dir)


def summarize(rows: dict, n_prompts: int, max_new_tokens: int, target_dir: Path, draft_dir: Path) -> dict:
    plain_tps = rows["plain"]["tokens"] / rows["plain"]["seconds"]
    out = {"target": str(target_dir), "draft": str(draft_dir), "prompts": n_prompts, "max_new_tokens": max_new_tokens,
           "threads": torch.get_num_threads(), "results": []}
    for name, row in rows.items():
        tps = row["tokens"] / row["seconds"]
        entry = {"setting": name, "tokens": row["tokens"], "tok_per_s": round(tps, 1),
                 "speedup": round(tps / plain_tps, 2), "output_mismatches": row["mismatch"]}
        if row["verify"]:
            # SGLang spec_accept_length: completion tokens (incl. the prefill token) / verify forwards
            entry["accept_length"] = round(row["tokens"] / row["verify"], 2)
            entry["accepted_drafts_per_verify"] = round(row["correct"] / row["verify"], 2)
            entry["accept_rate_by_position"] = [round(c / row["verify"], 3) for c in row["by_pos"]]
        out["results"].append(entry)
    best = max(out["results"][1:], key=lambda e: e["speedup"], default=None)
    out["best"] = best and {"setting": best["setting"], "speedup": best["speedup"]}
    return out


def print_table(summary: dict) -> None:
    print(f"target {summary['target']}\ndraft  {summary['draft']}\n"
          f"{summary['prompts']} prompts, max_new_tokens {summary['max_new_tokens']}, {summary['threads']} thread(s)")
    print(f"{'setting':>8} {'tokens':>7} {'tok/s':>8} {'speedup':>8} {'accept len':>10}  accept rate by draft position")
    for e in summary["results"]:
        by_pos = " ".join(f"{r:.2f}" for r in e.get("accept_rate_by_position", []))
        print(f"{e['setting']:>8} {e['tokens']:>7} {e['tok_per_s']:>8.1f} {e['speedup']:>7.2f}x "
              f"{e.get('accept_length', float('nan')):>10.2f}  {by_pos}"
              + ("" if not e["output_mismatches"] else f"  OUTPUT MISMATCHES: {e['output_mismatches']}"))
    if summary["best"]:
        print(f"best: {summary['best']['setting']} at {summary['best']['speedup']:.2f}x plain")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", type=Path, required=True, help="SGLang-format EAGLE-3 export dir of the trained draft")
    p.add_argument("--target", type=Path, default=None, help="HF target dir (default: the tiny target)")
    p.add_argument("--cache-root", type=Path, default=REPO / "runs" / "cache" / "targets",
                   help="tiny target cache (the pipeline's, tasks/stages/target.py)")
    p.add_argument("--settings", default=DEFAULT_SETTINGS, help="comma list of steps/topk/draft_tokens")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for the tiny target)")
    p.add_argument("--seed", type=int, default=1, help="builtin prompt sampling seed")
    p.add_argument("--exclude-samples", type=Path, default=None,
                   help="the draft's training samples.jsonl: its prompts are not benchmarked")
    p.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = args.target or build_tiny_target(TinyTargetConfig(), args.cache_root)
    with torch.inference_mode():
        summary = run(target, args.draft, parse_settings(args.settings), args.prompts, args.max_new_tokens, args.seed,
                      training_prompts(args.exclude_samples))
    print_table(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 1 if any(e["output_mismatches"] for e in summary["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
