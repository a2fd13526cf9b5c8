"""Shared fixtures for tests/eagle3: the test-size embedded tiny target, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3.config import TinyTargetConfig
from eagle3.data.tiny_target import build_tiny_target


@pytest.fixture(autouse=True)
def _one_thread():
    # The CI box has 2 shared cores; OpenMP spinning across them makes tiny ops 10-100x slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_test_config(**overrides) -> TinyTargetConfig:
    """A tiny target that builds in seconds: 7 layers (SGLang defaults distinct), H=32, V=300."""
    fields = dict(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=7,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        corpus_max_bytes=60_000,
        train_steps=10,
        batch_size=4,
        seq_len=64,
        eval_tokens=1024,
        num_threads=1,
    )
    return TinyTargetConfig(**(fields | overrides))


@pytest.fixture(scope="session")
def tiny_target_config() -> TinyTargetConfig:
    """The config the `tiny_target_dir` fixture was built from."""
    return tiny_test_config()


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, tiny_target_config) -> Path:
    """HF dir of the test-size tiny target (LlamaForCausalLM, L=7, H=32, V=300), built once."""
    return build_tiny_target(tiny_target_config, tmp_path_factory.mktemp("tiny-target-cache"))
