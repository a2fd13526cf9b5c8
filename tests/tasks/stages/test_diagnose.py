"""The diagnosis on benchmark rows and real served files: expectations per depth, alarms, causes and their
ranking, evidence it lacks. Expected values are written out by hand from the rules they test (SGLang's
Llama capture rule `ids + 1`, sha256 of the template text, counted tokens), never taken from the code
under test; the served model and draft are real files read through `tasks.hosts.served`, so every fault check
has its evidence and can fire.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from eagle3.draft.model import DraftModelConfig, Eagle3DraftModel
from eagle3.export import export_sglang
from tasks.config.schema import ExperimentConfig
from tasks.hosts.remote import LocalExecutor
from tasks.hosts.served import launch_paths, read_served_model
from tasks.stages.bench.diagnose import (
    alarms_for,
    asked_depth,
    cause_cost,
    cause_position_falloff,
    cause_settings_rewritten,
    diagnose,
    expected_accept_length,
)

ACC = [0.9, 0.8, 0.5]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TEMPLATE_SHA = hashlib.sha256(TEMPLATE.encode()).hexdigest()
TARGET = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 48,
          "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 7, "vocab_size": 300,
          "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
# The draft's 64 tokens: target ids 0..31 and 100..131 (d2t holds the offsets).
HOT = set(range(32)) | set(range(100, 132))
# Llama: SGLang captures the output of layer i for config id i, i.e. HF hidden_states[i + 1].
AUX_IDS, TRAINED_HF = [1, 3, 4], [2, 4, 5]
RECORD = {"architecture": "LlamaForCausalLM", "num_hidden_layers": 7, "aux_layer_ids": AUX_IDS,
          "hf_indices": TRAINED_HF, "chat_template_sha256": TEMPLATE_SHA, "draft_vocab_coverage": 0.99}


@pytest.fixture(scope="module")
def exported_draft(tmp_path_factory) -> Path:
    """A real SGLang export of a (random) draft with a reduced vocabulary."""
    config = DraftModelConfig.from_target_config(TARGET, draft_vocab_size=64, aux_layer_ids=AUX_IDS)
    model = Eagle3DraftModel(config)
    ids = torch.tensor(sorted(HOT))
    t2d = torch.zeros(300, dtype=torch.bool)
    t2d[ids] = True
    model.set_vocab_mapping(ids - torch.arange(64), t2d)
    return export_sglang(model, TARGET, tmp_path_factory.mktemp("draft") / "sglang", "float32")


def served_files(tmp_path: Path, draft: Path, *, target: dict | None = None, template: str = TEMPLATE,
                 record: dict | None = RECORD, eagle_ids: list[int] | None = None):
    """A served model folder and draft folder on this machine, read as the diagnosis reads a host's files."""
    model_dir, draft_dir = tmp_path / "model", tmp_path / "draft"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text(json.dumps(target or TARGET))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    shutil.copytree(draft, draft_dir)
    if record is not None:
        (draft_dir / "eagleops_training.json").write_text(json.dumps(record))
    if eagle_ids is not None:
        config = json.loads((draft_dir / "config.json").read_text())
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = eagle_ids
        (draft_dir / "config.json").write_text(json.dumps(config))
    argv = ["--model-path", str(model_dir), "--speculative-draft-model-path", str(draft_dir)]
    return read_served_model(LocalExecutor(), launch_paths(argv), paths_from="launch command").to_dict()


def row(setting="speculative 3/1/4", tok_s=120.0, accept=3.0, asked=None, effective=None, by_position=None,
        verify_s=0.01, speculative=True, **extra):
    """A benchmark row as tasks.stages.bench.stage.setting_row builds it, its settings reported by the server."""
    effective = effective or {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}
    return {"setting": setting, "speculative": speculative, "concurrency": 1, "tok_s_median": tok_s,
            "decode_accept_length": accept, "asked": asked if asked is not None else dict(effective),
            "effective": effective, "predicted": dict(effective), "settings_source": "/server_info" if speculative else "",
            "allow_adjustments": False, "accepted_by_position": by_position or [], "verify_s": verify_s,
            "itl_p50_s": 0.008, "log_decode_lines": 3 if speculative else 2,
            "log_accept_len": accept if speculative else None, "disagreements": [],
            "output_ids": [[5, 6, 7, 100, 131], [0, 1, 2, 3, 31]], **extra}


