"""target.engine sglang: SGLang 0.5.23's own model runner captures what eagleops' HF capture captures.

The runner runs in the CPU SGLang venv (`sglang_python`, tests/conftest.py; SGLang's CPU engine, tp 1,
its CUDA kernels replaced by an import stub that raises if called). The oracle on the other side is
transformers' forward with eagleops' hooks (`TargetFeatureExtractor`), in this process: two
implementations of the target, two implementations of the layer rule (SGLang's
`set_eagle3_layers_to_capture` per model file, eagleops' `eagle3.data.capture` table), and expected
indices written out by hand below.

Measured: Llama-shaped tiny target, fp32 on CPU -- aux and final states equal to 0.0 (max |diff|);
the tolerance below is fp32 rounding of a different kernel order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3.config import DataConfig, RegenerateConfig, TargetConfig
from eagle3.data.capture import TargetFeatureExtractor, aux_ids_to_hf_indices
from eagle3.data.generate import generate_dataset

REPO = Path(__file__).resolve().parents[3]
ROWS = [[5, 17, 33, 90, 12, 7, 8], [40, 41, 42, 43], [3] * 9]
ATOL = 1e-5

# Runs in the SGLang venv: one runner per process; further id sets go through SGLang's own
# set_eagle3_layers_to_capture on the same model (what the runner calls at start).
CAPTURE_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from eagle3.data.sglang_engine import SGLangCaptureSettings, SGLangFeatureExtractor, _capture, _layers_to_capture
    target, out, id_sets = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    rows = json.loads(sys.argv[4])
    first = id_sets[0]
    extractor = SGLangFeatureExtractor(SGLangCaptureSettings(target, first, device="cpu", max_batch_tokens=1024))
    results = {}
    for ids in id_sets:
        if ids != first:
            extractor.runner.model.set_eagle3_layers_to_capture(ids)
        aux, last = _capture(extractor.runner, rows)
        results[json.dumps(ids)] = {"aux": aux, "last": last, "indices": sorted(_layers_to_capture(extractor.runner.model))}
    results["engine"] = extractor.engine_record()
    torch.save(results, out)
    """
)


def run_in_sglang(sglang_python: Path, argv: list[str], tmp_path: Path, timeout: float = 300) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(sglang_python), *argv], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]


def sglang_capture(sglang_python: Path, target: Path, id_sets: list, tmp_path: Path) -> dict:
    out = tmp_path / "sglang-capture.pt"
    script = tmp_path / "capture.py"
    script.write_text(CAPTURE_SCRIPT)
    run_in_sglang(sglang_python, [str(script), str(target), str(out), json.dumps(id_sets), json.dumps(ROWS)], tmp_path)
    return torch.load(out)


