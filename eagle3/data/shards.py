"""The hidden-state shard format: safetensors files that pack their samples back to back
(`input_ids` [N_tok] int64, `loss_mask` [N_tok] uint8, `lengths` [N] int64, `sample_ids` [N]
int64, `aux_hidden_states` [N_tok, k*H], `last_hidden_states` [N_tok, H], and for
`float8_e4m3` datasets `aux_scales` [N_tok, k*H/block] fp32: eagle3/data/state_codec.py) and
`manifest.json`, which lists each finished shard with its sha256 and says the states' dtype and
scale layout.

Risk: a kill mid-write. A shard is written under a hidden temp name and renamed only once
complete; the sha256 is taken of the bytes as they are written; a resumed dump keeps only the
shards whose files still match the manifest of the same fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from eagle3.config import DataConfig
from eagle3.data.capture import FeatureExtractor
from eagle3.data.files import atomic_write_text, file_sha256, removed_on_failure
from eagle3.data.state_codec import STATE_DTYPES, manifest_state_fields  # noqa: F401 (STATE_DTYPES: re-exported)

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


SPLITS = ("train", "validation")


def plan_shards(samples: list[dict], shard_size: int, splits: tuple[str, ...] = SPLITS) -> list[tuple[str, list[dict]]]:
    """(file name, samples) per shard: each of `splits` in id order, shard_size samples per shard."""
    plan = []
    for split in splits:
        members = [s for s in samples if s["split"] == split]
        for n, start in enumerate(range(0, len(members), shard_size)):
            plan.append((f"{split}-{n:05d}.safetensors", members[start : start + shard_size]))
    return plan


_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64",
                       torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3"}
_WRITE_BLOCK = 64 << 20


def _safetensors_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """8-byte header length + JSON header of a safetensors file holding `tensors` in dict order (and the
    string `metadata` safetensors keeps under `__metadata__`)."""
    meta, offset = ({"__metadata__": metadata} if metadata else {}), 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        meta[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                      "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(meta, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # data starts 8-byte aligned, as safetensors pads it
    return struct.pack("<Q", len(header)) + header


def safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """The exact size of the shard file `tensors` make, known before it is written."""
    return len(_safetensors_header(tensors, metadata)) + sum(t.numel() * t.element_size() for t in tensors.values())


def _safetensors_blocks(tensors: dict[str, torch.Tensor],
                        metadata: dict[str, str] | None = None) -> Iterator[memoryview | bytes]:
    """A safetensors file as byte blocks: 8-byte header length, JSON header, then each tensor's
    bytes back to back in dict order (little-endian, as safetensors stores them)."""
    yield _safetensors_header(tensors, metadata)
    for tensor in tensors.values():
        raw = memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
        for start in range(0, len(raw), _WRITE_BLOCK):
            yield raw[start : start + _WRITE_BLOCK]


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def _write_shard(tensors: dict, path: Path) -> tuple[str, int]:
    """Save to a hidden temp name, then rename: a kill never leaves a partial shard visible."""
    digest, size = _write_hidden_shard(tensors, path)
    os.replace(_temp_name(path), path)
    return digest, size


def _write_hidden_shard(tensors: dict, path: Path, metadata: dict[str, str] | None = None) -> tuple[str, int]:
    """Write the shard to its hidden temp name (`_temp_name`); returns (sha256, bytes).

    The sha256 is of the bytes as they are written (no second read of the file). Block i is
    hashed on a second thread while it is written, so a shard costs max(hash, write) time, not
    their sum (sha256 ~0.5 s/GB: alone it is about as slow as an 8B target's forward makes
    states). Both release the GIL, so this also runs beside the next shard's capture. A failed
    write (a full disk) removes the temp file and names the shard in its error.
    """
    return write_hashed(path, _safetensors_blocks(tensors, metadata))


def write_hashed(path: Path, blocks: Iterable[memoryview | bytes],
                 ready: Callable[[int], None] | None = None) -> tuple[str, int]:
    """Write `blocks` to `path`'s hidden temp name (`_temp_name`), each hashed on a second thread in file
    order while the next is written; `ready(end)` is awaited before the block that ends at byte `end` (a
    shard still being captured). Returns (sha256, bytes); a failed write removes the temp file."""
    digest, size = hashlib.sha256(), 0
    with removed_on_failure(_temp_name(path), path), _temp_name(path).open("wb") as fh, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-hash") as hasher:
        hashed = None
        for block in blocks:
            if ready is not None:
                ready(size + len(block))
            if hashed is not None:
                hashed.result()  # blocks must reach the digest in file order
            hashed = hasher.submit(digest.update, block)
            fh.write(block)
            size += len(block)
        if hashed is not None:
            hashed.result()
    return digest.hexdigest(), size


def _verified_shards(directory: Path, fingerprint: str) -> dict[str, dict]:
    """Shard entries of an earlier run with the same fingerprint whose files still match their sha256."""
    path = directory / MANIFEST
    if not path.is_file():
        return {}
    manifest = json.loads(path.read_text())
    if manifest.get("fingerprint") != fingerprint:
        return {}
    good = {}
    for entry in manifest.get("shards", []):
        shard = directory / entry["file"]
        if shard.is_file() and shard.stat().st_size == entry["bytes"] and file_sha256(shard) == entry["sha256"]:
            good[entry["file"]] = entry
    return good


def _clear_stale(directory: Path, keep: set[str]) -> None:
    """Remove shards and temp files not in `keep` (left by a different or killed run)."""
    for path in directory.glob("*.safetensors"):
        if path.name not in keep:
            path.unlink()
    for path in directory.glob(".*.tmp"):
        path.unlink()


def _shard_entry(name: str, members: list[dict], digest: str, size: int) -> dict:
    return {
        "file": name,
        "split": name.split("-")[0],
        "num_samples": len(members),
        "num_tokens": sum(len(s["input_ids"]) for s in members),
        "sha256": digest,
        "bytes": size,
    }


def _manifest_header(
    extractor: FeatureExtractor, data_cfg: DataConfig, fingerprint: str, samples: list[dict],
    splits: tuple[str, ...] = SPLITS,
) -> dict:
    """What the shards hold and how they were made: the engine that captured (its name, version and
    the capture indices it actually hooked) is checked by training and by the deploy preflight.
    `splits`: those with shards here; the others' counts are listed too (a streamed train split is
    captured while training runs, eagle3.training.streaming)."""
    return {
        "splits": list(splits),
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "architecture": extractor.architecture,
        "num_hidden_layers": extractor.num_hidden_layers,
        "hidden_size": extractor.hidden_size,
        "aux_layer_ids": extractor.aux_layer_ids,
        "hf_indices": extractor.hf_indices,
        "num_aux": len(extractor.hf_indices),
        "engine": extractor.engine_record(),
        **manifest_state_fields(data_cfg.hidden_states_dtype, extractor.hidden_size),
        "max_length": data_cfg.max_length,
        "num_samples": {sp: sum(s["split"] == sp for s in samples) for sp in ("train", "validation")},
        "num_tokens": {
            sp: sum(len(s["input_ids"]) for s in samples if s["split"] == sp) for sp in ("train", "validation")
        },
    }


def _write_manifest(directory: Path, header: dict, shards: list[dict], complete: bool) -> None:
    atomic_write_text(directory / MANIFEST, json.dumps({**header, "complete": complete, "shards": shards}, indent=2))


def _manifest_dir(offline_dir: Path) -> Path:
    """Accept the hidden_states dir itself or the dataset dir that contains it."""
    offline_dir = Path(offline_dir)
    if (offline_dir / MANIFEST).is_file():
        return offline_dir
    if (offline_dir / "hidden_states" / MANIFEST).is_file():
        return offline_dir / "hidden_states"
    raise FileNotFoundError(f"no {MANIFEST} in {offline_dir} or {offline_dir / 'hidden_states'}")