BASELINE = row("baseline", tok_s=100.0, accept=None, asked={}, effective={}, speculative=False)
REQUESTS = {"endpoint": "generate", "template_sha256": TEMPLATE_SHA, "template_source": "rendered here"}
CFG = ExperimentConfig(experiment="unit")


def verdict(rows, served, offline=None, requests=REQUESTS, data=None):
    return diagnose(CFG, rows, offline or {"acc": ACC}, served, data=data, requests=requests)


def causes_of(found: dict) -> list[tuple[str, str]]:
    return [(c["cause"], c["setting"]) for c in found["causes"]]


# ------------------------------------------------------------------ figures and alarms


def test_expected_accept_length_is_the_chain_sum_of_products():
    # 1 + 0.9 + 0.9*0.8 + 0.9*0.8*0.5
    assert expected_accept_length(ACC, 3) == pytest.approx(1 + 0.9 + 0.72 + 0.36)
    assert expected_accept_length(ACC, 1) == pytest.approx(1.9)
    assert expected_accept_length(ACC, 10) == expected_accept_length(ACC, 3)  # no deeper than trained


def test_asked_depth_reads_draft_tokens_of_a_chain_as_the_depth_the_user_expected():
    assert asked_depth({"num_steps": 1, "eagle_topk": 1, "num_draft_tokens": 16}, {"num_steps": 1}) == 15
    assert asked_depth({"num_steps": 5, "eagle_topk": 4, "num_draft_tokens": 8}, {"num_steps": 5}) == 5


def test_alarms_for_slower_and_for_an_accept_length_below_the_promise():
    assert alarms_for(row(tok_s=120.0, accept=2.9), BASELINE, ACC, 0.25) == []
    slower = alarms_for(row(tok_s=90.0, accept=2.9), BASELINE, ACC, 0.25)
    assert slower == ["speculative 3/1/4: 90.0 tok/s is not faster than the baseline's 100.0"]
    short = alarms_for(row(accept=1.5), BASELINE, ACC, 0.25)
    assert short == [("speculative 3/1/4: online accept length 1.50 is well below the offline 2.98 the draft "
                     "promises at depth 3")]


def test_cost_says_when_a_verify_step_cannot_pay():
    # a verify step of 4 target steps (8 ms each) yielding 2 tokens: at most 0.5x
    found = cause_cost(row=row(accept=2.0, verify_s=0.032), baseline=BASELINE)
    assert found["summary"].startswith("a verify step costs 4.00 target steps and yields 2.00 tokens: at most 0.50x")
    assert cause_cost(row=row(accept=3.0, verify_s=0.016), baseline=BASELINE) is None  # 1.5x possible


def test_position_falloff_compares_cumulative_online_acceptance_with_the_product_of_training_acc_k():
    # Online accepted_by_position is cumulative (share of verify steps accepting >= k drafts); training's
    # acc_k is conditional. Its cumulative form, by hand: 0.9, 0.9 * 0.8 = 0.72, 0.9 * 0.8 * 0.5 = 0.36.
    found = cause_position_falloff(row=row(by_position=[0.85, 0.2, 0.1]), acc=ACC)
    assert found["summary"] == ("acceptance falls off from draft position 2: 0.20 of verify steps accept >= 2 drafts "
                                "online vs 0.72 expected from training (the product of its acc_0..acc_1)")
    assert found["evidence"]["training_cumulative_by_position"] == pytest.approx([0.9, 0.72, 0.36])
    assert found["evidence"]["online_cumulative_by_position"] == [0.85, 0.2, 0.1]
    first = cause_position_falloff(row=row(by_position=[0.5, 0.4, 0.3]), acc=ACC)  # 0.5 < 0.6 x 0.9 = 0.54
    assert first["summary"] == ("acceptance falls off from draft position 1: 0.50 of verify steps accept >= 1 drafts "
                                "online vs 0.90 expected from training (the product of its acc_0)")
    assert cause_position_falloff(row=row(by_position=[0.85, 0.75, 0.45]), acc=ACC) is None


