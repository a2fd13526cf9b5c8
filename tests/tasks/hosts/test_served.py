"""tasks.hosts.served: the launch's paths (last flag wins), the served model's files read where they are served,
and the chat template hashed as the training data hashed it. The oracle for the template hash is the
tokenizer transformers loads from the same folder; the preflight cases use real exported drafts."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from eagle3.data.chat import chat_template_sha256
from eagle3.draft.model import DraftModelConfig, Eagle3DraftModel
from eagle3.export import export_sglang
from tasks.config.schema import ExperimentConfig
from tasks.hosts.remote import LocalExecutor, connect
from tasks.hosts.served import (
    launch_paths,
    read_served_model,
    reported_paths,
    served_template,
)
from tasks.runner.context import StageContext
from tasks.stages.deploy import plan_placement, preflight, served_model_planned

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
TARGET = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 48,
          "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 7, "vocab_size": 300,
          "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
RECORD = {"architecture": "LlamaForCausalLM", "num_hidden_layers": 7, "aux_layer_ids": [1, 3, 4],
          "hf_indices": [2, 4, 5], "chat_template_sha256": hashlib.sha256(TEMPLATE.encode()).hexdigest()}
SPEC = {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}


def model_folder(path: Path, config: dict, template: str | None = TEMPLATE) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    if template is not None:
        (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return path


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    config = DraftModelConfig.from_target_config(TARGET, draft_vocab_size=300, aux_layer_ids=[1, 3, 4])
    folder = export_sglang(Eagle3DraftModel(config), TARGET, tmp_path_factory.mktemp("draft") / "sglang", "float32")
    (folder / "eagleops_training.json").write_text(json.dumps(RECORD))
    return folder


def test_launch_paths_take_the_last_flag_like_sglang():
    argv = ["--model-path", "/a", "--speculative-draft-model", "/d1", "--model=/b", "--tokenizer-path", "/t",
            "--speculative-draft-model-path", "/d2", "--chat-template", "chatml"]
    assert launch_paths(argv) == {"model": "/b", "draft": "/d2", "tokenizer": "/t", "chat_template": "chatml"}
    assert reported_paths({"model_path": "/m", "speculative_draft_model_path": None}) == {
        "model": "/m", "draft": None, "tokenizer": None, "chat_template": None}
    assert reported_paths({"version": "0.5.23"}) is None


def test_the_served_template_hash_is_the_one_the_tokenizer_loads(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                        unk_token="<unk>")
    tokenizer.chat_template = TEMPLATE + "{{ eos_token }}"
    tokenizer.save_pretrained(tmp_path / "tok")
    expected = chat_template_sha256(AutoTokenizer.from_pretrained(tmp_path / "tok"))

    def read(path: str) -> str | None:
        return Path(path).read_text() if Path(path).is_file() else None

    found, source = served_template(read, {"model": str(tmp_path / "tok")})
    assert found == expected and source.startswith(str(tmp_path / "tok"))


def test_a_chat_template_flag_is_the_template_the_server_applies(tmp_path):
    model = model_folder(tmp_path / "model", TARGET)
    jinja = tmp_path / "served.jinja"
    jinja.write_text("{{ messages }}")

    def served(flag: str):
        argv = ["--model-path", str(model), "--chat-template", flag]
        return read_served_model(LocalExecutor(), launch_paths(argv), paths_from="launch command")

    assert served(str(jinja)).chat_template_sha256 == hashlib.sha256(b"{{ messages }}").hexdigest()
    builtin = served("chatml")
    assert builtin.chat_template_sha256 is None
    assert builtin.missing == ["chat template: --chat-template chatml is SGLang's built-in template of that name, "
                               "not a file to compare"]


def unit_context(tmp_path: Path) -> StageContext:
    run_dir = tmp_path / "runs" / "unit" / "run-1"
    (run_dir / "deploy_server").mkdir(parents=True)
    return StageContext("deploy_server", run_dir / "deploy_server", run_dir, "", "")


def test_the_preflight_checks_the_model_deploy_model_path_names_not_the_training_target(tmp_path, draft_dir):
    trained_on = model_folder(tmp_path / "training-target", TARGET)
    served = model_folder(tmp_path / "served-model", {**TARGET, "num_hidden_layers": 9})
    cfg = ExperimentConfig(experiment="unit", deploy={"model_path": str(served), "speculative": SPEC})
    plan = plan_placement(cfg, LocalExecutor(), unit_context(tmp_path), draft_dir, trained_on)
    model = served_model_planned(cfg, plan)
    assert model.paths["model"] == str(served) and model.target_config["num_hidden_layers"] == 9
    findings, _ = preflight(cfg, cfg.deploy.speculative, draft_dir, model, plan)
    errors = [f.line() for f in findings if f.level == "error"]
    assert errors == ["wiring.training_target: trained on a 7-layer LlamaForCausalLM target, serving a 9-layer "
                      "LlamaForCausalLM"]
    # Without deploy.model_path, the training target is what is served (in place on this machine): no error.
    own = ExperimentConfig(experiment="unit", deploy={"speculative": SPEC})
    plan = plan_placement(own, LocalExecutor(), unit_context(tmp_path / "own"), draft_dir, trained_on)
    findings, _ = preflight(own, own.deploy.speculative, draft_dir, served_model_planned(own, plan), plan)
    assert [f for f in findings if f.level == "error"] == []


def test_on_an_ssh_host_the_model_is_read_there_and_an_upload_from_its_local_bytes(tmp_path, draft_dir, sshd):
    remote = tmp_path / "remote"
    served = model_folder(tmp_path / "host-models" / "m", {**TARGET, "num_hidden_layers": 9}, template="{{ host }}")
    trained_on = model_folder(tmp_path / "training-target", TARGET)
    host = sshd.host_config(workdir=str(remote))
    with connect(host) as executor:
        for model_path, layers, sha in ((str(served), 9, hashlib.sha256(b"{{ host }}").hexdigest()),
                                        (None, 7, RECORD["chat_template_sha256"])):
            cfg = ExperimentConfig(experiment="unit", hosts=[host], deploy={"host": host.name, "model_path": model_path,
                                                                            "speculative": SPEC})
            plan = plan_placement(cfg, executor, unit_context(tmp_path / str(layers)), draft_dir, trained_on)
            model = served_model_planned(cfg, plan)
            assert (model.host, model.target_config["num_hidden_layers"], model.chat_template_sha256) == \
                (host.name, layers, sha)
            assert model.training_record == RECORD  # the draft about to be uploaded, read from its local bytes
        assert not executor.path_exists(plan.model_path)  # the tiny target was read before any upload
    shutil.rmtree(remote, ignore_errors=True)
