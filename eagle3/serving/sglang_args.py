"""SGLang 0.5.23 launch flags in, the speculative settings SGLang will actually run out.

Owns one rule set: `srt/arg_groups/speculative_hook.py: handle_speculative_decoding` and
`srt/speculative/spec_info.py` -> `_handle_eagle_family` for EAGLE / EAGLE3 / NEXTN /
STANDALONE, as read in SGLang's source (reference: shared/reference/sglang-eagle3.md §1).
Used by `eagle3.serve` and by the deploy preflight, so a run records what SGLang does rather
than what was typed.

Risk: the rules are a copy. Each adjustment carries SGLang's own log text verbatim so a
drift shows up as a missing line in the server log, and each rule names its SGLang origin.
Not modelled: platform-dependent attention-backend defaults (§1.3: they need the GPU
generation), KV-pool sizing of max_running_requests (§1.4), and the non-EAGLE algorithms
(NGRAM, DFLASH, DSPARK, UNO), which are reported as errors.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

# SGLang's own log texts (speculative_hook.py / spec_info.py, sglang 0.5.23).
MSG_MAX_RUNNING = (
    "Max running requests is reset to 48 for speculative decoding. "
    "You can override this by explicitly setting --max-running-requests."
)
MSG_CPU_OVERLAP = "Overlap schedule is not implemented for speculative decoding on CPU."
MSG_NON_OVERLAP = "Non-overlap (synchronous) spec v2 is used for eagle/eagle3/standalone speculative decoding."
MSG_MIXED_CHUNK = "Mixed chunked prefill is disabled: {algo} speculative decoding does not support it."
MSG_DEEPSEEK_MTP = "DeepSeek MTP does not require setting speculative_draft_model_path."
MSG_DRAFT_TOKENS_ADJUSTED = (
    "speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when speculative_eagle_topk == 1"
)
MSG_REJECTION_INFO = "Rejection sampling is enabled for speculative decoding (speculative_use_rejection_sampling=True)."
MSG_WINDOW_NO_EFFECT = (
    "--speculative-draft-window-size has no effect with speculative_algorithm={algo} "
    "(honored by DFLASH, Llama EAGLE-3, and the EAGLE/MTP/NEXTN draft-decode path on the "
    "Triton/FlashInfer draft backends)."
)
MSG_ADAPTIVE_DISABLED = "speculative_adaptive disabled: {reason}. Falling back to static speculative params."
MSG_TOKEN_MAP_IGNORED = (
    "Speculative token map specified, but EAGLE3 models already have this. Ignoring the specified token map."
)

EAGLE_FAMILY = ("EAGLE", "EAGLE3", "STANDALONE")
BUILTIN_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH", "DSPARK", "UNO")
# Targets whose checkpoint carries its own MTP head (`_handle_eagle_family`, rule 1.2.7e).
MTP_TARGETS = (
    "DeepseekV32ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV4ForCausalLM", "Glm4MoeForCausalLM",
    "Glm4MoeLiteForCausalLM", "GlmMoeDsaForCausalLM", "BailingMoeForCausalLM", "BailingMoeV2ForCausalLM",
    "BailingMoeV2_5ForCausalLM", "MistralLarge3ForCausalLM", "PixtralForConditionalGeneration",
    "HYV3ForCausalLM", "HYV4ForCausalLM", "Qwen4ExpForConditionalGeneration",
)
MTP_TARGETS_WITHOUT_WARNING = ("MistralLarge3ForCausalLM", "PixtralForConditionalGeneration")
AUTO_5_4_8_TARGETS = ("LlamaForCausalLM", "Grok1ForCausalLM", "Grok1VForCausalLM")
PAGE_TREE_SPEC_BACKENDS = ("flashinfer", "fa3", "triton")
# Union of DEFAULT_ADAPTIVE_CONFIG candidate_steps (srt/speculative/adaptive_spec_params.py).
DEFAULT_ADAPTIVE_CANDIDATE_STEPS = (0, 1, 3, 5, 7)

# Flags eagle3.serve accepts and logs as ignored: they matter on a GPU server (parallelism,
# memory, CUDA graphs, kernels) or only feed the resolution rules above.
SERVE_IGNORED_FLAGS = (
    "tp_size", "dp_size", "pp_size", "mem_fraction_static", "cuda_graph_max_bs_decode",
    "cuda_graph_max_bs_prefill", "disable_cuda_graph", "attention_backend", "trust_remote_code",
    "context_length", "chunked_prefill_size", "kv_cache_dtype", "page_size", "quantization",
    "load_format", "speculative_attention_mode", "speculative_draft_attention_backend",
    "speculative_draft_kv_cache_dtype", "speculative_draft_load_format", "enable_torch_compile",
    "enable_mixed_chunk", "revision", "speculative_draft_model_revision",
)


class LaunchArgsError(ValueError):
    """An argv SGLang's argparse would reject; the message is argparse's own text."""


class _SGLangArgumentParser(argparse.ArgumentParser):
    """argparse with prefix matching off, raising instead of exiting.

    SGLang's parser allows abbreviations. Its flag set is far larger than ours, so a prefix
    that is unique here may be ambiguous there: we require full spellings, and mirror
    SGLang's ambiguity error where a prefix matches several of our flags (the retired
    `--cuda-graph-max-bs` matches `--cuda-graph-max-bs-decode` and `-prefill`).
    """

    def error(self, message: str):  # argparse calls this with its own message text
        raise LaunchArgsError(message)

    def parse_args(self, args: Sequence[str] | None = None, namespace=None):  # type: ignore[override]
        argv = list(args or [])
        self._check_ambiguous(argv)
        return super().parse_args(argv, namespace)

    def _check_ambiguous(self, argv: list[str]) -> None:
        known = set(self._option_string_actions)
        for token in argv:
            if not token.startswith("--") or token == "--":
                continue
            flag = token.split("=", 1)[0]
            if flag in known:
                continue
            matches = sorted(o for o in known if o.startswith(flag) and o.startswith("--"))
            if len(matches) > 1:
                self.error(f"ambiguous option: {flag} could match {', '.join(matches)}")


def build_arg_parser(prog: str = "eagle3.serve") -> argparse.ArgumentParser:
    """The subset of `python -m sglang.launch_server` flags eagleops understands, SGLang spellings."""
    p = _SGLangArgumentParser(prog=prog, allow_abbrev=False)
    add = p.add_argument
    # model / server
    add("--model-path", "--model", dest="model_path", type=str, required=True)
    add("--tokenizer-path", type=str, default=None)
    add("--served-model-name", type=str, default=None)
    add("--host", type=str, default="127.0.0.1")
    add("--port", type=int, default=30000)
    add("--dtype", type=str, default="auto", choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    add("--device", type=str, default=None)
    add("--random-seed", type=int, default=None)
    add("--max-running-requests", type=int, default=None)
    add("--decode-log-interval", type=int, default=40)
    add("--enable-metrics", action="store_true")
    add("--log-level", type=str, default="info")
    add("--disable-overlap-schedule", action="store_true")
    # speculative decoding (srt/arg_groups/fields/spec.py)
    add("--speculative-algorithm", type=str, default=None)
    add("--speculative-draft-model-path", "--speculative-draft-model", dest="speculative_draft_model_path",
        type=str, default=None)
    add("--speculative-draft-model-revision", type=str, default=None)
    add("--speculative-num-steps", type=int, default=None)
    add("--speculative-eagle-topk", type=int, default=None)
    add("--speculative-num-draft-tokens", type=int, default=None)
    add("--speculative-token-map", type=str, default=None)
    add("--speculative-accept-threshold-single", type=float, default=1.0)
    add("--speculative-accept-threshold-acc", type=float, default=1.0)
    add("--speculative-use-rejection-sampling", action="store_true")
    add("--speculative-use-block-verification", action="store_true")
    add("--speculative-adaptive", action="store_true")
    add("--speculative-adaptive-config", type=str, default=None)
    add("--speculative-draft-window-size", type=int, default=None)
    add("--speculative-draft-sink-size", type=int, default=None)
    # accepted, GPU-only (logged as ignored by eagle3.serve); some feed the resolution rules
    add("--tp-size", "--tp", dest="tp_size", type=int, default=None)
    add("--dp-size", "--dp", dest="dp_size", type=int, default=None)
    add("--pp-size", type=int, default=None)
    add("--mem-fraction-static", type=float, default=None)
    add("--cuda-graph-max-bs-decode", type=int, default=None)
    add("--cuda-graph-max-bs-prefill", type=int, default=None)
    add("--disable-cuda-graph", action="store_true", default=None)
    add("--attention-backend", type=str, default=None)
    add("--trust-remote-code", action="store_true", default=None)
    add("--context-length", type=int, default=None)
    add("--chunked-prefill-size", type=int, default=None)
    add("--kv-cache-dtype", type=str, default=None)
    add("--page-size", type=int, default=None)
    add("--quantization", type=str, default=None)
    add("--load-format", type=str, default=None)
    add("--speculative-attention-mode", type=str, default=None, choices=["prefill", "decode"])
    add("--speculative-draft-attention-backend", type=str, default=None)
    add("--speculative-draft-kv-cache-dtype", type=str, default=None)
    add("--speculative-draft-load-format", type=str, default=None)
    add("--enable-torch-compile", action="store_true", default=None)
    add("--enable-mixed-chunk", action="store_true", default=None)
    add("--revision", type=str, default=None)
    return p


def parse_launch_args(argv: Sequence[str], prog: str = "eagle3.serve") -> argparse.Namespace:
    """Parse SGLang launch argv; raises LaunchArgsError with argparse's message on bad flags."""
    return build_arg_parser(prog).parse_args(list(argv))