def hf_capture(model, ids: list[int] | None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    extractor = TargetFeatureExtractor.from_model(model, ids)
    aux, last = extractor.capture_rows(ROWS)
    return aux, last, extractor.hf_indices


def test_sglang_runner_captures_what_hf_captures_on_the_tiny_target(sglang_python, tiny_target_dir, tmp_path):
    # tiny target: 7 layers -> SGLang's default capture indices [2, L//2, L-3] = [2, 3, 4];
    # explicit ids [0, 3, 5] -> +1 each (Llama rule) -> [1, 4, 6]
    expected = {None: [2, 3, 4], (0, 3, 5): [1, 4, 6]}
    captured = sglang_capture(sglang_python, tiny_target_dir, [None, [0, 3, 5]], tmp_path)
    model = TargetFeatureExtractor(tiny_target_dir).model
    for ids, indices in expected.items():
        got = captured[json.dumps(list(ids) if ids else None)]
        aux, last, hf_indices = hf_capture(model, list(ids) if ids else None)
        assert got["indices"] == hf_indices == indices
        assert got["aux"].shape == aux.shape == (sum(map(len, ROWS)), 3 * model.config.hidden_size)
        torch.testing.assert_close(got["aux"], aux, atol=ATOL, rtol=0)
        torch.testing.assert_close(got["last"], last, atol=ATOL, rtol=0)
    assert captured["engine"]["name"] == "sglang" and captured["engine"]["version"] == "0.5.23"


def tiny_deepseek_v3(path: Path) -> Path:
    """A random 7-layer DeepSeek-V3 (MLA, MoE, yarn RoPE as the real one) saved as a hub checkpoint."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    yarn = {"rope_type": "yarn", "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
    config = DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, n_group=1, topk_group=1, max_position_embeddings=256, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(config).save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    # keys SGLang's deepseek_v2.py reads that transformers' config does not write
    raw.update({"rope_scaling": yarn, "rope_parameters": yarn, "moe_layer_freq": 1, "ep_size": 1,
                "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True})
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    return path


def test_deepseek_rule_in_sglangs_own_model_code(sglang_python, tiny_target_dir, tmp_path):
    """SGLang's deepseek_v2.py (also Kimi-K2.5's text model): +1 only when the first id is 1."""
    target = tiny_deepseek_v3(tmp_path / "dsv3")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (target / name).write_bytes((tiny_target_dir / name).read_bytes())
    # default [2, L//2, L-3] for L = 7; [1, 3, 5] starts with 1 -> +1; [2, 3, 5] is used as capture indices
    expected = {None: [2, 3, 4], (1, 3, 5): [2, 4, 6], (2, 3, 5): [2, 3, 5]}
    captured = sglang_capture(sglang_python, target, [list(k) if k else None for k in expected], tmp_path)
    for ids, indices in expected.items():
        got = captured[json.dumps(list(ids) if ids else None)]
        assert got["indices"] == indices
        assert aux_ids_to_hf_indices("DeepseekV3ForCausalLM", list(ids) if ids else None, 7) == indices
        assert got["aux"].shape == (sum(map(len, ROWS)), 3 * 64) and got["last"].shape == (sum(map(len, ROWS)), 64)


FORBID_HF_WEIGHTS = textwrap.dedent(
    """
    import runpy, sys, transformers
    def refuse(*args, **kwargs):
        raise AssertionError("target.engine sglang loaded the target's weights in transformers")
    transformers.PreTrainedModel.from_pretrained = classmethod(refuse)
    transformers.AutoModelForCausalLM.from_pretrained = refuse
    sys.argv = ["eagle3.data.generate", *sys.argv[1:]]
    runpy.run_module("eagle3.data.generate", run_name="__main__")
    """
)


def test_the_data_stage_through_sglang_writes_the_shards_hf_writes(sglang_python, tiny_target_dir, tmp_path):
    data = DataConfig(num_samples=10, max_length=256, shard_size=3, hidden_states_dtype="float32",
                      regenerate=RegenerateConfig(enabled=False), draft_vocab_size=64, capture_batch_size=4)
    hf = generate_dataset(tiny_target_dir, TargetConfig(), data, tmp_path / "hf", log=lambda m: None)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"target": json.loads(TargetConfig(engine="sglang").model_dump_json()),
                                  "data": json.loads(data.model_dump_json())}))
    launcher = tmp_path / "forbid_hf.py"
    launcher.write_text(FORBID_HF_WEIGHTS)
    run_in_sglang(sglang_python, [str(launcher), "--target-dir", str(tiny_target_dir), "--out-dir",
                                  str(tmp_path / "sglang"), "--config", str(config)], tmp_path)
    sglang = json.loads((tmp_path / "sglang" / "summary.json").read_text())
    assert sglang["hf_indices"] == hf["hf_indices"] and sglang["num_tokens"] == hf["num_tokens"]
    manifests = [json.loads((tmp_path / side / "hidden_states" / "manifest.json").read_text()) for side in ("hf", "sglang")]
    assert [m["engine"]["name"] for m in manifests] == ["transformers", "sglang"]
    assert manifests[1]["engine"]["capture_indices"] == manifests[0]["engine"]["capture_indices"] == hf["hf_indices"]
    for entry in manifests[0]["shards"]:
        ours, theirs = (load_file(tmp_path / side / "hidden_states" / entry["file"]) for side in ("hf", "sglang"))
        assert torch.equal(ours["input_ids"], theirs["input_ids"])
        for key in ("aux_hidden_states", "last_hidden_states"):
            torch.testing.assert_close(theirs[key], ours[key], atol=ATOL, rtol=0)


def test_capture_refuses_ids_sglangs_capture_mode_refuses():
    from eagle3.data.sglang_engine import check_capture_ids

    with pytest.raises(ValueError, match="id -1"):
        check_capture_ids([-1, 3, 5])
    with pytest.raises(ValueError, match="repeated"):
        check_capture_ids([3, 3, 5])
    check_capture_ids(None)


def test_the_launch_flags_are_sglangs_capture_only_mode():
    from eagle3.data.sglang_engine import SGLangCaptureSettings

    flags = SGLangCaptureSettings("/m", [1, 29, 57], tp=8, dtype="auto", device="cuda", trust_remote_code=True,
                                  extra_args=["--quantization", "w4afp8"]).launch_flags()
    joined = " ".join(flags)
    assert "--enable-return-aux-hidden-states --speculative-algorithm EAGLE3" in joined
    assert "--return-aux-hidden-state-layer-ids 1 29 57" in joined and "--tp-size 8" in joined
    assert "--dtype bfloat16" in joined and "--disable-radix-cache" in joined and "--trust-remote-code" in joined
    assert flags[-2:] == ["--quantization", "w4afp8"] and "--speculative-draft-model-path" not in joined
    assert sys.executable  # the flags are built without SGLang installed here
