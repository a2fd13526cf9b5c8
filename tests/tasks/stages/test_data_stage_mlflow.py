"""The data stage's MLflow record on a served night with no new traffic (data.host local): no vocabulary was
built, so none is logged -- it used to fail the stage with a TypeError on the missing path (found by
tests/flows/test_served_story.py's third night; the data-host path had it right)."""

from __future__ import annotations

from types import SimpleNamespace

from tasks.stages.data.stage import _log_to_mlflow


class _Run:
    def __init__(self):
        self.artifacts = []

    def log_params(self, params):
        self.params = params

    def log_dict(self, value, name):
        self.summary = value

    def log_artifact(self, path, name):
        self.artifacts.append((str(path), name))


def _summary(vocab):
    return {"aux_layer_ids": [1, 3, 5], "hf_indices": [2, 4, 6], "architecture": "LlamaForCausalLM",
            "chat_template_sha256": "0" * 64, "hidden_states": "offline", "regeneration": {},
            "paths": {"samples": "s.jsonl", "vocab": vocab, "hidden_states": None}}


def test_a_night_without_a_vocabulary_logs_none_and_one_with_it_logs_it(tmp_path):
    ctx = SimpleNamespace(mlflow=_Run())
    _log_to_mlflow(ctx, tmp_path, _summary(None))
    assert ctx.mlflow.artifacts == [] and ctx.mlflow.summary["paths"]["vocab"] is None
    (tmp_path / "vocab").mkdir()
    _log_to_mlflow(ctx, tmp_path, _summary(str(tmp_path / "vocab")))
    assert ctx.mlflow.artifacts == [(str(tmp_path / "vocab"), "vocab")]
