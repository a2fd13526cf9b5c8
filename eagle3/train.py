"""EAGLE-3 draft training: TTT unroll, optimizer loop, checkpoints, multi-GPU, curves.

Owns the training stage. `train_draft` is the entry the Prefect task wraps; `Trainer` is
the loop (load -> step -> checkpoint -> validate, as torchtitan's `Trainer.train`);
`Eagle3TTTModule` is the per-batch objective, wrapped by DDP/FSDP under torchrun.

Alignment (EAGLE / SpecForge `padding(x, left=False)`; decoding uses the same). For
query position t at TTT step k (0-based), with s = k + 1:
    token input  = input_ids[t + s]          (zero past the end)
    hidden input = fc(aux[t]) at k = 0, else this position's output of step k-1
    RoPE position = t + k
    teacher      = target distribution at t + s   (predicts token t + s + 1)
    counted iff  loss_mask[t + s] = 1 and the teacher's full-vocab argmax is a draft token
Worked example, T = 5, k = 1: query 2 reads token 4 at position 3 and learns teacher 4;
queries 3 and 4 have no teacher (t + s > T - 1) and are dropped. The loss mask is taken at
the token the draft reads (t + s), i.e. the draft is trained wherever it would be queried
while a response is being generated.

Risk: resuming must reproduce the uninterrupted run; checkpoints carry model, optimizer,
scheduler, RNG states and the data position, are written to a temp dir then renamed, and
a resume with a different training config is refused. Multi-GPU scaling depends on the input
pipeline never stalling the GPU (loader workers, pinned non_blocking copies, no host sync per
step) and on each rank getting CPU threads; a rank that dies is reported by rank with its log
tail (out_dir/torchrun_logs) and its process group is killed.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import math
import os
import random
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.distributed.elastic.multiprocessing.errors import record

from eagle3.config import TrainConfig
from eagle3.torchrun import TORCHRUN_TAIL_LINES, describe_rank_failures, torchrun_command, torchrun_env
from eagle3.losses import compile_loss_chunk, compute_teacher, soft_cross_entropy_steps
from eagle3.model import DraftModelConfig, Eagle3DraftModel, TTTCache

MetricsFn = Callable[[int, dict[str, float]], None]
ProgressFn = Callable[[int, int], None]
# Fields that may change between a run and its resume: they do not change the math.
RESUMABLE_FIELDS = {"checkpoint_every", "eval_every", "log_every", "keep_checkpoints", "num_workers", "prefetch_factor",
                    "eval_max_batches", "rendezvous"}
_STAT_ROWS = 4  # ce_sum, counted positions, correct, loss-masked positions


# ============================================================================ objective


class Eagle3TTTModule(nn.Module):
    """Training-time-test unroll of the draft on one batch; DDP/FSDP wrap this module."""

    def __init__(self, draft: Eagle3DraftModel, cfg: TrainConfig) -> None:
        super().__init__()
        self.draft = draft
        self.ttt_steps, self.step_decay = cfg.ttt_steps, cfg.step_decay
        self.attention, self.loss_chunk = cfg.attention, cfg.loss_chunk_tokens

    def forward(
        self,
        input_ids: Tensor,
        aux_hidden_states: Tensor,
        loss_mask: Tensor,
        target_p: Tensor,
        target_ids: Tensor,
        in_vocab: Tensor,
        loss_norm: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Weighted TTT loss and per-step statistics.

        Args:
            input_ids [B, T]; aux_hidden_states [B, T, k*H_t]; loss_mask bool [B, T];
            target_p fp32 [B, T, Vd], target_ids [B, T], in_vocab bool [B, T] from
            `compute_teacher` at the SAME positions as input_ids (unshifted).
            loss_norm: fp32 [ttt_steps] > 0, the divisor of step k's CE sum; None = this batch's
                own counted positions (a per-batch mean). The trainer passes the count over its whole
                optimizer step on all ranks (see `Trainer._optimizer_step`).
        Returns:
            loss = sum_k decay^k * CE sum of step k / loss_norm[k] (scalar), and
            stats fp32 [4, ttt_steps]: CE sum, counted positions, correct, loss-masked positions.
        """
        draft = self.draft
        b, t = input_ids.shape
        if t < 2:
            raise ValueError(f"input_ids: TTT needs sequences of at least 2 tokens, found length {t}")
        device_type = input_ids.device.type
        weights = (draft.cast_layer_weights(torch.get_autocast_dtype(device_type))
                   if torch.is_autocast_enabled(device_type) else None)
        hidden = draft.project(aux_hidden_states)  # [B, T, H]
        positions = torch.arange(t, device=input_ids.device)[None].expand(b, t)
        counted_all = loss_mask & in_vocab
        cache, normed_rows, targets, counts, masked = TTTCache(), [], [], [], []
        steps = min(self.ttt_steps, t - 1)  # step k needs a teacher at t + k + 1 <= T - 1
        for k in range(steps):
            s, n = k + 1, t - k - 1
            ids_k = F.pad(input_ids[:, s:], (0, s))  # token t+s at query t
            hidden, normed = draft.ttt_step(ids_k, hidden, positions + k, cache, self.attention,
                                            weights=weights, return_normed=True)
            # one contiguous [n, .] block per sequence: shifted [B, T, Vd] teacher slices are not
            # contiguous across the batch, and reshaping them would copy the teacher every step
            normed_rows += [normed[i, :n] for i in range(b)]
            targets += [(target_p[i, s:], target_ids[i, s:], counted_all[i, s:]) for i in range(b)]
            counts.append(counted_all[:, s:].sum())
            masked.append(loss_mask[:, s:].sum())
        counts_t = torch.stack(counts).float()
        decay = self.step_decay ** torch.arange(steps, device=input_ids.device, dtype=torch.float32)
        divisor = counts_t.clamp(min=1) if loss_norm is None else loss_norm[:steps].to(counts_t)
        scales = (decay / divisor).repeat_interleave(b)  # per (step, sequence) block
        loss, ce, correct = soft_cross_entropy_steps(normed_rows, draft.lm_head.weight, targets, scales,
                                                     self.loss_chunk)
        rows_per_step = [(t - k - 1) * b for k in range(steps)]
        correct_k = torch.stack([c.sum() for c in correct.split(rows_per_step)]).float()
        stats = torch.stack([ce.view(steps, b).sum(1), counts_t, correct_k, torch.stack(masked).float()])
        if stats.shape[1] < self.ttt_steps:  # sequences shorter than the unroll: later steps count nothing
            stats = F.pad(stats, (0, self.ttt_steps - stats.shape[1]))
        return loss, stats


