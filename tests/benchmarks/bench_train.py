"""Benchmark one EAGLE-3 training step (TTT unroll, AdamW) of a Llama-3.1-8B- or Kimi-K2.5-shaped draft.

Shapes (`--shape`), seq 2048, TTT 7, bf16 autocast over fp32 master weights, synthetic hidden states:
  llama-3.1-8b  H 4096, FFN 14336, 32 heads / 8 KV (head_dim 128), target vocab 128256, draft vocab 32000
  kimi-k2.5     H 7168, FFN 18432, 64 heads / 8 KV (head_dim 128), target vocab 163840, draft vocab 32000
  kimi-k2.5-mla the MLA draft (train.draft.architecture deepseek_mla, SGLang's Eagle3DeepseekV2ForCausalLM):
                H 7168, FFN 18432, 64 MLA heads, q/kv latent 1536/512, q/k head 128 + 64 rope, v 128,
                Kimi's YaRN; kimi-k2.5-mla-3.1 adds the EAGLE-3.1 options fc_norm and norm_output
Variants (same initial weights, same batch, fresh AdamW each):
  dense_eager     plain eager: dense boolean TTT mask in SDPA, [T, V] fp32 teacher, unfused loss
  dense_compiled  the same function under torch.compile
  fast_eager      eagle3.training.train path: causal flash + analytic diagonal merge, chunked teacher,
                  fused soft-CE with in-forward gradients, fused layer GEMMs summing weight grads
  fast_compiled   the same with the layer's elementwise pieces, merge math and loss chunks compiled
  fast_compiled_flash    fast_compiled with PyTorch's FA2 kernel for the causal block instead of cuDNN's
  fast_compiled_torch_adamw  fast_compiled with torch's fused AdamW kernel instead of the compiled update
  fast_compiled_unfused  the earlier path: separate q/k/v/gate/up GEMMs inside the compiled halves, each
                  step's weight gradient added up by autograd, FA2, torch's fused AdamW
  fast_compiled_prev  fast_compiled as it was before the persistent weight copies and the one-kernel loss
                  over all TTT steps (every weight cast each unroll, a loss kernel per step)
  fast_compiled_nopersist / _steploss  fast_compiled without one of those two
  fast_compiled_nohold (and _graphed_nohold)  fast_compiled with the weight-gradient sums cast into fp32 .grad for the clip and
                  AdamW instead of read by them in bf16 (eagle3.draft.held_grads)
  fast_compiled_graphed  fast_compiled with the whole step (teacher, forward, backward, clip, AdamW)
                  replayed as one CUDA graph after two eager steps (eagle3.training.step_graphs)
  fast_compiled_bN  fast_compiled at batch N (e.g. fast_compiled_b2); `--max-batch` also tries the
                  largest batch the measured memory slope predicts to fit, then smaller ones on OOM
MFU = useful FLOPs/token (fc once; per step q/k/v/o -- MLA: q_a/kv_a, q_b, kv_b, o --, MLP, draft lm_head,
causal attention -- MLA: QK^T over d_n + d_r, PV over d_v, the zero padding of v not counted --; all x3 for
fwd+bwd; plus the target lm_head teacher forward) x tokens/s over the bf16 matmul
rate measured here, and (MFU@ref) over a fixed `--ref-tflops` (790, see REF_TFLOPS). Prints a
table, and the memory one rank needs under FSDP at `--fsdp-world` ranks computed from the sizes
and the measured single-GPU peak; writes JSON (--out).

--loop instead runs the REAL training loop (`eagle3.training.train.train_draft`, the same entry the
pipeline uses, torchrun relaunch included) on synthetic offline shards of the project's format
written to a tmp dir: one GPU, DDP x2, FSDP x2 (`--modes`), N optimizer steps each at per-GPU
batch x grad_accum, and reports the loop's tokens/s (median of the log windows after the
compile warm-up), per-GPU tokens/s, scaling efficiency vs one GPU, MFU, the highest rank's peak
memory, and the loss.

    python tests/benchmarks/bench_train.py            # CUDA, full shape (skips without CUDA)
    python tests/benchmarks/bench_train.py --shape kimi-k2.5 --variants fast_compiled,fast_compiled_b2 --max-batch
    python tests/benchmarks/bench_train.py --tiny     # CPU smoke test with a tiny shape
    python tests/benchmarks/bench_train.py --loop     # 2 GPUs: single, DDP x2, FSDP x2 loops
    python tests/benchmarks/bench_train.py --loop --tiny --modes single,ddp   # CPU (gloo) smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import eagle3.draft.fused_layer as fused_layer  # noqa: E402
import eagle3.draft.losses as losses  # noqa: E402
import eagle3.draft.model as model_mod  # noqa: E402
from eagle3.config import DraftShapeConfig, TrainConfig  # noqa: E402
from eagle3.draft.held_grads import hold_gradients  # noqa: E402
from eagle3.draft.losses import compute_teacher  # noqa: E402
from eagle3.draft.model import MLA_DIMS, DraftModelConfig, Eagle3DraftModel, TTTCache  # noqa: E402
from eagle3.training.train import train_draft  # noqa: E402
from eagle3.training import adamw
from eagle3.training.trainer import clip_and_step
from eagle3.training import ttt as ttt_module
from eagle3.training.ttt import Eagle3TTTModule
from eagle3.training.step_graphs import StepGraphs

LLAMA31_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=128, vocab_size=128256, draft_vocab_size=32000, target_hidden_size=4096,
                  aux_layer_ids=[1, 15, 28], rms_norm_eps=1e-5, rope_theta=500000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                  max_position_embeddings=131072)
# Kimi-K2.5's draft (configs/kimi-k2.5-int4.yaml's train.draft) over its 61-layer target, DeepSeek/Kimi aux rule
KIMI_K25 = dict(hidden_size=7168, intermediate_size=18432, num_attention_heads=64, num_key_value_heads=8,
                head_dim=128, vocab_size=163840, draft_vocab_size=32000, target_hidden_size=7168,
                aux_layer_ids=[2, 30, 58], rms_norm_eps=1e-6, rope_theta=50000.0, max_position_embeddings=262144)
# the same target with the MLA draft (configs/kimi-k2.5-int4.yaml since issue 37): Kimi-K2's MLA dims and YaRN
KIMI_K25_MLA = dict(KIMI_K25, architecture="deepseek_mla", num_key_value_heads=64, head_dim=192, q_lora_rank=1536,
                    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    rope_scaling={"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                                  "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
SHAPES = {"llama-3.1-8b": (LLAMA31_8B, 32), "kimi-k2.5": (KIMI_K25, 61), "kimi-k2.5-mla": (KIMI_K25_MLA, 61),
          "kimi-k2.5-mla-3.1": (dict(KIMI_K25_MLA, fc_norm=True, norm_output=True), 61)}  # shape, target layers
TINY = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=512, draft_vocab_size=256, target_hidden_size=64, aux_layer_ids=[1, 2, 3])
TINY_MLA = dict(TINY, architecture="deepseek_mla", num_key_value_heads=4, head_dim=24, q_lora_rank=32, kv_lora_rank=16,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)  # --tiny with an -mla --shape


def tiny_shape(name: str) -> dict:
    return dict(TINY_MLA, **{k: v for k, v in SHAPES[name][0].items() if k in ("fc_norm", "norm_output")}) \
        if "mla" in name else TINY


ALL_VARIANTS = ("dense_eager", "fast_eager", "fast_compiled", "fast_compiled_b2", "dense_compiled")
EXTRA_VARIANTS = ("fast_compiled_flash", "fast_compiled_torch_adamw", "fast_compiled_unfused",  # only when named
                  "fast_compiled_prev", "fast_compiled_nopersist", "fast_compiled_steploss",
                  "fast_compiled_graphed", "fast_compiled_nohold", "fast_compiled_graphed_nohold")
# mode -> (devices, strategy); node-* go through `python -m eagle3.torchrun`, the launcher train.nodes
# starts on every node (one node here, static rendezvous on 127.0.0.1)
LOOP_MODES = {"single": (1, "ddp"), "ddp": (2, "ddp"), "fsdp": (2, "fsdp"), "node": (1, "ddp"),
              "node-ddp": (2, "ddp")}
TARGET_LAYERS = 32  # of the synthetic target, unless SHAPES gives the shape's own count
# A fixed rate for MFU beside the one measured in the run: the 8192^3 random-data probe read 600-680
# TFLOP/s on some H200s while the step's own GEMMs ran at 750 there (profile), and 769-798 on others;
# 790 is where issue 19's figures sit (the step before it, 30.1K tok/s here, is 66.4% at 790; the issue: 66.3%).
REF_TFLOPS = 790.0


def _attention_macs(cfg: DraftModelConfig, seq: int) -> tuple[float, float]:
    """(projection MACs, causal attention MACs) per token of one draft step.

    GQA: q/k/v from the 2H input, o; QK^T and PV over nh * d. MLA (as trained, the expanded form): q_a and
    kv_a from the 2H input, q_b (r_q -> nh (d_n + d_r)), kv_b (r_kv -> nh (d_n + d_v)), o (nh d_v -> H); QK^T over
    nh (d_n + d_r), PV over nh d_v (the TTT attention's zero padding of v to d_n + d_r is not useful work)."""
    h, nh, keys = cfg.hidden_size, cfg.num_attention_heads, (seq + 1) / 2  # causal: (T+1)/2 keys on average
    if cfg.is_mla:
        qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
        proj = (2 * h * (cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.q_lora_rank * nh * qk
                + cfg.kv_lora_rank * nh * (cfg.qk_nope_head_dim + v) + nh * v * h)
        return proj, nh * (qk + v) * keys
    q, kv = nh * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return 2 * h * (q + 2 * kv) + q * h, 2 * q * keys


def serving_kv_bytes_per_token(cfg: DraftModelConfig, dtype_bytes: int = 2) -> int:
    """The draft's KV cache per token as SGLang allocates it (bf16): GQA keeps k and v of every KV head; the MLA
    draft's pool keeps the latent and the rope key (kv_lora_rank + qk_rope_head_dim) once for all heads."""
    if cfg.is_mla:
        return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes
    return 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes


def useful_flops_per_token(cfg: DraftModelConfig, seq: int, ttt: int) -> dict[str, float]:
    """Useful training FLOPs per token (2 per MAC; x3 = forward + backward)."""
    h = cfg.hidden_size
    fc = 2 * cfg.num_aux_hidden_states * cfg.target_hidden_size * h * 3
    proj_macs, attn_macs = _attention_macs(cfg, seq)
    proj = 2 * proj_macs * 3
    mlp = 2 * 3 * h * cfg.intermediate_size * 3
    head = 2 * h * cfg.draft_vocab_size * 3
    attn = 2 * attn_macs * 3
    teacher = 2 * cfg.target_hidden_size * cfg.vocab_size
    parts = {"fc": fc, "attn_proj": ttt * proj, "mlp": ttt * mlp, "draft_lm_head": ttt * head,
             "attention": ttt * attn, "teacher": teacher}
    parts["total"] = sum(parts.values())
    return parts


def measure_matmul_tflops(device: torch.device, n: int, dtype: torch.dtype) -> float:
    """Median rate of an n^3 matmul on random data (device events on CUDA), after ~1 s of the same
    products so the clocks have ramped up (an idle GPU starts at 345 MHz)."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    if device.type == "cuda":
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1.0:
            a @ b
            torch.cuda.synchronize()
    times = []
    for i in range(23):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            a @ b
            ms = (time.perf_counter() - t0) * 1e3
        if i >= 3:
            times.append(ms)
    return 2 * n**3 / (statistics.median(times) * 1e-3) / 1e12


def build(cfg: DraftModelConfig, device: torch.device, param_dtype, seed: int = 0):
    """Draft (fp32 master weights, frozen embedding in `param_dtype`) and target lm_head."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    draft = Eagle3DraftModel(cfg)
    draft.embed_tokens.to(param_dtype)
    draft.to(device)
    used = torch.randperm(cfg.vocab_size, generator=g)[: cfg.draft_vocab_size].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[used] = True
    draft.set_vocab_mapping((used - torch.arange(cfg.draft_vocab_size)).to(device), t2d.to(device))
    lm_head = (torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=g) * 0.02).to(device, param_dtype)
    return draft, lm_head


def make_batch(cfg: DraftModelConfig, device, batch: int, seq: int, param_dtype, seed: int = 1) -> dict:
    """Synthetic hidden states of the offline-dataset contract (all positions in the loss)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device),
        "aux": torch.randn(batch, seq, cfg.num_aux_hidden_states * cfg.target_hidden_size, generator=g).to(device, param_dtype),
        "last": torch.randn(batch, seq, cfg.target_hidden_size, generator=g).to(device, param_dtype),
        "loss_mask": torch.ones(batch, seq, dtype=torch.bool, device=device),
    }


def baseline_loss(draft: Eagle3DraftModel, data: dict, lm_head, ttt: int, decay: float = 0.8):
    """Plain eager TTT (SpecForge-style): full [B, T, V] fp32 teacher, zero-padded shifts,
    dense boolean mask in SDPA, unfused log-softmax loss."""
    ids, lmask = data["input_ids"], data["loss_mask"]
    b, t = ids.shape
    with torch.no_grad():
        target = (data["last"] @ lm_head.T).float()
        counted = draft.t2d[target.argmax(-1)] & lmask
        p = torch.softmax(target[..., draft.t2d], -1)
    hidden = draft.project(data["aux"])
    pos = torch.arange(t, device=ids.device)[None].expand(b, t)
    cache, loss = TTTCache(), 0.0
    for k in range(ttt):
        s = k + 1
        hidden = draft.ttt_step(F.pad(ids[:, s:], (0, s)), hidden, pos + k, cache, "dense")
        logp = torch.log_softmax(draft.compute_logits(hidden).float(), -1)
        p_k, mask_k = F.pad(p[:, s:], (0, 0, 0, s)), F.pad(counted[:, s:], (0, s))
        ce = -(p_k * logp).sum(-1)
        loss = loss + decay**k * (ce * mask_k).sum() / mask_k.sum().clamp(min=1)
    return loss


def fast_loss(module: Eagle3TTTModule, data: dict, lm_head, chunk: int):
    """The eagle3.training.train path: chunked teacher + Eagle3TTTModule (fast attention, fused loss)."""
    draft = module.draft
    target_p, target_ids, in_vocab = compute_teacher(data["last"], lm_head, draft.t2d, chunk,
                                                     columns=draft.draft_vocab_columns())
    loss, _ = module(data["input_ids"], data["aux"], data["loss_mask"], target_p, target_ids, in_vocab)
    return loss


def reset_compiled(draft: Eagle3DraftModel) -> None:
    global _hold_gradients
    _hold_gradients = True
    draft.uncompile_layer()
    losses.uncompile_loss_chunk()
    adamw.uncompile_adamw()
    model_mod.set_causal_attention_backend("auto")
    fused_layer.set_persistent_copies(True)
    ttt_module.set_unroll_loss(True)
    draft.__dict__.pop("fused_layer_weights", None)


def variant_batch(variant: str, default: int) -> int:
    """fast_compiled_b4 -> 4; other names -> default."""
    head, _, tail = variant.rpartition("_b")
    return int(tail) if head and tail.isdigit() else default


def make_loss_fn(variant: str, draft, lm_head, data, ttt: int, chunk: int, device):
    global _hold_gradients
    reset_compiled(draft)
    compiled = "compiled" in variant
    if variant.startswith("dense"):
        fn = torch.compile(baseline_loss) if compiled else baseline_loss
        return lambda: fn(draft, data, lm_head, ttt)
    if compiled:
        draft.compile_layer()
        losses.compile_loss_chunk()
        if not variant.endswith(("_torch_adamw", "_unfused")):
            adamw.compile_adamw()
    if variant.endswith(("_flash", "_unfused")):
        model_mod.set_causal_attention_backend("flash")
    if variant.endswith("_unfused"):  # the earlier layer path: per-projection weights, autograd's grad sums
        draft.fused_layer_weights = lambda dtype: draft.cast_layer_weights(dtype) if dtype else None
    if variant.endswith(("_unfused", "_prev", "_nohold")):
        _hold_gradients = False
    if variant.endswith(("_unfused", "_prev", "_nopersist")):
        fused_layer.set_persistent_copies(False)
    if variant.endswith(("_unfused", "_prev", "_steploss")):
        ttt_module.set_unroll_loss(False)
    module = Eagle3TTTModule(draft, TrainConfig(ttt_steps=ttt, loss_chunk_tokens=chunk, compile=False))
    return lambda: fast_loss(module, data, lm_head, chunk)


_hold_gradients = True  # False: the weight-gradient sums go to fp32 .grad (variant *_nohold)


def train_step(loss_fn, optimizer, params, device, autocast_dtype):
    ctx = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else torch.autocast(device.type, enabled=False)
    # as the trainer: the compiled AdamW reads the bf16 gradient sums where they are (eagle3.draft.held_grads)
    with hold_gradients(_hold_gradients and adamw.eligible(optimizer)) as hold:
        with ctx:
            loss = loss_fn()
        loss.backward()
        grad_norm = clip_and_step(optimizer, params, 0.5, hold)  # the trainer's clip (folded into AdamW) + step
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), grad_norm


def graphed_train_step():
    """`train_step` replayed as a CUDA graph (eagle3.training.step_graphs) after two eager steps; the batch
    is static (the loss function's closure), so the graph has no inputs."""
    graphs = None

    def step(loss_fn, optimizer, params, device, autocast_dtype):
        nonlocal graphs
        if graphs is None:
            graphs = StepGraphs(lambda _: train_step(loss_fn, optimizer, params, device, autocast_dtype),
                                before_replay=lambda: adamw.load_hyperparameters(optimizer))
        return graphs([])

    return step


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_variant(variant, args, draft, lm_head, data, init_state, device, autocast_dtype):
    """Restore the initial weights, then time `iters` steps after `warmup` (compilation included there)."""
    draft.load_state_dict(init_state)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), fused=device.type == "cuda")
    loss_fn = make_loss_fn(variant, draft, lm_head, data, args.ttt, args.chunk, device)
    step = graphed_train_step() if "_graphed" in variant else train_step
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    first_loss, first_grad_norm = map(float, step(loss_fn, optimizer, params, device, autocast_dtype))
    for _ in range(args.warmup - 1):
        step(loss_fn, optimizer, params, device, autocast_dtype)
    _sync(device)
    warmup_s = time.perf_counter() - t0
    # Then steps until --warmup-s of them have run: an H200 takes seconds under load to reach its
    # steady clocks (the matmul probe read 600 then 662 TFLOP/s across one run), and a training run
    # lives in that steady state for hours.
    t1 = time.perf_counter()
    while time.perf_counter() - t1 < args.warmup_s:
        step(loss_fn, optimizer, params, device, autocast_dtype)
        _sync(device)
    times = []
    for _ in range(args.iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(loss_fn, optimizer, params, device, autocast_dtype)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t1 = time.perf_counter()
            step(loss_fn, optimizer, params, device, autocast_dtype)
            times.append((time.perf_counter() - t1) * 1e3)
    back_to_back_ms, host_launch_ms = time_back_to_back(step, (loss_fn, optimizer, params, device, autocast_dtype), args.iters)
    ms, batch = statistics.median(times), data["input_ids"].shape[0]
    result = {"variant": variant, "batch": batch, "ms_per_step": ms, "ms_min": min(times), "ms_max": max(times),
              "tokens_per_s": batch * args.seq / (ms * 1e-3), "first_loss": first_loss, "first_grad_norm": first_grad_norm, "warmup_s": warmup_s,
              "times_ms": times, "ms_back_to_back": back_to_back_ms, "ms_host_launch": host_launch_ms,
              "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}
    result["persistent_weight_copies"] = len(fused_layer._persistent_copies)  # 0 where they do not apply
    if args.profile and variant in args.profile.split(",") and device.type == "cuda":
        result["profile"] = profile_step(step, loss_fn, optimizer, params, device, autocast_dtype)
        if args.host_profile:
            result["host_profile"] = host_profile_step(step, loss_fn, optimizer, params, device, autocast_dtype)
    reset_compiled(draft)
    del optimizer, loss_fn
    for p in params:
        p.grad = None
    return result


def time_back_to_back(step, step_args, iters: int) -> tuple[float | None, float | None]:
    """(device ms, host ms) per step over `iters` steps launched back to back (one sync at the end), as the
    training loop runs them: the host may run ahead, so a step's launch latency hides behind the one before;
    equal figures = the host sets the pace."""
    device = step_args[3]
    if device.type != "cuda":
        return None, None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        step(*step_args)
    host_ms = (time.perf_counter() - t0) * 1e3 / iters
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters, host_ms


def _kernel_category(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("flash", "fmha", "sdpa", "cudnn", "fort_native")):
        return "attention"
    if any(k in n for k in ("gemm", "xmma", "cutlass", "nvjet", "sm90", "cublas", "matmul")):
        return "gemm"
    if "adam" in n or "multi_tensor" in n:
        return "optimizer"
    if n.startswith("triton"):
        return "triton_fused"
    return "other_elementwise"


def profile_step(step, loss_fn, optimizer, params, device, autocast_dtype, steps: int = 2) -> dict:
    """Device time per kernel category and the top kernels over `steps` training steps."""
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(loss_fn, optimizer, params, device, autocast_dtype)
        _sync(device)
    kernels = [(e.key, e.self_device_time_total / steps / 1e3, e.count // steps) for e in prof.key_averages()
               if e.self_device_time_total > 0]
    categories: dict[str, float] = {}
    for name, ms, _ in kernels:
        categories[_kernel_category(name)] = categories.get(_kernel_category(name), 0.0) + ms
    top = sorted(kernels, key=lambda k: -k[1])[:80]
    return {"ms_by_category": categories, "device_ms_total": sum(categories.values()),
            "top_kernels": [{"name": n[:160], "ms": ms, "calls": c, "category": _kernel_category(n)}
                            for n, ms, c in top],
            "idle": device_idle_gaps(prof, steps)}


def host_profile_step(step, loss_fn, optimizer, params, device, autocast_dtype, steps: int = 2) -> str:
    """The host's side of `steps` steps: ops by their own CPU time (what the GPU waits on in the gaps)."""
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step(loss_fn, optimizer, params, device, autocast_dtype)
        host_ms = (time.perf_counter() - t0) * 1e3 / steps
        _sync(device)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70)
    return f"host ms per step until the last launch (under the profiler): {host_ms:.1f}\n{table}"


def device_idle_gaps(prof, steps: int, min_us: float = 5.0) -> dict:
    """Where the GPU waits for the host: the time between one kernel's end and the next one's start
    (kernels in start order, any stream), summed per step, and the largest gaps with their neighbours."""
    from torch.autograd import DeviceType

    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    gaps, reach = [], kernels[0][1] if kernels else 0
    for (_, end, name), (start, nxt_end, nxt) in zip(kernels, kernels[1:]):
        reach = max(reach, end)
        if start - reach >= min_us:
            gaps.append((start - reach, name[:70], nxt[:70]))
        reach = max(reach, nxt_end)
    span = (kernels[-1][1] - kernels[0][0]) if kernels else 0
    return {"span_ms_per_step": span / steps / 1e3, "idle_ms_per_step": sum(g[0] for g in gaps) / steps / 1e3,
            "gaps_per_step": len(gaps) / steps,
            "largest": [{"us": round(us, 1), "after": a, "before": b} for us, a, b in sorted(gaps, reverse=True)[:15]]}


# ---------------------------------------------------------------- the real trainer loop


def write_synthetic_target(target_dir: Path, shape: dict, seed: int = 0, layers: int = TARGET_LAYERS) -> Path:
    """A target dir as train_draft reads it: config.json + model.safetensors (embed_tokens, lm_head)."""
    from safetensors.torch import save_file

    target_dir.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers,
              "hidden_size": shape["target_hidden_size"], "intermediate_size": shape["intermediate_size"],
              "num_attention_heads": shape["num_attention_heads"], "num_key_value_heads": shape["num_key_value_heads"],
              "head_dim": shape["head_dim"], "vocab_size": shape["vocab_size"], "tie_word_embeddings": False,
              "rms_norm_eps": shape.get("rms_norm_eps", 1e-5), "rope_theta": shape.get("rope_theta", 10000.0),
              "rope_scaling": shape.get("rope_scaling"),
              "max_position_embeddings": shape.get("max_position_embeddings", 4096),
              **{k: shape[k] for k in MLA_DIMS if shape.get(k)}}  # a DeepSeek-V3-style target's MLA dims
    (target_dir / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(seed)
    size = (shape["vocab_size"], shape["target_hidden_size"])
    save_file({"model.embed_tokens.weight": (torch.randn(size, generator=g) * 0.02).bfloat16(),
               "lm_head.weight": (torch.randn(size, generator=g) * 0.02).bfloat16()},
              str(target_dir / "model.safetensors"))
    return target_dir


def write_synthetic_dataset(data_dir: Path, shape: dict, lengths: dict[str, list[int]], shard_size: int,
                            seed: int = 0, layers: int = TARGET_LAYERS) -> Path:
    """Offline shards + manifest.json (eagle3/data/shards.py format, bf16) and the draft vocab, random content.

    lengths: tokens of each sample per split, e.g. {"train": [2048] * 32, "validation": [2048] * 2}.
    The random states are drawn once and sliced for every shard: their values do not change speed.
    """
    from eagle3.data.shards import FORMAT_VERSION, MANIFEST, _write_shard
    from eagle3.draft.vocab import build_draft_vocab, save_draft_vocab

    hidden, k, vocab = shape["target_hidden_size"], len(shape["aux_layer_ids"]), shape["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    most = max(sum(lens[i : i + shard_size]) for lens in lengths.values() for i in range(0, len(lens), shard_size))
    aux_pool = torch.randn(most, k * hidden, generator=g, dtype=torch.bfloat16)
    last_pool = torch.randn(most, hidden, generator=g, dtype=torch.bfloat16)
    out = data_dir / "hidden_states"
    out.mkdir(parents=True, exist_ok=True)
    entries, sample_id = [], 0
    for split, lens in lengths.items():
        for n, start in enumerate(range(0, len(lens), shard_size)):
            part = lens[start : start + shard_size]
            tokens = sum(part)
            tensors = {"input_ids": torch.randint(0, vocab, (tokens,), generator=g),
                       "loss_mask": torch.ones(tokens, dtype=torch.uint8),
                       "lengths": torch.tensor(part, dtype=torch.long),
                       "sample_ids": torch.arange(sample_id, sample_id + len(part)),
                       "aux_hidden_states": aux_pool[:tokens], "last_hidden_states": last_pool[:tokens]}
            name = f"{split}-{n:05d}.safetensors"
            digest, size = _write_shard(tensors, out / name)
            entries.append({"file": name, "split": split, "num_samples": len(part), "num_tokens": tokens,
                            "sha256": digest, "bytes": size})
            sample_id += len(part)
    manifest = {"format_version": FORMAT_VERSION, "fingerprint": "synthetic", "architecture": "LlamaForCausalLM",
                "num_hidden_layers": layers, "hidden_size": hidden, "aux_layer_ids": shape["aux_layer_ids"],
                "hf_indices": [i + 1 for i in shape["aux_layer_ids"]], "num_aux": k, "dtype": "bfloat16",
                "max_length": max(max(v) for v in lengths.values()),
                "num_samples": {sp: len(v) for sp, v in lengths.items()},
                "num_tokens": {sp: sum(v) for sp, v in lengths.items()}, "complete": True, "shards": entries}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    counts = torch.randint(1, 1000, (vocab,), generator=g)
    save_draft_vocab(build_draft_vocab(counts, shape["draft_vocab_size"]), data_dir / "vocab")
    return data_dir


def loop_config(mode: str, args, shape: dict | None = None) -> TrainConfig:
    devices, strategy = LOOP_MODES[mode]
    shape = shape or {}
    draft = DraftShapeConfig(architecture=shape.get("architecture", "llama"), fc_norm=shape.get("fc_norm", False),
                             norm_output=shape.get("norm_output", False))
    return TrainConfig(draft=draft, ttt_steps=args.ttt, batch_size=args.batch, grad_accum=args.grad_accum, max_steps=args.steps,
                       epochs=10_000, lr=1e-5, warmup_ratio=0.0, log_every=args.log_every, eval_every=10**8,
                       checkpoint_every=10**8, eval_max_batches=1, devices=devices, strategy=strategy,
                       compile=not args.tiny, loss_chunk_tokens=args.chunk, cuda_graphs=args.cuda_graphs)


def run_loop_mode(mode: str, args, shape: dict, target_dir: Path, data_dir: Path, out_dir: Path) -> dict:
    """One train_draft run; one GPU runs as its own process (`python -m eagle3.training.train`, as a rank
    would) so no mode inherits another's GPU memory; devices=2 goes through train_draft's torchrun relaunch."""
    cfg = loop_config(mode, args, shape)
    t0 = time.perf_counter()
    if mode.startswith("node"):
        error = _run_through_node_launcher(cfg, shape, target_dir, data_dir, out_dir)
        if error:
            return {"mode": mode, "error": error}
    elif cfg.devices == 1:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "cfg.json").write_text(cfg.model_dump_json())
        cmd = [sys.executable, "-m", "eagle3.training.train", "--data-dir", str(data_dir), "--target-dir", str(target_dir),
               "--out-dir", str(out_dir), "--config", str(out_dir / "cfg.json"),
               "--aux-layer-ids", ",".join(map(str, shape["aux_layer_ids"])),
               "--draft-vocab-size", str(shape["draft_vocab_size"])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            return {"mode": mode, "error": proc.stderr[-1500:]}
        graph_lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "CUDA graph" in line]
        if graph_lines:
            print(f"{mode}: " + f"\n{mode}: ".join(graph_lines))
    else:
        try:
            train_draft(data_dir, target_dir, cfg, out_dir, aux_layer_ids=shape["aux_layer_ids"],
                        draft_vocab_size=shape["draft_vocab_size"], log=lambda line: None)
        except RuntimeError as err:
            return {"mode": mode, "error": str(err)[-1500:]}
    rows = [json.loads(line) for line in (out_dir / "history.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/tokens_per_s" in r]
    timed = rows[args.skip_windows :] or rows[-1:]
    tok_s = statistics.median(r["train/tokens_per_s"] for r in timed)
    return {"mode": mode, "world": cfg.devices, "strategy": cfg.strategy, "steps": rows[-1]["step"],
            "tokens_per_s": tok_s, "tokens_per_s_per_gpu": tok_s / cfg.devices,
            "window_tokens_per_s": [r["train/tokens_per_s"] for r in rows],
            "peak_memory_gib": rows[-1].get("train/peak_memory_gib"),
            "first_loss": rows[0]["train/loss"], "last_loss": rows[-1]["train/loss"],
            "wall_s": time.perf_counter() - t0}


def _run_through_node_launcher(cfg: TrainConfig, shape: dict, target_dir: Path, data_dir: Path,
                               out_dir: Path) -> str | None:
    """One node of train.nodes on this machine; the error text, or None."""
    import socket

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cfg.json").write_text(cfg.model_dump_json())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "eagle3.torchrun", "--data-dir", str(data_dir), "--target-dir", str(target_dir),
           "--out-dir", str(out_dir), "--config", str(out_dir / "cfg.json"),
           "--aux-layer-ids", ",".join(map(str, shape["aux_layer_ids"])),
           "--draft-vocab-size", str(shape["draft_vocab_size"]), "--node-rank", "0", "--nnodes", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(port)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        status = out_dir / "node_status.json"
        return (json.loads(status.read_text())["failures"] if status.is_file() else "") + proc.stdout[-1500:]
    return None


def run_loop(args) -> int:
    """--loop: the real trainer loop in each of args.modes on one synthetic dataset."""
    modes = args.modes.split(",")
    unknown = set(modes) - set(LOOP_MODES)
    if unknown:
        raise SystemExit(f"bench_train: unknown --modes {sorted(unknown)}; choose from {sorted(LOOP_MODES)}")
    if args.tiny:
        shape, args.seq, device = tiny_shape(args.shape), min(args.seq, 64), torch.device("cpu")
    else:
        if not torch.cuda.is_available() or torch.cuda.device_count() < max(LOOP_MODES[m][0] for m in modes):
            print(f"bench_train --loop: needs {max(LOOP_MODES[m][0] for m in modes)} CUDA GPUs (use --tiny on CPU). Skipped.")
            return 0
        shape, device = SHAPES[args.shape][0], torch.device("cuda")
    cfg = DraftModelConfig(**shape)
    flops = useful_flops_per_token(cfg, args.seq, args.ttt)
    matmul = measure_matmul_tflops(device, 1024 if args.tiny else 8192, torch.float32 if args.tiny else torch.bfloat16)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    per_step = args.batch * args.grad_accum * 2  # samples per optimizer step of the widest mode
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-train-loop-"))
    t0 = time.perf_counter()
    layers = TARGET_LAYERS if args.tiny else SHAPES[args.shape][1]
    target_dir = write_synthetic_target(work / "target", shape, layers=layers)
    data_dir = write_synthetic_dataset(work / "data", shape, {"train": [args.seq] * max(args.train_samples, per_step),
                                                               "validation": [args.seq] * 2}, shard_size=8,
                                       layers=layers)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "shape_name": "tiny" if args.tiny else args.shape, "shape": shape, "seq": args.seq, "ttt": args.ttt, "batch": args.batch, "grad_accum": args.grad_accum,
              "steps": args.steps, "flops_per_token": flops, "matmul_tflops": matmul, "ref_tflops": args.ref_tflops,
              "serving_kv_bytes_per_token": serving_kv_bytes_per_token(cfg),
              "dataset_write_s": time.perf_counter() - t0, "results": []}
    for mode in modes:
        res = run_loop_mode(mode, args, shape, target_dir, data_dir, work / f"run-{mode}")
        if "tokens_per_s" in res:
            res["mfu"] = flops["total"] * res["tokens_per_s_per_gpu"] / (matmul * 1e12)
            res["mfu_ref"] = flops["total"] * res["tokens_per_s_per_gpu"] / (args.ref_tflops * 1e12)
        report["results"].append(res)
        print(json.dumps(res), flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2))
    print_loop_table(report)
    return 0


def print_loop_table(report: dict) -> None:
    print(f"\n{report['device']}, torch {report['torch']}, matmul {report['matmul_tflops']:.3g} TFLOP/s, seq "
          f"{report['seq']}, TTT {report['ttt']}, shape {report['shape_name']}, per-GPU batch {report['batch']} x grad_accum {report['grad_accum']}, "
          f"{report['steps']} steps, draft KV cache when served {report['serving_kv_bytes_per_token']} B/token")
    single = next((r for r in report["results"] if r["mode"] == "single" and "tokens_per_s" in r), None)
    print(f"{'mode':<8}{'GPUs':>5}{'tok/s':>10}{'tok/s/GPU':>11}{'eff.':>7}{'MFU':>8}{'MFU@ref':>9}{'peak GiB':>10}"
          f"{'loss@1':>9}{'loss@N':>9}   (ref {report['ref_tflops']:.0f} TFLOP/s)")
    for r in report["results"]:
        if "error" in r:
            print(f"{r['mode']:<8} ERROR {r['error'][-300:]}")
            continue
        eff = f"{r['tokens_per_s_per_gpu'] / single['tokens_per_s_per_gpu']:.2f}" if single else "-"
        mem = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
        print(f"{r['mode']:<8}{r['world']:>5}{r['tokens_per_s']:>10.0f}{r['tokens_per_s_per_gpu']:>11.0f}{eff:>7}"
              f"{100 * r['mfu']:>7.1f}%{100 * r['mfu_ref']:>8.1f}%{mem:>10}{r['first_loss']:>9.4f}{r['last_loss']:>9.4f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shape on CPU (smoke test)")
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES), help="draft shape (CUDA)")
    parser.add_argument("--variants", default=None, help=f"comma list from {ALL_VARIANTS + EXTRA_VARIANTS} "
                        "(fast_compiled_bN: any batch N); default the first five (with --tiny: the eager ones)")
    parser.add_argument("--max-batch", action="store_true", help="also find the largest batch that fits "
                        "(fast_compiled; from the memory slope of the batches measured before it)")
    parser.add_argument("--fsdp-world", type=int, default=8, help="ranks for the computed FSDP memory per rank")
    parser.add_argument("--ref-tflops", type=float, default=REF_TFLOPS,
                        help="fixed bf16 rate of the second MFU column (MFU@ref), TFLOP/s")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--ttt", type=int, default=7)
    parser.add_argument("--chunk", type=int, default=8192, help="loss/teacher rows per chunk")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--warmup-s", type=float, default=5.0, help="then steps for this many seconds before timing "
                        "(steady clocks)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--profile", default="fast_compiled", help="comma list of variants to profile ('' = none)")
    parser.add_argument("--host-profile", action="store_true", help="with --profile: also the host's CPU time by op")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--loop", action="store_true", help="run the real trainer loop (see the docstring)")
    parser.add_argument("--modes", default="single,ddp,fsdp", help=f"--loop: comma list from {sorted(LOOP_MODES)}")
    parser.add_argument("--steps", type=int, default=40, help="--loop: optimizer steps per mode")
    parser.add_argument("--grad-accum", type=int, default=2, help="--loop: micro-batches per optimizer step")
    parser.add_argument("--log-every", type=int, default=5, help="--loop: steps per timing window")
    parser.add_argument("--skip-windows", type=int, default=2, help="--loop: windows left out (compile warm-up)")
    parser.add_argument("--train-samples", type=int, default=32, help="--loop: synthetic training samples")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="--loop: train.cuda_graphs (whole steps replayed as CUDA graphs on one GPU; the default)")
    parser.add_argument("--work-dir", default=None, help="--loop: where the synthetic data and runs go (default tmp)")
    args = parser.parse_args(argv)
    if args.loop:
        return run_loop(args)
    known = set(ALL_VARIANTS + EXTRA_VARIANTS)
    unknown = {v for v in (args.variants or "").split(",") if v and v not in known
               and not (v.startswith("fast_compiled_b") and v[len("fast_compiled_b"):].isdigit())}
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}")

    if args.tiny:
        device, shape, autocast_dtype, param_dtype = torch.device("cpu"), tiny_shape(args.shape), None, torch.float32
        args.seq, args.iters, args.warmup = min(args.seq, 64), min(args.iters, 3), min(args.warmup, 1)
        variants = args.variants.split(",") if args.variants else [v for v in ALL_VARIANTS if "compiled" not in v]
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            print("bench_train: CUDA not available; the full shape needs a GPU (use --tiny on CPU). Skipped.")
            return 0
        device, autocast_dtype, param_dtype = torch.device("cuda"), torch.bfloat16, torch.bfloat16
        shape = SHAPES[args.shape][0]
        variants = args.variants.split(",") if args.variants else list(ALL_VARIANTS)
    cfg = DraftModelConfig(**shape)
    flops = useful_flops_per_token(cfg, args.seq, args.ttt)
    matmul = measure_matmul_tflops(device, 1024 if args.tiny else 8192, torch.float32 if args.tiny else torch.bfloat16)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "shape_name": "tiny" if args.tiny else args.shape, "shape": shape,
              "seq": args.seq, "ttt": args.ttt, "flops_per_token": flops, "matmul_tflops": matmul,
              "serving_kv_bytes_per_token": serving_kv_bytes_per_token(cfg),
              "ref_tflops": args.ref_tflops, "results": []}
    draft, lm_head = build(cfg, device, param_dtype)
    init_state = {k: v.detach().cpu().clone() for k, v in draft.state_dict().items()}
    for variant in variants:
        measure_variant(variant, variant_batch(variant, args.batch), args, report, draft, lm_head, init_state,
                        cfg, device, autocast_dtype, param_dtype)
    if args.max_batch and device.type == "cuda":
        find_max_batch(args, report, draft, lm_head, init_state, cfg, device, autocast_dtype, param_dtype)
    if device.type == "cuda":
        report["fsdp_memory"] = fsdp_rank_memory(report, draft, lm_head, args.fsdp_world)
        torch.cuda.empty_cache()
        # MFU against the higher of the rates measured before and after the variants (the conservative one)
        report["matmul_tflops_start"] = matmul
        report["matmul_tflops_end"] = measure_matmul_tflops(device, 8192, torch.bfloat16)
        report["matmul_tflops"] = max(matmul, report["matmul_tflops_end"])
        for res in report["results"]:
            if "tokens_per_s" in res:
                res["mfu"] = flops["total"] * res["tokens_per_s"] / (report["matmul_tflops"] * 1e12)
                res["mfu_ref"] = flops["total"] * res["tokens_per_s"] / (args.ref_tflops * 1e12)
        report["ref_tflops"] = args.ref_tflops
    report["pooled"] = [{"variant": v, "batch": b, **row} for (v, b), row in pooled_repeats(report).items()]
    save_report(args, report)
    print_table(report)
    return 0


