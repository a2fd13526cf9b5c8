"""tasks.stages.bench.stage pieces that need no server: an offline figure that cannot be computed is left out with its
reason, after every measurement is taken, instead of failing the stage; the benchmark's progress lines name the
setting they measure."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import torch

from eagle3.draft.model import DraftModelConfig, Eagle3DraftModel
from eagle3.export import export_sglang
from tasks.config.load import load_experiment
from tasks.stages.bench import stage as bench
from tasks.stages.bench.stage import _reference_figure, accepted_by_position

REPO = Path(__file__).resolve().parents[3]

TARGET = {"architectures": ["FooForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 48,
          "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 7, "vocab_size": 300,
          "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def test_an_architecture_without_a_capture_rule_leaves_the_reference_decoder_out(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TARGET.items() if k != "architectures"})).save_pretrained(
        tmp_path / "target")
    config_file = tmp_path / "target" / "config.json"  # a Llama by its weights, unknown to the capture rules here
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "architectures": ["FooForCausalLM"]}))
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                            unk_token="<unk>").save_pretrained(tmp_path / "target")
    draft = export_sglang(Eagle3DraftModel(DraftModelConfig.from_target_config(TARGET, 300, [1, 3, 4])), TARGET,
                          tmp_path / "draft", "float32")
    figure = _reference_figure(tmp_path / "target", draft, [[1, 2, 3]],
                               {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}, 4)
    assert list(figure) == ["reference_decoder_unavailable"]
    assert "no SGLang aux-capture rule known for architecture 'FooForCausalLM'" in figure["reference_decoder_unavailable"]


def test_acceptance_by_position_sums_the_requests_histograms_bin_by_bin():
    from types import SimpleNamespace

    # depth 2: histogram[a] = verifies with exactly a drafts accepted, a = 0..2; two requests, two runs
    histograms = [[1, 2, 7], [0, 4, 6], [2, 2, 6], [1, 1, 8]]
    runs = [SimpleNamespace(requests=[SimpleNamespace(meta_info={"spec_correct_drafts_histogram": h}) for h in pair])
            for pair in (histograms[:2], histograms[2:])]
    # 40 verifies: position 1 accepted in all but the 4 with none, position 2 in the 27 with both
    assert accepted_by_position(SimpleNamespace(runs=runs)) == [36 / 40, 27 / 40]


def test_measure_logs_the_rounds_progress_under_the_settings_label(monkeypatch, caplog):
    """The client's progress lines reach the stage's logger, each prefixed with the setting and concurrency
    (the client against a real server: tests/eagle3/serving/test_sglang_client.py)."""
    cfg = load_experiment(REPO / "configs" / "tiny.yaml")

    def fake_rounds(client, prompts, **kwargs):
        for i in range(kwargs["timed_runs"]):
            kwargs["log"](f"timed run {i + 1}/{kwargs['timed_runs']}: 10.0 tok/s")
        return "result"

    monkeypatch.setattr(bench, "run_rounds", fake_rounds)
    handle = SimpleNamespace(label="speculative 4/1/5", local_url="http://127.0.0.1:9")
    with caplog.at_level(logging.INFO, logger="eagleops"):
        assert bench.measure(cfg, handle, "generate", [[1, 2], [3]], 1) == "result"
    warm, timed = cfg.bench.warmup_runs, cfg.bench.timed_runs  # the demo's: 1 + 3 (configs/tiny.yaml)
    assert [r.getMessage() for r in caplog.records] == [
        f"speculative 4/1/5 (concurrency 1): {warm} warm-up + {timed} timed runs of 2 prompts x 128 tokens",
        *[f"speculative 4/1/5 (concurrency 1): timed run {i}/{timed}: 10.0 tok/s" for i in range(1, timed + 1)]]
