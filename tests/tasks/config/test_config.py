"""Config loading: shipped configs validate; broken ones fail with file:line: field messages, exit 2."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from tasks.config.load import ConfigError, load_experiment, load_sweep

REPO = Path(__file__).resolve().parents[3]
SHIPPED = sorted((REPO / "configs").glob("*.yaml"))
runner = CliRunner()

BASE = """\
experiment: broken
target:
  kind: tiny
data:
  num_samples: 16
  regenerate:
    backend: local
train:
  ttt_steps: 7
deploy:
  host: local
  speculative:
    num_steps: 3
    eagle_topk: 1
    num_draft_tokens: 4
bench:
  concurrency: [1]
"""


def test_every_shipped_config_validates():
    assert {p.name for p in SHIPPED} >= {"tiny.yaml", "llama-3.1-8b.yaml", "kimi-k2.5-int4.yaml"}
    for path in SHIPPED:
        result = runner.invoke(app, ["validate", str(path)])
        assert result.exit_code == 0, (path, result.output)


def test_sweep_expands_into_validated_variants():
    variants = load_sweep(REPO / "configs/sweeps/llama-3.1-8b-spec-grid.yaml")
    settings = [(c.deploy.speculative.num_steps, c.deploy.speculative.eagle_topk, c.deploy.speculative.num_draft_tokens) for _, c in variants]
    assert settings == [(3, 1, 4), (5, 1, 6), (7, 1, 8), (5, 4, 8), (4, 2, 6)]
    assert all(c.experiment == "llama-3.1-8b-eagle3" for _, c in variants)
    result = runner.invoke(app, ["validate", str(REPO / "configs/sweeps/llama-3.1-8b-spec-grid.yaml")])
    assert result.exit_code == 0, result.output


def test_resolved_config_has_defaults_and_the_chain_setting():
    cfg = load_experiment(REPO / "configs/kimi-k2.5-int4.yaml")
    assert (cfg.deploy.speculative.num_steps, cfg.deploy.speculative.eagle_topk, cfg.deploy.speculative.num_draft_tokens) == (3, 1, 4)
    assert cfg.data.num_samples == 100_000 and cfg.data.stream.disk_budget_gb == 1000 and cfg.hosts[0].port == 22


# (replace this line of BASE, with this text) -> (line of the error, expected message fragment)
BROKEN = [
    ("  ttt_steps: 7", "  ttt_steps: 0", 9, "train.ttt_steps: must be >= 1 (got 0)"),
    ("  ttt_steps: 7", "  ttt_step: 7", 9, "train.ttt_step: unknown field (allowed: ttt_steps,"),
    ("  num_samples: 16", "  num_samples: -3", 5, "data.num_samples: must be >= 1 (got -3)"),
    ("  num_samples: 16", "  num_samples: lots", 5, "data.num_samples: must be a valid integer"),
    ("  kind: tiny", "  kind: gguf", 3, "target.kind: must be 'tiny' or 'hf' (got 'gguf')"),
    ("  kind: tiny", "  kind: hf", 3, "target.model_path is required when target.kind is 'hf'"),
    ("    backend: local", "    backend: http", 7, "data.regenerate.endpoint is required when data.regenerate.backend is 'http'"),
    ("    backend: local", "    backend: grpc", 7, "data.regenerate.backend: must be 'local', 'http' or 'sglang' (got 'grpc')"),
    ("  host: local", "  host: gpu-9", 11, "deploy.host 'gpu-9' is neither 'local' nor one of hosts[].name"),
    ("    num_steps: 3", "    num_steps: 0", 13, "deploy.speculative.num_steps: must be >= 1 (got 0)"),
    ("    num_draft_tokens: 4", "    num_draft_tokens: 1", 15, "deploy.speculative.num_draft_tokens: must be >= 2 (got 1)"),
    ("    num_steps: 3", "    algorithm: EAGLE", 13, "deploy.speculative.algorithm: must be 'EAGLE3' (got 'EAGLE')"),
    ("  concurrency: [1]", "  concurrency: [0]", 17, "bench.concurrency: each value must be between 1 and 4096"),
    ("  concurrency: [1]", "  concurrency: []", 17, "bench.concurrency: List should have at least 1 item"),
    ("experiment: broken", "experiment: Broken Name", 1, "experiment: must match pattern"),
    ("experiment: broken", "experimnt: broken", 1, "experimnt: unknown field (allowed: experiment,"),
    ("experiment: broken", "experiment: broken\ntracking:\n  uri: ftp://x", 3, "tracking.uri must start with sqlite:///"),
    ("experiment: broken", "experiment: broken\nhosts:\n  - name: a\n    address: h\n    user: u\n    port: 70000", 6, "hosts.0.port: must be <= 65535 (got 70000)"),
    ("experiment: broken", "experiment: broken\nhosts:\n  - name: a\n    address: h", 3, "hosts.0.user: required field is missing"),
    ("experiment: broken", "experiment: broken\nhosts:\n  - {name: a, address: h, user: u}\n  - {name: a, address: g, user: u}", 2, "hosts: duplicate host names ['a']"),
    ("  ttt_steps: 7", "  ttt_steps: 7\n  lr: 0", 10, "train.lr: must be > 0.0 (got 0)"),
    ("  ttt_steps: 7", "  ttt_steps: 7\n  precision: fp8", 10, "train.precision: must be 'auto', 'fp32' or 'bf16' (got 'fp8')"),
    ("  ttt_steps: 7", "  ttt_steps: 7\n  betas: [0.9, 1.5]", 10, "train.betas: each beta must be in [0, 1)"),
    ("  num_samples: 16", "  num_samples: 16\n  draft_vocab_size: 999999", 6, "data.draft_vocab_size (999999) exceeds the target vocabulary"),
    ("  num_samples: 16", "  num_samples: 16\n  validation_fraction: 1.0", 6, "data.validation_fraction: must be < 1.0 (got 1.0)"),
    ("    backend: local", "    backend: local\n    api_key: ${EAGLEOPS_TEST_UNSET_VAR}", 8, "data.regenerate.api_key: environment variable EAGLEOPS_TEST_UNSET_VAR is not set"),
    ("target:\n  kind: tiny", "target:\n  kind: tiny\n  aux_layer_ids: []", 4, "target.aux_layer_ids: List should have at least 1 item"),
    ("train:\n  ttt_steps: 7", "train: 5", 8, "train: must be a valid dictionary"),
    ("  ttt_steps: 7\ndeploy:", "  ttt_steps: 7\n  draft:\n    architecture: deepseek_mla\nexport:\n"
     "  formats: [sglang, speculators]\ndeploy:", 13,
     "export.formats: speculators cannot hold the deepseek_mla draft (train.draft.architecture)"),
    ("  ttt_steps: 7", "  ttt_steps: 7\n  draft:\n    q_lora_rank: 64", 11,
     "train.draft.q_lora_rank is an MLA dimension: set train.draft.architecture: deepseek_mla"),
    ("  ttt_steps: 7", "  ttt_steps: 7\n  draft:\n    architecture: mla", 11,
     "train.draft.architecture: must be 'llama' or 'deepseek_mla' (got 'mla')"),
    ("    num_draft_tokens: 4\nbench:\n  concurrency: [1]", "    num_draft_tokens: 4\n  baseline: false\nbench:\n"
     "  concurrency: [1]\n  plan: {num_steps: [1, 2]}", 19,
     "bench.plan predicts each setting against the baseline (speculation off is one of its picks), and "
     "deploy.baseline is false"),
    ("  ttt_steps: 7", "  ttt_steps: [7", 9, "invalid YAML"),  # the line the bracket opens
]


@pytest.mark.parametrize("find,replace,line,fragment", BROKEN, ids=[b[3][:40] for b in BROKEN])
def test_broken_variant_names_file_line_and_field(tmp_path, find, replace, line, fragment, monkeypatch):
    monkeypatch.delenv("EAGLEOPS_TEST_UNSET_VAR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert find in BASE
    path = tmp_path / "x.yaml"
    path.write_text(BASE.replace(find, replace, 1))
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    text = " ".join(result.output.split())
    assert fragment in text, text
    assert re.search(rf"x\.yaml:{line}: ", text), text


def test_base_of_the_broken_table_is_valid(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text(BASE)
    assert load_experiment(path).train.ttt_steps == 7


def test_missing_file_and_env_interpolation(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="nope.yaml: file not found"):
        load_experiment(tmp_path / "nope.yaml")
    monkeypatch.setenv("EAGLEOPS_TEST_SAMPLES", "33")
    path = tmp_path / "x.yaml"
    path.write_text(BASE.replace("num_samples: 16", "num_samples: ${EAGLEOPS_TEST_SAMPLES}").replace("host: local", "host: ${EAGLEOPS_TEST_HOST:-local}"))
    cfg = load_experiment(path)
    assert cfg.data.num_samples == 33 and cfg.deploy.host == "local"


def test_run_rejects_bad_input_with_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BASE.replace("ttt_steps: 7", "ttt_steps: 0"))
    assert runner.invoke(app, ["run", str(bad)]).exit_code == 2
    good = tmp_path / "good.yaml"
    good.write_text(BASE)
    result = runner.invoke(app, ["run", str(good), "--stages", "check_environment,train"])
    assert result.exit_code == 2 and "unknown stage(s) train" in " ".join(result.output.split())
    result = runner.invoke(app, ["run", str(good), "--run-dir", str(tmp_path)])
    assert result.exit_code == 2 and "not a run directory" in result.output


SPECULATIVE_CASES = [
    # (the speculative block, exit code, what validate says)
    ("{num_steps: 1, eagle_topk: 1, num_draft_tokens: 16}", 2,
     "deploy.speculative.num_draft_tokens: asked 16, SGLang runs 2 (SGLang: \"speculative_num_draft_tokens is "
     "adjusted to speculative_num_steps + 1 when speculative_eagle_topk == 1\"); ask for 2"),
    ("{num_steps: 1, eagle_topk: 1, num_draft_tokens: 16, allow_adjustments: true}", 0,
     "sglang_settings: deploy.speculative.num_draft_tokens: asked 16, SGLang runs 2 (SGLang: \"speculative_num_"
     "draft_tokens is adjusted to speculative_num_steps + 1 when speculative_eagle_topk == 1\") ok"),
    ("{num_steps: 3}", 2, "TypeError: '>' not supported between instances of 'NoneType' and 'int'"),
    ("{eagle_topk: 4}", 2, "AssertionError (empty message)"),
    ("{num_steps: 2, eagle_topk: 2, num_draft_tokens: 32}", 2, "too large for the draft tree"),
    ("{num_steps: 5, eagle_topk: 1, num_draft_tokens: 6}", 0, "speculative_num_draft_tokens"),
]


@pytest.mark.parametrize("speculative, code, message", SPECULATIVE_CASES)
def test_validate_applies_sglangs_launch_rules(tmp_path, monkeypatch, speculative, code, message):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "tmp.yaml"
    config.write_text(BASE.replace("  speculative:\n    num_steps: 3\n    eagle_topk: 1\n    num_draft_tokens: 4",
                                   f"  speculative: {speculative}"))
    result = runner.invoke(app, ["validate", str(config)], env={"COLUMNS": "400"})
    output = " ".join(result.output.split())
    assert result.exit_code == code, output
    if code == 0 and "allow" not in speculative:
        assert "error" not in output and "sglang_settings: deploy.speculative" not in output
    else:
        assert message in output


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("eagleops ")
