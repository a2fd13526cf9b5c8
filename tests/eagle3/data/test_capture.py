"""Aux-layer id conventions (SGLang 0.5.23) and the capture itself on the tiny target."""

from __future__ import annotations

import itertools

import pytest
import torch

from eagle3.data.capture import (
    CAPTURE_RULES,
    TargetFeatureExtractor,
    aux_ids_to_hf_indices,
    capture_hidden_states,
    decoder_layers,
    default_aux_layer_ids,
    hf_indices_to_aux_ids,
)
from eagle3.data.target import load_target

LLAMA, DSV3, KIMI, GLM_LITE, GPT_OSS = (
    "LlamaForCausalLM",
    "DeepseekV3ForCausalLM",
    "KimiK25ForConditionalGeneration",
    "Glm4MoeLiteForCausalLM",
    "GptOssForCausalLM",
)


@pytest.mark.parametrize(
    ("arch", "layers", "expected_ids"),
    [
        (LLAMA, 32, [1, 15, 28]),  # Llama-3.1-8B: outputs of layers 1, 15, 28 (SpecForge default)
        (LLAMA, 8, [1, 3, 4]),
        (LLAMA, 7, [1, 2, 3]),
        ("Qwen3ForCausalLM", 36, [1, 17, 32]),
        (DSV3, 61, [2, 30, 58]),  # what SpecForge's kimi-k25-eagle3.json ships
        (KIMI, 61, [2, 30, 58]),
        (GLM_LITE, 47, [2, 23, 44]),
        (GPT_OSS, 24, [1, 11, 20]),
        (GPT_OSS, 36, [1, 17, 32]),
    ],
)
def test_default_ids_select_sglang_default_layers(arch, layers, expected_ids):
    assert default_aux_layer_ids(arch, layers) == expected_ids
    assert aux_ids_to_hf_indices(arch, expected_ids, layers) == [2, layers // 2, layers - 3]
    assert aux_ids_to_hf_indices(arch, None, layers) == [2, layers // 2, layers - 3]


@pytest.mark.parametrize(
    ("arch", "ids", "expected_hf"),
    [
        (LLAMA, [1, 3, 4], [2, 4, 5]),
        (LLAMA, [4, 1, 3], [2, 4, 5]),  # captured in layer order, not list order
        (LLAMA, [1, 1, 4], [2, 5]),  # duplicates captured once
        (LLAMA, [-1, 0, 6], [0, 1, 7]),  # -1 = embeddings; 6 = output of layer 6 = HF 7
        (DSV3, [1, 3, 4], [2, 4, 5]),  # first id is 1 -> +1
        (DSV3, [2, 4, 5], [2, 4, 5]),  # otherwise as-is
        (DSV3, [0, 3, 4], [0, 3, 4]),  # as-is, NOT [1, 4, 5]
        (DSV3, [4, 1, 5], [1, 4, 5]),  # HF 1 reachable only when 1 is not first
        (KIMI, [1, 5, 6], [2, 6, 7]),
        (GLM_LITE, [3, 5, 7], [3, 5, 7]),
        (GPT_OSS, [1, 3, 8], [1, 3, 8]),  # max id == L -> as-is; 8 = after the last layer
        (GPT_OSS, [1, 3, 7], [2, 4, 8]),  # else +1, and 7 + 1 = 8 is still reachable
    ],
)
def test_ids_to_hf_indices_per_architecture(arch, ids, expected_hf):
    assert aux_ids_to_hf_indices(arch, ids, 8) == expected_hf


@pytest.mark.parametrize(
    ("arch", "hf", "expected_ids"),
    [
        (LLAMA, [2, 4, 5], [1, 3, 4]),
        (LLAMA, [5, 2, 4], [1, 3, 4]),
        (LLAMA, [0, 7], [-1, 6]),
        (DSV3, [2, 4, 5], [2, 4, 5]),
        (DSV3, [1, 4, 5], [4, 1, 5]),
        (DSV3, [0, 1], [0, 1]),  # lowest is 0, so as-is works
        (GPT_OSS, [2, 4, 5], [1, 3, 4]),
        (GPT_OSS, [1, 3, 8], [1, 3, 8]),
    ],
)
def test_hf_indices_to_ids_per_architecture(arch, hf, expected_ids):
    assert hf_indices_to_aux_ids(arch, hf, 8) == expected_ids


def test_round_trip_over_every_small_index_set():
    for arch in (LLAMA, DSV3, GPT_OSS):
        top = 8 if arch == GPT_OSS else 7
        for size in (1, 2, 3):
            for hf in itertools.combinations(range(top + 1), size):
                if arch == DSV3 and hf == (1,):
                    continue
                ids = hf_indices_to_aux_ids(arch, list(hf), 8)
                assert aux_ids_to_hf_indices(arch, ids, 8) == list(hf), (arch, hf, ids)


def test_final_normed_state_is_unreachable_for_llama():
    only_2_4 = r"would capture only HF indices \[2, 4\]"
    with pytest.raises(ValueError, match=r"capture indices \[8\] outside 0\.\.7.*" + only_2_4):
        hf_indices_to_aux_ids(LLAMA, [2, 4, 8], 8)
    with pytest.raises(ValueError, match=r"aux ids \[1, 3, 7\].*" + only_2_4 + r" \(2 tensors instead of 3\)"):
        aux_ids_to_hf_indices(LLAMA, [1, 3, 7], 8)
    with pytest.raises(ValueError, match="outside 0..7"):
        aux_ids_to_hf_indices(DSV3, [2, 4, 8], 8)
    with pytest.raises(ValueError, match=r"outside 0\.\.8"):
        aux_ids_to_hf_indices(GPT_OSS, [1, 3, 9], 8)


def test_deepseek_lone_index_one_and_unknown_architecture_raise():
    with pytest.raises(ValueError, match="HF index 1 alone"):
        hf_indices_to_aux_ids(DSV3, [1], 8)
    with pytest.raises(ValueError, match="no SGLang aux-capture rule known for architecture 'FooForCausalLM'"):
        default_aux_layer_ids("FooForCausalLM", 8)
    assert CAPTURE_RULES["MistralForCausalLM"] == CAPTURE_RULES[LLAMA]


def _batch(vocab: int, lengths=(12, 7)) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.zeros((len(lengths), max(lengths)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(10, vocab, (n,), generator=gen)
        mask[i, :n] = 1
    return ids, mask


def test_capture_matches_hf_output_hidden_states(tiny_model):
    ids, mask = _batch(tiny_model.config.vocab_size)
    with torch.no_grad():
        out = tiny_model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    hs = out.hidden_states
    assert len(hs) == 8  # L + 1 for L = 7
    aux, last = capture_hidden_states(tiny_model, ids, mask, None)  # default ids [1, 2, 3] -> HF [2, 3, 4]
    assert aux.shape == (2, 12, 3 * 32) and last.shape == (2, 12, 32)
    torch.testing.assert_close(aux, torch.cat([hs[2], hs[3], hs[4]], dim=-1))
    aux, _ = capture_hidden_states(tiny_model, ids, mask, [5, -1])  # HF [0, 6], ascending
    torch.testing.assert_close(aux, torch.cat([hs[0], hs[6]], dim=-1))
    # last = HF hidden_states[L] = post-norm = the lm_head input
    torch.testing.assert_close(last, hs[7])
    torch.testing.assert_close(tiny_model.lm_head(last), out.logits)


def test_right_padding_does_not_change_real_tokens(tiny_model):
    ids, mask = _batch(tiny_model.config.vocab_size)
    aux_b, last_b = capture_hidden_states(tiny_model, ids, mask, [1, 2, 3])
    aux_1, last_1 = capture_hidden_states(tiny_model, ids[1:, :7], mask[1:, :7], [1, 2, 3])
    torch.testing.assert_close(aux_b[1, :7], aux_1[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last_b[1, :7], last_1[0], atol=1e-5, rtol=1e-5)


def test_gpt_oss_index_l_is_the_prenorm_last_layer_output(tiny_target_dir):
    model, _ = load_target(tiny_target_dir)
    model.config.architectures = [GPT_OSS]  # same weights, gpt-oss id rule
    ids, mask = _batch(model.config.vocab_size)
    seen = {}
    handle = decoder_layers(model)[-1].register_forward_hook(lambda m, a, o: seen.setdefault("out", o))
    with torch.no_grad():
        hs = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    handle.remove()
    aux, last = capture_hidden_states(model, ids, mask, [1, 3, 7])  # max == L -> as-is: HF [1, 3, 7]
    torch.testing.assert_close(aux, torch.cat([hs[1], hs[3], seen["out"]], dim=-1))
    assert not torch.allclose(aux[..., 64:], hs[7])  # HF's entry L is normed, SGLang's capture is not
    torch.testing.assert_close(last, hs[7])


def test_feature_extractor_from_dir(tiny_target_dir, tiny_model):
    extractor = TargetFeatureExtractor(tiny_target_dir)
    assert (extractor.architecture, extractor.num_hidden_layers, extractor.hidden_size) == (LLAMA, 7, 32)
    assert extractor.aux_layer_ids == [1, 2, 3] and extractor.hf_indices == [2, 3, 4]
    ids, mask = _batch(tiny_model.config.vocab_size)
    aux, last = extractor(ids, mask)
    ref_aux, ref_last = capture_hidden_states(tiny_model, ids, mask, [1, 2, 3])
    torch.testing.assert_close(aux, ref_aux)
    torch.testing.assert_close(last, ref_last)
    assert not aux.requires_grad
