"""The reference server's launch: SGLang's flags parsed and resolved (`eagle3.serving.sglang_args`,
so the effective speculative settings and the startup warnings are SGLang's), what this CPU
server refuses to run, and the target (+ EAGLE-3 draft) loaded from the launch paths.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from eagle3.data.capture import aux_ids_to_hf_indices
from eagle3.data.target import load_target
from eagle3.export import load_exported
from eagle3.serving.decoding import Eagle3Drafter, SpecConfig, SpeculativeEngine, TargetModel
from eagle3.serving.sglang_args import SpecResolution, build_arg_parser, resolve_speculative_args

logger = logging.getLogger("eagle3.serve")


@dataclass
class ServerSettings:
    argv: list[str]
    args: Any  # the parsed launch namespace (kept for /server_info)
    resolution: SpecResolution
    spec: SpecConfig | None
    max_running_requests: int
    context_length: int
    served_model_name: str
    random_seed: int

    @property
    def decode_log_interval(self) -> int:
        return self.args.decode_log_interval

    @property
    def max_total_num_tokens(self) -> int:
        return self.max_running_requests * self.context_length

    def dump_server_args(self) -> dict:
        """`server_args` of a request dump: the launch flags with the resolved settings, as plain JSON
        values (what `eagle3.data.served_dumps` admits without a class)."""
        fields = {**vars(self.args), **self.resolution.resolved_settings(), "served_model_name": self.served_model_name,
                  "random_seed": self.random_seed, "context_length": self.context_length}
        return json.loads(json.dumps(fields, default=str))


def build_settings(argv: list[str]) -> ServerSettings:
    """Parse and resolve the launch argv; raises LaunchArgsError / ValueError with SGLang-style messages."""
    ns = build_arg_parser().parse_args(argv)
    if ns.decode_log_interval < 1:
        raise ValueError(f"--decode-log-interval must be >= 1, found {ns.decode_log_interval}")
    res = resolve_speculative_args(ns, detected_device="cpu")
    for level, msg in res.adjustments:
        getattr(logger, level)(msg)
    if res.errors or res.runtime_errors:
        raise ValueError("; ".join(res.errors + res.runtime_errors))
    spec = None
    if res.speculative_algorithm is not None:
        _check_servable(res, ns)
        spec = SpecConfig(res.speculative_num_steps, res.speculative_eagle_topk, res.speculative_num_draft_tokens)
    config = json.loads(Path(ns.model_path, "config.json").read_text())
    seed = ns.random_seed if ns.random_seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
    return ServerSettings(
        argv=list(argv), args=ns, resolution=res, spec=spec,
        max_running_requests=res.max_running_requests or 48,
        context_length=int(config.get("max_position_embeddings", 2048)),
        served_model_name=ns.served_model_name or ns.model_path,
        random_seed=seed,
    )


def _check_servable(res: SpecResolution, ns) -> None:
    """What SGLang would run but this CPU reference server does not implement."""
    if res.speculative_algorithm != "EAGLE3":
        raise ValueError(f"eagle3.serve serves EAGLE3 drafts only, found "
                         f"speculative_algorithm={res.speculative_algorithm}")
    if res.speculative_draft_model_path is None:
        raise ValueError("--speculative-algorithm EAGLE3 needs --speculative-draft-model-path")
    if res.speculative_adaptive:
        raise ValueError("eagle3.serve does not implement --speculative-adaptive")
    if ns.speculative_accept_threshold_single != 1.0 or ns.speculative_accept_threshold_acc != 1.0:
        raise ValueError("eagle3.serve does not implement relaxed acceptance (--speculative-accept-threshold-*)")


def load_engine(settings: ServerSettings):
    """Target (+ EAGLE-3 drafter) from the launch paths. -> (SpeculativeEngine, tokenizer)"""
    ns = settings.args
    model, tokenizer = load_target(ns.model_path, dtype=_dtype_name(ns.dtype), device="cpu")
    if ns.tokenizer_path:
        tokenizer = AutoTokenizer.from_pretrained(ns.tokenizer_path)
    if settings.spec is None:
        return SpeculativeEngine(TargetModel(model), seed=settings.random_seed), tokenizer
    drafter = load_eagle3_drafter(ns.speculative_draft_model_path, model)
    target = TargetModel(model, drafter.aux_hidden_indices)
    return SpeculativeEngine(target, drafter, settings.spec, seed=settings.random_seed), tokenizer


def load_eagle3_drafter(draft_dir: str | Path, target_model: torch.nn.Module) -> Eagle3Drafter:
    """An SGLang-format EAGLE-3 draft dir as a Drafter for this target (embedding shared as SGLang does)."""
    draft = load_exported(draft_dir, target_model.get_input_embeddings().weight)
    draft = draft.to(dtype=next(target_model.parameters()).dtype)
    cfg = target_model.config
    hf_indices = aux_ids_to_hf_indices(cfg.architectures[0], list(draft.config.aux_layer_ids), cfg.num_hidden_layers)
    return Eagle3Drafter(draft, hf_indices)


def _dtype_name(dtype: str) -> str:
    return {"half": "float16", "float": "float32"}.get(dtype, dtype)
