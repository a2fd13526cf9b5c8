"""Checkpoints: written atomically (temp dir, then rename, then `latest`), found again on resume,
and drafts rebuilt from them or started from another draft's weights.

Risk: resuming must reproduce the uninterrupted run, so a checkpoint carries model, optimizer,
scheduler, RNG states and the data position; a kill at any point leaves the previous one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file
from torch import Tensor

from eagle3.draft.model import DraftModelConfig, Eagle3DraftModel


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def write_checkpoint(ckpt_root: Path, step: int, files: dict[str, Callable[[Path], None]], keep: int) -> Path:
    """Write a checkpoint atomically: each writer fills a temp dir, which is renamed to
    `step_<8-digit step>`, then `latest` is replaced; a kill at any point leaves the previous one."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:08d}"
    tmp = ckpt_root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, writer in files.items():
        writer(tmp / name)
    _fsync_dir(tmp)
    if final.exists():  # re-saving the same step after a resume
        trash = ckpt_root / f".old-{final.name}-{os.getpid()}"
        final.rename(trash)
        shutil.rmtree(trash)
    tmp.rename(final)
    latest_tmp = ckpt_root / f".latest-{os.getpid()}"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, ckpt_root / "latest")
    for old in sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())[:-keep]:
        shutil.rmtree(old)
    return final


def find_latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The checkpoint named by `latest`, else the highest complete `step_*` directory."""
    pointer = ckpt_root / "latest"
    if pointer.exists() and (ckpt_root / pointer.read_text().strip()).is_dir():
        return ckpt_root / pointer.read_text().strip()
    steps = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
    return steps[-1] if steps else None


def draft_state_dict(draft: Eagle3DraftModel) -> dict[str, Tensor]:
    """Weights a checkpoint needs: everything but a frozen (target-copied) embedding."""
    skip = {"embed_tokens.weight"} if not draft.embed_tokens.weight.requires_grad else set()
    return {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items() if k not in skip}


def load_draft_checkpoint(checkpoint_dir: Path, target_embedding: Tensor | None = None) -> Eagle3DraftModel:
    """Rebuild the draft of a training checkpoint (embedding from the target when shared)."""
    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / "model.safetensors").exists():
        raise FileNotFoundError(f"{checkpoint_dir}: expected model.safetensors of a training checkpoint")
    config = DraftModelConfig.from_dict(json.loads((checkpoint_dir / "draft_config.json").read_text()))
    draft = Eagle3DraftModel(config)
    state = load_file(str(checkpoint_dir / "model.safetensors"))
    missing, unexpected = draft.load_state_dict(state, strict=False)
    allowed_missing = {"embed_tokens.weight"} if config.shares_target_embedding else set()
    if set(missing) - allowed_missing or unexpected:
        raise ValueError(f"{checkpoint_dir}: missing {sorted(set(missing) - allowed_missing)}, unexpected {unexpected}")
    if target_embedding is not None:
        draft.load_target_embedding(target_embedding)
    return draft


def load_initial_weights(draft: Eagle3DraftModel, source: Path) -> None:
    """Start `draft` from another draft's weights (a training checkpoint or an SGLang export).

    The vocab mapping must be the same: lm_head row i means draft token d2t-mapped i, so rows
    trained under another mapping would predict other tokens.
    """
    weights = Path(source) / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"train.init_checkpoint: {weights} not found (expected a checkpoint or sglang export folder)")
    state = load_file(str(weights))
    own = draft.state_dict()
    unexpected = sorted(set(state) - set(own))
    wrong_shape = sorted(k for k in set(state) & set(own) if state[k].shape != own[k].shape)
    if unexpected or wrong_shape:
        raise ValueError(f"train.init_checkpoint: {weights} does not fit this draft: unexpected {unexpected}, "
                         f"shape differs for {wrong_shape}")
    if "d2t" in state and not torch.equal(state["d2t"].to(own["d2t"].dtype), own["d2t"]):
        raise ValueError(f"train.init_checkpoint: {weights} was trained with another draft vocabulary (d2t differs); "
                         "start from scratch or regenerate the data with its vocab")
    draft.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()}, strict=False)
