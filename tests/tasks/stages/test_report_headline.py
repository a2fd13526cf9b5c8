"""The report stage's headline for a person's first look: the parent run's display figures (short names, rounded as
shown) and the registered version's description (benchmark, verdict, training, where the run is)."""

from __future__ import annotations

from tasks.stages.report import display_metrics, registered_version, version_description

BENCH = {"best_tok_s": 1266.8349, "speedup": 1.613982, "accept_length_online": 3.3464, "accept_length_offline": 3.5912,
         "accept_length_offline_depth": 4, "baseline_tok_s": 784.91}
MANIFEST = {"run_id": "20261205-073352-358073", "stages": {
    "run_benchmark": {"summary": {"metrics": BENCH, "verdict": {"best": {"setting": "speculative 4/1/5"},
                                                                "summary": "best speculative 4/1/5: 1.61x the baseline"}}},
    "train_draft": {"summary": {"metrics": {"simulated_accept_length": 4.5912}}},
    "export_checkpoint": {"summary": {"outputs": {"registered_model_version": "tiny-draft/3"}}}}}


def test_display_figures_are_short_names_rounded_as_shown():
    assert display_metrics(BENCH) == {"_tok_s": 1266.8, "_speedup": 1.61, "_accept_len_online": 3.35,
                                      "_accept_len_offline": 3.59, "_baseline_tok_s": 784.9}
    assert display_metrics({"best_tok_s": 10.04}) == {"_tok_s": 10.0}  # what was not measured is left out


def test_the_version_description_holds_the_figures_and_where_the_run_is():
    text = version_description(MANIFEST, "tiny-20261205-073352-358073", {"Run folder": "/runs/tiny/x"})
    assert text.splitlines()[0] == ("**Benchmark:** best speculative 4/1/5: 1266.8 tok/s, 1.61x the baseline "
                                    "(784.9 tok/s), accept length 3.35 online vs 3.59 offline (simulated at depth 4)")
    assert "**Verdict:** best speculative 4/1/5: 1.61x the baseline" in text
    assert "simulated accept length 4.59 at the full TTT depth" in text
    assert "Experiment run: tiny-20261205-073352-358073" in text and "Run folder: /runs/tiny/x" in text
    assert registered_version(MANIFEST) == ("tiny-draft", "3")
    journaled = {"stages": {"export_checkpoint": {"summary": {"outputs": {
        "registered_model_version": "tiny-draft/offline-version-1"}}}}}
    assert registered_version(journaled) is None