def counted_positions(loss_mask: Tensor, in_vocab: Tensor, ttt_steps: int) -> Tensor:
    """Positions each TTT step counts in the loss, as `Eagle3TTTModule.forward` counts them.

    Step k (s = k + 1) learns the teacher at t + s for query t, so it counts loss_mask & in_vocab
    over positions s..T-1. loss_mask, in_vocab: bool [B, T]. Returns fp32 [ttt_steps].
    """
    counted = loss_mask & in_vocab  # [B, T]
    t = counted.shape[1]
    rows = [counted[:, k + 1 :].sum() if k + 1 < t else counted.new_zeros((), dtype=torch.long)
            for k in range(ttt_steps)]
    return torch.stack(rows).float()


def metrics_from_stats(stats: Tensor, step_decay: float, prefix: str) -> dict[str, float]:
    """stats [4, K] summed over batches -> loss_k, acc_k, weighted loss, simulated accept length.

    acc_k = correct / loss-masked positions (a teacher argmax outside the draft vocab is a
    miss, as at serving time); accept length = 1 + sum_k prod_{j<=k} acc_j (1 = bonus token).
    """
    ce, counted, correct, masked = stats.double().cpu()
    loss_k = (ce / counted.clamp(min=1)).tolist()
    acc_k = (correct / masked.clamp(min=1)).tolist()
    out = {f"{prefix}/loss": sum(step_decay**k * v for k, v in enumerate(loss_k))}
    out.update({f"{prefix}/loss_{k}": v for k, v in enumerate(loss_k)})
    out.update({f"{prefix}/acc_{k}": v for k, v in enumerate(acc_k)})
    out[f"{prefix}/simulated_accept_length"] = simulated_accept_length(acc_k)
    return out


def clip_and_step(optimizer: torch.optim.Optimizer, params: list[Tensor], max_norm: float) -> Tensor:
    """Global-norm gradient clipping + optimizer step; returns the pre-clip norm.

    A fused (Adam/AdamW) optimizer divides the gradients by its `grad_scale` inside its own
    kernel (the GradScaler protocol), so the clip factor is handed to it there instead of
    rescaling every gradient in a separate pass; other optimizers (and DTensor gradients
    under FSDP) use clip_grad_norm_.
    """
    fused = all(group.get("fused") for group in optimizer.param_groups)
    grads = [p.grad for p in params if p.grad is not None]
    if not fused or any(hasattr(g, "full_tensor") for g in grads):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        return norm
    norm = torch.nn.utils.get_total_norm(grads)
    optimizer.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0)  # as clip_grad_norm_'s coefficient
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale
    return norm


def simulated_accept_length(acc_k: Sequence[float]) -> float:
    """1 + sum_k prod_{j<=k} acc_j: expected tokens per verify of a chain draft, bonus included."""
    total, running = 1.0, 1.0
    for acc in acc_k:
        running *= acc
        total += running
    return total


# ============================================================================ schedule / data


def build_lr_lambda(total_steps: int, warmup_ratio: float, min_lr_ratio: float) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine down to min_lr_ratio at total_steps."""
    warmup = int(math.ceil(total_steps * warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


@dataclass(frozen=True)
class DataPlan:
    """Deterministic order: epoch e is randperm(seed + e); global batch g holds B*W indices,
    rank r takes the r-th block of B. The data position in a checkpoint is (step)."""

    num_samples: int
    batch_size: int
    world_size: int
    grad_accum: int
    seed: int

    @property
    def global_batches_per_epoch(self) -> int:
        return math.ceil(self.num_samples / (self.batch_size * self.world_size))

    @property
    def steps_per_epoch(self) -> int:
        return self.global_batches_per_epoch // self.grad_accum

    def rank_batches(self, epoch: int, rank: int, start: int) -> Iterator[list[int]]:
        """Index lists of this rank's micro-batches of `epoch`, from global batch `start`."""
        g = torch.Generator().manual_seed(self.seed + epoch)
        perm = torch.randperm(self.num_samples, generator=g).tolist()
        per_global = self.batch_size * self.world_size
        needed = self.global_batches_per_epoch * per_global
        perm = (perm * math.ceil(needed / len(perm)))[:needed]  # wrap around to fill the last batch
        for gb in range(start, self.steps_per_epoch * self.grad_accum):
            base = gb * per_global + rank * self.batch_size
            yield perm[base : base + self.batch_size]

    def rank_steps(self, rank: int, step: int, total_steps: int) -> Iterator[list[int]]:
        """This rank's micro-batches of optimizer steps step..total_steps-1, across epoch boundaries
        (grad_accum index lists per step; epoch e = step // steps_per_epoch)."""
        while step < total_steps:
            epoch, offset = divmod(step, self.steps_per_epoch)
            in_epoch = min(self.steps_per_epoch - offset, total_steps - step)
            yield from itertools.islice(self.rank_batches(epoch, rank, offset * self.grad_accum),
                                        in_epoch * self.grad_accum)
            step += in_epoch


