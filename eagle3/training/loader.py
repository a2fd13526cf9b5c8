"""Micro-batches for the train loop: DataLoader workers that read and collate ahead of the step, and a
stall guard that turns a worker which stops handing over batches into a failed rank instead of a hung one.

A worker that is alive but never delivers (a process stuck on a lock inherited at its fork from a thread
of the rank, a file system that stopped answering) is invisible to the DataLoader's own checks: they
only notice workers that died, so the rank waits in `_try_get_data` for ever and the whole job with it.
With `train.stall_timeout_s` as the DataLoader's timeout the wait ends; before the rank fails, every
worker writes its Python stack to the rank's log (faulthandler on SIGUSR1), so the log says where it hung.

A stream's loader has no such timeout: its workers wait for shards a live capture side has not written
yet (loading a large target alone can take longer), and `StreamedDataset` has its own checks on that side.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator

import torch

from eagle3.training.streaming.dataset import StreamedDataset

STACK_SIGNAL = signal.SIGUSR1
STACK_DUMP_WAIT_S = 1.0  # for the workers' stacks to reach the log before the rank fails and stops them


class LoaderStalled(RuntimeError):
    """No micro-batch came from the DataLoader workers within train.stall_timeout_s."""


def quiet_when_the_trainer_is_gone(worker_id: int) -> None:
    """DataLoader worker setup: a worker hands each batch's shared memory to the trainer as a file
    descriptor, from a background thread (multiprocessing.resource_sharer). When the trainer stops
    mid-hand-over (SIGTERM, Ctrl-C), that thread's send fails with a broken pipe and its traceback
    lands in the user's log under a clean "interrupted" line. Such errors, outside the worker's main
    thread, are dropped; anything else still prints."""
    original = sys.excepthook

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, ConnectionError) and threading.current_thread() is not threading.main_thread():
            return
        original(exc_type, exc, tb)

    sys.excepthook = hook


def setup_worker(worker_id: int) -> None:
    """A worker's start: quiet when the trainer is gone, and its stack on SIGUSR1 (see `_dump_worker_stacks`)."""
    quiet_when_the_trainer_is_gone(worker_id)
    faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True)


class MicroBatches:
    """The collated micro-batches of `index_lists`, read ahead by up to `num_workers` processes (each
    keeping `prefetch_factor` ready); LoaderStalled when they hand over none for `stall_timeout_s`.

    `reused=True` keeps the workers between passes (an evaluation every few steps reads the same
    batches): they fork once, not once per evaluation. A fork of a rank while another of its threads
    is being born or ending (the previous pass's queue feeders) can leave the child stuck on a lock
    the thread held, for ever, on CPython before 3.12 (gh-112275); fewer forks, fewer such moments.
    `close()` stops them.
    """

    def __init__(self, dataset, index_lists: list[list[int]], collate_fn: Callable, num_workers: int,
                 prefetch_factor: int, pin_memory: bool, stall_timeout_s: float, reused: bool = False) -> None:
        workers = min(num_workers, len(index_lists))
        self.timeout_s = stall_timeout_s if workers and not isinstance(dataset, StreamedDataset) else 0
        self.loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=index_lists, collate_fn=collate_fn, num_workers=workers,
            prefetch_factor=prefetch_factor if workers else None, pin_memory=pin_memory,
            worker_init_fn=setup_worker if workers else None, timeout=self.timeout_s,
            persistent_workers=reused and workers > 0,
        )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if not self.timeout_s:
            return iter(self.loader)
        # registered across the fork: a worker stuck before its own setup runs (on a lock taken at the fork) dumps too
        faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True)
        try:
            batches = iter(self.loader)
        finally:
            faulthandler.unregister(STACK_SIGNAL)
        return _stall_guarded(batches, self.timeout_s)

    def close(self) -> None:
        """Stop the workers a reused loader keeps (a pass's own workers stop at its end)."""
        workers = getattr(self.loader, "_iterator", None)
        if workers is not None:
            workers._shutdown_workers()
            self.loader._iterator = None


def micro_batches(dataset, index_lists: list[list[int]], collate_fn: Callable, num_workers: int,
                  prefetch_factor: int, pin_memory: bool, stall_timeout_s: float) -> Iterator[dict[str, Any]]:
    """One pass over `index_lists` (see MicroBatches); its workers stop when the pass ends or is dropped."""
    return iter(MicroBatches(dataset, index_lists, collate_fn, num_workers, prefetch_factor, pin_memory,
                             stall_timeout_s))


def _stall_guarded(batches, timeout_s: float) -> Iterator[dict[str, Any]]:
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except RuntimeError as err:
            if not str(err).startswith("DataLoader timed out"):
                raise
            pids = _dump_worker_stacks(batches)
            raise LoaderStalled(
                f"no micro-batch came from the DataLoader workers (pids {', '.join(map(str, pids))}) in "
                f"{timeout_s:g} s (train.stall_timeout_s): each worker's stack is in this log above"
            ) from None
        yield batch


def _dump_worker_stacks(batches) -> list[int]:
    """SIGUSR1 to each live worker (faulthandler writes its threads' stacks to stderr); their pids."""
    pids = [w.pid for w in getattr(batches, "_workers", []) if w.is_alive()]
    for pid in pids:
        try:
            os.kill(pid, STACK_SIGNAL)
        except ProcessLookupError:
            pass
    if pids:
        with contextlib.suppress(RuntimeError):  # the DataLoader's SIGCHLD check, if one died of the signal
            time.sleep(STACK_DUMP_WAIT_S)
    return pids
