"""eagle3.serving.step_costs: per-iteration step costs from the server's own forward timings and the client's
stream, against a real `python -m eagle3.serve` (3-step chain) over HTTP; the division rules on made-up rounds."""

from __future__ import annotations

import pytest
from test_sglang_client import launch_reference_server, stop_server
from test_serve_http import build_model_dirs

from eagle3.serving.bench_prompts import builtin_prompts, render_prompts
from eagle3.serving.sglang_client import BenchResult, RequestResult, RunStats, SGLangClient, ServerFigures, run_benchmark
from eagle3.serving.step_costs import measure_step_costs, server_iteration_s

CHAIN_3 = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]


@pytest.fixture(scope="module")
def chain_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("step-costs")
    target_dir, draft_dir = build_model_dirs(root)
    proc, url = launch_reference_server(target_dir, draft_dir, root / "server.log",
                                        [*CHAIN_3, "--max-running-requests", "4", "--enable-metrics"])
    yield url, target_dir
    stop_server(proc)


def test_server_timings_per_round_add_up_to_what_the_client_counted(chain_server):
    url, target_dir = chain_server
    prompts = render_prompts(builtin_prompts(4, seed=3), target_dir)
    with SGLangClient(url, timeout=120) as client:
        result = run_benchmark(client, prompts, warmup_runs=1, timed_runs=2, concurrency=2, max_new_tokens=10,
                               endpoint="generate", ignore_eos=True)
    deltas = result.server.run_deltas
    assert len(deltas) == 2
    for run, delta in zip(result.runs, deltas):
        # the server's counts for each round are the client's, exactly
        assert delta["verify_calls"] == run.spec_verify_ct and delta["generation_tokens"] == run.output_tokens
        assert delta["requests"] == run.num_requests
        assert {"target_verify", "eagle_draft", "eagle_draft_extend"} <= set(delta["forward_s"])
        assert "decode" not in delta["forward_s"]  # no plain decode step under speculation
    costs = measure_step_costs(result, {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4})
    assert costs["source"] == "server" and costs["concurrency"] == 2
    for name in ("iteration_s", "target_verify_s", "eagle_draft_s", "draft_step_s", "other_s"):
        assert costs[name]["min"] <= costs[name]["median"] <= costs[name]["max"], name
    assert costs["draft_step_s"]["median"] == pytest.approx(costs["eagle_draft_s"]["median"] / 3)
    # the forwards ran inside the rounds the client timed. (other_s itself may dip below 0 on a loaded machine:
    # the server's iterations are verify calls / concurrency, fewer than it ran when the two requests of a round
    # did not overlap for their whole life; CI once measured -2.1 ms against a 6.3 ms iteration.)
    for run, delta in zip(result.runs, deltas):
        assert 0 < sum(delta["forward_s"].values()) <= run.wall_s


def _request(itl: list[float], verifies: int | None) -> RequestResult:
    return RequestResult(prompt_tokens=3, output_ids=None, completion_tokens=len(itl) + 1, ttft_s=0.1, itl_s=itl,
                         e2e_s=1.0, spec_verify_ct=verifies, accept_length=None, meta_info={})


def test_baseline_iterations_are_decode_steps_and_concurrency_scales_the_batch():
    # 2 requests of 5 tokens: 4 decode steps each, every ITL 0.05 s; the server timed 0.2 s of decode forwards
    run = RunStats(0, False, 1.0, [_request([0.05] * 4, None), _request([0.05] * 4, None)])
    delta = {"forward_s": {"decode": 0.2, "extend": 0.3}, "verify_calls": 0, "generation_tokens": 10, "requests": 2}
    result = BenchResult("generate", 2, 5, 0.0, 2, [], [run], ServerFigures(True, None, None, None, {}, [delta]))
    costs = measure_step_costs(result, None)
    # 8 decode steps at 2 per iteration = 4 iterations: 0.05 s of decode forward each, no time left over
    assert costs["decode_s"]["median"] == pytest.approx(0.05)
    assert costs["iteration_s"]["median"] == pytest.approx(0.05)
    assert costs["other_s"]["median"] == pytest.approx(0.0)
    assert "target_verify_s" not in costs and "draft_step_s" not in costs


def test_no_server_timings_leaves_the_client_figure_alone():
    assert server_iteration_s({"forward_s": {}, "verify_calls": 10, "generation_tokens": 30, "requests": 2}, 2,
                              True) == {}
    run = RunStats(0, False, 1.0, [_request([0.1, 0.1, 0.1, 0.1], 2)])
    result = BenchResult("generate", 1, 5, 0.0, 1, [], [run], ServerFigures(True, None, None, None, {}, []))
    costs = measure_step_costs(result, {"num_steps": 2, "eagle_topk": 1, "num_draft_tokens": 3})
    assert costs["source"] == "client" and costs["iteration_s"]["median"] == pytest.approx(0.2)
    assert "other_s" not in costs