def default_collate_fn(items: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Right-pad dataset items (the contract of eagle3/data.py) and add attention_mask [B, T]."""
    t = max(item["input_ids"].shape[0] for item in items)
    out: dict[str, Tensor] = {}
    for key in items[0]:
        rows = [F.pad(it[key], (0, 0) * (it[key].dim() - 1) + (0, t - it[key].shape[0])) for it in items]
        out[key] = torch.stack(rows)
    out["attention_mask"] = torch.stack(
        [F.pad(torch.ones(it["input_ids"].shape[0], dtype=torch.long), (0, t - it["input_ids"].shape[0])) for it in items]
    )
    return out


# ============================================================================ distributed


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> DistInfo:
    """Join the torchrun process group (nccl on GPUs, gloo on CPU); single process otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank)


def _all_reduce_sum(x: Tensor, info: DistInfo) -> Tensor:
    if info.world_size > 1:
        dist.all_reduce(x)
    return x


# ============================================================================ checkpoints


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def write_checkpoint(ckpt_root: Path, step: int, files: dict[str, Callable[[Path], None]], keep: int) -> Path:
    """Write a checkpoint atomically: each writer fills a temp dir, which is renamed to
    `step_<8-digit step>`, then `latest` is replaced; a kill at any point leaves the previous one."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:08d}"
    tmp = ckpt_root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, writer in files.items():
        writer(tmp / name)
    _fsync_dir(tmp)
    if final.exists():  # re-saving the same step after a resume
        trash = ckpt_root / f".old-{final.name}-{os.getpid()}"
        final.rename(trash)
        shutil.rmtree(trash)
    tmp.rename(final)
    latest_tmp = ckpt_root / f".latest-{os.getpid()}"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, ckpt_root / "latest")
    for old in sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())[:-keep]:
        shutil.rmtree(old)
    return final


def find_latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The checkpoint named by `latest`, else the highest complete `step_*` directory."""
    pointer = ckpt_root / "latest"
    if pointer.exists() and (ckpt_root / pointer.read_text().strip()).is_dir():
        return ckpt_root / pointer.read_text().strip()
    steps = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
    return steps[-1] if steps else None


def draft_state_dict(draft: Eagle3DraftModel) -> dict[str, Tensor]:
    """Weights a checkpoint needs: everything but a frozen (target-copied) embedding."""
    skip = {"embed_tokens.weight"} if not draft.embed_tokens.weight.requires_grad else set()
    return {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items() if k not in skip}


def load_draft_checkpoint(checkpoint_dir: Path, target_embedding: Tensor | None = None) -> Eagle3DraftModel:
    """Rebuild the draft of a training checkpoint (embedding from the target when shared)."""
    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / "model.safetensors").exists():
        raise FileNotFoundError(f"{checkpoint_dir}: expected model.safetensors of a training checkpoint")
    config = DraftModelConfig.from_dict(json.loads((checkpoint_dir / "draft_config.json").read_text()))
    draft = Eagle3DraftModel(config)
    state = load_file(str(checkpoint_dir / "model.safetensors"))
    missing, unexpected = draft.load_state_dict(state, strict=False)
    allowed_missing = {"embed_tokens.weight"} if config.shares_target_embedding else set()
    if set(missing) - allowed_missing or unexpected:
        raise ValueError(f"{checkpoint_dir}: missing {sorted(set(missing) - allowed_missing)}, unexpected {unexpected}")
    if target_embedding is not None:
        draft.load_target_embedding(target_embedding)
    return draft


def load_initial_weights(draft: Eagle3DraftModel, source: Path) -> None:
    """Start `draft` from another draft's weights (a training checkpoint or an SGLang export).

    The vocab mapping must be the same: lm_head row i means draft token d2t-mapped i, so rows
    trained under another mapping would predict other tokens.
    """
    weights = Path(source) / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"train.init_checkpoint: {weights} not found (expected a checkpoint or sglang export folder)")
    state = load_file(str(weights))
    own = draft.state_dict()
    unexpected = sorted(set(state) - set(own))
    wrong_shape = sorted(k for k in set(state) & set(own) if state[k].shape != own[k].shape)
    if unexpected or wrong_shape:
        raise ValueError(f"train.init_checkpoint: {weights} does not fit this draft: unexpected {unexpected}, "
                         f"shape differs for {wrong_shape}")
    if "d2t" in state and not torch.equal(state["d2t"].to(own["d2t"].dtype), own["d2t"]):
        raise ValueError(f"train.init_checkpoint: {weights} was trained with another draft vocabulary (d2t differs); "
                         "start from scratch or regenerate the data with its vocab")
    draft.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()}, strict=False)


# ============================================================================ trainer


