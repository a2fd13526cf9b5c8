"""Time the embedded demo's ML stages directly through eagle3, wall and CPU seconds per part.

    PYTHONPATH=. .venv/bin/python tests/benchmarks/bench_demo.py [--config configs/tiny.yaml]
        [--set train.epochs=2 --set target.tiny.train_steps=200 ...] [--work DIR] [--threads 1]

Runs what `make demo` runs for the config's ML stages, without Prefect, MLflow or HTTP:
`build_tiny_target` into a fresh cache dir, `generate_dataset`, `train_draft`,
`export_checkpoint`, then plain vs speculative greedy decoding in the engine the reference
server uses (`bench_spec_decode.run`, prompts the draft never trained on, outputs checked
identical). Prints, per part, wall seconds and CPU seconds (user + sys of this process, all
threads): on a machine shared with other jobs wall time is inflated by waiting for a core,
CPU time is not, so CPU seconds at 1 thread are the figure to reason from. Ends with the
draft's simulated accept length on validation and the measured speedup of the configured
`deploy.speculative` setting (and of any `--settings`).

--work DIR keeps the outputs; a rerun with the same DIR reuses the tiny target (content-hash
cache) and the dataset when their settings match, so later parts can be iterated alone.
Not collected by pytest.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_spec_decode import parse_settings, training_prompts  # noqa: E402
from bench_spec_decode import run as run_spec_decode  # noqa: E402

import eagle3.data.generate  # noqa: E402
from eagle3.data.generate import generate_dataset  # noqa: E402
from eagle3.data.tiny_target import build_tiny_target, cpu_threads  # noqa: E402
from eagle3.export import export_checkpoint  # noqa: E402
from eagle3.training.train import train_draft  # noqa: E402
from tasks.config.schema import ExperimentConfig  # noqa: E402


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class PartTimer:
    """Wall and CPU seconds of named parts; `progress` splits a stage at its progress events."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, float]] = []
        self._open: tuple[str, float, float] | None = None

    def start(self, name: str) -> None:
        self.stop()
        self._open = (name, time.perf_counter(), cpu_seconds())

    def stop(self) -> None:
        if self._open:
            name, wall0, cpu0 = self._open
            self.rows.append((name, time.perf_counter() - wall0, cpu_seconds() - cpu0))
            self._open = None

    def progress(self, prefix: str):
        """An on_progress callback that opens part `prefix/stage` whenever the stage changes."""
        def callback(stage: str, done: int, total: int) -> None:
            name = f"{prefix}/{stage}"
            if self._open is None or self._open[0] != name:
                self.start(name)
        return callback

    @contextlib.contextmanager
    def part(self, name: str):
        """Time a whole stage (its sub-parts, if any, are recorded inside it by `progress`)."""
        wall0, cpu0 = time.perf_counter(), cpu_seconds()
        try:
            yield
        finally:
            self.stop()
            self.rows.append((name, time.perf_counter() - wall0, cpu_seconds() - cpu0))


def load_config(path: Path, overrides: list[str]) -> ExperimentConfig:
    """The experiment file with dotted `key=value` overrides (value parsed as YAML), validated."""
    data = yaml.safe_load(path.read_text())
    for item in overrides:
        dotted, _, value = item.partition("=")
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = yaml.safe_load(value)
    return ExperimentConfig.model_validate(data)


@contextlib.contextmanager
def pinned_data_threads(threads: int):
    """generate_dataset picks its own thread count from the load; pin it when asked (threads > 0)."""
    if not threads:
        yield
        return
    original = eagle3.data.generate.cpu_threads
    eagle3.data.generate.cpu_threads = lambda requested=0, log=None: original(threads, log)
    try:
        yield
    finally:
        eagle3.data.generate.cpu_threads = original


