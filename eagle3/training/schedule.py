"""What each optimizer step sees: the deterministic data order over ranks and epochs, the
learning-rate schedule, and the padding of a micro-batch.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor


def build_lr_lambda(total_steps: int, warmup_ratio: float, min_lr_ratio: float) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine down to min_lr_ratio at total_steps."""
    warmup = int(math.ceil(total_steps * warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


@dataclass(frozen=True)
class DataPlan:
    """Deterministic order: epoch e is randperm(seed + e); global batch g holds B*W indices,
    rank r takes the r-th block of B. The data position in a checkpoint is (step).

    A *slot* is one place in that order over the whole run: optimizer step s consumes slots
    [s * slots_per_step, (s + 1) * slots_per_step), epoch e slots [e * slots_per_epoch, ...).
    Streamed hidden states (eagle3.training.streaming) are captured and read by slot, so the
    capture side follows training's order exactly; offline datasets are read by sample index.
    """

    num_samples: int
    batch_size: int
    world_size: int
    grad_accum: int
    seed: int

    @property
    def global_batches_per_epoch(self) -> int:
        return math.ceil(self.num_samples / (self.batch_size * self.world_size))

    @property
    def steps_per_epoch(self) -> int:
        return self.global_batches_per_epoch // self.grad_accum

    @property
    def slots_per_step(self) -> int:
        """Samples one optimizer step consumes, all ranks and micro-batches together."""
        return self.batch_size * self.world_size * self.grad_accum

    @property
    def slots_per_epoch(self) -> int:
        return self.steps_per_epoch * self.slots_per_step

    def epoch_order(self, epoch: int) -> list[int]:
        """Sample indices of `epoch` in the order its steps consume them (slot order within the epoch).

        randperm(seed + epoch), wrapped around to fill the last global batch, cut after the last whole
        optimizer step. Example: 5 samples, B=2, W=1, grad_accum=1, perm [3, 0, 4, 1, 2] ->
        3 global batches = 6 slots [3, 0, 4, 1, 2, 3] (sample 3 twice).
        """
        g = torch.Generator().manual_seed(self.seed + epoch)
        perm = torch.randperm(self.num_samples, generator=g).tolist()
        needed = self.global_batches_per_epoch * self.batch_size * self.world_size
        perm = (perm * math.ceil(needed / len(perm)))[:needed]  # wrap around to fill the last batch
        return perm[: self.slots_per_epoch]

    def samples_of_slots(self, first: int, end: int) -> list[int]:
        """Sample indices of slots first..end-1 (they may cross epoch boundaries)."""
        out, slot = [], first
        while slot < end:
            epoch, offset = divmod(slot, self.slots_per_epoch)
            take = self.epoch_order(epoch)[offset : offset + end - slot]
            out.extend(take)
            slot += len(take)
        return out

    def rank_batches(self, epoch: int, rank: int, start: int, slots: bool = False) -> Iterator[list[int]]:
        """Index lists of this rank's micro-batches of `epoch`, from global batch `start`: sample indices,
        or with `slots` the run-wide slot numbers of the same places."""
        order = self.epoch_order(epoch)
        per_global = self.batch_size * self.world_size
        first_slot = epoch * self.slots_per_epoch
        for gb in range(start, self.steps_per_epoch * self.grad_accum):
            base = gb * per_global + rank * self.batch_size
            if slots:
                yield list(range(first_slot + base, first_slot + base + self.batch_size))
            else:
                yield order[base : base + self.batch_size]

    def rank_steps(self, rank: int, step: int, total_steps: int, slots: bool = False) -> Iterator[list[int]]:
        """This rank's micro-batches of optimizer steps step..total_steps-1, across epoch boundaries
        (grad_accum index lists per step; epoch e = step // steps_per_epoch); `slots` as in rank_batches."""
        while step < total_steps:
            epoch, offset = divmod(step, self.steps_per_epoch)
            in_epoch = min(self.steps_per_epoch - offset, total_steps - step)
            yield from itertools.islice(self.rank_batches(epoch, rank, offset * self.grad_accum, slots),
                                        in_epoch * self.grad_accum)
            step += in_epoch


def planned_steps(plan: DataPlan, epochs: int, max_steps: int | None) -> int:
    """Optimizer steps of a run: every whole step of `epochs` epochs, or `max_steps` when fewer."""
    return min(max_steps or 1 << 62, plan.steps_per_epoch * epochs)


def default_collate_fn(items: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Right-pad dataset items (the contract of eagle3/data/datasets.py) and add attention_mask [B, T]."""
    t = max(item["input_ids"].shape[0] for item in items)
    out: dict[str, Tensor] = {}
    for key in items[0]:
        rows = [F.pad(it[key], (0, 0) * (it[key].dim() - 1) + (0, t - it[key].shape[0])) for it in items]
        out[key] = torch.stack(rows)
    out["attention_mask"] = torch.stack(
        [F.pad(torch.ones(it["input_ids"].shape[0], dtype=torch.long), (0, t - it["input_ids"].shape[0])) for it in items]
    )
    return out
