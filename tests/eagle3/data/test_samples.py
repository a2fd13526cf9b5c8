"""The split, the disk estimate, server URLs and batch collation: the small helpers of the data wing."""

from __future__ import annotations

import torch

from eagle3.data.datasets import collate_hidden_states
from eagle3.data.samples import split_ids
from eagle3.data.server_pool import chat_completions_url
from eagle3.environment import hidden_state_bytes as estimate_hidden_state_bytes


def test_split_estimate_url_and_collate():
    val = split_ids(10, 0.2, seed=0)
    assert len(val) == 2 and val == split_ids(10, 0.2, seed=0) and val <= set(range(10))
    assert len(split_ids(3, 0.1, seed=0)) == 1 and split_ids(5, 0.0, seed=0) == set()
    assert estimate_hidden_state_bytes(1000, 4096) == 1000 * 4 * 4096 * 2 == 32_768_000
    assert estimate_hidden_state_bytes(10, 32, num_aux=2, dtype_bytes=4) == 10 * 3 * 32 * 4
    assert chat_completions_url("http://h:1/") == "http://h:1/v1/chat/completions"
    assert chat_completions_url("http://h:1/v1") == "http://h:1/v1/chat/completions"
    items = [
        {"input_ids": torch.tensor([5, 6]), "loss_mask": torch.tensor([0, 1]), "aux_hidden_states": torch.ones(2, 3)},
        {
            "input_ids": torch.tensor([7, 8, 9]),
            "loss_mask": torch.tensor([1, 1, 0]),
            "aux_hidden_states": torch.ones(3, 3),
        },
    ]
    batch = collate_hidden_states(items)
    assert batch["input_ids"].tolist() == [[5, 6, 0], [7, 8, 9]]
    assert batch["loss_mask"].tolist() == [[0, 1, 0], [1, 1, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch["aux_hidden_states"].shape == (2, 3, 3) and batch["aux_hidden_states"][0, 2].sum() == 0
