"""The target's head read from safetensors (eagle3.data.target)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from eagle3.data.target import load_target, load_target_head


def test_target_head_tied_and_untied(tiny_target_dir, tmp_path):
    head = load_target_head(tiny_target_dir)
    model, _ = load_target(tiny_target_dir)
    assert head["config"]["tie_word_embeddings"] is True
    assert head["lm_head"].shape == (300, 32)
    torch.testing.assert_close(head["lm_head"], model.lm_head.weight)
    torch.testing.assert_close(head["embed_tokens"], model.model.embed_tokens.weight)

    untied = tmp_path / "untied"
    untied.mkdir()
    config = {"tie_word_embeddings": False, "architectures": ["LlamaForCausalLM"]}
    (untied / "config.json").write_text(json.dumps(config))
    weights = {"model.embed_tokens.weight": torch.ones(5, 2), "lm_head.weight": torch.full((5, 2), 2.0)}
    save_file(weights, str(untied / "model.safetensors"))
    head = load_target_head(untied)
    assert head["lm_head"].tolist() == [[2.0, 2.0]] * 5 and head["embed_tokens"].tolist() == [[1.0, 1.0]] * 5

    save_file({"model.embed_tokens.weight": torch.ones(5, 2)}, str(untied / "model.safetensors"))
    with pytest.raises(ValueError, match="no 'lm_head.weight' and tie_word_embeddings is false"):
        load_target_head(untied)