@dataclass
class SpecResolution:
    """What SGLang 0.5.23 runs for a launch argv (the `resolved_dict()` values, not the raw flags).

    adjustments: SGLang's own log lines, (level, verbatim text), in the order SGLang logs them.
    errors: the launch fails during argument resolution (SGLang's exception type and text,
        then what to pass instead).
    runtime_errors: resolution passes but the server crashes at the first decode.
    """

    speculative_algorithm: str | None
    speculative_num_steps: int | None
    speculative_eagle_topk: int | None
    speculative_num_draft_tokens: int | None
    max_running_requests: int | None
    speculative_draft_model_path: str | None
    speculative_draft_model_revision: str | None
    speculative_use_rejection_sampling: bool
    speculative_adaptive: bool
    disable_overlap_schedule: bool
    enable_mixed_chunk: bool
    device: str
    target_architecture: str | None
    adjustments: list[tuple[str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    runtime_errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when SGLang would start and decode with these settings."""
        return not self.errors and not self.runtime_errors

    def resolved_settings(self) -> dict:
        """The effective values under SGLang's `resolved_dict()` key names."""
        d = asdict(self)
        for k in ("adjustments", "errors", "runtime_errors", "target_architecture"):
            d.pop(k)
        return d


def read_architecture(model_dir: str | Path) -> str:
    """`architectures[0]` of a local HF model dir's config.json."""
    cfg_path = Path(model_dir) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"expected {cfg_path} (a local model dir with config.json), found nothing")
    archs = json.loads(cfg_path.read_text()).get("architectures") or []
    if not archs:
        raise ValueError(f"{cfg_path}: expected a non-empty 'architectures' list, found {archs!r}")
    return str(archs[0])


def resolve_speculative_args(
    argv: Sequence[str] | argparse.Namespace,
    target_architecture: str | None = None,
    detected_device: str = "cuda",
) -> SpecResolution:
    """Apply SGLang 0.5.23's speculative resolution rules to a launch argv.

    Args:
        argv: `python -m sglang.launch_server` arguments (without the program), or a namespace
            from `parse_launch_args`.
        target_architecture: the target's `architectures[0]`; None = read it from
            `--model-path`/config.json when that is a local dir.
        detected_device: what SGLang's device auto-detection would pick when `--device` is
            not given (SGLang raises "No accelerator ..." on a machine without one).
    """
    if isinstance(argv, argparse.Namespace):
        ns = argv
    else:
        try:
            ns = parse_launch_args(argv)
        except LaunchArgsError as e:
            return _failed(f"error: {e}", detected_device, target_architecture)
    res = SpecResolution(
        speculative_algorithm=ns.speculative_algorithm,
        speculative_num_steps=ns.speculative_num_steps,
        speculative_eagle_topk=ns.speculative_eagle_topk,
        speculative_num_draft_tokens=ns.speculative_num_draft_tokens,
        max_running_requests=ns.max_running_requests,
        speculative_draft_model_path=ns.speculative_draft_model_path,
        speculative_draft_model_revision=ns.speculative_draft_model_revision,
        speculative_use_rejection_sampling=bool(ns.speculative_use_rejection_sampling),
        speculative_adaptive=bool(ns.speculative_adaptive),
        disable_overlap_schedule=bool(ns.disable_overlap_schedule),
        enable_mixed_chunk=bool(ns.enable_mixed_chunk),
        device=ns.device or detected_device,
        target_architecture=target_architecture,
    )
    if res.target_architecture is None and Path(ns.model_path, "config.json").is_file():
        res.target_architecture = read_architecture(ns.model_path)
    try:
        _handle_speculative_decoding(res, ns)
    except _ResolutionFailure as e:
        res.errors.append(str(e))
    if not res.errors:
        _predict_runtime_errors(res, ns)
    return res


class _ResolutionFailure(Exception):
    """SGLang's resolution raises here; the message names SGLang's exception and the fix."""


def _failed(message: str, device: str, arch: str | None) -> SpecResolution:
    return SpecResolution(None, None, None, None, None, None, None, False, False, False, False, device, arch,
                          errors=[message])


def _handle_speculative_decoding(res: SpecResolution, ns: argparse.Namespace) -> None:
    """`speculative_hook.handle_speculative_decoding`, rules 1.2.1-1.2.6, then the family hook."""
    if res.speculative_draft_model_path is not None and res.speculative_draft_model_revision is None:
        res.speculative_draft_model_revision = "main"
    if res.speculative_algorithm is None:
        return
    algo = res.speculative_algorithm.upper()
    algo = _resolve_algorithm_alias(algo, res.speculative_draft_model_path)
    res.speculative_algorithm = algo
    _check_block_verification(res, ns)
    _check_draft_window(res, ns)
    if algo not in BUILTIN_ALGORITHMS and algo != "FROZEN_KV_MTP":
        raise _ResolutionFailure(f"ValueError: Unknown speculative algorithm name: {algo}")
    if algo not in EAGLE_FAMILY:
        raise _ResolutionFailure(
            f"speculative_algorithm={algo}: eagleops mirrors SGLang's rules for EAGLE, EAGLE3, NEXTN and "
            "STANDALONE only; use --speculative-algorithm EAGLE3 for an EAGLE-3 draft."
        )
    if res.speculative_adaptive:
        _handle_adaptive(res, ns)
    _handle_eagle_family(res, ns)


def _check_block_verification(res: SpecResolution, ns: argparse.Namespace) -> None:
    """Rule 1.2.4 with its two checks (`handle_speculative_decoding`, before the window checks)."""
    if not ns.speculative_use_block_verification:
        return
    if res.speculative_algorithm not in ("EAGLE", "EAGLE3", "DFLASH", "DSPARK"):
        raise _ResolutionFailure(
            "ValueError: --speculative-use-block-verification only supports EAGLE / EAGLE3 / NEXTN / DFLASH / DSPARK.")
    if res.device != "cuda":
        raise _ResolutionFailure("ValueError: --speculative-use-block-verification only supports CUDA or ROCm.")
    if res.speculative_algorithm in ("EAGLE", "EAGLE3"):
        res.speculative_use_rejection_sampling = True


def _check_draft_window(res: SpecResolution, ns: argparse.Namespace) -> None:
    """Rule 1.2.5: draft window / sink sizes, validated for every algorithm."""
    window, sink = ns.speculative_draft_window_size, ns.speculative_draft_sink_size
    if window is not None:
        if window <= 0:
            raise _ResolutionFailure(f"ValueError: --speculative-draft-window-size must be positive, got {window}.")
        if res.speculative_algorithm not in ("EAGLE", "EAGLE3", "DFLASH"):
            res.adjustments.append(("warning", MSG_WINDOW_NO_EFFECT.format(algo=res.speculative_algorithm)))
    if sink is not None:
        if sink < 0:
            raise _ResolutionFailure(f"ValueError: --speculative-draft-sink-size must be non-negative, got {sink}.")
        if window is None:
            raise _ResolutionFailure(
                "ValueError: --speculative-draft-sink-size requires --speculative-draft-window-size.")


def _resolve_algorithm_alias(algo: str, draft_path: str | None) -> str:
    """`_resolve_speculative_algorithm_alias`: NEXTN -> EAGLE; Gemma4 assistant drafts."""
    draft_archs: list[str] = []
    if draft_path and Path(draft_path, "config.json").is_file():
        draft_archs = json.loads(Path(draft_path, "config.json").read_text()).get("architectures") or []
    is_gemma4 = any(a in ("Gemma4AssistantForCausalLM", "Gemma4UnifiedAssistantForCausalLM") for a in draft_archs)
    if algo == "EAGLE3" and is_gemma4:
        raise _ResolutionFailure(
            "ValueError: Gemma4AssistantForCausalLM draft requires --speculative-algorithm NEXTN or EAGLE; "
            "EAGLE3 is not supported for this draft architecture."
        )
    if algo in ("NEXTN", "EAGLE"):
        return "FROZEN_KV_MTP" if is_gemma4 else "EAGLE"
    return algo


def _handle_adaptive(res: SpecResolution, ns: argparse.Namespace) -> None:
    """`_maybe_disable_adaptive` + `_init_adaptive_speculative_params` (rule 1.2.6)."""
    reason = None
    if res.speculative_algorithm not in ("EAGLE", "EAGLE3"):
        reason = f"speculative_algorithm={res.speculative_algorithm} (only EAGLE/EAGLE3 are supported)"
    elif res.speculative_eagle_topk is not None and res.speculative_eagle_topk != 1:
        reason = f"speculative_eagle_topk={res.speculative_eagle_topk} (only topk=1 is supported)"
    if reason is not None:
        res.adjustments.append(("warning", MSG_ADAPTIVE_DISABLED.format(reason=reason)))
        res.speculative_adaptive = False
        return
    candidates = _adaptive_candidate_steps(ns.speculative_adaptive_config)
    if res.speculative_eagle_topk is None:
        res.speculative_eagle_topk = 1
    if res.speculative_num_steps is None:
        res.speculative_num_steps = candidates[len(candidates) // 2]
    if res.speculative_num_steps not in candidates:
        raise _ResolutionFailure(
            f"ValueError: --speculative-num-steps={res.speculative_num_steps} is not in the adaptive config "
            f"candidate_steps {candidates}. Pass one of those values."
        )
    res.speculative_num_draft_tokens = res.speculative_num_steps + 1


def _adaptive_candidate_steps(config_path: str | None) -> list[int]:
    if config_path is None:
        return list(DEFAULT_ADAPTIVE_CANDIDATE_STEPS)
    try:  # SGLang reads it at startup and dies with the same exception
        cfg = json.loads(Path(config_path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _ResolutionFailure(f"{type(e).__name__}: speculative_adaptive_config {config_path}: {e}") from None
    entries = [entry for k, entry in cfg.items() if k.isdigit()] if isinstance(cfg, dict) else []
    lists = [entry["candidate_steps"] for entry in entries
             if isinstance(entry, dict) and isinstance(entry.get("candidate_steps"), list)]
    steps = {s for steps_ in lists for s in steps_ if isinstance(s, int) and not isinstance(s, bool)}
    if not steps:
        raise _ResolutionFailure(
            f"ValueError: speculative_adaptive_config {config_path} must contain at least one integer-string BS key "
            'with candidate_steps, e.g. {"1": {"candidate_steps": [1,3,7]}}'
        )
    return sorted(steps)


def _handle_eagle_family(res: SpecResolution, ns: argparse.Namespace) -> None:
    """`spec_info._handle_eagle_family` (rules 1.2.7a-k), in SGLang's order."""
    algo = res.speculative_algorithm
    if res.max_running_requests is None:
        res.max_running_requests = 48
        res.adjustments.append(("warning", MSG_MAX_RUNNING))
    if res.device == "cpu" and not res.disable_overlap_schedule:
        res.disable_overlap_schedule = True
        res.adjustments.append(("warning", MSG_CPU_OVERLAP))
    if res.disable_overlap_schedule:
        res.adjustments.append(("warning", MSG_NON_OVERLAP))
    if res.enable_mixed_chunk and algo == "STANDALONE":
        res.enable_mixed_chunk = False
        res.adjustments.append(("warning", MSG_MIXED_CHUNK.format(algo=algo)))
    arch = res.target_architecture
    if arch in MTP_TARGETS:
        if res.speculative_draft_model_path is None:
            res.speculative_draft_model_path = ns.model_path
            res.speculative_draft_model_revision = ns.revision
        elif arch not in MTP_TARGETS_WITHOUT_WARNING:
            res.adjustments.append(("warning", MSG_DEEPSEEK_MTP))
    if not res.speculative_adaptive and res.speculative_num_steps is None:
        _choose_auto_params(res)
    topk = res.speculative_eagle_topk
    if ns.attention_backend == "trtllm_mha" and topk is not None and topk > 1:
        raise _ResolutionFailure("ValueError: trtllm_mha backend only supports topk = 1 for speculative decoding.")
    if res.speculative_use_rejection_sampling:
        _check_rejection_sampling(res, ns)
    steps = res.speculative_num_steps
    if topk == 1 and res.speculative_num_draft_tokens != steps + 1:
        res.adjustments.append(("warning", MSG_DRAFT_TOKENS_ADJUSTED))
        res.speculative_num_draft_tokens = steps + 1
    if topk is None:
        raise _ResolutionFailure(
            "TypeError: '>' not supported between instances of 'NoneType' and 'int' -- SGLang 0.5.23 crashes in "
            "_handle_eagle_family when --speculative-num-steps is given without --speculative-eagle-topk. "
            "Pass --speculative-eagle-topk too (e.g. --speculative-num-steps 3 --speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens 4), or none of the three flags for the automatic choice."
        )
    if topk > 1 and ns.page_size is not None and ns.page_size > 1 and ns.attention_backend is not None \
            and ns.attention_backend not in PAGE_TREE_SPEC_BACKENDS:
        raise _ResolutionFailure(
            f"ValueError: speculative_eagle_topk > 1 with page_size > 1 is only supported on "
            f"{PAGE_TREE_SPEC_BACKENDS}; got attention_backend={ns.attention_backend!r}. "
            "Use page_size == 1 or one of those backends."
        )


def _choose_auto_params(res: SpecResolution) -> None:
    """Rule 1.2.7f: the bare assert, then `_auto_choose_speculative_params` by target architecture."""
    if res.speculative_eagle_topk is not None or res.speculative_num_draft_tokens is not None:
        given = [f for f, v in (("--speculative-eagle-topk", res.speculative_eagle_topk),
                                ("--speculative-num-draft-tokens", res.speculative_num_draft_tokens)) if v is not None]
        raise _ResolutionFailure(
            f"AssertionError (empty message) -- SGLang 0.5.23 asserts in _handle_eagle_family that "
            f"--speculative-eagle-topk and --speculative-num-draft-tokens are unset when --speculative-num-steps is "
            f"unset, and you gave {' and '.join(given)} alone. Pass all three (e.g. --speculative-num-steps 3 "
            "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4), or none for the automatic choice."
        )
    if res.speculative_algorithm == "STANDALONE":
        res.speculative_num_steps, res.speculative_eagle_topk, res.speculative_num_draft_tokens = 3, 1, 4
        return
    if res.target_architecture is None:
        raise _ResolutionFailure(
            "target architecture unknown: SGLang picks the automatic (steps, topk, draft tokens) from the target's "
            "config.json architectures[0]; give a local --model-path or pass target_architecture"
        )
    auto = (5, 4, 8) if res.target_architecture in AUTO_5_4_8_TARGETS else (3, 1, 4)
    res.speculative_num_steps, res.speculative_eagle_topk, res.speculative_num_draft_tokens = auto


def _check_rejection_sampling(res: SpecResolution, ns: argparse.Namespace) -> None:
    """Rule 1.2.7i."""
    if res.speculative_algorithm not in ("EAGLE", "EAGLE3"):
        raise _ResolutionFailure(
            "NotImplementedError: --speculative-use-rejection-sampling is only supported for EAGLE / EAGLE3 / NEXTN, "
            f"not speculative_algorithm={res.speculative_algorithm}."
        )
    if res.speculative_eagle_topk != 1:
        raise _ResolutionFailure(
            "ValueError: --speculative-use-rejection-sampling requires --speculative-eagle-topk=1.")
    if ns.speculative_accept_threshold_single != 1.0 or ns.speculative_accept_threshold_acc != 1.0:
        raise _ResolutionFailure(
            "ValueError: --speculative-use-rejection-sampling is incompatible with "
            "--speculative-accept-threshold-single / --speculative-accept-threshold-acc; rejection sampling ignores "
            "the accept thresholds."
        )
    res.adjustments.append(("info", MSG_REJECTION_INFO))


def _predict_runtime_errors(res: SpecResolution, ns: argparse.Namespace) -> None:
    """Settings resolution accepts but the EAGLE worker cannot run (reference §1.2, last list)."""
    if res.speculative_algorithm is None:
        return
    steps, topk, n_draft = res.speculative_num_steps, res.speculative_eagle_topk, res.speculative_num_draft_tokens
    if n_draft is None:
        res.runtime_errors.append(
            f"speculative_num_draft_tokens is unset with speculative_eagle_topk={topk} > 1: SGLang 0.5.23 starts, then "
            "crashes at the first decode (organize_draft_results calls torch.topk(scores, num_draft_tokens - 1)). "
            f"Pass --speculative-num-draft-tokens (at most {max_tree_nodes(steps, topk) + 1} for this tree)."
        )
        return
    if n_draft - 1 > max_tree_nodes(steps, topk):
        res.runtime_errors.append(
            f"speculative_num_draft_tokens={n_draft} is too large for the draft tree: with num_steps={steps} and "
            f"topk={topk} the draft proposes only topk + (num_steps-1)*topk^2 = {max_tree_nodes(steps, topk)} "
            f"candidates, so torch.topk(scores, {n_draft - 1}) in organize_draft_results fails at the first decode. "
            f"Pass --speculative-num-draft-tokens <= {max_tree_nodes(steps, topk) + 1}."
        )
    if res.speculative_algorithm == "EAGLE3" and ns.speculative_token_map is not None:
        res.adjustments.append(("warning", MSG_TOKEN_MAP_IGNORED))


def max_tree_nodes(num_steps: int, topk: int) -> int:
    """Draft candidates SGLang's tree offers `organize_draft_results`: topk + (steps-1)*topk^2."""
    return topk + (num_steps - 1) * topk * topk
