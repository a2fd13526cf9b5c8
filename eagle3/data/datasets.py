"""The datasets the trainer reads: `HiddenStateDataset` (offline shards, read lazily),
`TokenizedDataset` (online mode: tokens only) and `collate_hidden_states`.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from torch.utils.data import Dataset

from eagle3.data.samples import SAMPLES_FILE, read_samples
from eagle3.data.shards import MANIFEST, SPLITS, _manifest_dir
from eagle3.data.state_codec import FP8, SCALES_KEY, STATE_DTYPES, check_shard_dtypes, decode_aux


class HiddenStateDataset(Dataset):
    """Offline samples: dicts of `input_ids` [T] int64, `loss_mask` [T] int64 (1 = assistant),
    `aux_hidden_states` [T, k*H_t] and `last_hidden_states` [T, H_t] (dtype as stored).

    Reads lazily from the shards (safetensors slices), reopening files after a fork so it
    works with DataLoader workers. The manifest (`self.manifest`) must be complete, and every
    shard must hold the dtype it names (a mixed-dtype dataset is refused). A shard entry's `file` may be an
    absolute path and may name `rows` (its samples this dataset holds): a served night's dataset lists the
    capture cache's shards (eagle3.data.served_capture).

    fp8 datasets (`dtype: float8_e4m3`): with decode="host" items carry the decoded bf16 aux
    states; with decode="device" they carry the stored e4m3 `aux_hidden_states` and their
    `aux_scales`, for the consumer to decode where it computes (`decode_aux`; the trainer does it
    on its GPU: decoding on a CPU costs ~0.6 s per 2048-token sample of an 8B target).
    """

    def __init__(self, offline_dir: Path | str, split: str = "train", decode: str = "host") -> None:
        if split not in ("train", "validation"):
            raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
        if decode not in ("host", "device"):
            raise ValueError(f"decode must be 'host' or 'device', got {decode!r}")
        self.directory = _manifest_dir(Path(offline_dir))
        self.manifest = json.loads((self.directory / MANIFEST).read_text())
        if not self.manifest.get("complete"):
            raise ValueError(f"{self.directory / MANIFEST} is incomplete; rerun generate_dataset to resume the dump")
        if split not in self.manifest.get("splits", SPLITS):
            raise ValueError(f"{self.directory / MANIFEST}: the {split} split has no shards here (splits "
                             f"{self.manifest['splits']}): data.hidden_states: stream captures it while training runs "
                             "(eagle3.training.streaming.dataset.StreamedDataset)")
        self.split, self.dtype = split, self.manifest.get("dtype", "bfloat16")
        if self.dtype not in STATE_DTYPES:
            raise ValueError(f"{self.directory / MANIFEST}: dtype: expected one of {sorted(STATE_DTYPES)}, "
                             f"found {self.dtype!r}")
        self.decode_on_host = decode == "host" and self.dtype == FP8
        self.index: list[tuple[str, int, int]] = []  # (shard file, token offset, length)
        for entry in self.manifest["shards"]:
            with safe_open(str(self.directory / entry["file"]), framework="pt") as fh:
                check_shard_dtypes(str(self.directory / entry["file"]), fh, self.dtype)  # every split's shards
                if entry["split"] == split:
                    lengths = fh.get_tensor("lengths").tolist()
                    offsets = [0, *itertools.accumulate(lengths)][:-1]
                    rows = list(zip(offsets, lengths, strict=True))
                    if "rows" in entry:  # a capture-cache shard (served nights): only these of its samples
                        rows = [rows[r] for r in entry["rows"]]
                    self.index.extend((entry["file"], o, n) for o, n in rows)
        self._handles: dict[str, object] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.index)

    def _handle(self, name: str):
        if self._pid != os.getpid():
            self._handles, self._pid = {}, os.getpid()
        if name not in self._handles:
            self._handles[name] = safe_open(str(self.directory / name), framework="pt")
        return self._handles[name]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        name, start, length = self.index[i]
        fh = self._handle(name)

        return shard_item(lambda key: fh.get_slice(key)[start : start + length], self.dtype, self.decode_on_host)


def shard_item(rows: Callable[[str], torch.Tensor], dtype: str, decode_on_host: bool) -> dict[str, torch.Tensor]:
    """One sample as training reads it, from `rows(key)`: its rows of a shard's tensor `key` (the item contract
    in HiddenStateDataset's docstring; fp8 states decoded here with `decode_on_host`, else with their scales)."""
    item = {
        "input_ids": rows("input_ids").long(),
        "loss_mask": rows("loss_mask").long(),
        "aux_hidden_states": rows("aux_hidden_states"),
        "last_hidden_states": rows("last_hidden_states"),
    }
    if dtype == FP8:
        scales = rows(SCALES_KEY)
        if decode_on_host:
            item["aux_hidden_states"] = decode_aux(item["aux_hidden_states"], scales)
        else:
            item[SCALES_KEY] = scales
    return item


class TokenizedDataset(Dataset):
    """Online-mode samples: dicts of `input_ids` [T] int64 and `loss_mask` [T] int64."""

    def __init__(self, samples_path: Path | str, split: str = "train") -> None:
        path = Path(samples_path)
        path = path / SAMPLES_FILE if path.is_dir() else path
        self.samples = [
            (torch.tensor(s["input_ids"], dtype=torch.long), torch.tensor(s["loss_mask"], dtype=torch.long))
            for s in read_samples(path, split)
        ]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        input_ids, loss_mask = self.samples[i]
        return {"input_ids": input_ids, "loss_mask": loss_mask}


def collate_hidden_states(items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad every key to the batch's longest sample and add `attention_mask` [B, T] (1 = real).

    Pads are 0 (ids, mask, states). Works for both datasets: hidden keys are padded when present.
    """
    width = max(len(it["input_ids"]) for it in items)
    batch = {}
    for key in items[0]:
        first = items[0][key]
        out = torch.zeros((len(items), width, *first.shape[1:]), dtype=first.dtype)
        for i, it in enumerate(items):
            out[i, : len(it[key])] = it[key]
        batch[key] = out
    batch["attention_mask"] = torch.zeros((len(items), width), dtype=torch.long)
    for i, it in enumerate(items):
        batch["attention_mask"][i, : len(it["input_ids"])] = 1
    return batch
