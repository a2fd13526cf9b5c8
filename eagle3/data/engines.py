"""The capture engines behind one call: `target.engine: hf` (transformers, the target placed over
target.placement's devices) or `sglang` (SGLang's own model runner, eagle3.data.sglang_engine).

The data stage's offline dump and the streamed capture (eagle3.training.streaming) open their
engine here, so both capture exactly the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from torch import nn

from eagle3.config import DataConfig, TargetConfig
from eagle3.data.capture import FeatureExtractor, TargetFeatureExtractor
from eagle3.data.sglang_engine import SGLangFeatureExtractor
from eagle3.data.sglang_engine import settings_for as sglang_settings
from eagle3.data.target import load_engine_target


@contextlib.contextmanager
def open_capture_engine(target_dir: Path, target_cfg: TargetConfig, data_cfg: DataConfig, aux_layer_ids: list[int],
                        loaded: tuple[nn.Module, dict[str, str]] | None = None) -> Iterator[FeatureExtractor]:
    """The target's capture engine on this machine, closed on exit. `loaded`: the HF engine's model and
    device map when the caller has it already (local regeneration loaded it)."""
    if target_cfg.engine == "sglang":
        with sglang_extractor(target_dir, target_cfg, data_cfg) as extractor:
            yield extractor
        return
    model, device_map = loaded or load_engine_target(target_dir, target_cfg)
    yield TargetFeatureExtractor.from_model(model, aux_layer_ids, device_map)


def sglang_extractor(target_dir: Path, target_cfg: TargetConfig, data_cfg: DataConfig) -> SGLangFeatureExtractor:
    """SGLang's runner on this machine's GPUs (or its CPU engine), for the target's capture."""
    capture = data_cfg.capture
    return SGLangFeatureExtractor(sglang_settings(
        target_dir, target_cfg.aux_layer_ids, tp=capture.tp, dtype=target_cfg.dtype,
        max_batch_tokens=capture.max_batch_tokens, trust_remote_code=target_cfg.trust_remote_code,
        extra_args=capture.extra_args, mem_fraction_static=capture.mem_fraction_static,
    ))
