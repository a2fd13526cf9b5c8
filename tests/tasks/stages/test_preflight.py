"""tasks/stages/preflight.py: what is refused before any stage, and what is left to the stages.

The bad configs themselves (each answered in one line by `validate` and `run`) are in the mutation corpus
(tests/tasks/config/test_config_mutations.py); these are the rules' other side: what passes, and the choices.
"""

from __future__ import annotations

import json

import pytest

from tasks.config.load import ConfigError
from tasks.config.schema import ExperimentConfig
from tasks.stages.preflight import preflight_findings, refuse_before_stages, served_context

DRAFT_FLAG = "--speculative-draft-model-path"


def config(**sections) -> ExperimentConfig:
    return ExperimentConfig.model_validate({"experiment": "preflight", **sections})


def errors(cfg: ExperimentConfig, stages: list[str] | None = None) -> list[str]:
    return [f"{f.field}: {f.check}" for f in preflight_findings(cfg, stages) if f.level == "error"]


def test_an_eagle3_draft_in_extra_args_passes_and_a_remote_one_is_left_to_its_host(tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    assert errors(config(deploy={"extra_args": [DRAFT_FLAG, str(draft)]})) == []
    assert errors(config(deploy={"extra_args": [f"{DRAFT_FLAG}={draft}"]})) == []
    # on a GPU host the folder is the host's: the deploy stage reads it there
    remote = {"extra_args": [DRAFT_FLAG, "/models/draft"], "host": "gpu-1"}
    hosts = [{"name": "gpu-1", "address": "10.0.0.1", "user": "ops"}]
    assert errors(config(deploy=remote, hosts=hosts)) == []
    assert errors(config(deploy={"extra_args": [DRAFT_FLAG, "/models/draft"]})) == ["deploy.extra_args: draft_config"]


def test_the_served_context_comes_from_what_the_server_will_read(tmp_path):
    assert served_context(config()) == (1024, "target.tiny.max_position_embeddings")
    # SGLang honours --context-length; the reference server reads the model's config.json only
    sglang = config(deploy={"server": "sglang", "extra_args": ["--context-length", "300"]})
    assert served_context(sglang)[0] == 300
    assert served_context(config(deploy={"extra_args": ["--context-length", "300"]}))[0] == 1024
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4,
                                                   "text_config": {"max_position_embeddings": 512}}))
    hf = config(target={"kind": "hf", "model_path": str(model)}, data={"max_length": 256})
    assert served_context(hf) == (512, f"max_position_embeddings of {model}/config.json (target.model_path)")
    other = config(target={"kind": "hf", "model_path": str(model)}, deploy={"model_path": "/elsewhere"})
    assert served_context(other) == (None, "")  # another model is served: its context is read where it is


def test_the_length_bound_is_an_answer_of_at_least_one_token_after_a_prompt(tmp_path):
    assert errors(config(data={"max_length": 256}, bench={"max_new_tokens": 255})) == []
    assert errors(config(data={"max_length": 256}, bench={"max_new_tokens": 256})) == [
        "bench.max_new_tokens: bench_lengths"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    # a prompts file is not held to the trained length (its prompts are the user's), only to the served context
    assert errors(config(data={"max_length": 256}, bench={"prompts": str(prompts), "max_new_tokens": 1023})) == []


def test_deploy_preflight_warn_leaves_sglang_rewrites_to_the_deploy_stage(tmp_path):
    rewritten = {"num_steps": 1, "eagle_topk": 1, "num_draft_tokens": 16}  # SGLang runs 2 draft tokens
    path = tmp_path / "c.yaml"
    path.write_text("experiment: preflight\n")
    with pytest.raises(ConfigError, match="deploy.speculative: sglang_settings"):
        refuse_before_stages(config(deploy={"speculative": rewritten}), path)
    refuse_before_stages(config(deploy={"speculative": rewritten, "preflight": "warn"}), path)
    with pytest.raises(ConfigError, match="bench_lengths"):  # what no server can run is refused either way
        refuse_before_stages(config(deploy={"speculative": rewritten, "preflight": "warn"},
                                    bench={"max_new_tokens": 5000}), path)


def test_only_the_selected_stages_checks_refuse(tmp_path):
    cfg = config(bench={"prompts": str(tmp_path / "none.jsonl")}, train={"init_checkpoint": str(tmp_path / "none")})
    assert errors(cfg) == ["bench.prompts: prompt_file", "train.init_checkpoint: init_checkpoint"]
    assert errors(cfg, ["check_environment", "generate_data"]) == []
    assert errors(cfg, ["train_draft"]) == ["train.init_checkpoint: init_checkpoint"]
    assert errors(cfg, ["run_benchmark"]) == ["bench.prompts: prompt_file"]


def test_a_prompt_file_that_is_a_folder_is_named(tmp_path):
    assert [f.message for f in preflight_findings(config(bench={"prompts": str(tmp_path)}))
            if f.level == "error"] == [f"{tmp_path}: cannot read (Is a directory)"]
