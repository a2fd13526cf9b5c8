"""The recording view (tasks/config/reads.py) and the check of a stage's reads against its StageSpec.

The reads are made by project code (tasks.hosts.launch, tasks.config, tasks.runner), as a stage makes
them; the expected paths are written out by hand from what that code reads.
"""

from __future__ import annotations

import copy
from pathlib import Path

from eagle3.config import StrictModel
from tasks.config.load import load_experiment
from tasks.config.masked import masked_dict
from tasks.config.reads import recording_reads
from tasks.config.schema import ExperimentConfig
from tasks.hosts.launch import launch_args, speculative_flags
from tasks.runner.specs import STAGE_SPECS, StageSpec, stage_inputs, undeclared_reads

REPO = Path(__file__).resolve().parents[3]


def llama() -> ExperimentConfig:
    return load_experiment(REPO / "configs" / "llama-3.1-8b.yaml")


def test_attribute_reads_are_recorded_by_schema_path():
    cfg = llama()
    with recording_reads(cfg) as reads:
        speculative_flags(cfg.deploy.speculative, "/draft")
    assert reads == {"deploy.speculative.algorithm", "deploy.speculative.num_steps", "deploy.speculative.eagle_topk",
                     "deploy.speculative.num_draft_tokens"}


def test_a_whole_section_dumped_is_every_field_below_it_and_list_items_lose_their_index():
    cfg = llama()
    with recording_reads(cfg) as reads:
        masked_dict(cfg.hosts[0])
    assert reads == {f"hosts.{name}" for name in type(cfg.hosts[0]).model_fields}


def test_reads_through_copies_count_and_reads_outside_the_project_do_not():
    cfg = llama()
    with recording_reads(cfg) as reads:
        cfg.train.lr  # this test file is not eagle3/, tasks/ or flows/: not a stage's read
        server = cfg.model_copy(update={"deploy": cfg.deploy.model_copy(update={"port": 1})})
        launch_args(copy.deepcopy(server), model_path="m", draft_path=None, port=1)
    assert "train.lr" not in reads
    assert reads == {"deploy.tp", "deploy.mem_fraction_static", "deploy.max_running_requests",
                     "deploy.enable_metrics", "deploy.extra_args"}


def test_the_hooks_are_gone_once_the_recording_ends():
    with recording_reads():
        assert "__getattribute__" in StrictModel.__dict__
    assert "__getattribute__" not in StrictModel.__dict__ and "model_dump" not in StrictModel.__dict__


def test_a_read_neither_input_nor_operational_is_named_and_conditional_reads_follow_the_config():
    cfg = llama()  # regenerates through servers it starts (data.regenerate.deploy)
    reads = {"data.num_samples", "data.regenerate.concurrency", "deploy.model_path", "deploy.port", "bench.num_prompts"}
    assert undeclared_reads("generate_data", cfg, reads) == ["bench.num_prompts"]
    without = StageSpec(config=("target", "data"), operational=STAGE_SPECS["generate_data"].operational)
    assert undeclared_reads("generate_data", cfg, reads, without) == ["bench.num_prompts", "deploy.model_path",
                                                                      "deploy.port"]
    inputs = stage_inputs(cfg, "generate_data", {}, "v")["config"]
    assert "deploy.model_path" in inputs and "deploy.server" in inputs  # what the servers serve: an input
    assert "deploy.port" not in inputs and "data.regenerate.concurrency" not in inputs  # how: operational
    tiny = load_experiment(REPO / "configs" / "tiny.yaml")  # local regeneration: deploy is not the data's
    assert not [k for k in stage_inputs(tiny, "generate_data", {}, "v")["config"] if k.startswith("deploy.")]
