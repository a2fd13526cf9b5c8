"""`eagleops validate` refuses every data/capture/training placement the stages cannot run, naming the field.

Each case starts from a placement that runs (the data stage on a GPU host, SGLang capturing,
training there) and changes one thing; the message and the line must name the field to change.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from flows.cli import app

runner = CliRunner()

RUNS = """\
experiment: placed
target:
  kind: hf
  model_path: /models/target
  engine: sglang
data:
  host: gpu
  hidden_states: offline
  max_length: 256
  capture_batch_size: 4
  regenerate:
    backend: sglang
    deploy: {host: gpu, servers: 1}
train:
  devices: 8
  nodes: [gpu]
export:
  formats: [sglang]
deploy:
  host: gpu
  speculative: {num_steps: 3, eagle_topk: 1, num_draft_tokens: 4}
hosts:
  - name: gpu
    address: 10.0.0.8
    user: ubuntu
"""

# (replace, with) -> (line of the error, message fragment)
REFUSED = [
    ("  hidden_states: offline", "  hidden_states: online", 16, "train.nodes needs data.hidden_states: offline"),
    ("  host: gpu\n  hidden_states", "  host: gpu-9\n  hidden_states", 7, "data.host 'gpu-9' is neither 'local' nor one"),
    ("  nodes: [gpu]", "  nodes: []", 16, "train.nodes []: the shards stay on data.host 'gpu'"),
    ("  nodes: [gpu]", "  nodes: [gpu, local]", 16, "train.nodes ['gpu', 'local']: the shards stay on data.host 'gpu'"),
    ("    backend: sglang\n    deploy: {host: gpu, servers: 1}", "    backend: local", 12,
     "data.regenerate.backend: local generates with transformers"),
    ("    deploy: {host: gpu, servers: 1}", "    deploy: {host: local, servers: 1}", 13,
     "data.regenerate.deploy.host 'local': the data stage on data.host 'gpu' asks"),
    ("  formats: [sglang]", "  formats: [sglang, speculators]", 18, "export.formats: speculators embeds"),
    ("  capture_batch_size: 4", "  capture_batch_size: 4\n  capture: {max_batch_tokens: 512}", 11,
     "data.capture.max_batch_tokens 512 is below data.capture_batch_size x data.max_length = 1024"),
    ("  engine: sglang", "  engine: sglang\n  aux_layer_ids: [-1, 3, 5]", 6,
     "target.aux_layer_ids [-1, 3, 5]: SGLang's capture takes ids >= 0"),
]


def test_the_placement_that_runs_validates(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(RUNS)
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("old,new,line,fragment", REFUSED, ids=[r[2:4][1][:40] for r in REFUSED])
def test_a_placement_the_stages_cannot_run_is_refused_naming_the_field(tmp_path, old, new, line, fragment):
    assert old in RUNS
    path = tmp_path / "broken.yaml"
    path.write_text(RUNS.replace(old, new, 1))
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    assert fragment in result.output and f"broken.yaml:{line}:" in result.output, result.output
    assert "Traceback" not in result.output


def test_online_on_several_ranks_or_with_the_sglang_engine_is_refused(tmp_path):
    path = tmp_path / "online.yaml"
    path.write_text(RUNS.replace("  hidden_states: offline", "  hidden_states: online").replace("  devices: 8", "  devices: 1")
                    .replace("  host: gpu\n  hidden_states", "  host: local\n  hidden_states").replace("  nodes: [gpu]", "  nodes: []"))
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2 and "target.engine sglang never does" in result.output, result.output
    path.write_text(path.read_text().replace("  engine: sglang", "  engine: hf").replace("  devices: 1", "  devices: 8"))
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2 and "with train.devices 8 (torchrun ranks)" in result.output, result.output


STREAMED = RUNS.replace("  hidden_states: offline", "  hidden_states: stream\n  stream: {disk_budget_gb: 100}").replace(
    "  model_path: /models/target", "  model_path: /models/target\n  shape: {architecture: LlamaForCausalLM, "
    "num_hidden_layers: 32, hidden_size: 4096, vocab_size: 128256, max_position_embeddings: 8192}")
STREAM_REFUSED = [
    ("  stream: {disk_budget_gb: 100}", "", 9, "data.stream.disk_budget_gb is required with data.hidden_states: stream"),
    ("  hidden_states: stream", "  hidden_states: offline", 10, "data.stream is set but data.hidden_states is 'offline'"),
    ("  host: gpu\n  hidden_states", "  host: local\n  hidden_states", 19,
     "train.nodes ['gpu']: streamed shards stay on the data host's disk (data.host local)"),
    # 8 ranks x batch 8 = 64 samples a step = 8 shards of 8, +1 unaligned; a shard: 8 x 4096 tokens x (4 x 4096 x 2 + 9) B
    ("  stream: {disk_budget_gb: 100}", "  stream: {disk_budget_gb: 0.5}", 10,
     "data.stream.disk_budget_gb 0.5 GB is below 9.67 GB: one optimizer step reads up to 9 shards of up to 1.07 GB"),
    ("  engine: sglang", "  engine: sglang\n  placement: {devices: [cuda:0, cuda:1]}", 7,
     "target.placement.devices ['cuda:0', 'cuda:1']: the placement is the HF engine's"),
]


def test_a_streamed_placement_validates(tmp_path):
    path = tmp_path / "streamed.yaml"
    path.write_text(STREAMED.replace("  devices: 8", "  devices: 8\n  batch_size: 1"))
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("old,new,line,fragment", STREAM_REFUSED, ids=[r[3][:40] for r in STREAM_REFUSED])
def test_a_stream_the_stages_cannot_run_is_refused_naming_the_field(tmp_path, old, new, line, fragment):
    base = STREAMED.replace("  max_length: 256", "  max_length: 4096\n  shard_size: 8")
    assert old in base
    path = tmp_path / "broken.yaml"
    path.write_text(base.replace(old, new, 1))
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    assert fragment in result.output and f"broken.yaml:{line}:" in result.output, result.output
    assert "Traceback" not in result.output
