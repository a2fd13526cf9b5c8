"""The diagnosis on hand-made benchmark rows: expectations per depth, alarms, causes and their ranking."""

from __future__ import annotations

import pytest

from tasks.config import ExperimentConfig
from tasks.diagnose import (
    alarms_for, asked_depth, cause_cost, cause_position_falloff, cause_settings_rewritten, diagnose,
    expected_accept_length,
)

ACC = [0.9, 0.8, 0.5]


def row(setting="speculative 3/1/4", tok_s=120.0, accept=3.0, asked=None, effective=None, by_position=None,
        verify_s=0.01, speculative=True):
    effective = effective or {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}
    return {"setting": setting, "speculative": speculative, "concurrency": 1, "tok_s_median": tok_s,
            "decode_accept_length": accept, "asked": asked if asked is not None else dict(effective),
            "effective": effective, "accepted_by_position": by_position or [], "verify_s": verify_s,
            "itl_p50_s": 0.008, "output_ids": []}


BASELINE = row("baseline", tok_s=100.0, accept=None, asked={}, effective={}, speculative=False)


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
    assert short == ["speculative 3/1/4: online accept length 1.50 is well below the offline 2.98 the draft "
                     "promises at depth 3"]


def test_rewritten_settings_name_both_values_and_the_rule():
    found = cause_settings_rewritten(row=row(asked={"num_steps": 1, "eagle_topk": 1, "num_draft_tokens": 16},
                                             effective={"num_steps": 1, "eagle_topk": 1, "num_draft_tokens": 2}))
    assert found["summary"] == ("the server rewrote the speculative settings: asked num_draft_tokens 16, the server "
                                "runs 2 (topk 1 forces num_draft_tokens = num_steps + 1)")
    assert cause_settings_rewritten(row=row()) is None


def test_cost_says_when_a_verify_step_cannot_pay():
    # a verify step of 4 target steps (8 ms each) yielding 2 tokens: at most 0.5x
    found = cause_cost(row=row(accept=2.0, verify_s=0.032), baseline=BASELINE)
    assert found["summary"].startswith("a verify step costs 4.00 target steps and yields 2.00 tokens: at most 0.50x")
    assert cause_cost(row=row(accept=3.0, verify_s=0.016), baseline=BASELINE) is None  # 1.5x possible


def test_position_falloff_compares_online_acceptance_with_training():
    found = cause_position_falloff(row=row(by_position=[0.85, 0.2, 0.1]), acc=ACC)
    assert found["summary"] == "acceptance falls off from draft position 2: 0.20 online vs 0.80 in training"
    assert cause_position_falloff(row=row(by_position=[0.85, 0.75, 0.45]), acc=ACC) is None


def test_a_healthy_run_gets_no_cause_and_a_slow_one_is_explained(tmp_path):
    cfg = ExperimentConfig(experiment="unit")
    healthy = diagnose(cfg, [row(), BASELINE], {"acc": ACC}, {}, tmp_path, {})
    assert healthy["status"] == "faster" and healthy["causes"] == []
    assert healthy["summary"] == "best speculative 3/1/4: 1.20x the baseline"
    slow = diagnose(cfg, [row(tok_s=60.0, accept=2.0, verify_s=0.032), BASELINE], {"acc": ACC}, {}, tmp_path, {})
    assert slow["status"] == "slower" and slow["causes"][0]["cause"] == "cost"
