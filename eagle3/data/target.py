"""The target model in transformers: loaded whole onto one device (`load_target`: the reference
server, tests), placed over the devices target.placement names (`load_engine_target`: the HF
engine's capture, online features and local regeneration; eagle3/data/placement.py), or only its
output head and embeddings read straight from safetensors (`load_target_head`: the teacher's
logits without loading the model).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3.config import TargetConfig
from eagle3.data.placement import load_placed_model


def _safetensors_index(target_dir: Path) -> dict[str, Path]:
    """Tensor name -> file, from model.safetensors.index.json or the single model.safetensors."""
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: target_dir / file for name, file in weight_map.items()}
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {target_dir}")
    names = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            names.update({k: f for k in fh.keys()})
    return names


def _pick(names: dict[str, Path], suffix: str) -> str | None:
    """The shortest tensor name ending in suffix (the text model's, not a vision tower's)."""
    matches = sorted((n for n in names if n.endswith(suffix)), key=len)
    return matches[0] if matches else None


def load_target_head(target_dir: Path | str) -> dict:
    """`{"lm_head": [V, H], "embed_tokens": [V, H], "config": dict}` straight from safetensors.

    Teacher logits = last_hidden_states @ lm_head.T (plus any config-declared softcapping).
    With tied embeddings and no stored lm_head, lm_head is the embedding matrix.
    """
    target_dir = Path(target_dir)
    config = json.loads((target_dir / "config.json").read_text())
    names = _safetensors_index(target_dir)
    embed_name, head_name = _pick(names, "embed_tokens.weight"), _pick(names, "lm_head.weight")
    if embed_name is None:
        raise ValueError(f"{target_dir}: no '*embed_tokens.weight' tensor in the safetensors files")
    tied = config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings", False))
    if head_name is None and not tied:
        raise ValueError(f"{target_dir}: no 'lm_head.weight' and tie_word_embeddings is false")

    def read(name: str) -> torch.Tensor:
        with safe_open(str(names[name]), framework="pt") as fh:
            return fh.get_tensor(name)

    embed = read(embed_name)
    return {"lm_head": read(head_name) if head_name else embed, "embed_tokens": embed, "config": config}


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """`auto` = bfloat16 on CUDA, float32 elsewhere; otherwise the named torch dtype."""
    if dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return getattr(torch, dtype)


def load_target(path: Path | str, dtype: str = "auto", device: str = "cpu", trust_remote_code: bool = False):
    """Load an HF causal-LM dir (the tiny target or a real one) onto one device. -> (model in eval mode, tokenizer)"""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in target dir {path}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype, device),
                                                 trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    return model.to(device).eval(), tokenizer


def load_engine_target(path: Path | str, target_cfg: TargetConfig) -> tuple[torch.nn.Module, dict[str, str]]:
    """The target as the HF engine runs it (capture, online features, local regeneration): its layers placed
    over target.placement's devices. -> (model in eval mode, device map {unit: device})"""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in target dir {path}")
    dtype = resolve_dtype(target_cfg.dtype, "cuda" if torch.cuda.is_available() else "cpu")
    return load_placed_model(path, dtype, target_cfg.placement, target_cfg.trust_remote_code)
