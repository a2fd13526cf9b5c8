"""Reduced draft vocabulary: the `d2t` / `t2d` buffers of an EAGLE-3 draft.

Owns: counting assistant-token frequencies, picking the top-N, the d2t offset encoding
SGLang reads (`hot_token_id = d2t + arange(N)`, reference sglang-eagle3.md §3.4), coverage, and
a cache keyed by a hash of the data. Risk: a stale cached map reused for other data (the
speculators PR #1081 bug), so the key covers token ids, masks, N and the target vocab size.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

VOCAB_FILE = "vocab_map.safetensors"
VOCAB_INFO = "vocab_map.json"


@dataclass(frozen=True)
class DraftVocab:
    """d2t [N] int64 (target id = i + d2t[i]), t2d [V] bool, and the selected target ids [N]."""

    d2t: torch.Tensor
    t2d: torch.Tensor
    data_hash: str

    @property
    def target_ids(self) -> torch.Tensor:
        """Draft index -> target id. [N] int64"""
        return self.d2t + torch.arange(len(self.d2t))

    def coverage(self, counts: torch.Tensor) -> float:
        """Share of the counted tokens (a [V] histogram) that fall inside the draft vocab."""
        total = counts.sum().item()
        return float(counts[self.t2d].sum().item() / total) if total else 0.0


def count_masked_tokens(
    input_ids: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[int]], target_vocab_size: int
) -> torch.Tensor:
    """Histogram of the tokens with loss_mask == 1. -> [V] int64"""
    counts = torch.zeros(target_vocab_size, dtype=torch.long)
    for ids, mask in zip(input_ids, loss_masks, strict=True):
        ids_t, mask_t = torch.as_tensor(ids, dtype=torch.long), torch.as_tensor(mask, dtype=torch.bool)
        if ids_t.numel() and int(ids_t.max()) >= target_vocab_size:
            raise ValueError(f"token id {int(ids_t.max())} >= target vocab size {target_vocab_size}")
        counts += torch.bincount(ids_t[mask_t], minlength=target_vocab_size)
    return counts


def select_draft_tokens(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """Top-N target ids by count (ties: lower id first), padded with the lowest unused ids, ascending.

    Example: counts = [0, 5, 0, 9, 5, 0], N = 4 -> seen by rank [3, 1, 4]; pad with 0 -> [0, 1, 3, 4].
    """
    vocab = len(counts)
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size must be in 1..{vocab} (target vocab), got {draft_vocab_size}")
    seen = torch.nonzero(counts > 0).flatten()
    # Stable sort by descending count keeps ascending ids among equal counts.
    order = torch.sort(counts[seen], descending=True, stable=True).indices
    chosen = seen[order][:draft_vocab_size]
    if len(chosen) < draft_vocab_size:
        unused = torch.ones(vocab, dtype=torch.bool)
        unused[chosen] = False
        chosen = torch.cat([chosen, torch.nonzero(unused).flatten()[: draft_vocab_size - len(chosen)]])
    return torch.sort(chosen).values


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int, data_hash: str = "") -> DraftVocab:
    """d2t/t2d from a [V] token histogram.

    Worked example, V = 6, N = 4, counts = [0, 5, 0, 9, 5, 0]:
      draft ids 0..3 -> target ids [0, 1, 3, 4]; d2t = [0, 0, 1, 1]; t2d = [T, T, F, T, T, F].
    """
    target_ids = select_draft_tokens(counts, draft_vocab_size)
    d2t = target_ids - torch.arange(draft_vocab_size)  # [N] offsets, as SGLang expects
    t2d = torch.zeros(len(counts), dtype=torch.bool)
    t2d[target_ids] = True
    return DraftVocab(d2t=d2t.to(torch.long), t2d=t2d, data_hash=data_hash)


def vocab_data_hash(
    input_ids: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[int]],
    draft_vocab_size: int,
    target_vocab_size: int,
) -> str:
    """sha256 over every sample's ids and mask, N and V: the cache key of a draft vocab."""
    h = hashlib.sha256(f"N={draft_vocab_size};V={target_vocab_size};n={len(input_ids)}".encode())
    for ids, mask in zip(input_ids, loss_masks, strict=True):
        h.update(torch.as_tensor(ids, dtype=torch.int64).numpy().tobytes())
        h.update(b"|")
        h.update(torch.as_tensor(mask, dtype=torch.uint8).numpy().tobytes())
        h.update(b";")
    return h.hexdigest()


def save_draft_vocab(vocab: DraftVocab, out_dir: Path, info: dict | None = None) -> Path:
    """Write `vocab_map.safetensors` (d2t, t2d) and `vocab_map.json`; returns the tensor file path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / VOCAB_FILE
    tmp = path.with_suffix(".tmp")
    save_file({"d2t": vocab.d2t.contiguous(), "t2d": vocab.t2d.contiguous()}, str(tmp))
    os.replace(tmp, path)
    meta = {"data_hash": vocab.data_hash, "draft_vocab_size": len(vocab.d2t), "target_vocab_size": len(vocab.t2d)}
    (out_dir / VOCAB_INFO).write_text(json.dumps({**meta, **(info or {})}, indent=2))
    return path


def load_draft_vocab(out_dir: Path, expected_hash: str | None = None) -> DraftVocab:
    """Read a saved draft vocab; with expected_hash, a mismatch raises ValueError (stale map)."""
    info_path, path = out_dir / VOCAB_INFO, out_dir / VOCAB_FILE
    if not path.is_file() or not info_path.is_file():
        raise FileNotFoundError(f"no {VOCAB_FILE} + {VOCAB_INFO} in {out_dir}")
    info = json.loads(info_path.read_text())
    if expected_hash is not None and info.get("data_hash") != expected_hash:
        raise ValueError(
            f"draft vocab in {out_dir} was built for data {info.get('data_hash')}, expected {expected_hash}"
        )
    tensors = load_file(str(path))
    return DraftVocab(d2t=tensors["d2t"], t2d=tensors["t2d"], data_hash=info["data_hash"])


def build_or_load_draft_vocab(
    input_ids: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[int]],
    draft_vocab_size: int,
    target_vocab_size: int,
    out_dir: Path,
) -> tuple[DraftVocab, dict]:
    """Reuse out_dir's map when its data hash matches, else build and save it.

    Returns (vocab, info) where info has data_hash, cached (bool), coverage (share of the
    counted assistant tokens inside the draft vocab), distinct_tokens and counted_tokens.
    """
    data_hash = vocab_data_hash(input_ids, loss_masks, draft_vocab_size, target_vocab_size)
    counts = count_masked_tokens(input_ids, loss_masks, target_vocab_size)
    try:
        vocab, cached = load_draft_vocab(out_dir, expected_hash=data_hash), True
    except (FileNotFoundError, ValueError):
        vocab, cached = build_draft_vocab(counts, draft_vocab_size, data_hash), False
    info = {
        "data_hash": data_hash,
        "cached": cached,
        "coverage": vocab.coverage(counts),
        "distinct_tokens": int((counts > 0).sum()),
        "counted_tokens": int(counts.sum()),
        "draft_vocab_size": draft_vocab_size,
        "target_vocab_size": target_vocab_size,
    }
    if not cached:
        save_draft_vocab(vocab, out_dir, {k: info[k] for k in ("coverage", "distinct_tokens", "counted_tokens")})
    return vocab, info
