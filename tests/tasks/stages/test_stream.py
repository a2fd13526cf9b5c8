"""tasks.stages.train.stream: what the capture side's start cleans on the data host (here: this machine's executor)."""

from __future__ import annotations

from tasks.hosts.remote import LocalExecutor
from tasks.stages.train.stream import StreamPlace, _drop_other_attempts_shards


def test_shards_of_other_attempts_go_and_everything_else_stays(tmp_path):
    stage = tmp_path / "train" / "exp" / "run-1" / "train_draft"
    kept = []
    for attempt in ("attempt-1", "attempt-2", "attempt-3"):
        stream = stage / attempt / "node-0" / "draft" / "stream"
        stream.mkdir(parents=True)
        for name in ("shard-000000.safetensors", "shard-000001.safetensors"):
            (stream / name).write_bytes(b"x")
        for name in ("manifest.json", "session.json"):
            (stream / name).write_text("{}")
            kept.append(stream / name)
        (stage / attempt / "node-0" / "draft" / "checkpoints").mkdir()
        kept.append(stage / attempt / "node-0" / "draft" / "checkpoints")
    this = stage / "attempt-3" / "node-0" / "draft"
    kept += [this / "stream" / "shard-000000.safetensors", this / "stream" / "shard-000001.safetensors"]
    place = StreamPlace("local", LocalExecutor(), "python3", str(this), "/target", "/dataset", str(this.parent))
    _drop_other_attempts_shards(place)
    left = sorted(p for p in stage.rglob("*") if p.is_file() or p.name == "checkpoints")
    assert left == sorted(kept)
