"""A rehearsal on this machine of each shipped GPU config: the run a real user starts first.

`configs/llama-3.1-8b.yaml` and `configs/kimi-k2.5-int4.yaml` run end to end with only what this
machine lacks replaced:
- the GPU host is the local sshd (a real SSH connection), its workdir a folder here, its Python the
  CPU SGLang 0.5.23 venv (`sglang_python`) with eagleops on its path: real SGLang captures for
  `target.engine: sglang` (its model runner on the CPU engine, tp 1), transformers for `hf`;
- the model on the host is the tiny test target (placed at the host's model path, as the weights
  are on a real host before the run), the prompts file a few of the built-in prompts on the host;
- SGLang serving is the reference server (`deploy.server: reference`: SGLang's flags, endpoints
  and modes), for the regeneration servers the data stage starts and for deploy + benchmark;
- sizes shrink to CPU scale (8 samples, a few steps, 1 GPU-rank per node, 1 server instead of 8).
Every stage must run where the real cluster runs it, and nothing that should stay on the host may
cross this machine: the test records every upload and download this process makes, checks where
each stage's files are, and for the SGLang-engine config forbids transformers from loading any
model weights, here and in every host process but the reference server (which stands in for SGLang).
"""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
import yaml

from eagle3.config import TinyTargetConfig
from eagle3.data.placement import SIMULATED_DEVICES_ENV
from eagle3.data.prompts import builtin_conversations, prompt_part
from eagle3.data.tiny_target import build_tiny_target
from flows.experiment import eagle3_experiment
from tasks.hosts.remote.ssh import SSHExecutor
from tasks.rundir import RunDirectory
from tests.helpers import TEST_TARGET_YAML, free_port, reference_servers_alive

REPO = Path(__file__).resolve().parents[2]

# Runs at the start of every host process (the wrapper puts it on PYTHONPATH): in the rehearsal of
# a target.engine sglang config, transformers may load model weights only in the reference server.
FORBID_HF_WEIGHTS = textwrap.dedent(
    """
    import os, sys
    if os.environ.get("REHEARSAL_FORBID_HF_WEIGHTS") and "eagle3.serve" not in " ".join(sys.orig_argv):
        import importlib.abc, importlib.machinery

        def refuse(*args, **kwargs):
            raise AssertionError("target.engine sglang: transformers loaded model weights in " + " ".join(sys.orig_argv))

        class _Patch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name != "transformers.modeling_utils":
                    return None
                sys.meta_path.remove(self)
                spec = importlib.machinery.PathFinder.find_spec(name, path)
                loader = spec.loader
                original = loader.exec_module

                def exec_module(module):
                    original(module)
                    module.PreTrainedModel.from_pretrained = classmethod(refuse)
                loader.exec_module = exec_module
                return spec

        sys.meta_path.insert(0, _Patch())
    """
)


class Transfers:
    """Every upload and download this process makes over SSH (what crosses the orchestrator)."""

    def __init__(self, monkeypatch) -> None:
        self.uploads: list[str] = []
        self.downloads: list[str] = []
        upload, download = SSHExecutor.upload_file, SSHExecutor.download_file

        def recorded_upload(executor, local, remote, *args, **kwargs):
            self.uploads.append(str(local))
            return upload(executor, local, remote, *args, **kwargs)

        def recorded_download(executor, remote, local, *args, **kwargs):
            self.downloads.append(str(remote))
            return download(executor, remote, local, *args, **kwargs)

        monkeypatch.setattr(SSHExecutor, "upload_file", recorded_upload)
        monkeypatch.setattr(SSHExecutor, "download_file", recorded_download)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    tiny = yaml.safe_load(TEST_TARGET_YAML)["target"]["tiny"]
    return build_tiny_target(TinyTargetConfig(**tiny), tmp_path_factory.mktemp("rehearsal-targets"))


