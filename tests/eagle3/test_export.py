"""Export: SGLang key set and config, reload gives identical logits, speculators layout,
and the validator rejecting each way SGLang would silently mis-load a draft."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.config import ExportConfig
from eagle3.draft.model import DraftModelConfig, Eagle3DraftModel
from eagle3.export import (
    assert_valid_sglang_checkpoint,
    export_checkpoint,
    export_sglang,
    export_speculators,
    load_exported,
    validate_sglang_checkpoint,
    validate_speculators_checkpoint,
)

# SGLang's LlamaForCausalLMEagle3 tensor names (sglang python/sglang/srt/models/llama_eagle3.py,
# checkpoint naming, one layer, no fc bias, no norm_before_fc); embed_tokens is the target's.
SGLANG_KEYS = {
    "fc.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}
TARGET = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 8,
    "vocab_size": 80,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0},
    "bos_token_id": 1,
    "eos_token_id": 2,
}
AUX = [1, 3, 4]




def make_model(seed: int = 0) -> tuple[Eagle3DraftModel, torch.Tensor]:
    torch.manual_seed(seed)
    model = Eagle3DraftModel(DraftModelConfig.from_target_config(TARGET, 40, AUX))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    used = torch.tensor(sorted(torch.randperm(80, generator=torch.Generator().manual_seed(1))[:40].tolist()))
    t2d = torch.zeros(80, dtype=torch.bool)
    t2d[used] = True
    model.set_vocab_mapping(used - torch.arange(40), t2d)
    embed = torch.randn(80, 32)
    model.load_target_embedding(embed)
    return model, embed


def logits_of(model: Eagle3DraftModel, seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids, aux = torch.randint(0, 80, (2, 6), generator=g), torch.randn(2, 6, 96, generator=g)
    dtype = model.fc.weight.dtype
    with torch.no_grad():
        out, _ = model.decoder_step(ids, model.project(aux.to(dtype)), torch.arange(6)[None].expand(2, 6))
        return model.compute_logits(out)


def test_sglang_export_has_exactly_sglangs_keys_and_config(tmp_path):
    model, _ = make_model()
    path = export_sglang(model, TARGET, tmp_path / "sglang", "bfloat16")
    weights = load_file(str(path / "model.safetensors"))
    assert set(weights) == SGLANG_KEYS
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    assert weights["fc.weight"].dtype == torch.bfloat16
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["vocab_size"] == 80 and config["draft_vocab_size"] == 40 and config["target_hidden_size"] == 32
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": AUX, "use_aux_hidden_state": True,
                                      "norm_before_fc": False}
    assert "eagle_aux_hidden_state_layer_ids" not in config  # SGLang reads only the nested one
    assert config["rope_parameters"] == TARGET["rope_parameters"]
    assert config["max_position_embeddings"] == 512
    assert validate_sglang_checkpoint(path, TARGET) == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_reload_gives_identical_logits(tmp_path, dtype):
    model, embed = make_model()
    path = export_sglang(model, TARGET, tmp_path / "sglang", dtype)
    reloaded = load_exported(path, target_embedding=embed)
    reference = model.to(getattr(torch, dtype))
    assert reloaded.fc.weight.dtype == getattr(torch, dtype)
    assert torch.equal(logits_of(reloaded), logits_of(reference))
    assert torch.equal(reloaded.d2t, model.d2t) and torch.equal(reloaded.t2d, model.t2d)
    assert reloaded.config == model.config


def test_speculators_export_layout_ids_and_reload(tmp_path):
    model, embed = make_model()
    path = export_speculators(model, TARGET, tmp_path / "spec", "float32", 3, "/models/target", embed)
    weights = load_file(str(path / "model.safetensors"))
    # The embedding travels: speculators' own loader leaves an absent one uninitialised.
    assert set(weights) == {k.replace("midlayer.", "layers.0.") for k in SGLANG_KEYS} | {"embed_tokens.weight"}
    assert torch.equal(weights["embed_tokens.weight"], embed)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Eagle3Speculator"] and config["speculators_model_type"] == "eagle3"
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM: input of layer k = SGLang id + 1
    assert config["norm_before_residual"] is False  # explicit: vLLM's adapter defaults a missing key to True
    layer = config["transformer_layer_config"]
    assert layer["hidden_size"] == 32 and layer["vocab_size"] == 80 and layer["num_hidden_layers"] == 1
    spec = config["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == 3
    assert spec["verifier"] == {"name_or_path": "/models/target", "architectures": ["LlamaForCausalLM"]}
    assert validate_speculators_checkpoint(path, TARGET) == []
    without_embedding = load_file(str(path / "model.safetensors"))
    del without_embedding["embed_tokens.weight"]
    save_file(without_embedding, str(path / "model.safetensors"))
    assert [p.code for p in validate_speculators_checkpoint(path, TARGET)] == ["embed_tokens_missing"]
    reloaded = load_exported(path, target_embedding=embed)
    assert reloaded.config.aux_layer_ids == AUX
    assert torch.equal(logits_of(reloaded), logits_of(model))


def _target_dir(tmp_path: Path, embed: torch.Tensor) -> Path:
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TARGET))
    save_file({"model.embed_tokens.weight": embed, "lm_head.weight": torch.randn(80, 32)}, str(target / "model.safetensors"))
    return target


def test_export_checkpoint_stage_entry(tmp_path):
    model, embed = make_model()
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000010"
    ckpt.mkdir(parents=True)
    state = {k: v for k, v in model.state_dict().items() if k != "embed_tokens.weight"}
    save_file(state, str(ckpt / "model.safetensors"))
    (ckpt / "draft_config.json").write_text(json.dumps(model.config.to_dict()))
    target = _target_dir(tmp_path, embed)
    result = export_checkpoint(ckpt, target, ExportConfig(formats=["sglang", "speculators"], dtype="float32"),
                               tmp_path / "export")
    assert set(result["formats"]) == {"sglang", "speculators"}
    assert result["validation"]["sglang"] == []
    # The default verifier is this machine's target path: flagged, since it names nothing on a serving host.
    assert [p["code"] for p in result["validation"]["speculators"]] == ["verifier_local_path"]
    json.dumps(result)
    reloaded = load_exported(Path(result["formats"]["sglang"]), target_dir=target)
    assert torch.equal(logits_of(reloaded), logits_of(model))
    with pytest.raises(ValueError, match="target_embedding or target_dir"):
        load_exported(Path(result["formats"]["sglang"]))
    (ckpt.parent / "latest").write_text(ckpt.name)  # a run's checkpoints/ root resolves to its latest
    again = export_checkpoint(ckpt.parent, target, ExportConfig(dtype="float32"), tmp_path / "export2")
    assert load_file(again["formats"]["sglang"] + "/model.safetensors").keys() == SGLANG_KEYS


# ---------------------------------------------------------------- validator


def _broken(tmp_path: Path, edit_config=None, edit_weights=None) -> Path:
    model, _ = make_model()
    path = export_sglang(model, TARGET, tmp_path / "draft", "bfloat16")
    if edit_config:
        config = json.loads((path / "config.json").read_text())
        edit_config(config)
        (path / "config.json").write_text(json.dumps(config))
    if edit_weights:
        weights = load_file(str(path / "model.safetensors"))
        edit_weights(weights)
        save_file(weights, str(path / "model.safetensors"))
    return path


def _rename(old: str, new: str):
    return lambda w: w.__setitem__(new, w.pop(old))


def _set(key, value):
    return lambda c: c.__setitem__(key, value)


def _set_ids(ids):
    return lambda c: c["eagle_config"].__setitem__("eagle_aux_hidden_state_layer_ids", ids)


def _ids_top_level(c):
    c["eagle_aux_hidden_state_layer_ids"] = c.pop("eagle_config")["eagle_aux_hidden_state_layer_ids"]


def _shuffle_d2t(w):
    w["d2t"] = w["d2t"].flip(0)


BROKEN = {
    "missing key": (None, lambda w: w.pop("lm_head.weight"), "missing_key", "stays at its initial value"),
    "missing d2t": (None, lambda w: w.pop("d2t"), "missing_key", "first draft_vocab_size target ids"),
    "renamed key": (None, _rename("midlayer.self_attn.q_proj.weight", "midlayer.attn.q_proj.weight"),
                    "unknown_key", "drops it silently"),
    "leftover prefix": (None, _rename("fc.weight", "draft_model.fc.weight"), "key_prefix", "drops names"),
    "model. prefix": (None, _rename("lm_head.weight", "model.lm_head.weight"), "key_prefix", "initial value"),
    "no draft_vocab_size": (lambda c: c.pop("draft_vocab_size"), None, "draft_vocab_size_missing", "AttributeError"),
    "tied embeddings": (_set("tie_word_embeddings", True), None, "tie_word_embeddings", "lm_head.weight is dropped"),
    "ids only top level": (_ids_top_level, None, "aux_layer_ids_location", "default layers"),
    "id L-1 not capturable": (_set_ids([1, 3, 7]), None, "aux_layer_ids_range", "never visits"),
    "id out of range": (_set_ids([-3, 3, 4]), None, "aux_layer_ids_range", "silently missing"),
    "ids not ascending": (_set_ids([4, 1, 3]), None, "aux_layer_ids_order", "ascending layer order"),
    "short context": (_set("max_position_embeddings", 128), None, "max_position_embeddings", "acceptance collapses"),
    "rope drift": (lambda c: c["rope_parameters"].__setitem__("rope_theta", 10000.0), None, "rope", "RoPE"),
    "d2t length": (None, lambda w: w.__setitem__("d2t", w["d2t"][:-1]), "d2t_length", "weight loader"),
    "d2t/t2d disagree": (None, _shuffle_d2t, "d2t_t2d", "serves another"),
    "wrong architecture": (_set("architectures", ["LlamaForCausalLM"]), None, "architecture", "architectures[0]"),
    "wrong fc width": (None, lambda w: w.__setitem__("fc.weight", w["fc.weight"][:, :64].contiguous()), "shape", "expected [32, 96]"),
    "wrong vocab": (_set("vocab_size", 96), None, "vocab_size", "target's"),
    "d2t dtype": (None, lambda w: w.__setitem__("d2t", w["d2t"].int()), "dtype", "torch.int64"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_validator_rejects_each_broken_variant(tmp_path, case):
    edit_config, edit_weights, code, phrase = BROKEN[case]
    path = _broken(tmp_path, edit_config, edit_weights)
    problems = validate_sglang_checkpoint(path, TARGET)
    matching = [p for p in problems if p.code == code]
    assert matching, problems
    assert any(phrase in p.message for p in matching), matching
    with pytest.raises(ValueError, match=code):
        assert_valid_sglang_checkpoint(path, TARGET)


def test_validator_warns_on_hf_index_looking_ids(tmp_path):
    path = _broken(tmp_path, _set_ids([2, 4, 5]))  # = SGLang's default capture indices for L = 8
    problems = validate_sglang_checkpoint(path, TARGET)
    assert [p.code for p in problems] == ["aux_layer_ids_hf_convention"]
    assert problems[0].severity == "warning" and "[1, 3, 4]" in problems[0].message
    assert assert_valid_sglang_checkpoint(path, TARGET) == problems  # warnings do not raise


def test_validator_missing_files(tmp_path):
    assert [p.code for p in validate_sglang_checkpoint(tmp_path, TARGET)] == ["missing_config"]
    path = _broken(tmp_path)
    (path / "model.safetensors").unlink()
    assert [p.code for p in validate_sglang_checkpoint(path, TARGET)] == ["missing_weights"]


def test_validator_deepseek_capture_rule(tmp_path):
    deepseek = {**TARGET, "architectures": ["DeepseekV3ForCausalLM"]}
    path = _broken(tmp_path, _set_ids([2, 4, 7]))  # first id != 1: used as capture indices as-is
    assert validate_sglang_checkpoint(path, deepseek) == []
    shutil.rmtree(path)
    path = _broken(tmp_path, _set_ids([1, 4, 7]))  # first id == 1: +1, so 7 -> 8 is out of range
    assert [p.code for p in validate_sglang_checkpoint(path, deepseek)] == ["aux_layer_ids_range"]


def test_serving_wiring_judges_the_layers_the_capture_engine_hooked(tmp_path):
    """The training record's capture engine (from the shards' manifest) is the evidence, not the ids asked."""
    from eagle3.export import check_serving_wiring

    model, _ = make_model()
    draft = export_sglang(model, TARGET, tmp_path / "draft", "bfloat16")
    # Llama rule, 8 layers: eagle_config ids [1, 3, 4] are fed from HF hidden_states [2, 4, 5]
    record = {"architecture": "LlamaForCausalLM", "num_hidden_layers": 8, "aux_layer_ids": AUX, "hf_indices": [2, 4, 5]}
    assert not [p for p in check_serving_wiring(draft, TARGET, record) if p.code == "layer_mismatch"]
    hooked = record | {"capture_engine": {"name": "sglang", "version": "0.5.23", "capture_indices": [1, 3, 4]}}
    problems = [p for p in check_serving_wiring(draft, TARGET, hooked) if p.code == "layer_mismatch"]
    assert problems and "HF hidden_states [1, 3, 4]" in problems[0].message and "[2, 4, 5]" in problems[0].message


# ---------------------------------------------------------------- the MLA draft (Eagle3DeepseekV2ForCausalLM)

MLA_TARGET = {**TARGET, "architectures": ["DeepseekV3ForCausalLM"], "q_lora_rank": 24, "kv_lora_rank": 16,
              "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6}
# the names SGLang's Eagle3DeepseekV2ForCausalLM.load_weights maps (kimi_k25_eagle3.py: q_a_proj and
# kv_a_proj_with_mqa fused by name, the rest under model.midlayer.*), with fc_norm's per-aux norms
MLA_KEYS = (SGLANG_KEYS - {f"midlayer.self_attn.{n}_proj.weight" for n in "qkv"}) | {
    f"midlayer.self_attn.{n}.weight" for n in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                                                "kv_a_layernorm", "kv_b_proj")} | {f"fc_norm.{i}.weight" for i in range(3)}


def make_mla_model(**options) -> Eagle3DraftModel:
    torch.manual_seed(0)
    model = Eagle3DraftModel(DraftModelConfig.from_target_config(MLA_TARGET, 40, AUX, architecture="deepseek_mla",
                                                                 **options))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    model.load_target_embedding(torch.randn(80, 32))
    return model


def test_mla_export_has_sglangs_mla_names_config_and_reloads_to_the_same_logits(tmp_path):
    model = make_mla_model(fc_norm=True, norm_output=True)
    path = export_sglang(model, MLA_TARGET, tmp_path / "sglang", "float32")
    assert set(load_file(str(path / "model.safetensors"))) == MLA_KEYS
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["model_type"] == "deepseek_v3"
    assert {k: config[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                   "v_head_dim", "num_attention_heads", "num_key_value_heads")} == {
        "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
        "num_attention_heads": 4, "num_key_value_heads": 4}
    assert config["rope_interleave"] is True and config["fc_norm"] is True and config["norm_output"] is True
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX
    assert validate_sglang_checkpoint(path, MLA_TARGET) == []
    from eagle3.export import check_serving_wiring

    assert [p.code for p in check_serving_wiring(path, MLA_TARGET, None)] == ["training_record"]
    reloaded = load_exported(path, target_embedding=model.embed_tokens.weight)
    assert reloaded.config == model.config
    torch.testing.assert_close(logits_of(reloaded), logits_of(model), rtol=0, atol=0)


MLA_BROKEN = {
    "no q_lora_rank": (lambda c: c.pop("q_lora_rank"), None, "mla_dims", "refuses a draft without q_lora_rank"),
    "neox rope": (_set("rope_interleave", False), None, "rope_interleave", "neox-style"),
    "llama model_type": (_set("model_type", "llama"), None, "model_type", "'deepseek_v3'"),
    "missing kv_a": (None, lambda w: w.pop("midlayer.self_attn.kv_a_proj_with_mqa.weight"), "missing_key", "initial value"),
    "renamed kv_b": (None, _rename("midlayer.self_attn.kv_b_proj.weight", "midlayer.self_attn.kv_b.weight"),
                     "unknown_key", "with a warning"),
    "wrong kv_b shape": (None, lambda w: w.__setitem__("midlayer.self_attn.kv_b_proj.weight",
                                                       w["midlayer.self_attn.kv_b_proj.weight"][:40].contiguous()),
                         "shape", "expected [56, 16]"),
}


@pytest.mark.parametrize("case", sorted(MLA_BROKEN))
def test_validator_rejects_each_broken_mla_variant(tmp_path, case):
    edit_config, edit_weights, code, phrase = MLA_BROKEN[case]
    path = export_sglang(make_mla_model(), MLA_TARGET, tmp_path / "sglang", "float32")
    if edit_config is not None:
        config = json.loads((path / "config.json").read_text())
        edit_config(config)
        (path / "config.json").write_text(json.dumps(config))
    if edit_weights is not None:
        weights = load_file(str(path / "model.safetensors"))
        edit_weights(weights)
        save_file(weights, str(path / "model.safetensors"))
    matching = [p for p in validate_sglang_checkpoint(path, MLA_TARGET) if p.code == code]
    assert matching and any(phrase in p.message for p in matching), validate_sglang_checkpoint(path, MLA_TARGET)