def measure_variant(variant, size, args, report, draft, lm_head, init_state, cfg, device, autocast_dtype,
                    param_dtype) -> dict:
    """One variant at batch `size` (fresh batch); appended to the report, OOM reported as an error."""
    data = None
    try:
        data = make_batch(cfg, device, size, args.seq, param_dtype)
        res = run_variant(variant, args, draft, lm_head, data, init_state, device, autocast_dtype)
    except torch.OutOfMemoryError as err:  # report and go on with the other variants
        res = {"variant": variant, "batch": size, "error": f"OOM: {str(err)[:200]}"}
        for p in draft.parameters():
            p.grad = None
    del data
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if "tokens_per_s" in res:
        res["mfu"] = report["flops_per_token"]["total"] * res["tokens_per_s"] / (report["matmul_tflops"] * 1e12)
        res["mfu_ref"] = report["flops_per_token"]["total"] * res["tokens_per_s"] / (report["ref_tflops"] * 1e12)
    report["results"].append(res)
    print(json.dumps({k: v for k, v in res.items() if k != "profile"}), flush=True)
    save_report(args, report)  # after every variant, so a timeout keeps what was measured
    return res


def save_report(args, report: dict) -> None:
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


def find_max_batch(args, report, draft, lm_head, init_state, cfg, device, autocast_dtype, param_dtype) -> None:
    """The largest fast_compiled batch that fits: predicted from the peak memory of two measured
    batches (linear in the batch), tried, then one smaller at a time on OOM."""
    done = {r["batch"]: r["peak_mem_gib"] for r in report["results"]
            if r.get("peak_mem_gib") and (r["variant"] == "fast_compiled" or variant_batch(r["variant"], 0) > 0)}
    if len(done) < 2:
        print("bench_train --max-batch: needs two fast_compiled batches measured first (e.g. fast_compiled,"
              "fast_compiled_b2)")
        return
    (b1, m1), (b2, m2) = sorted(done.items())[:2]
    per_sample = (m2 - m1) / (b2 - b1)
    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    predicted = int((0.97 * total - (m1 - per_sample * b1)) // per_sample)
    report["max_batch_prediction"] = {"gib_per_sample": per_sample, "fixed_gib": m1 - per_sample * b1,
                                      "device_gib": total, "predicted": predicted}
    for size in range(predicted, max(done), -1):
        res = measure_variant(f"fast_compiled_b{size}", size, args, report, draft, lm_head, init_state, cfg,
                              device, autocast_dtype, param_dtype)
        if "tokens_per_s" in res:
            report["max_batch"] = size
            return


def fsdp_rank_memory(report: dict, draft: Eagle3DraftModel, lm_head: torch.Tensor, world: int) -> dict | None:
    """Memory one rank needs under FSDP (`train.strategy: fsdp`, bf16 gathers, fp32 reduce) at `world`
    ranks, computed from the sizes and the measured single-GPU peak at batch 1 (not measured).

    P trainable parameters: fp32 master + fp32 grad + 2 AdamW moments (16 B/param) are sharded (/world);
    frozen weights (embedding, the target lm_head) stay whole. Two peaks: during backward = the
    single-GPU peak minus the unsharded share of the 16 B/param (the bf16 weights FSDP gathers take
    the place of the bf16 copies a single GPU casts); at the end of backward = the gathered bf16
    weights (2P) + their bf16 gradients (2P) + the fp32 copy reduce-scatter sends (4P) + shards + frozen.
    """
    single = next((r for r in report["results"] if r.get("variant") == "fast_compiled" and r.get("batch") == 1
                   and r.get("peak_mem_gib")), None)
    if single is None:
        return None
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in draft.parameters() if not p.requires_grad)
    frozen += lm_head.numel() * lm_head.element_size()
    gib = 2**30
    during = single["peak_mem_gib"] - 16 * trainable * (1 - 1 / world) / gib
    end = (8 * trainable + 16 * trainable / world + frozen) / gib
    return {"world": world, "trainable_params": trainable, "frozen_gib": frozen / gib,
            "sharded_state_gib": 16 * trainable / world / gib, "during_backward_gib": during,
            "end_of_backward_gib": end, "per_rank_gib": max(during, end)}


