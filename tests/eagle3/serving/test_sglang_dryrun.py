"""The real SGLang 0.5.23 as the oracle for eagleops' copy of its speculative rules.

The session fixture `sglang_python` (tests/conftest.py) installs SGLang into a CPU venv with
infra/install-sglang-cpu.sh. Then one python process of that venv runs
eagle3/serving/sglang_dryrun.py, piped on stdin exactly as the deploy preflight pipes it over SSH,
over a table of launch settings (SGLang's imports, ~15 s, are paid once), and each row's
answer must match `eagle3.serving.sglang_args.resolve_speculative_args` through `compare_dry_run`.
Model dirs are config-only (a Llama-3.1-8B-shaped and a Qwen3-8B-shaped target, and the
EAGLE-3 draft config our exporter writes): SGLang's resolution reads nothing else.

The last tests run without SGLang: the script's exit codes and `compare_dry_run` itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.draft.model import DraftModelConfig
from eagle3.export import build_sglang_config
from eagle3.serving.sglang_args import resolve_speculative_args
from eagle3.serving.sglang_dryrun import compare_dry_run

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "eagle3" / "serving" / "sglang_dryrun.py"

LLAMA_TARGET = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
    "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001, "tie_word_embeddings": False,
}
QWEN3_TARGET = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
    "tie_word_embeddings": False,
}

# (id, target, extra flags, what SGLang does: (steps, topk, draft tokens, max running) or the
# exception type). The expectation pins SGLang's behaviour itself (reference sglang-eagle3.md
# §6), so a changed SGLang fails here even where eagleops' copy changed the same way.
CASES = [
    ("seed-1-1-16", "llama", ["--speculative-num-steps", "1", "--speculative-eagle-topk", "1",
                              "--speculative-num-draft-tokens", "16"], (1, 1, 2, 48)),
    ("chain-3-1-4", "llama", ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                              "--speculative-num-draft-tokens", "4"], (3, 1, 4, 48)),
    ("tree-5-8-32", "llama", ["--speculative-num-steps", "5", "--speculative-eagle-topk", "8",
                              "--speculative-num-draft-tokens", "32"], (5, 8, 32, 48)),
    ("unset-llama", "llama", [], (5, 4, 8, 48)),
    ("unset-qwen3", "qwen3", [], (3, 1, 4, 48)),
    ("topk-only", "llama", ["--speculative-eagle-topk", "4"], "AssertionError"),
    ("draft-tokens-only", "llama", ["--speculative-num-draft-tokens", "8"], "AssertionError"),
    ("steps-only", "llama", ["--speculative-num-steps", "3"], "TypeError"),
    ("cpu-max-running-16", "llama", ["--device", "cpu", "--max-running-requests", "16", "--speculative-num-steps",
                                     "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"],
     (3, 1, 4, 16)),
    ("tree-2-2-32", "llama", ["--speculative-num-steps", "2", "--speculative-eagle-topk", "2",
                              "--speculative-num-draft-tokens", "32"], (2, 2, 32, 48)),
    ("tree-3-4-unset", "llama", ["--speculative-num-steps", "3", "--speculative-eagle-topk", "4"], (3, 4, None, 48)),
    ("chain-2-1-7", "qwen3", ["--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
                              "--speculative-num-draft-tokens", "7"], (2, 1, 3, 48)),
    ("rejection-topk-4", "llama", ["--speculative-use-rejection-sampling", "--speculative-num-steps", "3",
                                   "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"],
     "ValueError"),
    ("rejection-chain", "llama", ["--speculative-use-rejection-sampling", "--speculative-num-steps", "3",
                                  "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"],
     (3, 1, 4, 48)),
    ("adaptive", "llama", ["--speculative-adaptive"], (3, 1, 4, 48)),
    ("nextn-alias", "llama", ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                              "--speculative-num-draft-tokens", "4"], (3, 1, 4, 48)),
    ("retired-cuda-graph-flag", "llama", ["--cuda-graph-max-bs", "8"], "SystemExit"),
    ("standalone-window", "llama", ["--speculative-draft-window-size", "64"], (3, 1, 4, 48)),
    ("eagle-window", "llama", ["--speculative-draft-window-size", "64"], (5, 4, 8, 48)),
    ("standalone-mixed-chunk", "llama", ["--enable-mixed-chunk"], (3, 1, 4, 48)),
    ("block-verification", "llama", ["--speculative-use-block-verification", "--speculative-num-steps", "3",
                                     "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"],
     (3, 1, 4, 48)),
    ("disable-overlap", "llama", ["--disable-overlap-schedule"], (5, 4, 8, 48)),
    ("token-map", "llama", ["--speculative-token-map", "/nowhere/hot.pt"], (5, 4, 8, 48)),
    ("block-verification-cpu", "llama", ["--device", "cpu", "--speculative-use-block-verification",
                                         "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                                         "--speculative-num-draft-tokens", "4"], "ValueError"),
    ("block-verification-standalone", "llama", ["--speculative-use-block-verification"], "ValueError"),
    ("sink-without-window", "llama", ["--speculative-draft-sink-size", "4"], "ValueError"),
    ("window-zero", "llama", ["--speculative-draft-window-size", "0"], "ValueError"),
    ("unknown-algorithm", "llama", [], "ValueError"),
    ("lower-case-algorithm", "llama", ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                                       "--speculative-num-draft-tokens", "4"], (3, 1, 4, 48)),
    ("adaptive-topk-4", "llama", ["--speculative-adaptive", "--speculative-num-steps", "3",
                                  "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"],
     (3, 4, 8, 48)),
    ("adaptive-steps-not-candidate", "llama", ["--speculative-adaptive", "--speculative-num-steps", "4"],
     "ValueError"),
    ("page-tree-flashmla", "llama", ["--page-size", "16", "--attention-backend", "flashmla", "--speculative-num-steps",
                                     "3", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"],
     "ValueError"),
]
ALGORITHM = {"nextn-alias": "NEXTN", "standalone-window": "STANDALONE", "standalone-mixed-chunk": "STANDALONE",
             "eagle-window": "EAGLE", "block-verification-standalone": "STANDALONE", "unknown-algorithm": "FOO",
             "lower-case-algorithm": "eagle3"}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Config-only target dirs and the EAGLE-3 draft config written by eagle3.export."""
    root = tmp_path_factory.mktemp("sglang-dryrun-models")
    draft_cfg = DraftModelConfig.from_target_config(LLAMA_TARGET, draft_vocab_size=32000, aux_layer_ids=[1, 15, 28])
    configs = {"llama": LLAMA_TARGET, "qwen3": QWEN3_TARGET, "draft": build_sglang_config(draft_cfg, LLAMA_TARGET)}
    dirs = {}
    for name, config in configs.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        dirs[name] = root / name
    return dirs


