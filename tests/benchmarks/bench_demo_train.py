"""Time the demo's draft training alone at any commit, on a given tiny target and dataset (issue 38).

    cd <worktree of the commit> && PYTHONPATH=. /work/main/.venv/bin/python \
        /work/main/tests/benchmarks/bench_demo_train.py WORK TARGET_DIR DATASET_DIR [train.max_steps=80 ...]

Runs the worktree's own `tests/benchmarks/bench_demo.py` stages (`run_stages`, torch at 1 thread) with
`build_tiny_target` returning TARGET_DIR and a copy of DATASET_DIR under the tag the commit's config
hashes to (a copy: a commit whose data code differs re-captures the hidden states into it, and
concurrent runs must not write into one dataset). Prints the parts' wall and CPU seconds and the
reaped children's CPU seconds (the DataLoader workers', which the process's own CPU time leaves out).
Not collected by pytest.
"""

from __future__ import annotations

import os
import resource
import shutil
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.getcwd(), "tests", "benchmarks"))  # the worktree's bench_demo

import bench_demo  # noqa: E402
import torch  # noqa: E402


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str]) -> None:
    work, target, dataset, overrides = Path(argv[0]), Path(argv[1]), Path(argv[2]), argv[3:]
    cfg = bench_demo.load_config(bench_demo.REPO / "configs" / "tiny.yaml", overrides)
    work.mkdir(parents=True, exist_ok=True)
    data_dir = work / f"dataset-{bench_demo.settings_tag(cfg.target, cfg.data)}"
    if not data_dir.exists():
        shutil.copytree(dataset, data_dir)
    bench_demo.build_tiny_target = lambda *args, **kwargs: target
    torch.set_num_threads(1)
    timer = bench_demo.PartTimer()
    children0 = children_cpu_seconds()
    out = bench_demo.run_stages(cfg, work, work / "cache", 1, timer)
    for name, wall, cpu in timer.rows:
        print(f"{name:<28} {wall:>8.1f} {cpu:>8.1f}")
    print(f"children CPU s: {children_cpu_seconds() - children0:.1f}")
    trained = out["train"]
    print(f"train: {trained['steps']} steps, simulated accept length {trained['simulated_accept_length']!r}")
    print(f"history: {trained['history_path']}")


if __name__ == "__main__":
    main(sys.argv[1:])