def host_python(tmp_path: Path, sglang_python: Path, forbid_hf: bool, simulated_devices: str | None) -> Path:
    """The GPU host's Python: the SGLang venv with eagleops importable (as `pip install eagleops` makes it);
    `simulated_devices` makes the host look like several GPUs to the HF engine's placement."""
    site = tmp_path / "host-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FORBID_HF_WEIGHTS)
    wrapper = tmp_path / "host-python"
    flag = "REHEARSAL_FORBID_HF_WEIGHTS=1 " if forbid_hf else ""
    devices = f"{SIMULATED_DEVICES_ENV}={simulated_devices} " if simulated_devices else ""
    wrapper.write_text(f'#!/bin/sh\nexport PYTHONPATH="{site}:{REPO}" OMP_NUM_THREADS=1 {flag}{devices}\n'
                       f'exec "{sglang_python}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def rehearsal_config(shipped: Path, tmp_path: Path, sshd, python: Path, model: Path) -> tuple[Path, dict]:
    """The shipped config with its host mapped to the local sshd, its model to the tiny target and
    SGLang serving to the reference server, at CPU scale. Returns the file and the host's folders."""
    cfg = yaml.safe_load(shipped.read_text())
    host = sshd.host_config()
    name = cfg["data"]["host"]
    workdir, prompts = tmp_path / "host-workdir", tmp_path / "host-data" / "prompts.jsonl"
    prompts.parent.mkdir()
    prompts.write_text("".join(json.dumps({"messages": prompt_part(c)}) + "\n" for c in builtin_conversations(10, 7)))
    cfg["runs_root"] = str(tmp_path / "runs")
    cfg["hosts"] = [{"name": name, "address": host.address, "port": host.port, "user": host.user,
                     "key_file": host.key_file, "known_hosts": host.known_hosts, "workdir": str(workdir),
                     "python": str(python)}]
    cfg["target"].update({"model_path": str(model), "aux_layer_ids": None, "dtype": "float32"})
    cfg["target"].pop("shape", None)
    data = cfg["data"]
    data.update({"prompts": str(prompts), "num_samples": 8, "max_length": 256, "capture_batch_size": 4,
                 "draft_vocab_size": 64})
    data["regenerate"].update({"concurrency": 2, "max_new_tokens": 24, "temperature": 0.0, "timeout_s": 120,
                               "deploy": {"host": name, "servers": 1}})
    data["capture"] = {"tp": 1, "max_batch_tokens": 1024}
    if data["hidden_states"] == "stream":  # at CPU scale too: shards every step, 2 epochs (each captured), a budget
        data.update({"shard_size": 1, "stream": {"disk_budget_gb": 0.01}})  # this disk has
    cfg["train"].update({"devices": 1, "epochs": 1, "max_steps": 4, "precision": "auto", "num_workers": 0,
                         "checkpoint_every": 2, "eval_every": 4, "log_every": 1})
    if data["hidden_states"] == "stream":
        cfg["train"]["epochs"] = 2
    draft = cfg["train"].pop("draft", None) or {}  # the draft takes the tiny target's shape ...
    if draft.get("architecture") == "deepseek_mla":  # ... and, the tiny Llama having none, small MLA dims
        cfg["train"]["draft"] = {**draft, **TINY_MLA_DIMS}
    cfg["deploy"].update({"server": "reference", "port": free_port(), "model_path": str(model), "tp": 1,
                          "startup_timeout_s": 240})
    cfg["deploy"].pop("mem_fraction_static", None)
    cfg["target"].pop("placement", None)  # the host's devices are simulated instead (host_python)
    cfg["bench"].update({"num_prompts": 2, "warmup_runs": 0, "timed_runs": 1, "max_new_tokens": 16,
                         "concurrency": [1], "min_speedup": None})
    cfg["tracking"] = {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment_name": f"rehearsal-{shipped.stem}"}
    path = tmp_path / shipped.name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path, {"workdir": workdir, "name": name}


SHIPPED = ["llama-3.1-8b.yaml", "kimi-k2.5-int4.yaml", "llama-3.1-70b.yaml"]
# MLA dims for a draft on the tiny target (hidden 32, 2 heads), where Kimi's come from its config; v as wide as nope
TINY_MLA_DIMS = {"q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}
DRAFT_CLASSES = {"llama": "LlamaForCausalLMEagle3", "deepseek_mla": "Eagle3DeepseekV2ForCausalLM"}


def three_devices(target: Path) -> str:
    """EAGLEOPS_SIMULATED_DEVICES for the tiny target: three devices with room for the embeddings and two
    layers each, so its 7 layers need all three (as a 70B target needs several GPUs)."""
    from eagle3.data.target import load_target

    model, _ = load_target(target)
    layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    embed = model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    return f"3x{(embed + 2.5 * layer) / 1e3:.1f}KB"


@pytest.mark.slow
@pytest.mark.parametrize("config_name", SHIPPED)
def test_the_shipped_gpu_config_runs_every_stage_where_the_cluster_would(
        config_name, prefect_harness, sshd, sglang_python, tiny_target, tmp_path, monkeypatch):
    shipped = REPO / "configs" / config_name
    shipped_cfg = yaml.safe_load(shipped.read_text())
    engine, streamed = shipped_cfg["target"]["engine"], shipped_cfg["data"]["hidden_states"] == "stream"
    placed = "placement" in shipped_cfg["target"]  # the HF engine over several GPUs
    model = tmp_path / "host-models" / "target"
    shutil.copytree(tiny_target, model)  # the weights are on the GPU host before the run starts
    python = host_python(tmp_path, sglang_python, forbid_hf=engine == "sglang",
                         simulated_devices=three_devices(model) if placed else None)
    config, host = rehearsal_config(shipped, tmp_path, sshd, python, model)
    transfers = Transfers(monkeypatch)
    if engine == "sglang":  # ... and in this process, the orchestrator
        import transformers

        def refuse(*args, **kwargs):
            raise AssertionError("target.engine sglang: the orchestrator loaded model weights in transformers")

        monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refuse))

    result = eagle3_experiment(str(config))

    run_dir = Path(result["run_dir"])
    stages = RunDirectory.open(run_dir).manifest["stages"]
    assert {name: s["status"] for name, s in stages.items()} == {name: "completed" for name in stages}, stages
    assert set(stages) >= {"generate_data", "train_draft", "export_checkpoint", "deploy_server", "run_benchmark"}
    workdir = host["workdir"]

    # data: regenerated by servers on the host, captured and sharded there, by the configured engine
    shards = list(workdir.glob("data/**/dataset/hidden_states/*.safetensors"))
    manifest = json.loads(next(workdir.glob("data/**/dataset/hidden_states/manifest.json")).read_text())
    assert manifest["complete"] and len(manifest["shards"]) == len(shards)
    assert manifest["engine"]["name"] == {"sglang": "sglang", "hf": "transformers"}[engine]
    assert list(workdir.glob("data/**/dataset/samples.jsonl"))
    if streamed:  # the data stage captured the validation split only; the train split streamed during training
        assert manifest["splits"] == ["validation"]
        stream = json.loads(next(workdir.glob("train/**/node-0/draft/stream/manifest.json")).read_text())
        assert stream["engine"]["name"] == manifest["engine"]["name"] and stream["shards"] == []  # all consumed
        summary = stages["train_draft"]["summary"]["stream"]
        assert summary["shards_captured"] == summary["shards"] >= 2 and summary["disk_high_water_bytes"] > 0
        assert [e["epoch"] for e in summary["epochs"]] == [0, 1]  # each epoch captured again
    else:
        assert shards
    if placed:  # the HF engine split the target over the (simulated) GPUs, in layer order
        device_map = stream["engine"]["device_map"] if streamed else manifest["engine"]["device_map"]
        layers = [device_map[f"model.layers.{i}"] for i in range(7)]
        assert len(set(layers)) == 3 and layers == sorted(layers), device_map
    served = json.loads((run_dir / "servers.json").read_text())
    regen = [s for s in served.values() if s["label"].startswith("regenerate")]
    assert regen and {s["host"] for s in served.values()} == {host["name"]} and {s["status"] for s in served.values()} == {"stopped"}

    # training ran on the host, on the shards there; the checkpoint came back for export
    assert list(workdir.glob("train/**/node-0/draft/checkpoints/step_*"))
    assert (run_dir / "train_draft").is_dir() and list(run_dir.glob("train_draft/attempt-*/draft/checkpoints/step_*"))

    # nothing that stays on the host crossed: no shard, no samples file, no target weights
    local_files = [p.name for p in run_dir.rglob("*") if p.is_file()]
    assert not [n for n in local_files if n.endswith(".safetensors") and n.startswith(("train-", "validation-"))]
    assert "samples.jsonl" not in local_files
    assert not list(run_dir.glob("generate_data/attempt-*/target/*.safetensors"))  # the target card: no weights
    crossed = transfers.downloads + transfers.uploads
    assert not [p for p in crossed if "/hidden_states/" in p and p.endswith(".safetensors")], crossed
    assert not [p for p in crossed if p.endswith("samples.jsonl") or p.startswith(str(model)) and p.endswith(".safetensors")], crossed
    assert {Path(p).name for p in transfers.downloads if p.startswith(str(model))} >= {"config.json", "tokenizer.json"}
    assert not [p for p in transfers.uploads if "/dataset/" in p], transfers.uploads  # training did not re-upload it

    # the draft the shipped config names is the one trained, exported and served
    architecture = (shipped_cfg["train"].get("draft") or {}).get("architecture", "llama")
    exported = json.loads((run_dir / "export_checkpoint" / "attempt-1" / "summary.json").read_text())
    sglang_config = json.loads((run_dir / exported["outputs"]["sglang_dir"] / "config.json").read_text())
    assert sglang_config["architectures"] == [DRAFT_CLASSES[architecture]]
    checkpoint = next(run_dir.glob("train_draft/attempt-*/draft/checkpoints/step_*/draft_config.json"))
    assert json.loads(checkpoint.read_text())["architecture"] == architecture

    # export, deploy and benchmark: the draft served with the chain setting on the host
    bench = stages["run_benchmark"]["summary"]
    assert any(row["speculative"] and row["tok_s_median"] > 0 for row in bench["rows"]), bench
    assert any(not row["speculative"] for row in bench["rows"])  # the baseline, on the same host
    assert not reference_servers_alive(str(workdir)) and not reference_servers_alive(str(run_dir))
