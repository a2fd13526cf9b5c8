"""eagle3.serving.prediction on benchmark rows made by a known serving law (the model's own assumptions, with
costs that differ by concurrency): settings never measured are predicted exactly; what breaks the law (a
missing baseline, no acceptance profile) is refused by name."""

from __future__ import annotations

import pytest

from eagle3.serving.prediction import AcceptanceModel, Measurement, Predictor, token_itl_percentile
from eagle3.serving.spec_grid import OFF, Setting

MAX_NEW = 64
CHAIN = [0.8, 0.6, 0.45, 0.3, 0.2]  # P(position k accepted), chain measured at depth 5
TREE2 = [0.9, 0.75, 0.6, 0.45]  # topk 2, measured as 4/2/8
WAIT_S = 0.05


def law_positions(s: Setting) -> list[float]:
    """A tree of fewer draft nodes (beyond one) than 4/2/8 (6) lies that share of the way from the chain."""
    if s.eagle_topk == 1:
        return CHAIN[: s.num_steps]
    share = min((s.num_draft_tokens - 2) / 6, 1.0)
    return [c + (t - c) * share for c, t in zip(CHAIN, TREE2)][: s.num_steps]


def law_costs(s: Setting, c: int) -> dict[str, float]:
    """Seconds per iteration by category: verify 4 + 0.5 N ms, draft (1 + 2 d) ms (topk 1) or (1 + 3 d) ms
    (topk 2), extend 0.2 ms per accepted token, 1 ms else; all times c (batch size 1 forwards, one by one)."""
    if not s.speculative:
        return {"decode": c * 4.5e-3}
    accept = 1 + sum(law_positions(s))
    draft = (1 + (2 if s.eagle_topk == 1 else 3) * s.num_steps) * 1e-3
    return {"target_verify": c * (4 + 0.5 * s.num_draft_tokens) * 1e-3, "eagle_draft": c * draft,
            "eagle_draft_extend": c * 0.2e-3 * accept, "other": c * 1e-3}


def law_row(s: Setting, c: int, server_timings: bool = True) -> dict:
    costs = law_costs(s, c)
    iteration = sum(costs.values()) + (c * 1e-3 if not s.speculative else 0.0)
    positions = law_positions(s) if s.speculative else []
    accept = 1 + sum(positions)
    p = [1.0, *positions, 0.0]
    hist = [p[j] - p[j + 1] for j in range(len(p) - 1)] if s.speculative else [1.0]
    latency = WAIT_S + iteration + (MAX_NEW - 1) / accept * iteration
    step_costs = {"concurrency": c, "iteration_s": {"median": iteration}}
    if server_timings:
        step_costs.update({f"{k}_s": {"median": v} for k, v in costs.items() if k != "other"})
    return {"setting": s.label, "speculative": s.speculative, "concurrency": c,
            "effective": {"num_steps": s.num_steps, "eagle_topk": s.eagle_topk, "num_draft_tokens": s.num_draft_tokens},
            "tok_s_median": c * MAX_NEW / latency, "tok_s_min": None, "ttft_p99_s": WAIT_S + iteration,
            "itl_p50_s": token_itl_percentile(hist, iteration, 50), "itl_p99_s": token_itl_percentile(hist, iteration, 99),
            "accepted_by_position": positions, "step_costs": step_costs}


MEASURED = [OFF, Setting(5, 1, 6), Setting(2, 1, 3), Setting(4, 2, 8), Setting(2, 2, 4)]
HELD_OUT = [Setting(3, 1, 4), Setting(1, 1, 2), Setting(3, 2, 8), Setting(4, 2, 7)]


def predictor(server_timings: bool = True, settings=MEASURED) -> Predictor:
    rows = [law_row(s, c, server_timings) for c in (1, 4) for s in settings]
    return Predictor([Measurement.from_row(r) for r in rows], MAX_NEW, gpus=2)


@pytest.mark.parametrize("setting", [*HELD_OUT[:3], *MEASURED], ids=lambda s: s.label)
@pytest.mark.parametrize("c", [1, 4])
def test_settings_never_measured_are_predicted_as_the_law_serves_them(setting, c):
    expected = law_row(setting, c)
    got = predictor().predict(setting, c)
    assert got.tok_s_total == pytest.approx(expected["tok_s_median"], rel=1e-9)
    assert got.tok_s_per_request == pytest.approx(expected["tok_s_median"] / c, rel=1e-9)
    assert got.tok_s_per_gpu == pytest.approx(expected["tok_s_median"] / 2, rel=1e-9)
    assert got.ttft_p99_s == pytest.approx(expected["ttft_p99_s"], rel=1e-9)
    assert got.itl_p50_s == pytest.approx(expected["itl_p50_s"], rel=1e-9)
    assert got.itl_p99_s == pytest.approx(expected["itl_p99_s"], rel=1e-9)


def test_a_smaller_tree_lies_between_the_chain_and_the_measured_tree():
    acceptance = predictor().acceptance
    chain, tree = acceptance.accept_length(Setting(4, 1, 5)), acceptance.accept_length(Setting(4, 2, 8))
    smaller = acceptance.accept_length(Setting(4, 2, 7))  # 5 draft nodes beyond one, the measured tree has 6
    assert smaller == pytest.approx(chain + (tree - chain) * 5 / 6)
    # a tree accepts at most num_draft_tokens - 1 drafts, however deep it drafts
    assert acceptance.positions(Setting(6, 2, 4))[3:] == [0.0, 0.0, 0.0]


def test_depth_past_the_measured_one_continues_the_last_conditional_rate():
    positions = predictor().acceptance.positions(Setting(7, 1, 8))
    assert positions[:5] == pytest.approx(CHAIN)
    assert positions[5] == pytest.approx(0.2 * 0.2 / 0.3) and positions[6] == pytest.approx(0.2 * (0.2 / 0.3) ** 2)


def test_without_server_timings_the_iteration_is_fitted_on_depth_and_draft_tokens():
    # law without a per-category split: baseline + a*depth + b*(N-1) fits chains exactly (their N - 1 = depth)
    model = predictor(server_timings=False, settings=[OFF, Setting(5, 1, 6), Setting(2, 1, 3)])
    assert not model.costs[1].server
    expected = law_row(Setting(3, 1, 4), 4)
    assert model.predict(Setting(3, 1, 4), 4).tok_s_total == pytest.approx(expected["tok_s_median"], rel=0.02)


def test_what_cannot_be_predicted_is_refused_by_name():
    rows = [law_row(s, 1) for s in MEASURED[1:]]  # no baseline
    with pytest.raises(ValueError, match="concurrency 1: the prediction needs the baseline"):
        Predictor([Measurement.from_row(r) for r in rows], MAX_NEW)
    with pytest.raises(ValueError, match="acceptance by draft position"):
        AcceptanceModel([Measurement.from_row({**law_row(Setting(3, 1, 4), 1), "accepted_by_position": []})])
    with pytest.raises(ValueError, match="no step costs"):
        Measurement.from_row({**law_row(OFF, 1), "step_costs": None})


def test_token_itl_percentile_worked_example():
    assert token_itl_percentile([0.5, 0.5], 0.030, 50) == pytest.approx(0.015)
    assert token_itl_percentile([0.5, 0.5], 0.030, 99) == pytest.approx(0.030)
    assert token_itl_percentile([1.0], 0.010, 99) == pytest.approx(0.010)