class Trainer:
    """Train loop: micro-batches -> TTT loss -> AdamW step; metrics, validation, checkpoints.

    Args:
        draft: the draft (embedding and vocab mapping already loaded), on CPU or its device.
        target_lm_head: [V, H_t] target output embedding, for the teacher.
        train_data / val_data: map-style datasets of the eagle3/data.py item contract.
        online_features: callable (input_ids, attention_mask) -> (aux, last) for batches
            without stored hidden states (online mode).
        logit_softcap: the target's `final_logit_softcapping`, applied to the teacher logits.
    """

    def __init__(
        self,
        draft: Eagle3DraftModel,
        target_lm_head: Tensor,
        cfg: TrainConfig,
        train_data,
        val_data,
        out_dir: Path,
        *,
        collate_fn: Callable = default_collate_fn,
        online_features: Callable | None = None,
        on_metrics: MetricsFn | None = None,
        on_progress: ProgressFn | None = None,
        log: Callable[[str], None] = print,
        logit_softcap: float | None = None,
    ) -> None:
        self.cfg, self.out_dir, self.log, self.logit_softcap = cfg, Path(out_dir), log, logit_softcap
        self.info = init_distributed() if int(os.environ.get("WORLD_SIZE", "1")) > 1 else DistInfo()
        self.device = torch.device(f"cuda:{self.info.local_rank}") if torch.cuda.is_available() else torch.device("cpu")
        use_bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and self.device.type == "cuda")
        self.autocast_dtype = torch.bfloat16 if use_bf16 else None
        self.train_data, self.val_data, self.collate_fn = train_data, val_data, collate_fn
        self.online_features, self.on_metrics, self.on_progress = online_features, on_metrics, on_progress
        self.draft = draft.to(self.device)
        if use_bf16 and not self.draft.embed_tokens.weight.requires_grad:
            self.draft.embed_tokens.to(torch.bfloat16)  # frozen lookup table: half the memory, same values served
        self.lm_head = target_lm_head.to(self.device, torch.bfloat16 if use_bf16 else torch.float32)
        if cfg.compile and self.device.type == "cuda":
            self.draft.compile_layer()
            compile_loss_chunk()
        self.module = Eagle3TTTModule(self.draft, cfg)
        self.model = self._wrap(self.module)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.plan = DataPlan(len(train_data), cfg.batch_size, self.info.world_size, cfg.grad_accum, cfg.seed)
        if self.plan.steps_per_epoch < 1:
            raise ValueError(
                f"train split has {len(train_data)} samples; one optimizer step needs batch_size*devices*grad_accum "
                f"= {cfg.batch_size * self.info.world_size * cfg.grad_accum}"
            )
        self.total_steps = min(cfg.max_steps or 1 << 62, self.plan.steps_per_epoch * cfg.epochs)
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
            fused=self.device.type == "cuda",
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, build_lr_lambda(self.total_steps, cfg.warmup_ratio, cfg.min_lr_ratio)
        )
        self.step, self.tokens_seen, self.history = 0, 0, []
        self.ckpt_root = self.out_dir / "checkpoints"
        self.last_checkpoint: Path | None = None
        self._resume()

    # ------------------------------------------------------------------ setup

    def _wrap(self, module: nn.Module) -> nn.Module:
        if self.info.world_size == 1:
            return module
        if self.cfg.strategy == "fsdp":
            from torch.distributed.fsdp import fully_shard

            # One unit: the layer is driven through qkv()/finish(), not forward(), so a
            # separate midlayer unit would never be unsharded. Master weights, gradients and
            # optimizer state are sharded; the full weights exist only from forward to backward.
            # Frozen weights (the target's embedding: 1 GiB bf16 for Llama-3.1-8B) stay whole on
            # every rank: sharded they would be gathered in full for every micro-batch anyway,
            # one more all-gather that a single unit cannot overlap with compute.
            frozen = {p for p in module.parameters() if not p.requires_grad}
            fully_shard(module, mp_policy=self._fsdp_precision(), ignored_params=frozen or None)
            return module
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        # buffers (vocab maps, RoPE frequencies) are equal on every rank and never change, so no
        # broadcast before each forward; gradients live in DDP's buckets (no second fp32 copy)
        return DistributedDataParallel(module, device_ids=ids, broadcast_buffers=False, gradient_as_bucket_view=True)

    def _fsdp_precision(self):
        """bf16 training: FSDP gathers the weights in bf16.

        The full (unsharded) weights and their gradients are the memory FSDP cannot shard: they
        live from forward to backward. The layer computes in bf16 anyway (autocast,
        `cast_layer_weights`), so gathering bf16 halves them; master weights, gradient reduction
        and optimizer state stay fp32. fp32 training keeps FSDP's defaults (exactly DDP's math).
        """
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.autocast_dtype is None:
            return MixedPrecisionPolicy()
        # inputs keep their dtypes: the teacher distribution and the loss divisor are fp32 on purpose
        return MixedPrecisionPolicy(param_dtype=self.autocast_dtype, reduce_dtype=torch.float32,
                                    cast_forward_inputs=False)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _prepare(self, batch: dict[str, Tensor]) -> tuple[dict[str, Tensor], int]:
        """Move a collated batch to the device and add the teacher; returns (inputs, real tokens).

        The padding check and the token count read the batch while it is still on the host: the
        same checks on the device would wait for the GPU to drain (a sync per micro-batch). Copies
        are non_blocking: from the loader's pinned buffers they overlap with queued compute.
        """
        host_mask = batch["attention_mask"].bool()
        if (host_mask[:, 1:] & ~host_mask[:, :-1]).any():
            raise ValueError("attention_mask: expected right padding (ones then zeros per row)")
        real_tokens = int(host_mask.sum())
        batch = {key: value.to(self.device, non_blocking=True) for key, value in batch.items()}
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"].bool()
        if "aux_hidden_states" in batch:
            aux, last = batch["aux_hidden_states"], batch["last_hidden_states"]
        elif self.online_features is not None:
            with torch.no_grad():
                aux, last = self.online_features(input_ids, attention_mask.long())
        else:
            raise ValueError("batch has no aux_hidden_states and no online_features extractor was given")
        aux = aux.to(self.device, self.autocast_dtype or torch.float32)
        target_p, target_ids, in_vocab = compute_teacher(last.to(self.device), self.lm_head, self.draft.t2d,
                                                         self.cfg.loss_chunk_tokens, self.logit_softcap)
        loss_mask = batch["loss_mask"].to(self.device).bool() & attention_mask
        inputs = dict(input_ids=input_ids, aux_hidden_states=aux, loss_mask=loss_mask,
                      target_p=target_p, target_ids=target_ids, in_vocab=in_vocab)
        return inputs, real_tokens

    def _loader(self, index_lists: Iterator[list[int]] | list[list[int]], dataset) -> Iterator[dict[str, Tensor]]:
        """Collated micro-batches of `index_lists`, read ahead by cfg.num_workers processes.

        Workers read and collate (a 64 MiB micro-batch of an 8B target at T=2048: ~40 ms on one
        thread) while the GPU trains on the current one; each keeps cfg.prefetch_factor batches
        ready. On CUDA a pin-memory thread copies them into page-locked buffers so `_prepare`'s
        non_blocking copies are real async DMA. One loader serves a whole `train()` call (all
        epochs, see DataPlan.rank_steps), so workers start once, not per epoch.
        """
        index_lists = list(index_lists)
        workers = min(self.cfg.num_workers, len(index_lists))
        loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=index_lists, collate_fn=self.collate_fn, num_workers=workers,
            prefetch_factor=self.cfg.prefetch_factor if workers else None,
            pin_memory=self.device.type == "cuda",
        )
        return iter(loader)

    # ------------------------------------------------------------------ steps

    def _step_loss_norm(self, micro_batches: list[dict[str, Tensor]]) -> Tensor:
        """Per-TTT-step divisor [K] that makes the step's gradient the mean over ALL its counted
        positions: every micro-batch on every rank, whatever each one's own count.

        DDP and FSDP average gradients over ranks (a 1/W factor), so each rank divides its CE
        sums by (global count / W); summed over micro-batches and averaged over ranks this gives
        sum_k decay^k * (all CE of step k) / (all counted positions of step k), the loss of one
        process running the whole global batch. Per-rank means would instead weight a rank's
        tokens by 1/its own count: 2 ranks != 1 process when the counts differ.
        """
        counts = sum(counted_positions(m["loss_mask"], m["in_vocab"], self.cfg.ttt_steps) for m in micro_batches)
        # a step that counts nothing anywhere has CE sums of 0: any divisor > 0 keeps it at 0
        return _all_reduce_sum(counts, self.info).clamp(min=1) / self.info.world_size

    def _optimizer_step(self, batches: Iterator[dict[str, Tensor]]) -> tuple[Tensor, Tensor, int]:
        """grad_accum micro-batches, clip, AdamW, scheduler; returns (stats [4,K], grad norm, tokens).

        Nothing here waits for the device: stats and the grad norm stay device tensors until a
        log step reads them, so the host queues the next step while this one runs.

        All micro-batches of the step are prepared (teacher included) before the first
        backward: the loss divisor needs their counted positions. Memory: grad_accum teachers
        ([B, T, Vd] fp32 each) are held at once instead of one.
        """
        self.model.train()
        stats, tokens = torch.zeros(_STAT_ROWS, self.cfg.ttt_steps, device=self.device), 0
        prepared = [self._prepare(next(batches)) for _ in range(self.cfg.grad_accum)]
        loss_norm = self._step_loss_norm([inputs for inputs, _ in prepared])
        for i, (inputs, n_tok) in enumerate(prepared):
            last = i == self.cfg.grad_accum - 1
            sync = contextlib.nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync()
            with sync:
                with self._autocast():
                    loss, batch_stats = self.model(**inputs, loss_norm=loss_norm)
                loss.backward()
            prepared[i] = None  # free this micro-batch's teacher before the next forward
            stats += batch_stats
            tokens += n_tok
        grad_norm = clip_and_step(self.optimizer, self.params, self.cfg.grad_clip)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return stats, grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm, tokens

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation metrics over the whole val split (or eval_max_batches), all ranks summed."""
        self.model.eval()
        n, w, b = len(self.val_data), self.info.world_size, self.cfg.batch_size
        if n == 0:
            return {}
        per_rank = math.ceil(n / w)
        mine = list(range(self.info.rank, n, w))
        padded = mine + [mine[0] if mine else 0] * (per_rank - len(mine))  # equal batch counts for FSDP
        batches = [padded[i : i + b] for i in range(0, per_rank, b)][: self.cfg.eval_max_batches]
        stats = torch.zeros(_STAT_ROWS, self.cfg.ttt_steps, device=self.device)
        seen = 0
        for batch in self._loader(batches, self.val_data):
            inputs, _ = self._prepare(batch)
            real = torch.tensor([seen + j < len(mine) for j in range(inputs["input_ids"].shape[0])], device=self.device)
            inputs["loss_mask"] &= real[:, None]  # padding samples count for nothing
            seen += inputs["input_ids"].shape[0]
            with self._autocast():
                _, batch_stats = self.model(**inputs)
            stats += batch_stats
        return metrics_from_stats(_all_reduce_sum(stats, self.info), self.cfg.step_decay, "val")

    def train(self, stop_at_step: int | None = None) -> dict[str, Any]:
        """Run to total_steps (or stop_at_step, as a preemption would); returns the summary."""
        start_wall, start_tokens = time.perf_counter(), self.tokens_seen
        window = torch.zeros(_STAT_ROWS, self.cfg.ttt_steps, device=self.device)
        window_tokens, val_metrics = 0, {}
        last_step = min(self.total_steps, stop_at_step or self.total_steps)
        # the window's training time: wall time since window_start, minus evaluation and checkpoints
        window_start = time.perf_counter()
        batches = self._loader(self.plan.rank_steps(self.info.rank, self.step, last_step), self.train_data)
        while self.step < last_step:
            stats, grad_norm, tokens = self._optimizer_step(batches)
            self.step += 1
            window += stats
            window_tokens += tokens
            self.tokens_seen += tokens
            if self.step % self.cfg.log_every == 0 or self.step == self.total_steps:
                self._log_train(window, window_tokens, window_start, grad_norm)  # waits for the device
                window.zero_()
                window_tokens, window_start = 0, time.perf_counter()
            evaluate = self.step % self.cfg.eval_every == 0 or self.step == self.total_steps
            checkpoint = self.step % self.cfg.checkpoint_every == 0 or self.step == self.total_steps
            if evaluate or checkpoint:
                paused = self._synchronize()
                if evaluate:
                    val_metrics = self.evaluate()
                    self._emit(val_metrics)
                if checkpoint:
                    self.save_checkpoint()
                window_start += time.perf_counter() - paused
            if self.on_progress is not None and self.info.is_main:
                self.on_progress(self.step, self.total_steps)
        del batches  # stops the loader's workers
        wall = time.perf_counter() - start_wall
        return self._summary(val_metrics, wall, self.tokens_seen - start_tokens)

    def _synchronize(self) -> float:
        """Wait for the queued device work; returns the time after it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # ------------------------------------------------------------------ reporting

    def _log_train(self, window: Tensor, tokens: int, window_start: float, grad_norm: Tensor) -> None:
        """Report the window's metrics (all ranks summed); the .item() here is the loop's only
        regular wait for the device, so the time read after it covers the window's compute."""
        window = _all_reduce_sum(window.clone(), self.info)
        tok = _all_reduce_sum(torch.tensor(float(tokens), device=self.device), self.info).item()
        seconds = time.perf_counter() - window_start
        metrics = metrics_from_stats(window, self.cfg.step_decay, "train")
        metrics.pop("train/simulated_accept_length")
        metrics.update({
            "train/lr": self.scheduler.get_last_lr()[0],
            "train/grad_norm": float(grad_norm),
            "train/tokens_per_s": tok / max(seconds, 1e-9),
            "train/epoch": self.step / self.plan.steps_per_epoch,
        })
        if self.device.type == "cuda":  # the highest rank's peak, so FSDP's saving shows in the curves
            peak = torch.tensor(float(torch.cuda.max_memory_allocated(self.device)), device=self.device)
            if self.info.world_size > 1:
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            metrics["train/peak_memory_gib"] = peak.item() / 2**30
        self._emit(metrics)
        if self.info.is_main:
            self.log(f"step {self.step}/{self.total_steps} loss {metrics['train/loss']:.4f} "
                     f"acc_0 {metrics['train/acc_0']:.3f} lr {metrics['train/lr']:.2e} tok/s {metrics['train/tokens_per_s']:.0f}")

    def _emit(self, metrics: dict[str, float]) -> None:
        if not metrics or not self.info.is_main:
            return
        self.history.append({"step": self.step, **metrics})
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.out_dir / "history.jsonl", "a") as f:
            f.write(json.dumps({"step": self.step, **metrics}) + "\n")
        if self.on_metrics is not None:
            self.on_metrics(self.step, dict(metrics))

    def _summary(self, val_metrics: dict[str, float], wall: float, tokens: int) -> dict[str, Any]:
        k = range(self.cfg.ttt_steps)
        # a run resumed at its last step trains nothing: its metrics are the checkpoint's history
        final = (val_metrics or next((h for h in reversed(self.history) if "val/loss" in h), None)
                 or next((h for h in reversed(self.history) if "train/loss" in h), {}))
        prefix = "val" if "val/loss" in final else "train"
        acc = [final.get(f"{prefix}/acc_{i}") for i in k]
        return {
            "steps": self.step,
            "total_steps": self.total_steps,
            "finished": self.step >= self.total_steps,
            "metrics_split": prefix,
            "final_metrics": {key: v for key, v in final.items() if key != "step"},
            "acc": acc,
            "loss": [final.get(f"{prefix}/loss_{i}") for i in k],
            "simulated_accept_length": simulated_accept_length(acc) if None not in acc else None,
            "tokens": tokens,
            "tokens_per_s": tokens / max(wall, 1e-9),
            "wall_time_s": wall,
            "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
            "history_path": str(self.out_dir / "history.jsonl"),
        }

    # ------------------------------------------------------------------ checkpoints

    def _full_state(self) -> tuple[dict[str, Tensor], dict]:
        if self.cfg.strategy == "fsdp" and self.info.world_size > 1:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model_sd = get_model_state_dict(self.module, options=opts)
            optim_sd = get_optimizer_state_dict(self.module, self.optimizer, options=opts)
            model_sd = {k.removeprefix("draft."): v for k, v in model_sd.items()}
            frozen = not self.draft.embed_tokens.weight.requires_grad
            return {k: v for k, v in model_sd.items() if not (frozen and k == "embed_tokens.weight")}, optim_sd
        return draft_state_dict(self.draft), self.optimizer.state_dict()

    def save_checkpoint(self) -> Path:
        model_sd, optim_sd = self._full_state()
        if self.info.is_main:
            state = {"step": self.step, "tokens_seen": self.tokens_seen, "world_size": self.info.world_size,
                     "train_config": self.cfg.model_dump(mode="json"), "history": self.history}
            files = {
                "model.safetensors": lambda p: save_file(model_sd, str(p)),
                "draft_config.json": lambda p: p.write_text(json.dumps(self.draft.config.to_dict(), indent=2)),
                "train_state.pt": lambda p: torch.save(
                    {"optimizer": optim_sd, "scheduler": self.scheduler.state_dict(), "rng": _rng_state()}, p),
                "trainer_state.json": lambda p: p.write_text(json.dumps(state)),
            }
            self.last_checkpoint = write_checkpoint(self.ckpt_root, self.step, files, self.cfg.keep_checkpoints)
        if self.info.world_size > 1:
            dist.barrier()
        self.last_checkpoint = find_latest_checkpoint(self.ckpt_root)
        return self.last_checkpoint

    def _resume(self) -> None:
        ckpt = find_latest_checkpoint(self.ckpt_root) if self.ckpt_root.exists() else None
        self._check_same_checkpoint_everywhere(ckpt)
        if ckpt is None:
            return
        state = json.loads((ckpt / "trainer_state.json").read_text())
        self._check_resumable(ckpt, state)
        train_state = torch.load(ckpt / "train_state.pt", map_location="cpu", weights_only=False)
        model_sd = load_file(str(ckpt / "model.safetensors"))
        if self.cfg.strategy == "fsdp" and self.info.world_size > 1:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions, set_model_state_dict, set_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, strict=False)
            set_model_state_dict(self.module, {f"draft.{k}": v for k, v in model_sd.items()}, options=opts)
            set_optimizer_state_dict(self.module, self.optimizer, train_state["optimizer"], options=opts)
        else:
            self.draft.load_state_dict(model_sd, strict=False)
            self.optimizer.load_state_dict(train_state["optimizer"])
        self.scheduler.load_state_dict(train_state["scheduler"])
        _set_rng_state(train_state["rng"])
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.history = [h for h in state["history"] if h["step"] <= self.step]
        self.last_checkpoint = ckpt
        if self.info.is_main:  # drop metrics a killed run logged after this checkpoint
            with open(self.out_dir / "history.jsonl", "w") as f:
                f.writelines(json.dumps(h) + "\n" for h in self.history)
            self.log(f"resumed from {ckpt} at step {self.step}")

    def _check_same_checkpoint_everywhere(self, ckpt: Path | None) -> None:
        """Every rank resumes from the same step, before any collective load could hang on a rank
        that found none (nodes without a shared disk each read their own copy of node 0's)."""
        if self.info.world_size == 1:
            return
        step = json.loads((ckpt / "trainer_state.json").read_text())["step"] if ckpt else 0
        extremes = torch.tensor([step, -step], dtype=torch.int64, device=self.device)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        highest, lowest = int(extremes[0]), -int(extremes[1])
        if highest != lowest:
            raise ValueError(f"ranks found different checkpoints under {self.ckpt_root} (this rank: step {step}; "
                             f"all: steps {lowest}..{highest}); every node needs node 0's latest checkpoint to resume")

    def _check_resumable(self, ckpt: Path, state: dict) -> None:
        saved, current = state["train_config"], self.cfg.model_dump(mode="json")
        diff = sorted(k for k in set(saved) | set(current) if k not in RESUMABLE_FIELDS and saved.get(k) != current.get(k))
        if diff:
            raise ValueError(f"{ckpt}: train config differs from the checkpoint's in {diff}; "
                             "use a new out_dir or the original config")
        saved_draft = json.loads((ckpt / "draft_config.json").read_text())
        if saved_draft != self.draft.config.to_dict():
            raise ValueError(f"{ckpt}: draft config differs from the checkpoint's")
        if state["world_size"] != self.info.world_size:
            raise ValueError(f"{ckpt}: saved with world size {state['world_size']}, resuming with "
                             f"{self.info.world_size}; the data order depends on it")