def settings_tag(*sections) -> str:
    """Short hash of config sections: one output dir per setting, so reruns reuse only matches."""
    text = json.dumps([s.model_dump(mode="json") for s in sections], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def run_stages(cfg: ExperimentConfig, work: Path, cache_root: Path, threads: int, timer: PartTimer) -> dict:
    """tiny target -> dataset -> draft -> export, each timed; returns the paths and summaries."""
    tiny = cfg.target.tiny.model_copy(update={"num_threads": threads or cfg.target.tiny.num_threads})
    with timer.part("1 tiny target (total)"):
        target_dir = build_tiny_target(tiny, cache_root, on_progress=timer.progress("1 tiny target"))
    data_dir = work / f"dataset-{settings_tag(cfg.target, cfg.data)}"
    with timer.part("2 data (total)"), pinned_data_threads(threads):
        data = generate_dataset(target_dir, cfg.target, cfg.data, data_dir,
                                on_progress=timer.progress("2 data"), log=lambda msg: None)
    # a draft dir per data + train setting: train_draft resumes (here: finds finished) a matching run
    draft_dir = work / f"draft-{settings_tag(cfg.target, cfg.data, cfg.train)}"
    with timer.part("3 train (total)"), cpu_threads(threads):
        trained = train_draft(data_dir, target_dir, cfg.train, draft_dir,
                              aux_layer_ids=data["aux_layer_ids"], draft_vocab_size=cfg.data.draft_vocab_size,
                              log=lambda msg: None)
    with timer.part("4 export"):
        exported = export_checkpoint(Path(trained["checkpoint"]), target_dir, cfg.export, draft_dir / "export")
    return {"target_dir": target_dir, "data_dir": data_dir, "data": data, "train": trained, "export": exported}


def spec_setting(cfg: ExperimentConfig) -> str:
    spec = cfg.deploy.speculative
    return f"{spec.num_steps}/{spec.eagle_topk}/{spec.num_draft_tokens}"


def print_report(timer: PartTimer, out: dict, spec: dict, threads: int) -> None:
    print(f"\n{'part':<28} {'wall s':>8} {'CPU s':>8}   (torch threads: {threads or 'auto'})")
    for name, wall, cpu in timer.rows:
        print(f"{name:<28} {wall:>8.1f} {cpu:>8.1f}")
    evaluation = json.loads((out["target_dir"] / "eval.json").read_text())
    print(f"\ntiny target {out['target_dir'].name}: heldout loss {evaluation['heldout_loss']:.3f} "
          f"(unigram {evaluation['unigram_cross_entropy_heldout']:.3f}), chat answer loss "
          f"{evaluation['heldout_chat_response_loss']:.3f}, {evaluation['num_parameters']} params")
    data, trained = out["data"], out["train"]
    print(f"data: {data['num_samples']} samples, {data['num_tokens']} tokens, "
          f"{data['num_assistant_tokens']} assistant tokens")
    acc = " ".join(f"{a:.3f}" for a in trained["acc"] if a is not None)
    print(f"train: {trained['steps']} steps, {trained.get('tokens_per_s', 0):.0f} tok/s, acc_k {acc}")
    print(f"simulated_accept_length ({trained.get('metrics_split')}): {trained['simulated_accept_length']:.2f}")
    for e in spec["results"]:
        accept = f"accept len {e['accept_length']:.2f}" if "accept_length" in e else ""
        print(f"spec-decode {e['setting']:>6}: {e['tok_per_s']:>7.1f} tok/s  {e['speedup']:.2f}x  {accept}"
              + (f"  OUTPUT MISMATCHES {e['output_mismatches']}" if e["output_mismatches"] else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=REPO / "configs" / "tiny.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted config override")
    p.add_argument("--work", type=Path, default=None, help="output dir (default: a fresh temp dir)")
    p.add_argument("--cache-root", type=Path, default=None, help="tiny target cache (default: <work>/cache)")
    p.add_argument("--threads", type=int, default=1, help="torch threads everywhere (0 = the pipeline's auto)")
    p.add_argument("--settings", default="", help="extra steps/topk/draft_tokens settings, comma-separated")
    p.add_argument("--prompts", type=int, default=8, help="spec-decode prompts (held out from the draft's data)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.set)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    timer = PartTimer()
    out = run_stages(cfg, work, args.cache_root or work / "cache", args.threads, timer)
    settings = ",".join(dict.fromkeys([spec_setting(cfg), *filter(None, args.settings.split(","))]))
    with timer.part("5 spec-decode bench"), torch.inference_mode():
        spec = run_spec_decode(out["target_dir"], Path(out["export"]["formats"]["sglang"]), parse_settings(settings),
                               args.prompts, args.max_new_tokens, 1, training_prompts(out["data_dir"] / "samples.jsonl"))
    print(f"work dir: {work}")
    print_report(timer, out, spec, args.threads)
    if args.json:
        figures = {"parts": [{"name": n, "wall_s": w, "cpu_s": c} for n, w, c in timer.rows],
                   "simulated_accept_length": out["train"]["simulated_accept_length"], "spec_decode": spec,
                   "overrides": args.set, "threads": args.threads, "target_dir": str(out["target_dir"])}
        args.json.write_text(json.dumps(figures, indent=2))
    return 1 if any(e["output_mismatches"] for e in spec["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
