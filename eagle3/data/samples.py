"""Samples: conversations -> chat tokens + loss mask -> train/validation split, and
`samples.jsonl`, one sample per line: `{"id", "split", "messages", "input_ids", "loss_mask"}`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from eagle3.config import DataConfig
from eagle3.data.chat import Message, tokenize_chat, tokenize_generated
from eagle3.data.files import ProgressFn, atomic_write_text, file_sha256

FAILED_FILE = "failed.jsonl"
SAMPLES_FILE = "samples.jsonl"
# Bumped when the way samples are built changes (2: the target's own generated ids are kept).
SAMPLES_FORMAT = 2
SAMPLES_META = "samples.meta.json"


def split_ids(num: int, validation_fraction: float, seed: int) -> set[int]:
    """Seeded choice of validation sample indices (at least 1 when the fraction is > 0 and num > 1)."""
    n_val = round(num * validation_fraction)
    if validation_fraction > 0 and num > 1:
        n_val = min(max(n_val, 1), num - 1)
    return set(random.Random(seed).sample(range(num), n_val)) if n_val else set()


def build_samples(
    tokenizer, conversations: list[list[Message]], data_cfg: DataConfig, stop_ids: list[int], progress: ProgressFn,
    answer_ids: dict[int, list[int]] | None = None,
) -> tuple[list[dict], int]:
    """Tokenize + mask every conversation; drop those with no assistant token; split train/validation.

    answer_ids: the target's generated ids of conversation n's final answer, used as they are
    (prompt rendered exactly as it was for generation) instead of re-tokenizing the text.
    Returns (samples, dropped); sample = {"id", "split", "messages", "input_ids", "loss_mask"}.
    """
    kept, answer_ids = [], answer_ids or {}
    for n, messages in enumerate(conversations):
        if n in answer_ids:
            tokenized = tokenize_generated(tokenizer, messages[:-1], answer_ids[n], data_cfg.max_length)
        else:
            tokenized = tokenize_chat(tokenizer, messages, data_cfg.max_length, stop_ids)
        if tokenized.num_assistant_tokens:
            kept.append({"messages": messages, "input_ids": tokenized.input_ids, "loss_mask": tokenized.loss_mask})
        if (n + 1) % 256 == 0 or n + 1 == len(conversations):
            progress("tokenize", n + 1, len(conversations))
    validation = split_ids(len(kept), data_cfg.validation_fraction, data_cfg.seed)
    samples = [{"id": i, "split": "validation" if i in validation else "train", **s} for i, s in enumerate(kept)]
    return samples, len(conversations) - len(kept)


def write_samples(samples: list[dict], path: Path) -> str:
    """samples.jsonl (atomically); returns its sha256."""
    atomic_write_text(path, "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in samples))
    return file_sha256(path)


def read_samples(path: Path, split: str | None = None) -> list[dict]:
    """Samples of samples.jsonl, optionally only one split."""
    if not path.is_file():
        raise FileNotFoundError(f"samples file not found: {path}")
    with path.open(encoding="utf-8") as fh:
        samples = [json.loads(line) for line in fh if line.strip()]
    return [s for s in samples if split is None or s["split"] == split]
