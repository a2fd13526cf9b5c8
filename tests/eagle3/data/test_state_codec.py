"""fp8 hidden-state shards (eagle3.data.state_codec, shards, datasets): the e4m3 encoding against an
independent rounding, its scales and error bound, the shard round trip with the dtype and scale
layout in the manifest, and the refusal of a dataset whose shards hold different dtypes."""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest
import torch

from eagle3.config import DataConfig
from eagle3.data.capture import TargetFeatureExtractor
from eagle3.data.datasets import HiddenStateDataset, collate_hidden_states
from eagle3.data.disk import _dump_bytes
from eagle3.data.dump import dump_hidden_states
from eagle3.data.files import file_sha256
from eagle3.data.state_codec import FP8_MAX, decode_aux, encode_aux_fp8


def e4m3_round_reference(values: np.ndarray) -> np.ndarray:
    """Round float64 values to the nearest e4m3 (fn) number, ties to even, saturating at 448: the
    grid spacing is 2^(e-3) for |v| in [2^e, 2^(e+1)), e >= -6, and 2^-9 below 2^-6 (subnormals)."""
    magnitude = np.abs(values)
    exponent = np.floor(np.log2(np.where(magnitude > 0, magnitude, 1.0)))
    spacing = 2.0 ** (np.maximum(exponent, -6) - 3)
    rounded = np.round(magnitude / spacing) * spacing  # np.round: half to even
    return np.sign(values) * np.minimum(rounded, FP8_MAX)