def test_position_falloff_raises_no_false_alarm_from_comparing_with_conditional_acc_k():
    # Position 3: 0.28 online is 0.78 of the cumulative 0.36 (healthy), though below 0.6 x the conditional
    # acc 0.5 = 0.30, which is what comparing unlike quantities flagged.
    assert cause_position_falloff(row=row(by_position=[0.85, 0.65, 0.28]), acc=ACC) is None


def test_position_falloff_looks_only_within_the_served_and_the_trained_depth():
    # A depth-2 server has no third position, whatever its histogram's length says.
    depth_two = {"num_steps": 2, "eagle_topk": 1, "num_draft_tokens": 3}
    assert cause_position_falloff(row=row(effective=depth_two, by_position=[0.85, 0.75, 0.0]), acc=ACC) is None
    # A draft trained 1 step deep has nothing to compare past position 1.
    assert cause_position_falloff(row=row(by_position=[0.85, 0.1, 0.0]), acc=[0.9]) is None


# ------------------------------------------------------------------ the whole diagnosis, on real files


def test_a_healthy_run_on_real_files_gets_no_cause_and_lacks_no_evidence(tmp_path, exported_draft):
    served = served_files(tmp_path, exported_draft)
    assert served["chat_template_sha256"] == TEMPLATE_SHA and served["training_record"] == RECORD
    healthy = verdict([row(), BASELINE], served)
    assert healthy["status"] == "faster" and healthy["causes"] == [] and healthy["missing_evidence"] == []
    assert healthy["summary"] == "best speculative 3/1/4: 1.20x the baseline"


def test_a_slow_run_is_explained_by_cost_alone_when_the_files_are_right(tmp_path, exported_draft):
    slow = verdict([row(tok_s=60.0, accept=2.0, verify_s=0.032), BASELINE], served_files(tmp_path, exported_draft))
    assert slow["status"] == "slower" and causes_of(slow) == [("cost", "speculative 3/1/4")]
    assert slow["missing_evidence"] == []


@pytest.mark.parametrize("change,cause,summary", [
    ({"eagle_ids": [0, 2, 5]}, "layer_mismatch",  # ids + 1 -> HF [1, 3, 6]
     ("the draft was trained on ['layer 1', 'layer 3', 'layer 4'] but the server feeds it "
     "['layer 0', 'layer 2', 'layer 5']")),
    ({"eagle_ids": [4, 1, 3]}, "layer_mismatch",  # SGLang keeps the list order: [5, 2, 4]
     ("the draft was trained on ['layer 1', 'layer 3', 'layer 4'] but the server feeds it "
     "['layer 4', 'layer 1', 'layer 3'] (same layers, other order)")),
    ({"target": {**TARGET, "num_hidden_layers": 9}}, "target_mismatch",
     "the draft was trained on a 7-layer LlamaForCausalLM target; the server serves a 9-layer LlamaForCausalLM"),
    ({"template": TEMPLATE + " "}, "template_or_tokenization",
     "the server's own chat template"),
])
def test_each_file_fault_fires_from_the_served_files(tmp_path, exported_draft, change, cause, summary):
    found = verdict([row(), BASELINE], served_files(tmp_path, exported_draft, **change))
    assert [c["cause"] for c in found["causes"]] == [cause]
    assert found["causes"][0]["summary"].startswith(summary) and found["causes"][0]["setting"] == "all settings"


def test_the_layer_mismatch_weighs_more_when_the_figures_show_it(tmp_path, exported_draft):
    served = served_files(tmp_path, exported_draft, eagle_ids=[0, 2, 5])
    quiet = verdict([row(), BASELINE], served)["causes"][0]
    shown = verdict([row(accept=1.2), BASELINE], served)["causes"][0]
    assert (quiet["score"], shown["score"]) == (0.8, 1.0)
    assert shown["evidence"]["trained_hf_indices"] == TRAINED_HF and shown["evidence"]["served_hf_indices"] == [1, 3, 6]
    assert shown["evidence"]["served_draft"] == f"local:{tmp_path / 'draft'}"