def pooled_repeats(report: dict) -> dict:
    """(variant, batch) measured more than once (`--variants a,b,a,b`): the median over all their steps."""
    groups: dict = {}
    for r in report["results"]:
        if "times_ms" in r:
            groups.setdefault((r["variant"], r["batch"]), []).append(r)
    pooled = {}
    for (variant, batch), rows in groups.items():
        if len(rows) < 2:
            continue
        ms = statistics.median(t for r in rows for t in r["times_ms"])
        tok_s = batch * report["seq"] / (ms * 1e-3)
        pooled[(variant, batch)] = {"ms_per_step": ms, "tokens_per_s": tok_s, "rounds": len(rows),
                                    "round_medians_ms": [round(r["ms_per_step"], 1) for r in rows],
                                    "mfu_ref": report["flops_per_token"]["total"] * tok_s / (report["ref_tflops"] * 1e12)}
    return pooled


def print_table(report: dict) -> None:
    rates = (f" (before {report['matmul_tflops_start']:.3g}, after {report['matmul_tflops_end']:.3g})"
             if "matmul_tflops_end" in report else "")
    print(f"\n{report['device']}, torch {report['torch']}, shape {report['shape_name']}, measured matmul "
          f"{report['matmul_tflops']:.3g} TFLOP/s{rates}, useful {report['flops_per_token']['total'] / 1e9:.4g} GFLOP/token, "
          f"seq {report['seq']}, TTT {report['ttt']}, draft KV cache when served "
          f"{report['serving_kv_bytes_per_token']} B/token")
    print(f"{'variant':<18}{'batch':>6}{'ms/step':>10}{'tok/s':>10}{'MFU':>8}{'MFU@ref':>9}{'peak GiB':>10}"
          f"{'loss@0':>10}{'|g|@0':>10}{'b2b ms':>8}{'host ms':>9}   (ref {report['ref_tflops']:.0f} TFLOP/s; b2b: "
          f"steps back to back; host: its time to launch one of them, = b2b where the host sets the pace)")
    for r in report["results"]:
        if "error" in r:
            print(f"{r['variant']:<18} {r['error']}")
            continue
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        b2b = f"{r['ms_back_to_back']:>8.1f}" if r.get("ms_back_to_back") else f"{'-':>8}"
        b2b += f"{r['ms_host_launch']:>9.1f}" if r.get("ms_host_launch") else f"{'-':>9}"
        print(f"{r['variant']:<18}{r['batch']:>6}{r['ms_per_step']:>10.1f}{r['tokens_per_s']:>10.0f}"
              f"{100 * r['mfu']:>7.1f}%{100 * r['mfu_ref']:>8.1f}%{mem:>10}{r['first_loss']:>10.4f}"
              f"{r['first_grad_norm']:>10.4f}{b2b}")
    pooled = pooled_repeats(report)
    if pooled:
        print(f"\nvariants measured more than once (alternating, so clock drift hits each alike): median of all "
              f"their steps")
        for (variant, batch), row in pooled.items():
            print(f"{variant:<18}{batch:>6}{row['ms_per_step']:>10.1f}{row['tokens_per_s']:>10.0f}{'':>8}"
                  f"{100 * row['mfu_ref']:>8.1f}%   rounds {row['rounds']}, medians {row['round_medians_ms']}")
    for r in report["results"]:
        if "profile" in r:
            prof = r["profile"]
            flops = report["flops_per_token"]
            gemm_tflops = ((flops["total"] - flops["attention"]) * r["batch"] * report["seq"]
                           / (prof["ms_by_category"].get("gemm", float("nan")) * 1e-3) / 1e12)
            print(f"\nprofile of {r['variant']} (device ms per step, total {prof['device_ms_total']:.1f}; the GEMMs "
                  f"run the useful non-attention FLOPs at {gemm_tflops:.0f} TFLOP/s):")
            for cat, ms in sorted(prof["ms_by_category"].items(), key=lambda kv: -kv[1]):
                print(f"  {cat:<20}{ms:>8.2f}")
            for k in prof["top_kernels"][:40]:
                print(f"  {k['ms']:>7.2f} ms x{k['calls']:<4} {k['name'][:110]}")
            idle = prof.get("idle")
            if idle:
                print(f"  device idle between kernels: {idle['idle_ms_per_step']:.2f} ms of a {idle['span_ms_per_step']:.1f} ms"
                      f" span per step ({idle['gaps_per_step']:.0f} gaps >= 5 us); largest:")
                for g in idle["largest"]:
                    print(f"  {g['us']:>8.1f} us after {g['after']}  before {g['before']}")
        if "host_profile" in r:
            print(f"\nhost profile of {r['variant']}:\n{r['host_profile']}")
    if report.get("max_batch_prediction"):
        pred = report["max_batch_prediction"]
        print(f"\nmemory: {pred['fixed_gib']:.1f} GiB + {pred['gib_per_sample']:.2f} GiB/sample of {pred['device_gib']:.0f}"
              f" GiB -> predicted largest batch {pred['predicted']}; largest that ran: {report.get('max_batch')}")
    if report.get("fsdp_memory"):
        mem = report["fsdp_memory"]
        print(f"FSDP x{mem['world']} (computed, not measured): {mem['per_rank_gib']:.1f} GiB per rank at batch 1 "
              f"(during backward {mem['during_backward_gib']:.1f}, end of backward {mem['end_of_backward_gib']:.1f}; "
              f"{mem['trainable_params'] / 1e6:.0f}M trainable params, sharded state {mem['sharded_state_gib']:.1f} GiB, "
              f"frozen {mem['frozen_gib']:.1f} GiB)")


if __name__ == "__main__":
    raise SystemExit(main())
