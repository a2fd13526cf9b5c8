"""How the offline shards store hidden states: the dtypes `data.hidden_states_dtype` names, and the
opt-in fp8 encoding of the aux states.

`float8_e4m3` stores each aux state value as e4m3 (1 byte) with one fp32 scale per token and block
of 128 consecutive values of one aux layer (`aux_scales` [N_tok, k*H/block]; value = e4m3 x
scale, scale = the block's max |x| / 448), and keeps the last state (the teacher's input) in bf16.
For an H = 4096, 3-aux target that is 20,873 B/token instead of 32,777 (0.64x). Error: e4m3 has 3
mantissa bits, so a decoded value is within 2^-4 of |x| (normal range, round to nearest) or 2^-10
x scale (e4m3's subnormals, values under 2^-6 x scale), plus the bf16 rounding of the decoded value;
the block scale keeps one outlier channel from flushing the rest of its row to zero.

Encoding runs where the states are captured (the target's GPU); decoding is cheap on a GPU and
slow on a CPU (~0.6 s per 2048 x 12288 sample on one core), so the trainer decodes on its device
(`decode_aux`) and `HiddenStateDataset` decodes on the host only when asked to.

Risk: a dataset whose shards hold different dtypes (copied in from another dump) would train on
undecoded bytes: `check_shard_dtypes` refuses any shard whose tensors are not what the manifest says.
"""

from __future__ import annotations

import torch

from eagle3.environment import fp8_scale_block

FP8 = "float8_e4m3"
FP8_MAX = 448.0  # largest finite e4m3 (fn) value
STATE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                FP8: torch.float8_e4m3fn}
SCALES_KEY = "aux_scales"
_SAFETENSORS_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
                      torch.float8_e4m3fn: "F8_E4M3"}


def scale_block(hidden_size: int) -> int:
    """Values per fp8 scale (eagle3.environment.fp8_scale_block: 128, or its gcd with H)."""
    return fp8_scale_block(hidden_size)


def last_state_dtype(name: str) -> torch.dtype:
    """Dtype the last hidden state is stored in: fp8 datasets keep the teacher's input in bf16."""
    return torch.bfloat16 if name == FP8 else STATE_DTYPES[name]


@torch.no_grad()
def encode_aux_fp8(aux: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """aux [N, k*H] (any float dtype, on any device) -> (e4m3 [N, k*H], fp32 scales [N, k*H/block])."""
    n, width = aux.shape
    blocks = aux.float().view(n, width // block, block)
    amax = blocks.abs().amax(-1, keepdim=True)  # [N, k*H/block, 1]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    quantized = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quantized.view(n, width), scale.view(n, width // block)


def decode_aux(aux: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """e4m3 aux [..., k*H] and scales [..., k*H/block] -> states in `dtype` (run it on the training device)."""
    width, blocks = aux.shape[-1], scales.shape[-1]
    values = aux.float().view(*aux.shape[:-1], blocks, width // blocks) * scales.float()[..., None]
    return values.view(aux.shape).to(dtype)


def state_tensor_dtypes(name: str) -> dict[str, str]:
    """safetensors dtype of each state tensor a shard of dtype `name` holds."""
    names = {"aux_hidden_states": _SAFETENSORS_NAMES[STATE_DTYPES[name]],
             "last_hidden_states": _SAFETENSORS_NAMES[last_state_dtype(name)]}
    if name == FP8:
        names[SCALES_KEY] = "F32"
    return names


def manifest_state_fields(name: str, hidden_size: int) -> dict:
    """What the manifest says about the stored states: dtype, the last state's dtype, the scale layout."""
    fields = {"dtype": name, "last_dtype": str(last_state_dtype(name)).removeprefix("torch.")}
    if name == FP8:
        fields["aux_scale"] = {"tensor": SCALES_KEY, "dtype": "float32", "block": scale_block(hidden_size),
                               "layout": "[N_tok, k*H/block]: one scale per token per block of consecutive values "
                                         "of one aux layer; value = e4m3 * scale, scale = max|x| of the block / 448"}
    return fields


def check_shard_dtypes(path: str, handle, manifest_dtype: str) -> None:
    """Raise ValueError unless the shard's state tensors (a safe_open handle) are what `manifest_dtype` stores."""
    keys = set(handle.keys())
    for key, want in state_tensor_dtypes(manifest_dtype).items():
        if key not in keys:
            raise ValueError(f"{path}: no {key} tensor, which a {manifest_dtype} dataset stores; a dataset holds "
                             "one dtype (re-run the dump into a new folder)")
        found = handle.get_slice(key).get_dtype()
        if found != want:
            raise ValueError(f"{path}: {key} is {found} but the manifest says the dataset is {manifest_dtype} "
                             f"({want}); a dataset holds one dtype (re-run the dump into a new folder)")
    if manifest_dtype != FP8 and SCALES_KEY in keys:
        raise ValueError(f"{path}: has {SCALES_KEY} (an fp8 shard) but the manifest says the dataset is "
                         f"{manifest_dtype}; a dataset holds one dtype (re-run the dump into a new folder)")
