"""The torchrun process group as the trainer sees it: this rank, the world size, and sums over
ranks (nccl on GPUs, gloo on CPU; a single process without torchrun).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> DistInfo:
    """Join the torchrun process group (nccl on GPUs, gloo on CPU); single process otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank)


def all_reduce_sum(x: Tensor, info: DistInfo) -> Tensor:
    if info.world_size > 1:
        dist.all_reduce(x)
    return x
