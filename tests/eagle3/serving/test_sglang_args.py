"""eagle3.serving.sglang_args against the verified SGLang 0.5.23 behaviour (reference sglang-eagle3.md §1, §6)."""

from __future__ import annotations

import json

import pytest

from eagle3.serving.sglang_args import (
    LaunchArgsError,
    max_tree_nodes,
    parse_launch_args,
    read_architecture,
    resolve_speculative_args,
)

LLAMA = "LlamaForCausalLM"
# SGLang 0.5.23's own log texts (reference sglang-eagle3.md §1.2, rules 7a, 7b, 7c, 7j), spelled out
# here rather than imported from eagle3.serving.sglang_args, so a typo in the module's copy fails a test.
MAX_RUNNING = ("Max running requests is reset to 48 for speculative decoding. You can override this by "
               "explicitly setting --max-running-requests.")
CPU_OVERLAP = "Overlap schedule is not implemented for speculative decoding on CPU."
NON_OVERLAP = "Non-overlap (synchronous) spec v2 is used for eagle/eagle3/standalone speculative decoding."
DRAFT_TOKENS_ADJUSTED = ("speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when "
                         "speculative_eagle_topk == 1")


def spec_argv(steps=None, topk=None, draft=None, *extra, algo="EAGLE3"):
    argv = ["--model-path", "/models/target", "--speculative-algorithm", algo,
            "--speculative-draft-model-path", "/models/draft"]
    for flag, value in (("--speculative-num-steps", steps), ("--speculative-eagle-topk", topk),
                        ("--speculative-num-draft-tokens", draft)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + list(extra)


def effective(res):
    return res.speculative_num_steps, res.speculative_eagle_topk, res.speculative_num_draft_tokens


@pytest.mark.parametrize(
    "given, arch, expected",
    [
        ((1, 1, 16), LLAMA, (1, 1, 2)),
        ((2, 1, 7), LLAMA, (2, 1, 3)),
        ((3, 1, None), LLAMA, (3, 1, 4)),
        ((3, 1, 4), LLAMA, (3, 1, 4)),
        ((5, 8, 32), LLAMA, (5, 8, 32)),
        ((None, None, None), LLAMA, (5, 4, 8)),
        ((None, None, None), "Grok1ForCausalLM", (5, 4, 8)),
        ((None, None, None), "Qwen3ForCausalLM", (3, 1, 4)),
        ((None, None, None), "DeepseekV3ForCausalLM", (3, 1, 4)),
        ((None, None, None), "KimiK25ForConditionalGeneration", (3, 1, 4)),
    ],
)
def test_effective_values_match_verified_runs(given, arch, expected):
    res = resolve_speculative_args(spec_argv(*given), target_architecture=arch)
    assert res.ok, res.errors
    assert effective(res) == expected
    assert res.max_running_requests == 48
    assert ("warning", MAX_RUNNING) in res.adjustments
    adjusted = ("warning", DRAFT_TOKENS_ADJUSTED) in res.adjustments
    assert adjusted == (given[1] == 1 and given[2] != given[0] + 1)


def test_seed_case_reports_two_draft_tokens_with_sglang_warning():
    res = resolve_speculative_args(spec_argv(1, 1, 16), target_architecture=LLAMA)
    assert res.resolved_settings()["speculative_num_draft_tokens"] == 2
    assert res.adjustments == [("warning", MAX_RUNNING), ("warning", DRAFT_TOKENS_ADJUSTED)]


def test_explicit_max_running_requests_is_kept_and_cpu_disables_overlap():
    res = resolve_speculative_args(spec_argv(3, 1, 4, "--device", "cpu", "--max-running-requests", "16"),
                                   target_architecture=LLAMA)
    assert res.max_running_requests == 16 and res.disable_overlap_schedule
    assert res.adjustments == [("warning", CPU_OVERLAP), ("warning", NON_OVERLAP)]


def test_explicit_disable_overlap_logs_only_the_non_overlap_warning():
    res = resolve_speculative_args(spec_argv(3, 1, 4, "--disable-overlap-schedule"), target_architecture=LLAMA)
    assert ("warning", NON_OVERLAP) in res.adjustments and ("warning", CPU_OVERLAP) not in res.adjustments


@pytest.mark.parametrize("given, flag", [((None, 4, None), "--speculative-eagle-topk"),
                                         ((None, None, 8), "--speculative-num-draft-tokens")])
def test_partial_flags_without_steps_are_sglangs_bare_assertion(given, flag):
    res = resolve_speculative_args(spec_argv(*given), target_architecture=LLAMA)
    assert not res.ok and len(res.errors) == 1
    assert res.errors[0].startswith("AssertionError") and flag in res.errors[0]
    assert "--speculative-num-steps" in res.errors[0]


def test_steps_only_is_sglangs_type_error():
    res = resolve_speculative_args(spec_argv(2), target_architecture=LLAMA)
    assert res.errors and res.errors[0].startswith("TypeError: '>' not supported between instances of 'NoneType'")
    assert "--speculative-eagle-topk" in res.errors[0]


def test_tree_without_draft_tokens_is_a_runtime_crash():
    res = resolve_speculative_args(spec_argv(3, 4), target_architecture=LLAMA)
    assert not res.errors and effective(res) == (3, 4, None)
    assert len(res.runtime_errors) == 1 and "first decode" in res.runtime_errors[0]
    assert "--speculative-num-draft-tokens" in res.runtime_errors[0] and not res.ok


def test_too_large_tree_is_a_runtime_crash():
    assert max_tree_nodes(2, 2) == 6 and max_tree_nodes(5, 8) == 264
    res = resolve_speculative_args(spec_argv(2, 2, 32), target_architecture=LLAMA)
    assert not res.errors and effective(res) == (2, 2, 32)
    assert res.runtime_errors and "<= 7" in res.runtime_errors[0]
    assert resolve_speculative_args(spec_argv(5, 8, 32), target_architecture=LLAMA).ok


def test_rejection_sampling_needs_topk_one():
    res = resolve_speculative_args(spec_argv(3, 4, 8, "--speculative-use-rejection-sampling"), target_architecture=LLAMA)
    assert res.errors == ["ValueError: --speculative-use-rejection-sampling requires --speculative-eagle-topk=1."]
    res = resolve_speculative_args(spec_argv(3, 1, 4, "--speculative-use-rejection-sampling"), target_architecture=LLAMA)
    assert res.ok and res.speculative_use_rejection_sampling
    assert ("info", "Rejection sampling is enabled for speculative decoding "
                    "(speculative_use_rejection_sampling=True).") in res.adjustments
    res = resolve_speculative_args(spec_argv(3, 1, 4, "--speculative-use-block-verification"), target_architecture=LLAMA)
    assert res.speculative_use_rejection_sampling


def test_standalone_auto_params_and_mixed_chunk():
    res = resolve_speculative_args(spec_argv(None, None, None, "--enable-mixed-chunk", algo="STANDALONE"),
                                   target_architecture=LLAMA)
    assert effective(res) == (3, 1, 4) and not res.enable_mixed_chunk
    assert ("warning", "Mixed chunked prefill is disabled: STANDALONE speculative decoding does not support it.") \
        in res.adjustments
    res = resolve_speculative_args(spec_argv(3, 1, 4, "--enable-mixed-chunk"), target_architecture=LLAMA)
    assert res.enable_mixed_chunk


def test_algorithm_aliases_and_unknown_names():
    assert resolve_speculative_args(spec_argv(3, 1, 4, algo="nextn"), target_architecture=LLAMA) \
        .speculative_algorithm == "EAGLE"
    assert resolve_speculative_args(spec_argv(3, 1, 4, algo="eagle3"), target_architecture=LLAMA) \
        .speculative_algorithm == "EAGLE3"
    res = resolve_speculative_args(spec_argv(3, 1, 4, algo="MEDUSA"), target_architecture=LLAMA)
    assert res.errors == ["ValueError: Unknown speculative algorithm name: MEDUSA"]
    assert "EAGLE3" in resolve_speculative_args(spec_argv(algo="NGRAM"), target_architecture=LLAMA).errors[0]


def test_deepseek_mtp_warning_fires_for_an_eagle3_draft():
    res = resolve_speculative_args(spec_argv(), target_architecture="DeepseekV3ForCausalLM")
    assert ("warning", "DeepSeek MTP does not require setting speculative_draft_model_path.") in res.adjustments
    argv = ["--model-path", "/m", "--speculative-algorithm", "EAGLE"]
    res = resolve_speculative_args(argv, target_architecture="DeepseekV3ForCausalLM")
    assert res.speculative_draft_model_path == "/m" and effective(res) == (3, 1, 4)


def test_adaptive_defaults_to_three_steps():
    res = resolve_speculative_args(spec_argv(None, None, None, "--speculative-adaptive"), target_architecture=LLAMA)
    assert effective(res) == (3, 1, 4) and res.speculative_adaptive
    res = resolve_speculative_args(spec_argv(4, 1, 5, "--speculative-adaptive"), target_architecture=LLAMA)
    assert res.errors and "candidate_steps [0, 1, 3, 5, 7]" in res.errors[0]
    res = resolve_speculative_args(spec_argv(3, 4, 8, "--speculative-adaptive"), target_architecture=LLAMA)
    assert not res.speculative_adaptive and effective(res) == (3, 4, 8)
    assert res.adjustments[0][1].startswith("speculative_adaptive disabled: speculative_eagle_topk=4")


def test_trtllm_backend_rejects_trees():
    res = resolve_speculative_args(spec_argv(3, 4, 8, "--attention-backend", "trtllm_mha"), target_architecture=LLAMA)
    assert res.errors == ["ValueError: trtllm_mha backend only supports topk = 1 for speculative decoding."]


def test_architecture_is_read_from_the_model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    assert read_architecture(tmp_path) == "Qwen3ForCausalLM"
    res = resolve_speculative_args(["--model-path", str(tmp_path), "--speculative-algorithm", "EAGLE3"])
    assert effective(res) == (3, 1, 4) and res.target_architecture == "Qwen3ForCausalLM"
    res = resolve_speculative_args(["--model-path", str(tmp_path / "missing"), "--speculative-algorithm", "EAGLE3"])
    assert res.errors and "target architecture unknown" in res.errors[0]


def test_no_speculation_leaves_everything_unset():
    res = resolve_speculative_args(["--model-path", "/m"], target_architecture=LLAMA)
    assert res.ok and res.adjustments == [] and res.max_running_requests is None
    assert effective(res) == (None, None, None)


def test_parser_mirrors_sglang_flag_errors():
    with pytest.raises(LaunchArgsError, match="ambiguous option: --cuda-graph-max-bs could match "
                                              "--cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill"):
        parse_launch_args(["--model-path", "/m", "--cuda-graph-max-bs", "8"])
    with pytest.raises(LaunchArgsError, match="unrecognized arguments: --no-such-flag"):
        parse_launch_args(["--model-path", "/m", "--no-such-flag"])
    with pytest.raises(LaunchArgsError, match="ambiguous option: --speculative-num could match"):
        parse_launch_args(["--model-path", "/m", "--speculative-num", "3"])
    with pytest.raises(LaunchArgsError, match="unrecognized arguments: --speculative-eagle"):
        parse_launch_args(["--model-path", "/m", "--speculative-eagle", "3"])  # unique prefixes are refused too
    ns = parse_launch_args(["--model", "/m", "--speculative-draft-model=/d", "--tp", "2",
                            "--cuda-graph-max-bs-decode", "4"])
    assert ns.model_path == "/m" and ns.speculative_draft_model_path == "/d" and ns.tp_size == 2
    res = resolve_speculative_args(["--model-path", "/m", "--bogus"])
    assert res.errors == ["error: unrecognized arguments: --bogus"]