# ============================================================================ stage entry


def plot_training_curves(history: list[dict[str, float]], out_png: Path) -> Path:
    """Loss (train/val) and acc_k per TTT position (train solid, val dashed) vs step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(12, 4.5))
    for split, style in (("train", "-"), ("val", "--")):
        rows = [h for h in history if f"{split}/loss" in h]
        if rows:
            ax_loss.plot([h["step"] for h in rows], [h[f"{split}/loss"] for h in rows], style, label=f"{split} loss")
        k = 0
        while rows and f"{split}/acc_{k}" in rows[0]:
            ax_acc.plot([h["step"] for h in rows], [h[f"{split}/acc_{k}"] for h in rows], style,
                        color=f"C{k % 10}", label=f"{split} acc_{k}")
            k += 1
    ax_loss.set(xlabel="optimizer step", ylabel="weighted TTT loss", title="loss")
    ax_acc.set(xlabel="optimizer step", ylabel="accuracy", title="acc_k per TTT position", ylim=(0, 1))
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def _load_vocab_mapping(data_dir: Path, out_dir: Path, vocab_size: int, draft_vocab_size: int, log) -> tuple[Tensor, Tensor]:
    """The dataset stage's map (`data_dir/vocab/vocab_map.safetensors`) when it has the requested
    size, else one counted here from the training split's assistant tokens (saved to out_dir/vocab)."""
    from eagle3.data import TokenizedDataset
    from eagle3.vocab import VOCAB_FILE, build_draft_vocab, count_masked_tokens, load_draft_vocab, save_draft_vocab

    if (data_dir / "vocab" / VOCAB_FILE).exists():
        vocab = load_draft_vocab(data_dir / "vocab")
        if vocab.d2t.numel() == draft_vocab_size and vocab.t2d.numel() == vocab_size:
            return vocab.d2t.long(), vocab.t2d.bool()
        log(f"{data_dir / 'vocab'} maps {vocab.d2t.numel()} of {vocab.t2d.numel()} ids, need {draft_vocab_size} of "
            f"{vocab_size}: recounting")
    train = TokenizedDataset(data_dir, "train")
    items = [train[i] for i in range(len(train))]
    counts = count_masked_tokens([it["input_ids"] for it in items], [it["loss_mask"] for it in items], vocab_size)
    vocab = build_draft_vocab(counts, draft_vocab_size)
    save_draft_vocab(vocab, out_dir / "vocab")
    return vocab.d2t.long(), vocab.t2d.bool()