def test_prompts_sent_through_another_template_are_named(tmp_path, exported_draft):
    other = hashlib.sha256(b"another template").hexdigest()
    found = verdict([row(), BASELINE], served_files(tmp_path, exported_draft),
                    requests={**REQUESTS, "template_sha256": other})
    assert [c["cause"] for c in found["causes"]] == ["template_or_tokenization"]
    assert found["causes"][0]["summary"] == (f"the benchmark's prompts went through another chat template (rendered "
                                             f"here: {other[:12]}) than the training data ({TEMPLATE_SHA[:12]})")


def test_settings_the_server_reports_differently_from_asked_and_predicted(tmp_path, exported_draft):
    # The seed: asked 2/1/16, the preflight resolved 2/1/3, the server reports it runs 1/1/2.
    seed = row("speculative 1/1/2", accept=2.0, asked={"num_steps": 2, "eagle_topk": 1, "num_draft_tokens": 16},
               effective={"num_steps": 1, "eagle_topk": 1, "num_draft_tokens": 2},
               predicted={"num_steps": 2, "eagle_topk": 1, "num_draft_tokens": 3}, allow_adjustments=True)
    found = verdict([seed, BASELINE], served_files(tmp_path, exported_draft))
    top = found["causes"][0]
    assert (top["cause"], top["kind"], top["score"]) == ("settings_rewritten", "fault", 0.95)
    assert top["summary"] == ("the server rewrote the speculative settings: asked num_steps 2, the server runs 1; "
                              "asked num_draft_tokens 16, the server runs 2 (not SGLang's rule for the flags checked; "
                              "reported by /server_info); the preflight predicted num_steps 2, num_draft_tokens 3: the "
                              "server does not run what was checked")


def test_a_rewrite_opted_into_explains_an_alarm_but_never_outranks_a_fault(tmp_path, exported_draft):
    sweep = row("speculative 2/1/3", accept=1.9, asked={"num_steps": 2, "eagle_topk": 1, "num_draft_tokens": 8},
                effective={"num_steps": 2, "eagle_topk": 1, "num_draft_tokens": 3}, allow_adjustments=True)
    served = served_files(tmp_path, exported_draft)
    quiet = verdict([row(), BASELINE, {**sweep, "decode_accept_length": 2.9, "log_accept_len": 2.9}], served)
    assert quiet["causes"] == []  # opted in and nothing disappoints: recorded, not a cause
    assert quiet["settings"][1]["rewritten"] == {"num_draft_tokens": [8, 3]}
    alarmed = verdict([row(), BASELINE, sweep], served_files(tmp_path / "bad", exported_draft, eagle_ids=[0, 2, 5]))
    assert causes_of(alarmed)[:2] == [("layer_mismatch", "all settings"), ("settings_rewritten", "speculative 2/1/3")]
    assert alarmed["causes"][1]["kind"] == "explanation"


def test_the_same_cause_in_two_settings_is_reported_for_each(tmp_path, exported_draft):
    rewritten = [row(f"speculative 1/1/2 ({n})", accept=2.0, asked={"num_steps": 1, "eagle_topk": 1,
                                                                     "num_draft_tokens": n},
                     effective={"num_steps": 1, "eagle_topk": 1, "num_draft_tokens": 2}) for n in (8, 16)]
    found = verdict([*rewritten, BASELINE], served_files(tmp_path, exported_draft))
    assert [(c["cause"], c["setting"]) for c in found["causes"] if c["cause"] == "settings_rewritten"] == [
        ("settings_rewritten", "speculative 1/1/2 (8)"), ("settings_rewritten", "speculative 1/1/2 (16)")]


