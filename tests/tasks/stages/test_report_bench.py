"""The benchmark's headline figures and plot, from hand-made rows: the offline accept length is the one at the
setting's depth (computed here by hand, not by the code under test), one rounding in every place a figure is
shown, acceptance by position over the served positions only, cumulative online vs cumulative offline."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tasks.config.load import load_experiment
from tasks.stages.bench.report import (
    benchmark_figure,
    comparison_rows,
    render_markdown,
    setting_metrics,
    shown,
)
from tasks.stages.bench.stage import (
    accepted_by_position,
    headline_metrics,
    offline_figures,
)

# Training's acc_k over a 7-step TTT unroll: the full-depth expectation is far above the one at depth 3.
ACC = [0.8, 0.5, 0.25, 0.9, 0.9, 0.9, 0.9]
# By hand: 1 + 0.8 + 0.8*0.5 + 0.8*0.5*0.25 = 1 + 0.8 + 0.4 + 0.1
AT_DEPTH_3 = 2.3
FULL_DEPTH = 1 + 0.8 + 0.4 + 0.1 + 0.09 + 0.081 + 0.0729 + 0.06561


def row(setting: str, speculative: bool, tok_s: float, accept: float | None, steps: int | None) -> dict:
    effective = {"num_steps": steps, "eagle_topk": 1, "num_draft_tokens": steps + 1} if steps else {}
    return {"setting": setting, "speculative": speculative, "concurrency": 1, "asked": effective,
            "effective": effective, "tok_s_min": tok_s - 10, "tok_s_median": tok_s, "tok_s_max": tok_s + 10,
            "decode_accept_length": accept, "ttft_p50_s": 0.0123, "itl_p50_s": 0.0027, "itl_p99_s": 0.02,
            "accepted_by_position": [0.7, 0.35, 0.09][:steps or 0]}


@pytest.fixture
def measured(repo_root):
    cfg = load_experiment(repo_root / "configs" / "tiny.yaml")
    cfg = cfg.model_copy(update={"bench": cfg.bench.model_copy(update={"offline_reference": False})})
    rows = [row("speculative 3/1/4", True, 1266.8349, 3.34640522875817, 3), row("baseline", False, 784.91, None, None)]
    ctx = SimpleNamespace(upstream={"train_draft": {"acc": ACC, "simulated_accept_length": FULL_DEPTH}})
    offline = offline_figures(ctx, rows, [[1, 2, 3]], None, None, cfg)
    verdict = {"best": {"setting": "speculative 3/1/4", "tok_s_median": 1266.8349, "speedup": 1266.8349 / 784.91,
                        "accept_length": 3.34640522875817},
               "settings": [{"setting": "speculative 3/1/4", "speedup": 1266.8349 / 784.91, "alarms": []}],
               "causes": [], "summary": "best speculative 3/1/4: 1.61x the baseline"}
    return cfg, rows, offline, verdict


def test_the_offline_headline_is_the_simulated_accept_length_at_the_best_settings_depth(measured):
    _, rows, offline, verdict = measured
    metrics = headline_metrics(rows, offline, verdict)
    assert metrics["accept_length_offline"] == pytest.approx(AT_DEPTH_3, abs=0.005)
    assert metrics["accept_length_offline_depth"] == 3
    assert FULL_DEPTH - metrics["accept_length_offline"] > 0.3  # not the full-depth training figure (2.61)
    # per setting in MLflow too, rounded as shown
    assert setting_metrics(rows, offline, verdict)["spec_3_1_4.accept_length_offline"] == 2.3


def test_one_rounding_in_the_headline_the_table_markdown_and_mlflow(measured):
    cfg, rows, offline, verdict = measured
    metrics = headline_metrics(rows, offline, verdict)
    assert (metrics["best_tok_s"], metrics["speedup"], metrics["accept_length_online"]) == (1266.8, 1.61, 3.35)
    assert setting_metrics(rows, offline, verdict)["spec_3_1_4.c1.accept_length"] == 3.35
    markdown = render_markdown(cfg, rows, offline, verdict)
    line = next(line for line in markdown.splitlines() if line.startswith("| speculative 3/1/4"))
    assert "1266.8" in line and "1.61x" in line and "| 3.35 |" in line and "2.30 (depth 3)" in line
    assert "3.346" not in markdown and "1266.83" not in markdown
    assert shown(3.34640522875817, "accept_length") == "3.35" and shown(1.6139, "speedup") == "1.61x"


def test_the_comparison_table_has_speedup_and_the_offline_columns(measured):
    _, rows, offline, _ = measured
    spec, base = comparison_rows(rows, offline)
    assert spec["speedup"] == 1.61 and base["speedup"] == 1.0
    assert (spec["accept_length_offline"], spec["offline_depth"], spec["accept_length_online"]) == (2.3, 3, 3.35)
    assert base["accept_length_offline"] is None


def test_acceptance_by_position_counts_only_the_served_positions():
    # SGLang-style fixed-width histogram: 100 bins for a depth-3 server (bins past 3 are always empty)
    histogram = [2, 3, 1, 4] + [0] * 96
    result = SimpleNamespace(runs=[SimpleNamespace(requests=[SimpleNamespace(
        meta_info={"spec_correct_drafts_histogram": histogram})])])
    # 10 verifies: >=1 accepted in 8, >=2 in 5, >=3 in 4
    assert accepted_by_position(result, depth=3) == [0.8, 0.5, 0.4]


def test_the_plot_shows_the_real_positions_cumulative_online_vs_offline_with_units(measured):
    _, rows, offline, _ = measured
    figure = benchmark_figure(rows, offline)
    throughput, acceptance, accept_length = figure.axes
    for ax in figure.axes:
        assert "(" in ax.get_title() and ax.get_ylabel()  # every panel titled with its units
    assert "tok/s" in throughput.get_title() and "tokens per verify step" in accept_length.get_title()
    lines = {line.get_label(): line for line in acceptance.get_lines()}
    online, training = lines["online spec 3/1/4"], lines["offline (training, prod of acc_k)"]
    assert list(online.get_xdata()) == [1, 2, 3] and list(training.get_xdata()) == [1, 2, 3]
    assert list(training.get_ydata()) == pytest.approx([0.8, 0.4, 0.1])  # prod of acc_1..k, by hand
    assert acceptance.get_xlim() == (0.5, 3.5)