def _check_dataset_layers(manifest: dict, aux_layer_ids: list[int]) -> None:
    """The features on disk must come from the layers the draft will be served with."""
    stored = manifest.get("aux_layer_ids")
    if stored is not None and list(stored) != list(aux_layer_ids):
        raise ValueError(f"hidden states were captured at aux layers {stored}, training was asked for "
                         f"{list(aux_layer_ids)}; regenerate the dataset or pass the stored ids")


def train_draft(
    data_dir: Path,
    target_dir: Path,
    cfg: TrainConfig,
    out_dir: Path,
    *,
    aux_layer_ids: list[int],
    draft_vocab_size: int,
    online_features: Callable | None = None,
    on_metrics: MetricsFn | None = None,
    on_progress: ProgressFn | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train an EAGLE-3 draft on the offline hidden states in `data_dir` (or online features).

    With cfg.devices > 1 outside torchrun, relaunches itself under torchrun and relays the
    metrics rank 0 writes to out_dir/history.jsonl. Returns a JSON-able summary (final
    metrics incl. acc_k, loss_k and simulated_accept_length on validation, steps, tokens/s,
    wall time, checkpoint path, curves PNG).
    """
    out_dir = Path(out_dir)
    if cfg.devices > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        if online_features is not None:
            raise ValueError("online_features with devices > 1: start train_draft under torchrun in each rank")
        return _launch_torchrun(data_dir, target_dir, cfg, out_dir, aux_layer_ids, draft_vocab_size, on_metrics, log)
    from eagle3.data import HiddenStateDataset, TokenizedDataset, collate_hidden_states, load_target_head

    data_dir = Path(data_dir)
    head = load_target_head(Path(target_dir))
    if online_features is None:
        train_data, val_data = HiddenStateDataset(data_dir, "train"), HiddenStateDataset(data_dir, "validation")
        _check_dataset_layers(train_data.manifest, aux_layer_ids)
    else:
        train_data, val_data = TokenizedDataset(data_dir, "train"), TokenizedDataset(data_dir, "validation")
        _check_dataset_layers({"aux_layer_ids": getattr(online_features, "aux_layer_ids", None)}, aux_layer_ids)
    config = DraftModelConfig.from_target_config(head["config"], draft_vocab_size, aux_layer_ids,
                                                 **cfg.draft.model_dump())
    torch.manual_seed(cfg.seed)
    draft = Eagle3DraftModel(config)
    if config.shares_target_embedding:
        draft.load_target_embedding(head["embed_tokens"])
    draft.set_vocab_mapping(*_load_vocab_mapping(data_dir, out_dir, config.vocab_size, draft_vocab_size, log))
    if cfg.init_checkpoint:
        load_initial_weights(draft, Path(cfg.init_checkpoint))
        log(f"starting from the weights of {cfg.init_checkpoint}")
    trainer = Trainer(draft, head["lm_head"], cfg, train_data, val_data, out_dir, collate_fn=collate_hidden_states,
                      online_features=online_features, on_metrics=on_metrics, on_progress=on_progress, log=log,
                      logit_softcap=head["config"].get("final_logit_softcapping"))
    summary = trainer.train()
    if trainer.info.is_main:
        summary["curves_png"] = str(plot_training_curves(trainer.history, out_dir / "training_curves.png"))
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _launch_torchrun(data_dir, target_dir, cfg, out_dir, aux_layer_ids, draft_vocab_size, on_metrics, log):
    """Run `python -m eagle3.train` under torchrun, relay its output and metrics; raise naming the
    failed rank and its log tail. Every rank's stdout/stderr is also kept in out_dir/torchrun_logs."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "train_config.json").write_text(cfg.model_dump_json())
    (out_dir / "summary.json").unlink(missing_ok=True)
    log_dir = out_dir / "torchrun_logs"
    shutil.rmtree(log_dir, ignore_errors=True)  # so a failure report never reads an earlier launch's files
    cmd = torchrun_command(data_dir, target_dir, out_dir / "train_config.json", out_dir, cfg.devices, aux_layer_ids,
                           draft_vocab_size)
    env = torchrun_env(cfg.devices, cfg.num_workers)
    log(f"launching (OMP_NUM_THREADS={env['OMP_NUM_THREADS']} per rank): " + " ".join(cmd))
    history = out_dir / "history.jsonl"
    seen = _relay_metrics(history, set(), None)  # rows of an earlier (resumed) launch were relayed then
    # own session: torchrun, its ranks and their loader workers form one process group, killed as one
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    recent: collections.deque[str] = collections.deque(maxlen=TORCHRUN_TAIL_LINES)
    try:
        for line in proc.stdout:
            log(line.rstrip())
            recent.append(line.rstrip())
            seen = _relay_metrics(history, seen, on_metrics)
        proc.wait()
    finally:
        _kill_process_group(proc)
    _relay_metrics(history, seen, on_metrics)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun training exited with {proc.returncode}: "
                           f"{describe_rank_failures(log_dir, recent)}")
    return json.loads((out_dir / "summary.json").read_text())


