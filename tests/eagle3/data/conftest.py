"""Shared fixtures for tests/eagle3/data: the session tiny target loaded in transformers."""

from __future__ import annotations

import pytest

from eagle3.data.target import load_target


@pytest.fixture(scope="module")
def tiny_model(tiny_target_dir):
    model, _ = load_target(tiny_target_dir)
    return model
