"""tasks.stages.plan.build and `eagleops plan RUN_DIR`: the plan of a run from its benchmark rows (made by a known
serving law, tests/eagle3/serving/test_prediction.py), its page, the settings its check measures, bench.sla and
bench.plan validated with the file's line, and the CLI on a run folder."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eagle3.serving.spec_grid import OFF, Setting
from flows.cli import app
from tasks.config.load import ConfigError, load_experiment
from tasks.rundir import RunDirectory
from tasks.stages.plan.build import Plan, frontier_figure, render_markdown

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests" / "eagle3" / "serving"))
from test_prediction import MAX_NEW, MEASURED, law_row  # noqa: E402

PLAN_YAML = """\
  concurrency: [1, 4]
  max_new_tokens: {max_new}
  sla: {{itl_ms_p99: 40}}
  plan: {{num_steps: [1, 2, 3, 4, 5], eagle_topk: [1, 2], num_draft_tokens: [4, 8], check_top: 1, held_out: 2}}
"""


def config_with_plan(tmp_path: Path, plan: str = PLAN_YAML) -> Path:
    text = (REPO / "configs" / "tiny.yaml").read_text()
    bench_tail = re.compile(r"^  max_new_tokens: 128.*\n  concurrency: \[1\]\n", re.M)
    assert bench_tail.search(text), "configs/tiny.yaml's bench section changed: update the anchor here"
    text = bench_tail.sub(lambda _: plan.format(max_new=MAX_NEW), text, count=1)
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    return path


def law_rows() -> list[dict]:
    return [law_row(s, c) for c in (1, 4) for s in MEASURED]


def test_the_plan_of_a_run_picks_per_load_and_says_how_to_launch_it(tmp_path):
    plan = Plan(load_experiment(config_with_plan(tmp_path)), law_rows())
    data = plan.as_dict()
    picks = {c["concurrency"]: c["setting"] for c in data["choices"]}
    assert picks == {1: "2/1/3", 4: "1/1/2"}  # the SLA binds at 4 (test_plan.py has the figures)
    assert data["launch"] == {"load": 4, "flags": Setting(1, 1, 2).launch_flags()}
    assert data["adaptive_config"] == {"1": {"candidate_steps": [1, 2, 3]}, "4": {"candidate_steps": [0, 1]}}
    assert "--speculative-adaptive" in data["adaptive_flags"]
    page = render_markdown(plan, "tiny")
    assert "| 4 | 1/1/2 |" in page and "--speculative-num-steps 1 --speculative-eagle-topk 1" in page
    assert '"candidate_steps"' in page
    figure = frontier_figure(plan)
    assert len(figure.axes) == 2
    # the check measures the picks not measured yet (1/1/2; 2/1/3 was) and 2 held-out grid settings
    checks = plan.settings_to_check()
    assert checks[0] == Setting(1, 1, 2) and len(checks) == 3
    assert not {s for s in checks} & set(MEASURED) and OFF not in checks
    plan.with_check([law_row(s, c) for c in (1, 4) for s in checks])
    assert plan.held_out_error() == pytest.approx(0.0, abs=1e-9)
    assert all(c["check"].startswith("measured") for c in plan.as_dict()["choices"])


def test_sla_and_plan_are_validated_with_the_files_line(tmp_path):
    bad = config_with_plan(tmp_path, PLAN_YAML.replace("itl_ms_p99: 40", "itl_ms_p99: 0"))
    with pytest.raises(ConfigError, match=r"plan.yaml:\d+: bench.sla.itl_ms_p99: must be > 0"):
        load_experiment(bad)
    typo = config_with_plan(tmp_path, PLAN_YAML.replace("itl_ms_p99", "itl_p99"))
    with pytest.raises(ConfigError, match=r"plan.yaml:\d+: bench.sla.itl_p99: "):
        load_experiment(typo)
    wrong_load = config_with_plan(tmp_path, PLAN_YAML.replace("held_out: 2", "held_out: 2, load: 8"))
    with pytest.raises(ConfigError, match="bench.plan.load: 8 is not one of bench.concurrency"):
        load_experiment(wrong_load)


def test_eagleops_plan_reads_a_finished_runs_benchmark(tmp_path):
    config = config_with_plan(tmp_path)
    run = RunDirectory.create(tmp_path / "runs", "tiny", {"config_path": str(config)})
    attempt = run.new_attempt("run_benchmark", "f", {})
    (Path(attempt["dir"]) / "bench.json").write_text(json.dumps({"rows": law_rows()}))
    run.update_attempt("run_benchmark", attempt, status="completed")
    out = tmp_path / "plan-out"
    result = CliRunner().invoke(app, ["plan", str(run.path), "--itl-ms-p99", "30", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "| 4 | off |" in result.output and "itl_ms_p99 <= 30" in result.output  # a tighter SLA: off at 4
    assert json.loads((out / "plan.json").read_text())["sla"] == {"itl_ms_p99": 30.0}
    empty = RunDirectory.create(tmp_path / "runs", "tiny", {"config_path": str(config)})
    result = CliRunner().invoke(app, ["plan", str(empty.path)])
    assert result.exit_code == 2 and "no completed run_benchmark attempt" in result.output