def _kill_process_group(proc: subprocess.Popen) -> None:
    """Stop torchrun (if still running: the caller was interrupted) and anything left in its group."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # torchrun forwards it to the ranks
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):  # no member left: the usual case
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def _relay_metrics(history: Path, seen: set, on_metrics: MetricsFn | None) -> set:
    """Pass rank 0's new history rows to on_metrics (see relay_history_rows)."""
    return relay_history_rows(history.read_text(), seen, on_metrics) if history.exists() else seen


def relay_history_rows(text: str, seen: set, on_metrics: MetricsFn | None) -> set:
    """Pass the rows of history.jsonl `text` not in `seen` to on_metrics; a row is keyed by
    (step, metric names), so rows a resume rewrites are not sent twice."""
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line being written right now; read again next time
            continue
        key = (row["step"], tuple(sorted(row)))
        if key not in seen:
            seen.add(key)
            if on_metrics is not None:
                on_metrics(int(row.pop("step")), row)
    return seen


def main(argv: list[str] | None = None) -> None:
    """torchrun entry: `python -m eagle3.train --data-dir D --target-dir T --out-dir O --config C.json ...`."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    for flag in ("--data-dir", "--target-dir", "--out-dir", "--config", "--aux-layer-ids", "--draft-vocab-size"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args(argv)
    _rank_main(args, [int(i) for i in args.aux_layer_ids.split(",")])


@record  # a raising rank writes its traceback to the error file torchrun names (see describe_rank_failures)
def _rank_main(args, aux_layer_ids: list[int]) -> None:
    cfg = TrainConfig.model_validate_json(Path(args.config).read_text())
    print(f"rank {os.environ.get('RANK', '0')}/{os.environ.get('WORLD_SIZE', '1')}: {torch.get_num_threads()} torch "
          f"threads, {cfg.num_workers} loader workers", flush=True)
    train_draft(Path(args.data_dir), Path(args.target_dir), cfg, Path(args.out_dir),
                aux_layer_ids=aux_layer_ids, draft_vocab_size=int(args.draft_vocab_size))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