def test_a_server_that_reports_nothing_or_does_not_speculate_is_named(tmp_path, exported_draft):
    served = served_files(tmp_path, exported_draft)
    silent = verdict([row(settings_source="prediction"), BASELINE], served)
    assert causes_of(silent) == [("server_report", "speculative 3/1/4")]
    assert silent["causes"][0]["summary"].startswith("/server_info reports no speculative settings")
    plain = verdict([row(log_accept_len=None), BASELINE], served)
    assert plain["causes"][0]["score"] == 0.9
    assert "its log has 3 decode lines and none with an accept len" in plain["causes"][0]["summary"]


def test_vocabulary_coverage_counts_what_the_target_generated(tmp_path, exported_draft):
    # 10 generated tokens, 4 outside the draft's 64 (0..31, 100..131): 60% covered.
    outside = [[5, 40, 41, 100, 131], [0, 1, 200, 299, 31]]
    slow = {"tok_s": 90.0, "accept": 2.9}
    base = {**BASELINE, "output_ids": outside}
    found = verdict([row(**slow, output_ids=outside), base], served_files(tmp_path, exported_draft))
    vocab = next(c for c in found["causes"] if c["cause"] == "vocab_coverage")
    assert vocab["evidence"]["coverage"] == pytest.approx(0.6) and vocab["score"] == 0.8
    assert vocab["summary"].startswith("40.0% of the target's output tokens are outside the draft's vocabulary")


def test_without_output_ids_the_training_records_coverage_is_used_or_its_absence_said(tmp_path, exported_draft):
    chat = [row(tok_s=90.0, accept=2.9, output_ids=[]), {**BASELINE, "output_ids": []}]
    low = verdict(chat, served_files(tmp_path / "a", exported_draft, record={**RECORD, "draft_vocab_coverage": 0.7}))
    vocab = next(c for c in low["causes"] if c["cause"] == "vocab_coverage")
    assert vocab["evidence"]["source"] == "the training record (coverage of the training answers)"
    none = verdict(chat, served_files(tmp_path / "b", exported_draft, record={**RECORD, "draft_vocab_coverage": None}))
    assert {"check": "vocab_coverage", "setting": "all settings",
            "reason": "the endpoint returned no output_ids, and the training record carries no coverage"} \
        in none["missing_evidence"]


def test_an_unknown_architecture_is_missing_evidence_not_a_crash(tmp_path, exported_draft):
    foo = {**TARGET, "architectures": ["FooForCausalLM"]}
    found = verdict([row(accept=1.2), BASELINE], served_files(tmp_path, exported_draft, target=foo,
                                                                  record={**RECORD, "architecture": "FooForCausalLM"}))
    layers = [m for m in found["missing_evidence"] if m["check"] == "layers"]
    assert len(layers) == 1 and "which layers SGLang feeds a FooForCausalLM is not known here" in layers[0]["reason"]
    assert "layer_mismatch" not in {c["cause"] for c in found["causes"]}


def test_a_draft_without_its_training_record_is_said_to_lack_it(tmp_path, exported_draft):
    found = verdict([row(), BASELINE], served_files(tmp_path, exported_draft, record=None))
    assert {m["check"] for m in found["missing_evidence"]} >= {"served_files", "layers", "template"}
    assert found["causes"] == []


def test_without_a_baseline_the_speedup_is_unknown(tmp_path, exported_draft):
    found = verdict([row()], served_files(tmp_path, exported_draft))
    assert found["status"] == "no_baseline" and found["best"]["speedup"] is None
    assert found["summary"] == "best speculative 3/1/4: speedup unknown: no baseline was measured (deploy.baseline: false)"


def test_rewritten_settings_name_both_values_and_the_rule():
    found = cause_settings_rewritten(row=row(asked={"num_steps": 1, "eagle_topk": 1, "num_draft_tokens": 16},
                                             effective={"num_steps": 1, "eagle_topk": 1, "num_draft_tokens": 2}))
    assert found["summary"] == ("the server rewrote the speculative settings: asked num_draft_tokens 16, the server "
                                "runs 2 (topk 1 forces num_draft_tokens = num_steps + 1; reported by /server_info)")
    assert cause_settings_rewritten(row=row()) is None
