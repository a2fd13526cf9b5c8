"""The offline dump (eagle3.data.dump, eagle3.data.shards): a shard packs each sample's real tokens in order; shard files are safetensors, hashed as written and sized as estimated; the capture benchmark runs on CPU."""

from __future__ import annotations

import torch

from eagle3.data.capture import (
    TargetFeatureExtractor,
    capture_hidden_states,
)


def _samples(vocab: int, lengths) -> list[dict]:
    gen = torch.Generator().manual_seed(3)
    return [{"id": i, "split": "train", "input_ids": torch.randint(10, vocab, (n,), generator=gen).tolist(),
             "loss_mask": [i % 2] * n} for i, n in enumerate(lengths)]


def test_capture_shard_packs_each_samples_real_tokens_in_order(tiny_model):
    """5 samples in batches of 2 (the two staging buffers are reused, the last batch is short):
    rows of sample i are exactly its own capture, padding never lands in the shard."""
    from eagle3.data.dump import capture_shard

    lengths = [9, 4, 12, 3, 7]
    members = _samples(tiny_model.config.vocab_size, lengths)
    extractor = TargetFeatureExtractor.from_model(tiny_model, [1, 2, 3])
    shard = capture_shard(extractor, members, batch_size=2, dtype=torch.float32)
    assert shard["lengths"].tolist() == lengths and shard["sample_ids"].tolist() == [0, 1, 2, 3, 4]
    assert shard["aux_hidden_states"].shape == (sum(lengths), 96) and shard["last_hidden_states"].shape == (35, 32)
    assert shard["loss_mask"].dtype == torch.uint8 and shard["loss_mask"].tolist() == [0] * 9 + [1] * 4 + [0] * 12 + [1] * 3 + [0] * 7
    start = 0
    for s in members:
        ids = torch.tensor([s["input_ids"]])
        aux, last = capture_hidden_states(tiny_model, ids, torch.ones_like(ids), [1, 2, 3])
        n = len(s["input_ids"])
        assert shard["input_ids"][start : start + n].tolist() == s["input_ids"]
        torch.testing.assert_close(shard["aux_hidden_states"][start : start + n], aux[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(shard["last_hidden_states"][start : start + n], last[0], atol=1e-5, rtol=1e-5)
        start += n
    bf16 = capture_shard(extractor, members, batch_size=3, dtype=torch.bfloat16)  # converted on the device
    assert bf16["aux_hidden_states"].dtype == torch.bfloat16
    assert torch.equal(bf16["aux_hidden_states"], shard["aux_hidden_states"].bfloat16())


def test_shard_file_is_safetensors_hashed_as_written_and_sized_as_estimated(tmp_path):
    """The writer's own safetensors bytes: every tensor reads back (safe_open, as the trainer),
    the sha256 is the file's, and the data is exactly the estimate: (k+1)*H*2 B of states plus
    9 B of ids/mask per token and 16 B per sample; only the header comes on top."""
    import json
    import struct

    from safetensors import safe_open

    from eagle3.data.disk import _dump_bytes
    from eagle3.data.files import file_sha256
    from eagle3.data.shards import _write_shard

    lengths, hidden, k = [5, 3, 8], 24, 3
    tokens = sum(lengths)
    tensors = {"input_ids": torch.arange(tokens), "loss_mask": torch.ones(tokens, dtype=torch.uint8),
               "lengths": torch.tensor(lengths), "sample_ids": torch.tensor([4, 7, 9]),
               "aux_hidden_states": torch.randn(tokens, k * hidden).bfloat16(),
               "last_hidden_states": torch.randn(tokens, hidden).bfloat16()}
    path = tmp_path / "train-00000.safetensors"
    digest, size = _write_shard(tensors, path)
    assert not list(tmp_path.glob(".*.tmp"))
    assert digest == file_sha256(path) and size == path.stat().st_size
    with safe_open(str(path), framework="pt") as fh:
        assert set(fh.keys()) == set(tensors)
        for name, tensor in tensors.items():
            got = fh.get_tensor(name)
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
        assert torch.equal(fh.get_slice("aux_hidden_states")[5:8], tensors["aux_hidden_states"][5:8])
    header = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert header % 8 == 0 and json.loads(path.read_bytes()[8:header])["lengths"]["dtype"] == "I64"
    assert size - header == _dump_bytes(tokens, len(lengths), hidden, k, "bfloat16")


def test_bench_capture_tiny_runs_on_cpu(tmp_path):
    """tests/benchmarks/bench_capture.py --tiny: all four measurements in one run, the dump read
    back through HiddenStateDataset, bytes per token = estimate + ids/mask + header share."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(repo / "tests" / "benchmarks" / "bench_capture.py"), "--tiny",
                           "--dtypes", "bfloat16,float8_e4m3", "--out", str(out)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert list(report["results"]) == ["forward", "forward+hooks", "capture", "dump", "capture[float8_e4m3]",
                                       "dump[float8_e4m3]"]
    fp8 = report["dtypes"]["float8_e4m3"]  # 3 aux x (64 e4m3 + 1 fp32 scale per 64) + the last state in bf16
    assert fp8["states_bytes_per_token_estimate"] == 3 * (64 + 4) + 64 * 2
    assert 16 / report["seq"] <= fp8["bytes_per_token"] - fp8["bytes_per_token_estimate_with_ids_and_mask"] < 2
    assert fp8["check"]["ids_equal"] and fp8["check"]["aux_rel_rms_error"] < 0.05
    assert fp8["check"]["last_max_abs_diff"] < 0.05
    assert report["results"]["forward"]["ratio_to_forward"] == 1.0 and "vs forward" in proc.stdout
    assert report["states_bytes_per_token_estimate"] == 4 * 64 * 2
    per_token = report["bytes_per_token"] - report["bytes_per_token_estimate_with_ids_and_mask"]
    assert 16 / report["seq"] <= per_token < 16 / report["seq"] + 2  # per-sample fields + the shard headers
    assert report["check"]["samples"] == 24 and report["check"]["ids_equal"]
    assert report["check"]["aux_max_abs_diff"] < 0.05 and report["check"]["last_max_abs_diff"] < 0.05
