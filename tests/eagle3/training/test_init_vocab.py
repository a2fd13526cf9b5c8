"""Training from another draft's weights (train.init_checkpoint) keeps that draft's vocabulary: a served-traffic
nightly starts from the champion while the night's data counts its own draft vocabulary from other traffic
(found by tests/flows/test_served_story.py: night 2 failed with "d2t differs")."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from eagle3.training.checkpoints import load_initial_weights
from eagle3.training.train import _init_vocab_mapping
from tests.eagle3.training.test_train import VD, make_draft, make_world


def _saved(draft, folder):
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in draft.state_dict().items() if k != "embed_tokens.weight"},
              str(folder / "model.safetensors"))
    return folder


def test_training_from_a_draft_of_another_vocabulary_keeps_its_vocabulary(tmp_path):
    embed, _, champion_map = make_world(0)
    _, _, data_map = make_world(1)  # another night's traffic: another top-VD
    assert not torch.equal(champion_map[0], data_map[0])
    champion = _saved(make_draft(embed, champion_map, seed=3), tmp_path / "champion")
    lines = []
    d2t, t2d = _init_vocab_mapping(champion, data_map, lines.append)
    assert torch.equal(d2t, champion_map[0]) and torch.equal(t2d, champion_map[1])
    assert len(lines) == 1 and "training starts from" in lines[0]
    refined = make_draft(embed, (d2t, t2d), seed=4)
    load_initial_weights(refined, champion)  # the champion's rows under the champion's map
    assert torch.equal(refined.lm_head.weight, make_draft(embed, champion_map, seed=3).lm_head.weight)
    with pytest.raises(ValueError, match="d2t differs"):  # what the data's own map did before
        load_initial_weights(make_draft(embed, data_map, seed=4), champion)


def test_the_datas_vocabulary_stays_when_the_start_has_the_same_one_or_another_size(tmp_path):
    embed, _, mapping = make_world(0)
    same = _saved(make_draft(embed, mapping), tmp_path / "same")
    lines = []
    assert _init_vocab_mapping(same, mapping, lines.append) is mapping and lines == []
    other = tmp_path / "other"
    other.mkdir()
    save_file({"d2t": torch.zeros(VD // 2, dtype=torch.long)}, str(other / "model.safetensors"))
    assert _init_vocab_mapping(other, mapping, lines.append) is mapping  # load_initial_weights names the shape
    assert _init_vocab_mapping(tmp_path / "missing", mapping, lines.append) is mapping