def hidden_like(rows: int, width: int, seed: int = 0) -> torch.Tensor:
    """Hidden-state-like rows in bf16: gaussian, a per-row magnitude, and one outlier channel."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * torch.rand(rows, 1, generator=g).mul(4).add(0.1)
    x[:, 7] = 300.0 * x[:, 8:128].abs().amax(-1)  # an activation outlier in the first block of every row
    return x.bfloat16()


def test_fp8_encoding_matches_an_independent_e4m3_rounding_within_the_stated_bound():
    x = hidden_like(64, 3 * 256)
    q, scales = encode_aux_fp8(x, block=128)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (64, 6) and scales.dtype == torch.float32
    blocks = x.double().view(64, 6, 128)
    amax = blocks.abs().amax(-1)
    torch.testing.assert_close(scales.double(), amax / 448, rtol=1e-6, atol=0)  # scale = block max / 448
    # the format is q = e4m3(fp32(x / scale)); the reference rounds that fp32 quotient with numpy (bf16
    # inputs over a block scale land exactly on e4m3 midpoints often: ties to even must agree too)
    scaled = (x.float().view(64, 6, 128) / scales[..., None]).double().numpy()
    reference = torch.from_numpy(e4m3_round_reference(scaled)).view(64, -1)
    assert torch.equal(q.double(), reference)
    decoded = decode_aux(q, scales, torch.float32).double()
    # stated bound: |x^ - x| <= 2^-4 |x| (normal e4m3 numbers) + 2^-10 * scale (subnormals) + float32 rounding
    bound = 2.0**-4 * x.double().abs() + 2.0**-10 * scales.double().repeat_interleave(128, -1) + 1e-6 * x.double().abs()
    assert ((decoded - x.double()).abs() <= bound).all()
    rel_rms = ((decoded - x.double()).norm() / x.double().norm()).item()
    assert rel_rms < 0.03  # about 2.3% here: e4m3 keeps 3 mantissa bits


def test_fp8_block_scales_keep_an_outlier_from_flushing_the_other_blocks():
    """A massive activation (3e4 x its block's other values, as LLM residual streams carry) pushes the
    rest of a row under e4m3's normal range if it sets the row's one scale; a block scale confines it."""
    x = hidden_like(8, 256).float()
    x[:, 7] = 3e4 * x[:, 8:128].abs().amax(-1)
    x = x.bfloat16()
    q, scales = encode_aux_fp8(x, block=128)
    decoded = decode_aux(q, scales, torch.float32)
    second = slice(128, 256)  # no outlier there: its own scale, its own relative error
    assert (scales[:, 1] < scales[:, 0] / 20).all()
    rel = (decoded[:, second] - x[:, second].float()).norm() / x[:, second].float().norm()
    assert rel < 0.03
    q_row, s_row = encode_aux_fp8(x, block=256)  # one scale per row: the outlier sets it for everyone
    rel_row = (decode_aux(q_row, s_row, torch.float32)[:, second] - x[:, second].float()).norm() / x[:, second].float().norm()
    assert rel_row > 2 * rel


def test_fp8_zero_rows_and_extremes_decode_exactly():
    x = torch.zeros(3, 128, dtype=torch.bfloat16)
    x[1, 5], x[2, 0], x[2, 1] = 3.0, -1e4, 1e4
    q, scales = encode_aux_fp8(x, block=128)
    assert scales[0].item() == 1.0 and not torch.isnan(q.float()).any()  # an all-zero block: scale 1, no 0/0
    decoded = decode_aux(q, scales)
    assert decoded.dtype == torch.bfloat16 and torch.equal(decoded[0], x[0])
    assert decoded[1, 5].item() == 3.0 and torch.equal(decoded[2, :2], x[2, :2])  # the block max is exact


@pytest.fixture(scope="module")
def dumps(tiny_model, tmp_path_factory):
    """The same 7 samples dumped in bf16 and in fp8 (shards of 3)."""
    extractor = TargetFeatureExtractor.from_model(tiny_model, [1, 2, 3])
    gen = torch.Generator().manual_seed(5)
    samples = [{"id": i, "split": "train" if i < 5 else "validation",
                "input_ids": torch.randint(10, tiny_model.config.vocab_size, (n,), generator=gen).tolist(),
                "loss_mask": [1] * n} for i, n in enumerate([9, 4, 12, 3, 7, 5, 6])]
    root = tmp_path_factory.mktemp("fp8-dumps")
    out = {}
    for dtype in ("bfloat16", "float8_e4m3"):
        cfg = DataConfig(num_samples=7, max_length=32, shard_size=3, capture_batch_size=2, hidden_states_dtype=dtype)
        summary = dump_hidden_states(extractor, samples, root / dtype, cfg, f"fp-{dtype}", lambda *a: None,
                                     lambda m: None)
        out[dtype] = (root / dtype, summary)
    return out, extractor, samples


def test_fp8_shards_round_trip_with_dtype_and_scale_layout_in_the_manifest(dumps):
    out, extractor, samples = dumps
    directory, summary = out["float8_e4m3"]
    manifest = json.loads((directory / "manifest.json").read_text())
    hidden = extractor.hidden_size
    assert manifest["dtype"] == "float8_e4m3" and manifest["last_dtype"] == "bfloat16"
    assert manifest["aux_scale"]["tensor"] == "aux_scales" and manifest["aux_scale"]["block"] == min(hidden, 128)
    bf16_manifest = json.loads((out["bfloat16"][0] / "manifest.json").read_text())
    assert bf16_manifest["dtype"] == bf16_manifest["last_dtype"] == "bfloat16" and "aux_scale" not in bf16_manifest
    tokens = sum(len(s["input_ids"]) for s in samples)
    headers = sum(8 + struct.unpack("<Q", (directory / e["file"]).read_bytes()[:8])[0] for e in manifest["shards"])
    assert summary["bytes_total"] - headers == _dump_bytes(tokens, len(samples), hidden, 3, "float8_e4m3")
    reference = HiddenStateDataset(out["bfloat16"][0], "train")
    host = HiddenStateDataset(directory, "train")
    device = HiddenStateDataset(directory, "train", decode="device")
    assert len(host) == len(reference) == 5
    for i in range(5):
        want, got, raw = reference[i], host[i], device[i]
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["loss_mask"], want["loss_mask"])
        assert torch.equal(got["last_hidden_states"], want["last_hidden_states"])  # the teacher's input stays bf16
        assert raw["aux_hidden_states"].dtype == torch.float8_e4m3fn and raw["aux_scales"].dtype == torch.float32
        assert torch.equal(decode_aux(raw["aux_hidden_states"], raw["aux_scales"]), got["aux_hidden_states"])
        ref = want["aux_hidden_states"].double()
        assert ((got["aux_hidden_states"].double() - ref).norm() / ref.norm()) < 0.04
    batch = collate_hidden_states([device[0], device[1]])  # decode="device" batches: padded scales decode to 0
    decoded = decode_aux(batch["aux_hidden_states"], batch["aux_scales"])
    assert torch.equal(decoded[1, 4:], torch.zeros_like(decoded[1, 4:]))
    assert torch.equal(decoded[0], host[0]["aux_hidden_states"])


def _swap_in_shard(target_dir, source_dir, name):
    """Copy shard `name` of source_dir over target_dir's, with a manifest entry that matches its bytes."""
    shutil.copy(source_dir / name, target_dir / name)
    manifest = json.loads((target_dir / "manifest.json").read_text())
    for entry in manifest["shards"]:
        if entry["file"] == name:
            entry["sha256"], entry["bytes"] = file_sha256(target_dir / name), (target_dir / name).stat().st_size
    (target_dir / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("base,intruder", [("bfloat16", "float8_e4m3"), ("float8_e4m3", "bfloat16")])
def test_a_dataset_of_mixed_dtypes_is_refused_naming_the_shard(dumps, tmp_path, base, intruder):
    out, _, _ = dumps
    mixed = tmp_path / "mixed"
    shutil.copytree(out[base][0], mixed)
    _swap_in_shard(mixed, out[intruder][0], "validation-00000.safetensors")
    for split in ("train", "validation"):  # refused whichever split is opened
        with pytest.raises(ValueError, match=r"validation-00000\.safetensors: .*a dataset holds one dtype"):
            HiddenStateDataset(mixed, split)


def test_an_unknown_manifest_dtype_is_refused(dumps, tmp_path):
    out, _, _ = dumps
    copy = tmp_path / "copy"
    shutil.copytree(out["bfloat16"][0], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["dtype"] = "int4"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="manifest.json: dtype: expected one of"):
        HiddenStateDataset(copy)