def case_argv(case_id: str, target: str, flags: list[str], dirs: dict[str, Path]) -> list[str]:
    device = [] if "--device" in flags else ["--device", "cuda"]  # no accelerator here to auto-detect
    return ["--model-path", str(dirs[target]), *device, "--speculative-algorithm", ALGORITHM.get(case_id, "EAGLE3"),
            "--speculative-draft-model-path", str(dirs["draft"]), *flags]


@pytest.fixture(scope="session")
def dry_runs(sglang_python, model_dirs, tmp_path_factory) -> dict[str, dict]:
    """Every CASES row resolved by the real SGLang in one process, the script piped on stdin."""
    batch = tmp_path_factory.mktemp("sglang-dryrun") / "batch.json"
    batch.write_text(json.dumps([case_argv(c, t, f, model_dirs) for c, t, f, _ in CASES]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    with open(SCRIPT) as source:
        proc = subprocess.run([str(sglang_python), "-", "--batch", str(batch)], stdin=source, capture_output=True,
                              text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    assert len(results) == len(CASES)
    return {case[0]: result for case, result in zip(CASES, results)}


@pytest.mark.parametrize("case_id,target,flags,expected", CASES, ids=[c[0] for c in CASES])
def test_sglang_resolution_is_what_the_reference_says(dry_runs, case_id, target, flags, expected):
    dry = dry_runs[case_id]
    assert dry["sglang_version"] == "0.5.23"
    if isinstance(expected, str):
        assert not dry["ok"], dry
        assert dry["error"].startswith(f"{expected}:"), dry["error"]
        return
    assert dry["ok"], dry["error"]
    r = dry["resolved"]
    got = (r["speculative_num_steps"], r["speculative_eagle_topk"], r["speculative_num_draft_tokens"],
           r["max_running_requests"])
    assert got == expected


@pytest.mark.parametrize("case_id,target,flags,expected", CASES, ids=[c[0] for c in CASES])
def test_eagleops_prediction_matches_sglang(dry_runs, model_dirs, case_id, target, flags, expected):
    prediction = resolve_speculative_args(case_argv(case_id, target, flags, model_dirs))
    assert compare_dry_run(dry_runs[case_id], prediction) == []


def test_trees_sglang_accepts_but_cannot_decode_are_flagged_by_eagleops(dry_runs, model_dirs):
    # Resolution passes in SGLang; the worker fails at the first decode (reference §1.2).
    for case_id in ("tree-2-2-32", "tree-3-4-unset"):
        assert dry_runs[case_id]["ok"]
        flags = next(f for c, _, f, _ in CASES if c == case_id)
        assert resolve_speculative_args(case_argv(case_id, "llama", flags, model_dirs)).runtime_errors


def test_effective_values_differ_from_raw_input_and_log_why(dry_runs):
    seed = dry_runs["seed-1-1-16"]
    messages = [(w["level"], w["message"]) for w in seed["warnings"]]
    assert ("warning", "speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when "
            "speculative_eagle_topk == 1") in messages
    cpu = dry_runs["cpu-max-running-16"]
    assert cpu["resolved"]["disable_overlap_schedule"] is True and cpu["resolved"]["device"] == "cpu"
    assert dry_runs["nextn-alias"]["resolved"]["speculative_algorithm"] == "EAGLE"
    assert dry_runs["standalone-mixed-chunk"]["resolved"]["enable_mixed_chunk"] is False


def test_batch_rows_do_not_see_each_others_environment(dry_runs):
    # Resolution sets SGLANG_USE_CUDA_IPC_TRANSPORT; a later row that saw it would log this.
    for case_id, dry in dry_runs.items():
        assert not [w for w in dry["warnings"] if "SGLANG_USE_CUDA_IPC_TRANSPORT" in w["message"]], case_id


# --------------------------------------------------------------------------- without SGLang


def run_script(*args: str, python_flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *python_flags, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=120)


def test_script_exits_2_with_json_when_sglang_is_not_importable():
    # -S: no site-packages, so no sglang whatever this interpreter has installed.
    proc = run_script("--", "--model-path", "/m", python_flags=("-S",))
    assert proc.returncode == 2
    answer = json.loads(proc.stdout)
    assert answer["ok"] is False and answer["error"].startswith("sglang is not importable: ModuleNotFoundError")


def test_script_usage_errors_exit_2_with_json():
    for args, needle in ((("--full",), "no SGLang launch flags"), (("--batch",), "unknown or incomplete option"),
                         (("--batch-json", "{}"), "expected a JSON list of argv lists")):
        proc = run_script(*args)
        assert proc.returncode == 2, args
        assert needle in json.loads(proc.stdout)["error"], args


SGLANG_SEED_ANSWER = {
    "ok": True, "sglang_version": "0.5.23",
    "resolved": {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 1, "speculative_eagle_topk": 1,
                 "speculative_num_draft_tokens": 2, "max_running_requests": 48,
                 "speculative_draft_model_path": "/d", "speculative_draft_model_revision": "main",
                 "speculative_use_rejection_sampling": False, "speculative_adaptive": False,
                 "disable_overlap_schedule": False, "enable_mixed_chunk": False, "device": "cuda"},
    "warnings": [
        {"level": "info", "logger": "sglang.srt.arg_groups.overrides",
         "message": "Attention backend not specified. Use triton backend by default."},
        {"level": "warning", "logger": "sglang.srt.arg_groups.speculative_hook",
         "message": "Max running requests is reset to 48 for speculative decoding. You can override this by "
                    "explicitly setting --max-running-requests."},
        {"level": "warning", "logger": "sglang.srt.arg_groups.speculative_hook",
         "message": "speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when "
                    "speculative_eagle_topk == 1"},
    ],
}
SEED_ARGV = ["--model-path", "/t", "--device", "cuda", "--speculative-algorithm", "EAGLE3",
             "--speculative-draft-model-path", "/d", "--speculative-num-steps", "1", "--speculative-eagle-topk", "1",
             "--speculative-num-draft-tokens", "16"]


def test_compare_agrees_with_a_matching_answer():
    assert compare_dry_run(SGLANG_SEED_ANSWER, resolve_speculative_args(SEED_ARGV, "LlamaForCausalLM")) == []


def test_compare_names_the_wrong_value_and_the_missing_and_extra_log_lines():
    prediction = resolve_speculative_args(SEED_ARGV, "LlamaForCausalLM")
    prediction.speculative_num_draft_tokens = 16  # a rule copy that forgot the topk == 1 rewrite
    prediction.adjustments = [a for a in prediction.adjustments if "adjusted" not in a[1]]
    prediction.adjustments.append(("warning", "Overlap schedule is not implemented for speculative decoding on CPU."))
    assert compare_dry_run(SGLANG_SEED_ANSWER, prediction) == [
        "speculative_num_draft_tokens: sglang says 2, eagleops predicted 16",
        "log line: eagleops predicted warning 'Overlap schedule is not implemented for speculative decoding on "
        "CPU.', sglang did not log it",
        "log line: sglang logged warning 'speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 "
        "when speculative_eagle_topk == 1', eagleops predicted no such line",
    ]


def test_compare_failures():
    ok_prediction = resolve_speculative_args(SEED_ARGV, "LlamaForCausalLM")
    assert compare_dry_run({"ok": False, "error": "AssertionError: ", "warnings": []}, ok_prediction) == [
        "resolution: sglang fails with 'AssertionError: ', eagleops predicted success"]
    topk_only = resolve_speculative_args(SEED_ARGV[:8] + ["--speculative-eagle-topk", "4"], "LlamaForCausalLM")
    assert compare_dry_run({"ok": False, "error": "AssertionError: ", "warnings": []}, topk_only) == []
    [diff] = compare_dry_run({"ok": False, "error": "TypeError: '>' not supported", "warnings": []}, topk_only)
    assert diff.startswith("resolution error: sglang raises \"TypeError: '>' not supported\", eagleops predicted "
                           "'AssertionError")
    assert compare_dry_run(SGLANG_SEED_ANSWER, topk_only)[0].startswith(
        "resolution: sglang succeeds, eagleops predicted failure 'AssertionError")
    with pytest.raises(ValueError, match="expected one dry-run object"):
        compare_dry_run([SGLANG_SEED_ANSWER], ok_prediction)  # type: ignore[arg-type]


def test_deploy_preflight_dry_run_over_ssh_agrees_and_catches_a_disagreement(sglang_python, model_dirs, sshd):
    """The deploy stage's dry run: the script piped over SSH to the host's SGLang Python."""
    from tasks.hosts.remote import connect
    from tasks.stages.deploy import dry_run_findings, sglang_dry_run

    argv = case_argv("chain-3-1-4", "llama", ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                                        "--speculative-num-draft-tokens", "4"], model_dirs)
    with connect(sshd.host_config(python=str(sglang_python))) as host:
        dry = sglang_dry_run(host, argv)
    assert dry["ok"] and dry["resolved"]["speculative_num_draft_tokens"] == 4
    predicted = {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4, "max_running_requests": 48}
    assert [f.level for f in dry_run_findings(dry, predicted)] == ["info"]
    wrong = dry_run_findings(dry, {**predicted, "num_draft_tokens": 16})
    assert [f.message for f in wrong] == ["speculative_num_draft_tokens: SGLang resolves 4, eagleops predicted 16"]


def test_sweep_settings_get_sglangs_resolution_in_one_batched_dry_run(sglang_python, tmp_path):
    """The benchmark's sweep: each setting preflighted against the served model, then all resolved by the real
    SGLang in one process (`--batch-json`), before any sweep server would start."""
    import torch

    from eagle3.draft.model import Eagle3DraftModel
    from eagle3.export import export_sglang
    from tasks.config.schema import ExperimentConfig
    from tasks.hosts.launch import launch_args
    from tasks.hosts.remote import LocalExecutor
    from tasks.hosts.served import launch_paths, read_served_model
    from tasks.hosts.servers import Placement
    from tasks.stages.bench.stage import checked_sweep

    target = {**LLAMA_TARGET, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 7,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300}
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(target))
    draft_cfg = DraftModelConfig.from_target_config(target, draft_vocab_size=300, aux_layer_ids=[1, 3, 4])
    torch.manual_seed(0)
    draft = export_sglang(Eagle3DraftModel(draft_cfg), target, tmp_path / "draft", "float32")
    (draft / "eagleops_training.json").write_text(json.dumps(
        {"architecture": "LlamaForCausalLM", "num_hidden_layers": 7, "aux_layer_ids": [1, 3, 4], "hf_indices": [2, 4, 5]}))

    class DryRunsCounted(LocalExecutor):
        def __init__(self, python: str):
            super().__init__(python)
            self.dry_runs: list[list[str]] = []

        def run(self, argv, **kwargs):
            if "--batch-json" in argv:
                self.dry_runs.append(list(argv))
            return super().run(argv, **kwargs)

    executor = DryRunsCounted(python=str(sglang_python))
    cfg = ExperimentConfig(experiment="unit", deploy={
        "server": "sglang", "extra_args": ["--device", "cuda"],  # no accelerator here to auto-detect
        "speculative": {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}},
        bench={"sweep": [{"num_steps": 2, "eagle_topk": 1, "num_draft_tokens": 8},
                         {"num_steps": 5, "eagle_topk": 4, "num_draft_tokens": 8}]})
    placement = Placement(executor, None, str(tmp_path), str(tmp_path / "target"), str(draft))
    argv = launch_args(cfg, model_path=placement.model_path, draft_path=placement.draft_path, port=cfg.deploy.port)
    served = read_served_model(executor, launch_paths(argv), paths_from="launch command")
    checked = checked_sweep(cfg, placement, draft, served)
    assert [(spec.num_draft_tokens, predicted) for spec, predicted in checked] == [
        (8, {"num_steps": 2, "eagle_topk": 1, "num_draft_tokens": 3, "max_running_requests": 48}),  # steps + 1
        (8, {"num_steps": 5, "eagle_topk": 4, "num_draft_tokens": 8, "max_running_requests": 48})]
    assert len(executor.dry_runs) == 1 and len(json.loads(executor.dry_runs[0][-1])) == 2
