"""eagle3.serving.plan and spec_grid: the grid as SGLang runs it, the choice under an SLA that binds at high load,
the check's fall-back, and the adaptive config read by SGLang 0.5.23's own code (the CPU SGLang venv)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from test_prediction import law_row, predictor

from eagle3.serving.plan import (
    Sla,
    adaptive_config,
    adaptive_launch_flags,
    check_points,
    checked_choice,
    choose,
    frontier,
    mean_absolute_error,
)
from eagle3.serving.prediction import Measurement
from eagle3.serving.spec_grid import OFF, Setting, resolve_grid

REPO = Path(__file__).resolve().parents[3]
GRID, _ = resolve_grid([1, 2, 3, 4, 5], [1, 2], [4, 8])


def test_grid_is_what_sglang_runs():
    grid, refused = resolve_grid([1, 3], [1, 2], [4, 8, 16])
    labels = [s.label for s in grid]
    assert "1/1/2" in labels and "3/1/4" in labels  # chains verify steps + 1 whatever is asked
    assert not [s for s in grid if s.chain and s.num_draft_tokens != s.num_steps + 1]
    assert "3/2/8" in labels and "3/2/4" in labels and "3/2/16" not in labels  # 3 steps of topk 2: 10 candidates
    assert any(r.startswith("3/2/16: speculative_num_draft_tokens=16 is too large") for r in refused)
    assert len(labels) == len(set(labels))
    assert Setting.parse("3/2/8") == Setting(3, 2, 8) and Setting.parse("off") == OFF
    with pytest.raises(ValueError, match="num_steps/eagle_topk/num_draft_tokens"):
        Setting.parse("3-1-4")


def test_an_sla_that_binds_picks_differently_at_high_load():
    predictions = predictor().grid(GRID)
    free = {c: choose(predictions, Sla(), c) for c in (1, 4)}
    assert free[1].setting == Setting(2, 1, 3) and free[4].setting == Setting(2, 1, 3)  # no SLA: one setting
    sla = Sla(itl_ms_p99=40)
    bound = {c: choose(predictions, sla, c) for c in (1, 4)}
    assert bound[1].setting == Setting(2, 1, 3) and bound[1].within_sla
    assert bound[4].setting == Setting(1, 1, 2) and bound[4].prediction.itl_p99_s <= 0.040
    tight = choose(predictions, Sla(itl_ms_p99=30), 4)
    assert tight.setting == OFF and tight.why == "the baseline is fastest within the SLA"
    impossible = choose(predictions, Sla(ttft_ms_p99=1), 4)
    assert not impossible.within_sla and "no setting meets ttft_ms_p99 <= 1" in impossible.why


def test_frontier_is_not_beaten_on_both_throughput_and_itl():
    predictions = predictor().grid(GRID)
    front = frontier(predictions, 4)
    here = [p for p in predictions if p.concurrency == 4]
    for p in front:
        assert not [q for q in here if q.tok_s_total > p.tok_s_total and q.itl_p50_s < p.itl_p50_s]
    assert [p.itl_p50_s for p in front] == sorted(p.itl_p50_s for p in front)


def test_the_check_falls_back_to_the_measured_best_beyond_the_tolerance():
    predictions = predictor().grid(GRID)
    choice = choose(predictions, Sla(), 1)
    honest = [Measurement.from_row(law_row(s, 1)) for s in (OFF, Setting(2, 1, 3), Setting(3, 1, 4))]
    points = check_points(predictions, honest)
    assert mean_absolute_error(points) == pytest.approx(0.0, abs=1e-9)
    assert checked_choice(choice, points, honest, Sla(), 0.1)[0] == Setting(2, 1, 3)
    # the pick measured 30% below its prediction: the measured best (3/1/4) instead, said so
    slow = [m if m.setting != Setting(2, 1, 3) else Measurement.from_row(
        {**law_row(Setting(2, 1, 3), 1), "tok_s_median": 0.7 * law_row(Setting(2, 1, 3), 1)["tok_s_median"]})
        for m in honest]
    setting, why = checked_choice(choice, check_points(predictions, slow), slow, Sla(), 0.1)
    assert setting == Setting(3, 1, 4) and "bench.plan_tolerance" in why and "+42.9%" in why
    # predicted right but measured over the SLA: the measured best within it instead
    sla = Sla(itl_ms_p99=10)  # measured p99: 2/1/3 12.0 ms, 3/1/4 14.6 ms, off 5.5 ms
    setting, why = checked_choice(choice, points, honest, sla, 0.1)
    assert setting == OFF and why == ("measured itl_ms_p99 12.0 > 10: the measured best within the SLA, off at "
                                      f"{law_row(OFF, 1)['tok_s_median']:.1f} tok/s, instead")


def test_adaptive_config_only_where_choices_differ_by_load():
    predictions = predictor().grid(GRID)
    assert adaptive_config(predictions, Sla(itl_ms_p99=40)) == {"1": {"candidate_steps": [1, 2, 3]},
                                                                 "4": {"candidate_steps": [0, 1]}}
    assert adaptive_config([p for p in predictions if p.concurrency == 1], Sla()) is None


def test_sglang_reads_the_adaptive_config_as_the_plan_means_it(sglang_python, tmp_path):
    config = adaptive_config(predictor().grid(GRID), Sla(itl_ms_p99=40))
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps(config))
    flags = adaptive_launch_flags(config, str(path))
    start = int(flags[flags.index("--speculative-num-steps") + 1])
    # SGLang's own parser and per-batch-size routing (srt/speculative/adaptive_spec_params.py)
    probe = ("import json, sys\n"
             "from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams, "
             "resolve_candidate_steps_from_config\n"
             "params = AdaptiveSpeculativeParams(int(sys.argv[2]), sys.argv[1])\n"
             "print(json.dumps({'union': resolve_candidate_steps_from_config(sys.argv[1]), "
             "'steps': {b: params.get_steps_for_batch(b) for b in (1, 2, 3, 4, 8)}, "
             "'candidates': {b: params._route(b).candidate_steps for b in (1, 3, 4, 8)}}))\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    proc = subprocess.run([str(sglang_python), "-c", probe, str(path), str(start)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["union"] == [0, 1, 2, 3]
    assert seen["candidates"] == {"1": [1, 2, 3], "3": [1, 2, 3], "4": [0, 1], "8": [0, 1]}
    assert seen["steps"]["1"] == start == 3 and seen["steps"]["4"] in (0, 1)
    # and the launch flags pass SGLang's whole resolution (the dry run the preflight uses)
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    argv = ["--model-path", str(target), "--device", "cuda", *flags]
    with open(REPO / "eagle3" / "serving" / "sglang_dryrun.py") as source:
        dry = subprocess.run([str(sglang_python), "-", "--", *argv], stdin=source, capture_output=True, text=True,
                             timeout=300, env=env)
    answer = json.loads(dry.stdout)
    assert answer["ok"], answer
    resolved = answer["resolved"]
    assert resolved["speculative_adaptive"] is True
    assert (resolved["speculative_num_steps"], resolved["speculative_eagle_topk"],
            resolved["speculative_num_draft_tokens"]) == (3, 1, 4)
