"""Target hidden-state capture for EAGLE-3, identical to what SGLang 0.5.23 feeds the draft.

Owns the per-architecture mapping between the layer ids written into the draft's config.json
(`eagle_config.eagle_aux_hidden_state_layer_ids`) and HF `output_hidden_states` indices, and
the capture itself (forward hooks on the target's decoder layers).

Risk: an off-by-one here trains the draft on other layers than SGLang captures at serving
time. Nothing errors; the accept length just collapses (reference sglang-eagle3.md §2).

Vocabulary used below, for a target with L decoder layers:
- *capture index* j: SGLang's `layers_to_capture` entry = the residual stream entering decoder
  layer j (before its input norm) = HF `hidden_states[j]` for 0 <= j < L (j = 0: embeddings).
  Only gpt-oss can also capture j = L (the pre-norm output of the last layer), which is *not*
  HF `hidden_states[L]`: HF replaces that entry with the final-normed state.
- *hf index*: the same number as the capture index; what `capture_hidden_states` returns.
- *aux id*: the number written in the draft config; how it maps depends on the architecture.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from eagle3.data.structure import architecture_of, decoder_layers, decoder_layers_path, num_layers_of  # noqa: F401

PLUS_ONE = "plus_one"
PLUS_ONE_IF_FIRST_IS_ONE = "plus_one_if_first_is_one"
AS_IS_IF_MAX_IS_NUM_LAYERS = "as_is_if_max_is_num_layers"

# `set_eagle3_layers_to_capture` rule per HF architecture, from SGLang 0.5.23 srt/models/*.py.
# An architecture not listed raises: guessing a rule is how silent off-by-ones happen.
CAPTURE_RULES: dict[str, str] = {
    **{
        arch: PLUS_ONE
        for arch in (
            "LlamaForCausalLM",
            "MistralForCausalLM",
            "Qwen2ForCausalLM",
            "Qwen2MoeForCausalLM",
            "Qwen3ForCausalLM",
            "Qwen3MoeForCausalLM",
            "Qwen3NextForCausalLM",
            "Qwen2_5_VLForConditionalGeneration",
            "Qwen3VLForConditionalGeneration",
            "Qwen3VLMoeForConditionalGeneration",
            "Gemma3ForCausalLM",
            "Gemma3ForConditionalGeneration",
            "Glm4MoeForCausalLM",
            "MiniMaxM2ForCausalLM",
            "BailingMoeForCausalLM",
            "BailingMoeV2ForCausalLM",
            "LongcatFlashForCausalLM",
            "ApertusForCausalLM",
        )
    },
    **{
        arch: PLUS_ONE_IF_FIRST_IS_ONE
        for arch in (
            "DeepseekV2ForCausalLM",
            "DeepseekV3ForCausalLM",
            "KimiK25ForConditionalGeneration",
            "Glm4MoeLiteForCausalLM",
        )
    },
    "GptOssForCausalLM": AS_IS_IF_MAX_IS_NUM_LAYERS,
}


def capture_rule(architecture: str) -> str:
    """The id -> capture-index rule SGLang applies for this HF architecture."""
    if architecture not in CAPTURE_RULES:
        raise ValueError(
            f"no SGLang aux-capture rule known for architecture {architecture!r}; known: "
            f"{sorted(CAPTURE_RULES)}. Read set_eagle3_layers_to_capture in SGLang's srt/models "
            "for it and add it to eagle3.data.capture.CAPTURE_RULES"
        )
    return CAPTURE_RULES[architecture]


def sglang_default_capture_indices(num_hidden_layers: int) -> list[int]:
    """SGLang's capture indices when the draft config carries no ids: [2, L//2, L-3]."""
    return [2, num_hidden_layers // 2, num_hidden_layers - 3]


def _sglang_layers_to_capture(rule: str, ids: list[int] | None, num_hidden_layers: int) -> list[int]:
    """`layers_to_capture` exactly as SGLang sets it (unsorted, possibly with duplicates)."""
    if ids is None:
        return sglang_default_capture_indices(num_hidden_layers)
    if rule == PLUS_ONE:
        return [i + 1 for i in ids]
    if rule == PLUS_ONE_IF_FIRST_IS_ONE:
        return [i + 1 for i in ids] if ids[0] == 1 else list(ids)
    return list(ids) if max(ids) == num_hidden_layers else [i + 1 for i in ids]


def sglang_layers_to_capture(architecture: str, ids: list[int] | None, num_hidden_layers: int) -> list[int]:
    """SGLang's `layers_to_capture` for these ids, in the given order, unchecked (validators use it)."""
    return _sglang_layers_to_capture(capture_rule(architecture), None if ids is None else list(ids), num_hidden_layers)


def max_capture_index(architecture: str, num_hidden_layers: int) -> int:
    return _max_capture_index(capture_rule(architecture), num_hidden_layers)


def _max_capture_index(rule: str, num_hidden_layers: int) -> int:
    """Highest capture index the layer loop can record (gpt-oss also captures after the loop)."""
    return num_hidden_layers if rule == AS_IS_IF_MAX_IS_NUM_LAYERS else num_hidden_layers - 1


def _check_reachable(architecture: str, wanted: list[int], num_hidden_layers: int, what: str) -> None:
    """Raise ValueError naming what SGLang would really capture if any index is out of range."""
    top = _max_capture_index(capture_rule(architecture), num_hidden_layers)
    bad = [j for j in wanted if not 0 <= j <= top]
    if bad:
        kept = sorted({j for j in wanted if 0 <= j <= top})
        raise ValueError(
            f"{architecture} (L={num_hidden_layers}): {what} needs capture indices {bad} outside 0..{top}; "
            f"SGLang records only the residual entering layers 0..{num_hidden_layers - 1}"
            + (" (and after the last layer)" if top == num_hidden_layers else "")
            + f", so it would capture only HF indices {kept} ({len(kept)} tensors instead of {len(set(wanted))}). "
            f"HF index {num_hidden_layers} in HF output_hidden_states is the final *normed* state, "
            "which no aux id can select."
        )


def aux_ids_to_hf_indices(architecture: str, ids: list[int] | None, num_hidden_layers: int) -> list[int]:
    """HF `output_hidden_states` indices SGLang captures for these config ids, ascending, unique.

    Worked example, L = 8 (ids -> SGLang layers_to_capture -> returned HF indices):
      LlamaForCausalLM       [1, 3, 4] -> +1 -> [2, 4, 5]; None -> default [2, 4, 5]
      LlamaForCausalLM       [4, 1, 3] -> [5, 2, 4] -> [2, 4, 5] (capture order is by layer)
      DeepseekV3ForCausalLM  [1, 3, 4] -> first is 1, +1 -> [2, 4, 5]
      DeepseekV3ForCausalLM  [2, 4, 5] -> first is not 1, as-is -> [2, 4, 5]
      DeepseekV3ForCausalLM  [0, 3, 4] -> as-is -> [0, 3, 4] (not [1, 4, 5]!)
      GptOssForCausalLM      [1, 3, 8] -> max == L, as-is -> [1, 3, 8] (8 = pre-norm last output)
      GptOssForCausalLM      [1, 3, 7] -> +1 -> [2, 4, 8]
    Raises ValueError (naming what SGLang would capture) for unreachable ids, e.g. Llama id 7.
    """
    rule = capture_rule(architecture)
    if ids is not None and not ids:
        raise ValueError("aux layer ids must be None (SGLang default) or a non-empty list")
    wanted = _sglang_layers_to_capture(rule, None if ids is None else list(ids), num_hidden_layers)
    _check_reachable(architecture, wanted, num_hidden_layers, f"aux ids {ids}")
    return sorted(set(wanted))


def hf_indices_to_aux_ids(architecture: str, hf_indices: list[int], num_hidden_layers: int) -> list[int]:
    """Config ids that make SGLang capture exactly these HF indices (inverse of the above).

    Llama family: ids = indices - 1, so HF [2, 4, 5] -> [1, 3, 4].
    DeepSeek family: indices as-is unless the lowest is 1, which must not come first:
      HF [2, 4, 5] -> [2, 4, 5]; HF [1, 4, 5] -> [4, 1, 5] (membership, not order, is captured).
    gpt-oss: as-is if L is among them, else indices - 1: HF [1, 3, 8] -> [1, 3, 8], [2, 4, 5] -> [1, 3, 4].
    Raises ValueError for unreachable indices, e.g. HF index L for Llama (post-norm, never captured).
    """
    rule = capture_rule(architecture)
    wanted = sorted(set(hf_indices))
    if not wanted:
        raise ValueError("hf_indices must not be empty")
    _check_reachable(architecture, wanted, num_hidden_layers, f"HF indices {list(hf_indices)}")
    if rule == PLUS_ONE:
        ids = [j - 1 for j in wanted]
    elif rule == PLUS_ONE_IF_FIRST_IS_ONE:
        if wanted[0] == 1 and len(wanted) == 1:
            raise ValueError(
                f"{architecture}: HF index 1 alone cannot be requested: ids [1] are shifted to capture [2]"
            )
        ids = [wanted[1], 1, *wanted[2:]] if wanted[0] == 1 else wanted
    else:
        ids = wanted if wanted[-1] == num_hidden_layers else [j - 1 for j in wanted]
    assert aux_ids_to_hf_indices(architecture, ids, num_hidden_layers) == wanted
    return ids


def default_aux_layer_ids(architecture: str, num_hidden_layers: int) -> list[int]:
    """Ids to write in the draft config for SGLang's default layers (HF [2, L//2, L-3]).

    Llama L=32 -> [1, 15, 28]; Llama L=8 -> [1, 3, 4]; DeepseekV3 L=61 -> [2, 30, 58];
    gpt-oss L=24 -> [1, 11, 20].
    """
    return hf_indices_to_aux_ids(architecture, sglang_default_capture_indices(num_hidden_layers), num_hidden_layers)


# --------------------------------------------------------------------------- capture


def _record_input(store: dict, index: int, module, args, kwargs) -> None:
    """Pre-hook: the residual stream entering a decoder layer (HF hidden_states[index])."""
    hidden = args[0] if args else kwargs["hidden_states"]
    store[index] = hidden.detach().clone()


def _record_output(store: dict, index: int, module, args, kwargs, output) -> None:
    """Hook on the last layer: its pre-norm output (gpt-oss capture index L)."""
    hidden = output[0] if isinstance(output, tuple) else output
    store[index] = hidden.detach().clone()


@torch.no_grad()
def capture_hidden_states(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    aux_layer_ids: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward; returns the aux states SGLang would capture and the final state.

    Args:
        model: an HF causal LM (e.g. LlamaForCausalLM); its architecture picks the id rule.
        input_ids: [B, T] int64, right-padded.
        attention_mask: [B, T], 1 = real token.
        aux_layer_ids: SGLang config ids (None = SGLang's default for this architecture).
    Returns:
        aux: [B, T, k*H], the k captured states concatenated in ascending layer order.
        last: [B, T, H], the post-final-norm state (the lm_head input, HF hidden_states[L]).
    """
    count = num_layers_of(model)
    indices = aux_ids_to_hf_indices(architecture_of(model), aux_layer_ids, count)
    layers = decoder_layers(model)
    store: dict[int, torch.Tensor] = {}
    handles = [
        layers[j].register_forward_pre_hook(partial(_record_input, store, j), with_kwargs=True)
        if j < count
        else layers[count - 1].register_forward_hook(partial(_record_output, store, j), with_kwargs=True)
        for j in indices
    ]
    try:
        base = getattr(model, model.base_model_prefix, model)
        out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    last = out.last_hidden_state
    # a target placed over several devices (eagle3.data.placement) records each layer where it runs
    aux = torch.cat([store[j].to(last.device) for j in indices], dim=-1)  # k x [B, T, H] -> [B, T, k*H]
    return aux, last


def _right_pad(rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ids with 0. -> input_ids, attention_mask [B, T]"""
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


def _real_token_rows(lengths: Sequence[int], width: int) -> torch.Tensor:
    """Flat row indices of the real tokens of a right-padded [B, width] batch, in sample order.

    Example: lengths [3, 1], width 3 -> [0, 1, 2, 3] (row 1 keeps only its first position).
    """
    return torch.cat([torch.arange(i * width, i * width + n) for i, n in enumerate(lengths)])


class FeatureExtractor(Protocol):
    """What the offline dump needs of a capture engine (HF in-process, or SGLang's model runner)."""

    architecture: str
    num_hidden_layers: int
    hidden_size: int
    aux_layer_ids: list[int]
    hf_indices: list[int]

    @property
    def device(self) -> torch.device: ...

    def capture_rows(self, rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def engine_record(self) -> dict: ...


class TargetFeatureExtractor:
    """Target features for online training: `(input_ids, attention_mask) -> (aux, last)`.

    Built from a target dir (loaded with eagle3.data.target.load_target) or an already
    loaded model (`from_model`), possibly placed over several devices (eagle3.data.placement:
    its `device_map` is recorded). Attributes: `architecture`, `num_hidden_layers`,
    `hidden_size`, `aux_layer_ids` (resolved SGLang ids), `hf_indices`, `model`, `device_map`.
    """

    def __init__(
        self, target_dir: Path | str, aux_layer_ids: list[int] | None = None, dtype: str = "auto", device: str = "cpu"
    ) -> None:
        from eagle3.data.target import load_target

        model, _ = load_target(target_dir, dtype=dtype, device=device)
        self._setup(model, aux_layer_ids, None)

    @classmethod
    def from_model(cls, model: nn.Module, aux_layer_ids: list[int] | None = None,
                   device_map: dict[str, str] | None = None) -> TargetFeatureExtractor:
        """Wrap a loaded model (no second copy in memory); `device_map` as eagle3.data.placement placed it."""
        self = cls.__new__(cls)
        self._setup(model, aux_layer_ids, device_map)
        return self

    def _setup(self, model: nn.Module, aux_layer_ids: list[int] | None, device_map: dict[str, str] | None) -> None:
        for p in model.parameters():
            p.requires_grad_(False)
        self.model = model.eval()
        self.device_map = device_map
        self.architecture = architecture_of(model)
        self.num_hidden_layers = num_layers_of(model)
        self.hidden_size = model.config.get_text_config().hidden_size
        self.hf_indices = aux_ids_to_hf_indices(self.architecture, aux_layer_ids, self.num_hidden_layers)
        self.aux_layer_ids = (
            list(aux_layer_ids)
            if aux_layer_ids is not None
            else default_aux_layer_ids(self.architecture, self.num_hidden_layers)
        )
        self._input_device = model.get_input_embeddings().weight.device
        self._output_device = next(decoder_layers(model)[-1].parameters()).device

    @property
    def device(self) -> torch.device:
        """Where the captured states land: the last decoder layer's device (the only one of an unsplit target)."""
        return self._output_device

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] ids and mask (right-padded) -> aux [B, T, k*H], last [B, T, H] on the target device."""
        return capture_hidden_states(
            self.model, input_ids.to(self._input_device), attention_mask.to(self._input_device), self.aux_layer_ids
        )

    def capture_rows(self, rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token rows -> their real tokens' states packed back to back: aux [n, k*H], last [n, H].

        One right-padded forward; the real tokens are gathered on the target's device, so only
        they ever leave it.
        """
        ids, mask = _right_pad(rows)
        aux, last = self(ids, mask)  # [B, T, k*H], [B, T, H]
        keep = _real_token_rows([len(r) for r in rows], ids.shape[1])
        keep = (keep.pin_memory() if aux.device.type == "cuda" else keep).to(aux.device, non_blocking=True)
        return aux.flatten(0, 1).index_select(0, keep), last.flatten(0, 1).index_select(0, keep)

    def engine_record(self) -> dict:
        """Which engine captured, for the shard manifest: transformers, its version, the indices hooked."""
        import transformers

        record = {"name": "transformers", "version": transformers.__version__, "capture_indices": list(self.hf_indices)}
        return record | ({"device_map": self.device_map} if self.device_map else {})
