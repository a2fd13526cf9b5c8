"""The dump streams its shards (eagle3.data.dump._capture_and_write): one host copier for the whole
dump, each shard written and hashed while it is captured. The files must be the bytes the plain
writer makes of `capture_shard`'s tensors, and a failure on either side must end the dump with its
error, no hang and no temp file."""

from __future__ import annotations

import json
import threading

import pytest
import torch

import eagle3.data.dump as dump
import eagle3.data.shards as shards
from eagle3.config import DataConfig
from eagle3.data.capture import TargetFeatureExtractor
from eagle3.data.dump import capture_shard, dump_hidden_states
from eagle3.data.shards import STATE_DTYPES, _write_shard, plan_shards


def _samples(vocab: int, lengths) -> list[dict]:
    gen = torch.Generator().manual_seed(11)
    return [{"id": i, "split": "train", "input_ids": torch.randint(10, vocab, (n,), generator=gen).tolist(),
             "loss_mask": [1] * n} for i, n in enumerate(lengths)]


LENGTHS = [9, 4, 12, 3, 7, 5, 6, 8]  # shards of 3: 3 + 3 + 2 samples; batches of 2 straddle shard ends


def _dump(extractor, samples, directory, dtype: str, timeout_s: float = 120.0) -> dict:
    """dump_hidden_states on a thread, so that a hang fails the test instead of stalling it."""
    cfg = DataConfig(num_samples=len(samples), max_length=32, shard_size=3, capture_batch_size=2,
                     hidden_states_dtype=dtype)
    result: dict = {}

    def run() -> None:
        try:
            result["summary"] = dump_hidden_states(extractor, samples, directory, cfg, "fp", lambda *a: None,
                                                   lambda m: None)
        except BaseException as err:  # handed to the test below
            result["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), "the dump hung"
    return result


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3"])
def test_streamed_shards_are_the_bytes_of_the_plain_writer(tiny_model, tmp_path, monkeypatch, dtype):
    """96-byte write blocks, so blocks end mid-row and mid-batch and the writer waits for rows."""
    monkeypatch.setattr(shards, "_WRITE_BLOCK", 96)
    extractor = TargetFeatureExtractor.from_model(tiny_model, [1, 2, 3])
    samples = _samples(tiny_model.config.vocab_size, LENGTHS)
    result = _dump(extractor, samples, tmp_path / "dump", dtype)
    assert "error" not in result, result.get("error")
    manifest = json.loads((tmp_path / "dump" / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["shards"]) == 3
    for (name, members), entry in zip(plan_shards(samples, 3), manifest["shards"]):
        ref = tmp_path / "ref" / name
        ref.parent.mkdir(exist_ok=True)
        digest, size = _write_shard(capture_shard(extractor, members, 2, STATE_DTYPES[dtype]), ref)
        assert (tmp_path / "dump" / name).read_bytes() == ref.read_bytes(), name
        assert (entry["file"], entry["sha256"], entry["bytes"]) == (name, digest, size)
    assert not list((tmp_path / "dump").glob(".*.tmp"))


def test_a_capture_that_fails_mid_shard_ends_the_dump_with_its_error(tiny_model, tmp_path):
    extractor = TargetFeatureExtractor.from_model(tiny_model, [1, 2, 3])
    real, calls = extractor.capture_rows, []

    def failing(rows):
        calls.append(len(rows))
        if len(calls) == 4:  # the second shard's second batch: its writer is waiting for rows
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(rows)

    extractor.capture_rows = failing
    result = _dump(extractor, _samples(tiny_model.config.vocab_size, LENGTHS), tmp_path / "dump", "bfloat16")
    assert "simulated" in str(result.get("error"))
    assert not list((tmp_path / "dump").glob(".*.tmp"))
    manifest = tmp_path / "dump" / "manifest.json"  # written once a first shard is renamed into place
    listed = [e["file"] for e in json.loads(manifest.read_text())["shards"]] if manifest.exists() else []
    assert sorted(p.name for p in (tmp_path / "dump").glob("*.safetensors")) == sorted(listed)


def test_a_write_that_fails_ends_the_dump_naming_the_shard(tiny_model, tmp_path, monkeypatch):
    real_blocks = dump._safetensors_blocks

    def disk_full_after_the_header(tensors):
        blocks = real_blocks(tensors)
        yield next(blocks)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dump, "_safetensors_blocks", disk_full_after_the_header)
    extractor = TargetFeatureExtractor.from_model(tiny_model, [1, 2, 3])
    result = _dump(extractor, _samples(tiny_model.config.vocab_size, LENGTHS), tmp_path / "dump", "bfloat16")
    error = result.get("error")
    assert isinstance(error, OSError) and "train-0000" in str(error) and "No space" in str(error)
    assert not list((tmp_path / "dump").glob(".*.tmp"))


def test_shard_stream_lets_the_writer_through_only_up_to_the_rows_in_place():
    tensors = {"input_ids": torch.arange(6), "loss_mask": torch.ones(6, dtype=torch.uint8),
               "lengths": torch.tensor([6]), "sample_ids": torch.tensor([0]),
               "aux_hidden_states": torch.zeros(6, 4, dtype=torch.bfloat16),
               "last_hidden_states": torch.zeros(6, 2, dtype=torch.bfloat16)}
    stream = dump._ShardStream(tensors)
    assert stream.row_bytes == 8 and stream.size == stream.aux_start + 6 * 8 + 6 * 4
    stream.rows_ready(2)
    stream.wait_until_written(stream.aux_start + 16)  # two rows in: returns at once
    waiter_done = threading.Event()

    def wait_for_the_last_states() -> None:
        stream.wait_until_written(stream.size)
        waiter_done.set()

    thread = threading.Thread(target=wait_for_the_last_states)
    thread.start()
    stream.rows_ready(5)
    assert not waiter_done.wait(0.2)  # the last states follow the aux rows: not before every row is in
    stream.rows_ready(6)
    thread.join(5)
    assert waiter_done.is_set() and stream.complete()
    stream2 = dump._ShardStream(tensors)
    stream2.abort()
    with pytest.raises(RuntimeError, match="stopped"):
        stream2.wait_until_written(stream2.aux_start + 1)
