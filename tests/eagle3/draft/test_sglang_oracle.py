"""SGLang's own draft classes as the oracle of eagleops' draft and its SGLang export.

Each case trains nothing: it builds a draft with non-trivial weights (norm weights away from 1, a reduced
vocab with a non-identity d2t), exports it with `export_sglang`, and runs the export through SGLang 0.5.23's
model runner on the CPU (tests/eagle3/draft/sglang_draft_oracle.py, in the CPU SGLang venv): SGLang's
registry picks the class from config.json, its loader feeds the file to that class's `load_weights`, and
each forward is the draft's DRAFT_EXTEND_V2 forward over SGLang's KV pool with its CPU attention backend
(`torch_native`). For the MLA draft that is the absorbed-MLA path (latent KV cache, w_kc/w_vc split from
kv_b_proj), which eagleops computes in the expanded form: the two must agree.

Checked per case: the load left no parameter unwritten and (MLA class, which warns) skipped no name; SGLang's
hot-token map is eagleops' d2t; SGLang's logits for the first draft step (fc over the aux states) and for a
second step over the hidden state SGLang hands on (pre-norm, or normed with norm_output), and that hidden
state itself, equal eagleops' `decoder_step` + `compute_logits` within TOLERANCE (fp32 on both sides; the
measured gap is <= 1e-6, from summation order and the absorbed vs expanded MLA forms). This test found that
eagleops first applied DeepSeek-YaRN's mscale^2 softmax factor as mscale (logits 0.04 off).

What SGLang's CPU path does not run here: its GPU attention kernels (flashinfer/fa3/trtllm MLA) -- the
`torch_native` backend's SDPA over the same latent cache stands in -- and its EAGLE worker around the
draft (`set_embed`: the target's embedding is written into the draft folder the oracle loads instead).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.draft.model import DraftModelConfig, Eagle3DraftModel
from eagle3.export import export_sglang, validate_sglang_checkpoint

ORACLE = Path(__file__).with_name("sglang_draft_oracle.py")
TOLERANCE = dict(rtol=1e-5, atol=1e-5)  # fp32 logits of magnitude ~3; measured gaps <= 1e-6
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}  # Kimi-K2.x's YaRN keys (SGLang's CPU MLA rope needs one)
MLA_TARGET = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
              "num_attention_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
              "qk_rope_head_dim": 8, "v_head_dim": 12, "vocab_size": 300, "num_hidden_layers": 8,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256, "rope_scaling": YARN}
LLAMA_TARGET = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300,
                "num_hidden_layers": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256}
CASES = {  # id: (target config, draft options)
    "mla-plain": (MLA_TARGET, {"architecture": "deepseek_mla"}),
    "mla-fc_norm": (MLA_TARGET, {"architecture": "deepseek_mla", "fc_norm": True}),
    "mla-norm_output": (MLA_TARGET, {"architecture": "deepseek_mla", "norm_output": True}),
    "llama-fc_norm-norm_output": (LLAMA_TARGET, {"fc_norm": True, "norm_output": True}),
}


def build_draft(target: dict, options: dict) -> Eagle3DraftModel:
    """A draft whose every weight matters: linears N(0, 0.1), norms N(1, 0.2), draft vocab = 128 spread ids."""
    config = DraftModelConfig.from_target_config(target, 128, [1, 3, 5], **options)
    torch.manual_seed(0)
    draft = Eagle3DraftModel(config)
    draft.reset_parameters(std=0.1)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if param.dim() == 1:
                param.normal_(1.0, 0.2)
    target_ids = torch.randperm(config.vocab_size)[: config.draft_vocab_size].sort().values
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    draft.set_vocab_mapping(target_ids - torch.arange(config.draft_vocab_size), t2d)
    return draft.eval()


def run_oracle(sglang_python: Path, draft: Eagle3DraftModel, target: dict, root: Path,
               edit: Callable[[dict], None] | None = None) -> tuple[dict, dict, dict]:
    """Export `draft` (its tensors changed by `edit`, if given), run it through SGLang; returns (inputs, SGLang's
    outputs, its loading report)."""
    export = export_sglang(draft, target, root / "export", "float32")
    if edit is None:
        assert validate_sglang_checkpoint(export, target) == []
    else:
        weights = load_file(str(export / "model.safetensors"))
        edit(weights)
        save_file(weights, str(export / "model.safetensors"))
    torch.manual_seed(1)
    cfg = draft.config
    inputs = {"input_ids": torch.randint(0, cfg.vocab_size, (12,)),
              "aux": torch.randn(12, cfg.num_aux_hidden_states * cfg.target_hidden_size),
              "embedding": draft.embed_tokens.weight.detach().clone()}
    loaded = root / "as-served"  # the export plus the target's embedding, which SGLang's EAGLE worker sets
    shutil.copytree(export, loaded)
    save_file({**load_file(str(export / "model.safetensors")), "embed_tokens.weight": inputs["embedding"]},
              str(loaded / "model.safetensors"))
    save_file(inputs, str(root / "inputs.safetensors"))
    proc = subprocess.run([str(sglang_python), str(ORACLE), str(loaded), str(root / "inputs.safetensors"),
                           str(root / "out.safetensors")], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return inputs, load_file(str(root / "out.safetensors")), json.loads((root / "loading.json").read_text())


@torch.no_grad()
def eagleops_steps(draft: Eagle3DraftModel, inputs: dict) -> dict:
    """eagleops' two draft steps over the same inputs: logits and the hidden state the first step hands on."""
    ids = inputs["input_ids"][None]
    positions = torch.arange(ids.shape[1])[None]
    hidden_0, _ = draft.decoder_step(ids, draft.project(inputs["aux"][None]), positions)
    hidden_1, _ = draft.decoder_step(ids, hidden_0, positions)
    return {"logits_0": draft.compute_logits(hidden_0)[0], "hidden_0": hidden_0[0],
            "logits_1": draft.compute_logits(hidden_1)[0]}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_sglangs_own_draft_class_loads_the_export_and_computes_the_same_logits(case, sglang_python, tmp_path):
    target, options = CASES[case]
    draft = build_draft(target, options)
    inputs, sglang, loading = run_oracle(sglang_python, draft, target, tmp_path)

    expected_class = "Eagle3DeepseekV2ForCausalLM" if draft.config.is_mla else "LlamaForCausalLMEagle3"
    assert loading["class"] == expected_class
    assert loading["missing"] == [] and loading["unexpected"] == [], loading
    assert torch.equal(sglang["hot_token_id"], draft.draft_to_target(torch.arange(draft.config.draft_vocab_size)))
    ours = eagleops_steps(draft, inputs)
    gaps = {name: (ours[name] - sglang[name]).abs().max().item() for name in ours}
    print(f"{case}: max |eagleops - SGLang| {gaps}, logits max |x| {sglang['logits_0'].abs().max().item():.2f}")
    for name in ours:
        torch.testing.assert_close(ours[name], sglang[name], **TOLERANCE, msg=lambda m: f"{case} {name}: {m}")

    # the comparison tells the EAGLE-3.1 options apart: without the option eagleops would be far off
    for option in ("fc_norm", "norm_output"):
        if options.get(option):
            plain = Eagle3DraftModel(DraftModelConfig(**{**draft.config.to_dict(), option: False}))
            plain.load_state_dict(draft.state_dict(), strict=False)
            name = "logits_0" if option == "fc_norm" else "logits_1"
            assert (eagleops_steps(plain.eval(), inputs)[name] - sglang[name]).abs().max() > 100 * TOLERANCE["atol"]


@pytest.mark.slow
def test_a_name_sglangs_mla_loader_does_not_know_is_caught(sglang_python, tmp_path):
    """The oracle's key check can fail: a renamed tensor is skipped (SGLang warns) and its parameter stays
    unwritten; eagleops' validator says the same before any server would start."""
    draft = build_draft(MLA_TARGET, {"architecture": "deepseek_mla"})

    def rename(weights: dict) -> None:
        weights["midlayer.self_attn.kv_b.weight"] = weights.pop("midlayer.self_attn.kv_b_proj.weight")

    _, _, loading = run_oracle(sglang_python, draft, MLA_TARGET, tmp_path, edit=rename)
    assert loading["unexpected"] == ["midlayer.self_attn.kv_b.weight"]
    assert loading["missing"] == ["model.midlayer.self_attn.kv_b_proj.weight"]
    problems = validate_sglang_checkpoint(tmp_path / "export", MLA_TARGET)
    assert {p.code for p in problems} == {"unknown_key", "missing_key"}, problems
