"""Reading samples back out of capture-cache shards (`eagle3.data.capture_cache`): a replayed sample's token
ids and loss mask (for samples.jsonl), and a streamed shard assembled from cached rows instead of a forward
(the stream's capture side, `eagle3.training.streaming.producer`).

A shard packs its samples back to back (`eagle3.data.shards`): row r's tokens are
[sum(lengths[:r]), sum(lengths[:r + 1])) of every per-token tensor.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3.data.state_codec import SCALES_KEY

_TOKEN_KEYS = ("input_ids", "loss_mask")
_STATE_KEYS = ("aux_hidden_states", SCALES_KEY, "last_hidden_states")


class _Shard:
    """One open shard file and its rows' token offsets."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.handle = safe_open(str(path), framework="pt")
        lengths = self.handle.get_tensor("lengths").tolist()
        self.offsets = [0, *itertools.accumulate(lengths)]

    def rows(self, key: str, row: int) -> torch.Tensor:
        return self.handle.get_slice(key)[self.offsets[row] : self.offsets[row + 1]]

    def keys(self) -> set[str]:
        return set(self.handle.keys())


def read_cached_tokens(locations: list[tuple[Path, int]]) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of each (shard file, row), in the order given."""
    shards: dict[Path, _Shard] = {}
    out = []
    for path, row in locations:
        shard = shards.get(path) or shards.setdefault(path, _Shard(path))
        out.append(tuple(shard.rows(key, row).tolist() for key in _TOKEN_KEYS))
    return out


def shard_from_cache(members: list[dict]) -> dict[str, torch.Tensor]:
    """A shard's tensors (the layout `eagle3.data.dump.capture_shard` returns) from the cached rows of `members`
    (each with `cached: {"file", "row"}` and its `id`); each row's ids must be the sample's (checked)."""
    shards: dict[str, _Shard] = {}
    parts: dict[str, list[torch.Tensor]] = {}
    for sample in members:
        where = sample["cached"]
        shard = shards.get(where["file"]) or shards.setdefault(where["file"], _Shard(Path(where["file"])))
        ids = shard.rows("input_ids", where["row"])
        if ids.tolist() != sample["input_ids"]:
            raise ValueError(f"{where['file']} row {where['row']}: its token ids are not those of sample "
                             f"{sample['id']} (the capture cache changed under this dataset)")
        for key in (*_TOKEN_KEYS, *_STATE_KEYS):
            if key in shard.keys():
                parts.setdefault(key, []).append(ids if key == "input_ids" else shard.rows(key, where["row"]))
    tensors = {"input_ids": torch.cat(parts["input_ids"]).long(), "loss_mask": torch.cat(parts["loss_mask"]),
               "lengths": torch.tensor([len(s["input_ids"]) for s in members], dtype=torch.long),
               "sample_ids": torch.tensor([s["id"] for s in members], dtype=torch.long)}
    return tensors | {key: torch.cat(parts[key]) for key in _STATE_KEYS if key in parts}
