"""Disk space for the hidden states: the bytes a dump writes, the free-space check made before
anything is computed (reference eagle3-training.md (e).4: 4 * H * 2 bytes per token in bf16; about
2.5 * H with `data.hidden_states_dtype: float8_e4m3`), and what a streamed capture's budget must hold.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

from eagle3.data.files import LogFn
from eagle3.environment import hidden_state_bytes as estimate_hidden_state_bytes


class InsufficientDiskSpaceError(OSError):
    """The offline hidden states would not fit on the destination filesystem."""


def _dump_bytes(num_tokens: int, num_samples: int, hidden_size: int, num_aux: int, dtype: str) -> int:
    """Shard bytes: hidden states (in `data.hidden_states_dtype` `dtype`, fp8 scales included) + int64 ids
    + uint8 mask per token + int64 length/id per sample."""
    states = estimate_hidden_state_bytes(num_tokens, hidden_size, num_aux, dtype=dtype)
    return states + 9 * num_tokens + 16 * num_samples


def max_shard_bytes(data_cfg, hidden_size: int, num_aux: int) -> int:
    """The largest shard `data_cfg` can make: data.shard_size samples of data.max_length tokens."""
    samples = data_cfg.shard_size
    return _dump_bytes(samples * data_cfg.max_length, samples, hidden_size, num_aux, data_cfg.hidden_states_dtype)


def min_budget_shards(slots_per_step: int, shard_size: int) -> int:
    """Streamed shards the budget must hold at once, or each side waits for the other forever: every shard one
    optimizer step reads (training reports what it consumed after the step; unaligned, its slots touch
    ceil(slots_per_step / shard_size) + 1 shards). Only a larger budget lets the capture run ahead."""
    return math.ceil(slots_per_step / shard_size) + 1


def budget_problem(budget: int, slots_per_step: int, data_cfg, hidden_size: int, num_aux: int) -> str | None:
    """Why data.stream's `budget` bytes cannot hold what one optimizer step reads, or None."""
    shards = min_budget_shards(slots_per_step, data_cfg.shard_size)
    largest = max_shard_bytes(data_cfg, hidden_size, num_aux)
    if budget >= shards * largest:
        return None
    return (f"data.stream.disk_budget_gb {budget / 1e9:.3g} GB is below {shards * largest / 1e9:.3g} GB: one optimizer "
            f"step reads up to {shards} shards of up to {largest / 1e9:.3g} GB (data.shard_size {data_cfg.shard_size} x "
            f"data.max_length {data_cfg.max_length} tokens x {largest // (data_cfg.shard_size * data_cfg.max_length)} "
            "B), which must all be on disk at once; raise the budget or lower data.shard_size")


def check_disk_space(directory: Path, need: int, log: LogFn) -> None:
    """Raise InsufficientDiskSpaceError unless need (+5% and 100 MiB headroom) fits in free space."""
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    required = int(need * 1.05) + (100 << 20)
    log(
        f"hidden states: need {need / 1e9:.3f} GB (+headroom {required / 1e9:.3f} GB), "
        f"free {free / 1e9:.3f} GB at {directory}"
    )
    if required > free:
        raise InsufficientDiskSpaceError(
            f"hidden states need {need} bytes ({need / 1e9:.3f} GB; {required} with headroom) "
            f"but only {free} bytes ({free / 1e9:.3f} GB) are free at {directory}; free space there, use fewer "
            "samples or shorter ones (data.num_samples, data.max_length, data.regenerate.max_new_tokens), "
            "data.hidden_states: stream (captured while training runs, within data.stream.disk_budget_gb) or "
            "online (one training process with the target loaded in transformers)"
        )
