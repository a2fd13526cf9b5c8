"""The train loop's micro-batch loader (eagle3/training/loader.py): a DataLoader worker that stays alive but
hands over nothing (as a worker stuck on a lock it inherited at its fork does) fails the rank after
train.stall_timeout_s, with the worker's stack in the rank's log, instead of hanging the run for ever."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from tests.helpers import stop_group

REPO = Path(__file__).resolve().parents[3]

STALLING_EVALUATION = textwrap.dedent(
    """
    import sys, threading
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, sys.argv[2])
    from test_train import make_world, make_draft, make_items, train_config
    from eagle3.training.trainer import Trainer

    class StuckInTheWorker(list):
        # a validation split whose items never come in a loader worker (the training thread reads them fine)
        def __getitem__(self, index):
            if torch.utils.data.get_worker_info() is not None:
                wait_for_a_lock_nobody_releases()
            return list.__getitem__(self, index)

    def wait_for_a_lock_nobody_releases():
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()

    embed, lm_head, mapping = make_world()
    cfg = train_config(max_steps=4, eval_every=2, num_workers=1, stall_timeout_s=3)
    trainer = Trainer(make_draft(embed, mapping), lm_head, cfg, make_items(24, 1, embed),
                      StuckInTheWorker(make_items(8, 2, embed)), sys.argv[1], log=lambda s: None)
    trainer.train()
    """
)


def test_a_loader_worker_that_hands_over_nothing_fails_the_rank_with_its_stack(tmp_path):
    script = tmp_path / "stalling_evaluation.py"
    script.write_text(STALLING_EVALUATION)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "run"), str(Path(__file__).parent)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=150)
        left = [p.pid for p in psutil.process_iter() if _in_group(p, proc.pid)]
    finally:  # a hung run (the worker, forked into the script's group, included) is not left behind
        stop_group(proc.pid, first=signal.SIGKILL, grace_s=5, leader=proc)
    took = time.monotonic() - started
    assert proc.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(r"eagle3\.training\.loader\.LoaderStalled: no micro-batch came from the DataLoader workers "
                        r"\(pids \d+\) in 3 s \(train\.stall_timeout_s\): each worker's stack is in this log above",
                        last), last
    # the stuck worker's own stack, written by the worker before the rank failed
    dump = err[: err.index("Traceback (most recent call last)")]
    assert "wait_for_a_lock_nobody_releases" in dump and "__getitem__" in dump, err[-3000:]
    assert "in evaluate" in err  # it was the evaluation's loader, after two training steps
    assert left == []  # the stuck worker went with the rank
    print(f"failed {took:.1f} s after the start")


def _in_group(process: psutil.Process, group: int) -> bool:
    try:
        return os.getpgid(process.pid) == group and process.status() != psutil.STATUS_ZOMBIE
    except (ProcessLookupError, psutil.NoSuchProcess):
        return False


def test_one_set_of_evaluation_workers_serves_every_evaluation_and_stops_with_training(tmp_path):
    """Each evaluation reads the same batches: its workers fork at the first one and serve the rest (a fork
    per evaluation was a fork while the last one's queue threads ended: gh-112275's hang on CPython 3.11).
    The figures are those of evaluating on the training thread, and no worker outlives train()."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_train import make_draft, make_items, make_world, train_config

    from eagle3.training.trainer import Trainer

    class RecordingReader(list):
        def __init__(self, items, record: Path):
            super().__init__(items)
            self.record = record

        def __getitem__(self, index):
            with open(self.record, "a") as f:
                f.write(f"{os.getpid()}\n")
            return list.__getitem__(self, index)

    val_metrics, readers = {}, {}
    for workers in (0, 1):
        embed, lm_head, mapping = make_world()
        record, metrics = tmp_path / f"val-readers-{workers}.txt", []
        cfg = train_config(max_steps=4, eval_every=1, num_workers=workers)
        Trainer(make_draft(embed, mapping), lm_head, cfg, make_items(24, 1, embed),
                RecordingReader(make_items(8, 2, embed), record), tmp_path / f"run-{workers}",
                on_metrics=lambda s, m: metrics.append(m), log=lambda s: None).train()
        val_metrics[workers] = [m["val/loss"] for m in metrics if "val/loss" in m]
        readers[workers] = set(map(int, record.read_text().split()))
    assert len(val_metrics[0]) == 4 and val_metrics[1] == val_metrics[0]
    assert readers[0] == {os.getpid()}
    (eval_worker,) = readers[1]  # one worker process read all four evaluations
    assert eval_worker != os.getpid()
    assert not psutil.pid_exists(eval_worker) or psutil.Process(eval_worker).status() == psutil.STATUS_ZOMBIE
