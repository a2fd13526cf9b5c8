"""Draft vocabulary: top-N of assistant tokens, d2t offsets, t2d mask, padding, cache."""

from __future__ import annotations

import pytest
import torch

from eagle3.draft.vocab import (
    build_draft_vocab,
    build_or_load_draft_vocab,
    count_masked_tokens,
    load_draft_vocab,
    select_draft_tokens,
    vocab_data_hash,
)

# Target vocab V = 10. Only loss-masked tokens count:
#   sample 0: ids [1, 7, 7, 3, 9], mask [0, 1, 1, 1, 0] -> 7, 7, 3
#   sample 1: ids [2, 3, 7, 5, 5], mask [0, 1, 1, 1, 1] -> 3, 7, 5, 5
# counts: 7 x3, 3 x2, 5 x2 (1, 2, 9 are unmasked and do not count)
IDS = [[1, 7, 7, 3, 9], [2, 3, 7, 5, 5]]
MASKS = [[0, 1, 1, 1, 0], [0, 1, 1, 1, 1]]


def test_counts_only_masked_tokens():
    assert count_masked_tokens(IDS, MASKS, 10).tolist() == [0, 0, 0, 2, 0, 2, 0, 3, 0, 0]


def test_top_n_sorted_ascending_with_offsets():
    vocab = build_draft_vocab(count_masked_tokens(IDS, MASKS, 10), draft_vocab_size=2)
    # top-2 by count: 7 (3), then 3 and 5 tie at 2 -> lower id 3 wins; ascending -> [3, 7]
    assert vocab.target_ids.tolist() == [3, 7]
    assert vocab.d2t.tolist() == [3, 6]  # target id = i + d2t[i]: 0 + 3 = 3, 1 + 6 = 7
    assert vocab.d2t.dtype == torch.int64
    assert vocab.t2d.tolist() == [False, False, False, True, False, False, False, True, False, False]
    assert vocab.t2d.dtype == torch.bool


def test_pads_with_lowest_unused_ids_when_too_few_seen():
    vocab = build_draft_vocab(count_masked_tokens(IDS, MASKS, 10), draft_vocab_size=5)
    # seen: 7, 3, 5; padded with the two lowest unused ids 0, 1 -> ascending [0, 1, 3, 5, 7]
    assert vocab.target_ids.tolist() == [0, 1, 3, 5, 7]
    assert vocab.d2t.tolist() == [0, 0, 1, 2, 3]
    assert vocab.t2d.tolist() == [True, True, False, True, False, True, False, True, False, False]


def test_docstring_example_and_bounds():
    counts = torch.tensor([0, 5, 0, 9, 5, 0])
    assert select_draft_tokens(counts, 4).tolist() == [0, 1, 3, 4]
    assert build_draft_vocab(counts, 4).d2t.tolist() == [0, 0, 1, 1]
    with pytest.raises(ValueError, match=r"draft_vocab_size must be in 1\.\.6"):
        select_draft_tokens(counts, 7)
    with pytest.raises(ValueError, match="token id 12 >= target vocab size 10"):
        count_masked_tokens([[12]], [[1]], 10)


def test_coverage_is_share_of_assistant_tokens_in_vocab():
    counts = count_masked_tokens(IDS, MASKS, 10)
    assert build_draft_vocab(counts, 2).coverage(counts) == pytest.approx(5 / 7)  # 7 x3 + 3 x2 of 7 tokens
    assert build_draft_vocab(counts, 3).coverage(counts) == pytest.approx(1.0)


def test_cache_reuses_only_matching_data(tmp_path):
    vocab, info = build_or_load_draft_vocab(IDS, MASKS, 2, 10, tmp_path)
    assert info["cached"] is False and info["coverage"] == pytest.approx(5 / 7)
    assert (info["distinct_tokens"], info["counted_tokens"]) == (3, 7)
    again, info2 = build_or_load_draft_vocab(IDS, MASKS, 2, 10, tmp_path)
    assert info2["cached"] is True and info2["data_hash"] == info["data_hash"]
    assert torch.equal(again.d2t, vocab.d2t) and torch.equal(again.t2d, vocab.t2d)
    # one mask bit differs -> another hash -> rebuilt (9 now counts once; the top-2 stays [3, 7])
    changed = [[0, 1, 1, 1, 0], [0, 1, 1, 1, 1]]
    changed[0][4] = 1  # token 9 now counts
    rebuilt, info3 = build_or_load_draft_vocab(IDS, changed, 2, 10, tmp_path)
    assert info3["cached"] is False and info3["data_hash"] != info["data_hash"]
    assert rebuilt.target_ids.tolist() == [3, 7]
    with pytest.raises(ValueError, match="was built for data"):
        load_draft_vocab(tmp_path, expected_hash=info["data_hash"])


def test_hash_covers_n_and_target_vocab():
    base = vocab_data_hash(IDS, MASKS, 2, 10)
    assert base == vocab_data_hash(IDS, MASKS, 2, 10)
    assert len({base, vocab_data_hash(IDS, MASKS, 3, 10), vocab_data_hash(IDS, MASKS, 2, 11)}) == 3
