"""The train loop: micro-batches -> TTT loss -> AdamW step; metrics, validation, checkpoints,
resume (load -> step -> checkpoint -> validate, as torchtitan's `Trainer.train`), under DDP or
FSDP when torchrun starts several ranks.

Risk: a resume with a different training config is refused (only `RESUMABLE_FIELDS` may
change). Multi-GPU scaling depends on the input pipeline never stalling the GPU (loader
workers, pinned non_blocking copies, no host sync per step).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from eagle3.config import TrainConfig
from eagle3.data.state_codec import decode_aux
from eagle3.draft.held_grads import GradientHold, hold_gradients, total_norm
from eagle3.draft.losses import compile_loss_chunk, compute_teacher
from eagle3.draft.model import Eagle3DraftModel
from eagle3.training import adamw
from eagle3.training.checkpoints import (
    draft_state_dict,
    find_latest_checkpoint,
    rng_state,
    set_rng_state,
    write_checkpoint,
)
from eagle3.training.distributed import DistInfo, all_reduce_sum, init_distributed
from eagle3.training.loader import MicroBatches, micro_batches
from eagle3.training.schedule import DataPlan, build_lr_lambda, default_collate_fn, planned_steps
from eagle3.training.step_graphs import StepGraphs, bucket_length, pad_time
from eagle3.training.streaming.dataset import StreamedDataset
from eagle3.training.ttt import (
    STAT_ROWS,
    Eagle3TTTModule,
    counted_positions,
    metrics_from_stats,
    simulated_accept_length,
)

MetricsFn = Callable[[int, dict[str, float]], None]
ProgressFn = Callable[[int, int], None]
# Fields that may change between a run and its resume: they do not change the math.
RESUMABLE_FIELDS = {"checkpoint_every", "eval_every", "log_every", "keep_checkpoints", "num_workers", "prefetch_factor",
                    "eval_max_batches", "rendezvous", "stall_timeout_s", "cuda_graphs", "cuda_graph_bucket"}


def clip_and_step(optimizer: torch.optim.Optimizer, params: list[Tensor], max_norm: float,
                  hold: GradientHold | None = None) -> Tensor:
    """Global-norm gradient clipping + optimizer step; returns the pre-clip norm.

    A fused (Adam/AdamW) optimizer divides the gradients by its `grad_scale` inside its own
    kernel (the GradScaler protocol), so the clip factor is handed to it there instead of
    rescaling every gradient in a separate pass (or to `eagle3.training.adamw`'s compiled update,
    once `compile_adamw()` was called); other optimizers (and DTensor gradients under FSDP) use
    clip_grad_norm_. Gradients `hold` keeps in the compute dtype (eagle3.draft.held_grads) are read
    there by the norm and the compiled update; any other optimizer gets them in `.grad` first.
    """
    fused = all(group.get("fused") for group in optimizer.param_groups)
    if hold is not None and len(hold) and not (fused and adamw.eligible(optimizer)):
        hold.release()
    if hold is not None and len(hold):
        gradients = hold.gradients(params)
        norm = total_norm(gradients)
        adamw.adamw_step(optimizer, _clip_coefficient(norm, max_norm), hold)
        return norm
    grads = [p.grad for p in params if p.grad is not None]
    if not fused or any(hasattr(g, "full_tensor") for g in grads):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        return norm
    norm = torch.nn.utils.get_total_norm(grads)
    coefficient = _clip_coefficient(norm, max_norm)
    if adamw.eligible(optimizer) and grads and grads[0].is_cuda:  # the compiled one-pass update (adamw.py)
        adamw.adamw_step(optimizer, coefficient)
        return norm
    optimizer.grad_scale = coefficient
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale
    return norm


def _clip_coefficient(norm: Tensor, max_norm: float) -> Tensor:
    return torch.clamp((norm + 1e-6) / max_norm, min=1.0)  # as clip_grad_norm_'s coefficient


class Trainer:
    """Train loop: micro-batches -> TTT loss -> AdamW step; metrics, validation, checkpoints.

    Args:
        draft: the draft (embedding and vocab mapping already loaded), on CPU or its device.
        target_lm_head: [V, H_t] target output embedding, for the teacher.
        train_data / val_data: map-style datasets of the eagle3/data/datasets.py item contract.
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
            adamw.compile_adamw()
        self.module = Eagle3TTTModule(self.draft, cfg)
        self.model = self._wrap(self.module)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.plan = DataPlan(len(train_data), cfg.batch_size, self.info.world_size, cfg.grad_accum, cfg.seed)
        if self.plan.steps_per_epoch < 1:
            raise ValueError(
                f"train split has {len(train_data)} samples; one optimizer step needs batch_size*devices*grad_accum "
                f"= {cfg.batch_size * self.info.world_size * cfg.grad_accum}"
            )
        self.total_steps = planned_steps(self.plan, cfg.epochs, cfg.max_steps)
        # a streamed train split is read by slot, in step with its capture side (eagle3.training.streaming)
        self.stream = train_data if isinstance(train_data, StreamedDataset) else None
        if self.stream is not None:
            self.stream.check_plan(self.plan, self.total_steps)
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
            fused=self.device.type == "cuda",
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, build_lr_lambda(self.total_steps, cfg.warmup_ratio, cfg.min_lr_ratio)
        )
        # the compiled AdamW reads the bf16 weight-gradient sums as they are (eagle3.draft.held_grads); DDP
        # and FSDP reduce `.grad`, so they get it as before
        self.holds_gradients = self.info.world_size == 1 and adamw.eligible(self.optimizer)
        self.step_graphs = self._step_graphs()
        self.step, self.tokens_seen, self.history = 0, 0, []
        self.ckpt_root = self.out_dir / "checkpoints"
        self.last_checkpoint: Path | None = None
        self.eval_batches: MicroBatches | None = None  # built at the first evaluation, kept to train()'s end
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
        `fused_layer_weights`), so gathering bf16 halves them; master weights, gradient reduction
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

    @staticmethod
    def _real_tokens(batch: dict[str, Tensor]) -> int:
        """Tokens inside attention_mask, checked to be right-padded, read while the batch is still on the host:
        the same checks on the device would wait for the GPU to drain (a sync per micro-batch)."""
        host_mask = batch["attention_mask"].bool()
        if (host_mask[:, 1:] & ~host_mask[:, :-1]).any():
            raise ValueError("attention_mask: expected right padding (ones then zeros per row)")
        return int(host_mask.sum())

    def _to_device(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """non_blocking copies: from the loader's pinned buffers they overlap with queued compute."""
        return {key: value.to(self.device, non_blocking=True) for key, value in batch.items()}

    def _prepare(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """The module's inputs for a collated batch on the device: hidden states decoded or computed, the teacher."""
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"].bool()
        if "aux_scales" in batch:  # fp8 shards (HiddenStateDataset decode="device"): decoded here, on the device
            aux = decode_aux(batch["aux_hidden_states"], batch["aux_scales"], self.autocast_dtype or torch.float32)
            last = batch["last_hidden_states"]
        elif "aux_hidden_states" in batch:
            aux, last = batch["aux_hidden_states"], batch["last_hidden_states"]
        elif self.online_features is not None:
            with torch.no_grad():
                aux, last = self.online_features(input_ids, attention_mask.long())
        else:
            raise ValueError("batch has no aux_hidden_states and no online_features extractor was given")
        aux = aux.to(self.device, self.autocast_dtype or torch.float32)
        target_p, target_ids, in_vocab = compute_teacher(last.to(self.device), self.lm_head, self.draft.t2d,
                                                         self.cfg.loss_chunk_tokens, self.logit_softcap,
                                                         columns=self.draft.draft_vocab_columns())
        loss_mask = batch["loss_mask"].to(self.device).bool() & attention_mask
        return dict(input_ids=input_ids, aux_hidden_states=aux, loss_mask=loss_mask,
                    target_p=target_p, target_ids=target_ids, in_vocab=in_vocab)

    def _loader(self, index_lists: Iterator[list[int]] | list[list[int]], dataset) -> Iterator[dict[str, Tensor]]:
        """Collated micro-batches of `index_lists`, read ahead by cfg.num_workers processes.

        Workers read and collate (a 64 MiB micro-batch of an 8B target at T=2048: ~40 ms on one
        thread) while the GPU trains on the current one; each keeps cfg.prefetch_factor batches
        ready. On CUDA a pin-memory thread copies them into page-locked buffers so `_to_device`'s
        non_blocking copies are real async DMA. One loader serves a whole `train()` call (all
        epochs, see DataPlan.rank_steps), so workers start once, not per epoch. Workers that hand
        over nothing for cfg.stall_timeout_s fail the rank (eagle3/training/loader.py).
        """
        return micro_batches(dataset, list(index_lists), self.collate_fn, self.cfg.num_workers,
                             self.cfg.prefetch_factor, self.device.type == "cuda", self.cfg.stall_timeout_s)

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
        return all_reduce_sum(counts, self.info).clamp(min=1) / self.info.world_size

    def _optimizer_step(self, batches: Iterator[dict[str, Tensor]]) -> tuple[Tensor, Tensor, int]:
        """grad_accum micro-batches, clip, AdamW, scheduler; returns (stats [4,K], grad norm, tokens).

        Nothing here waits for the device: stats and the grad norm stay device tensors until a
        log step reads them, so the host queues the next step while this one runs. Where CUDA graphs
        apply (`_step_graphs`) the step is replayed from its shape's graph.
        """
        self.model.train()
        host_batches = [next(batches) for _ in range(self.cfg.grad_accum)]
        tokens = sum(self._real_tokens(batch) for batch in host_batches)
        device_batches = [self._to_device(batch) for batch in host_batches]
        if self.step_graphs is not None:
            stats, grad_norm = self.step_graphs(self._graph_inputs(device_batches))
        else:
            stats, grad_norm = self._compute_step(device_batches)
        self.scheduler.step()
        return stats, grad_norm, tokens

    def _compute_step(self, device_batches: list[dict[str, Tensor]]) -> tuple[Tensor, Tensor]:
        """Teacher, forward and backward of every micro-batch, clip, AdamW; returns (stats, grad norm) and
        leaves the gradients None.

        All micro-batches of the step are prepared (teacher included) before the first
        backward: the loss divisor needs their counted positions. Memory: grad_accum teachers
        ([B, T, Vd] fp32 each) are held at once instead of one.
        """
        stats = torch.zeros(STAT_ROWS, self.cfg.ttt_steps, device=self.device)
        prepared = [self._prepare(batch) for batch in device_batches]
        loss_norm = self._step_loss_norm(prepared)
        with hold_gradients(self.holds_gradients) as hold:
            for i, inputs in enumerate(prepared):
                last = i == len(prepared) - 1
                sync = contextlib.nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync()
                with sync:
                    with self._autocast():
                        loss, batch_stats = self.model(**inputs, loss_norm=loss_norm)
                    loss.backward()
                prepared[i] = None  # free this micro-batch's teacher before the next forward
                stats += batch_stats
            grad_norm = clip_and_step(self.optimizer, self.params, self.cfg.grad_clip, hold)
        self.optimizer.zero_grad(set_to_none=True)
        return stats, grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm

    def _step_graphs(self) -> StepGraphs | None:
        """Whole steps replayed as CUDA graphs (eagle3.training.step_graphs) where that is the same step: one
        process on CUDA, compiled AdamW (its hyperparameters are device tensors), stored hidden states (the
        online extractor runs the target model, which is not captured)."""
        if not (self.cfg.cuda_graphs and self.device.type == "cuda" and self.info.world_size == 1
                and self.online_features is None and adamw.eligible(self.optimizer)):
            return None
        return StepGraphs(self._compute_step, before_replay=lambda: adamw.load_hyperparameters(self.optimizer),
                          log=self.log)

    def _graph_inputs(self, device_batches: list[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
        """The step's micro-batches, each padded to the step's length bucket (one graph per bucket; padded
        positions are outside every mask, see `pad_time`)."""
        length = bucket_length(max(batch["input_ids"].shape[1] for batch in device_batches), self.cfg.cuda_graph_bucket)
        return [pad_time(batch, length) for batch in device_batches]

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation metrics over the whole val split (or eval_max_batches), all ranks summed."""
        self.model.eval()
        n, w = len(self.val_data), self.info.world_size
        if n == 0:
            return {}
        mine = list(range(self.info.rank, n, w))
        stats = torch.zeros(STAT_ROWS, self.cfg.ttt_steps, device=self.device)
        seen = 0
        for batch in self._eval_loader(mine, math.ceil(n / w)):
            self._real_tokens(batch)  # the padding check
            inputs = self._prepare(self._to_device(batch))
            real = torch.tensor([seen + j < len(mine) for j in range(inputs["input_ids"].shape[0])], device=self.device)
            inputs["loss_mask"] &= real[:, None]  # padding samples count for nothing
            seen += inputs["input_ids"].shape[0]
            with self._autocast():
                _, batch_stats = self.model(**inputs)
            stats += batch_stats
        return metrics_from_stats(all_reduce_sum(stats, self.info), self.cfg.step_decay, "val")

    def _eval_loader(self, mine: list[int], per_rank: int) -> MicroBatches:
        """This rank's validation batches, padded to `per_rank` samples (equal batch counts for FSDP); one
        loader whose workers serve every evaluation of a train() call."""
        if self.eval_batches is None:
            padded = mine + [mine[0] if mine else 0] * (per_rank - len(mine))
            b = self.cfg.batch_size
            batches = [padded[i : i + b] for i in range(0, per_rank, b)][: self.cfg.eval_max_batches]
            self.eval_batches = MicroBatches(self.val_data, batches, self.collate_fn, self.cfg.num_workers,
                                             self.cfg.prefetch_factor, self.device.type == "cuda",
                                             self.cfg.stall_timeout_s, reused=True)
        return self.eval_batches

    def _stop_eval_loader(self) -> None:
        if self.eval_batches is not None:
            self.eval_batches.close()
            self.eval_batches = None

    def train(self, stop_at_step: int | None = None) -> dict[str, Any]:
        """Run to total_steps (or stop_at_step, as a preemption would); returns the summary."""
        start_wall, start_tokens = time.perf_counter(), self.tokens_seen
        window = torch.zeros(STAT_ROWS, self.cfg.ttt_steps, device=self.device)
        window_tokens, val_metrics = 0, {}
        last_step = min(self.total_steps, stop_at_step or self.total_steps)
        # the window's training time: wall time since window_start, minus evaluation and checkpoints
        window_start = time.perf_counter()
        slots = self.stream is not None
        batches = self._loader(self.plan.rank_steps(self.info.rank, self.step, last_step, slots), self.train_data)
        self._report_stream(checkpoint=True)  # where training starts: 0 or the checkpoint it resumed from
        while self.step < last_step:
            stats, grad_norm, tokens = self._optimizer_step(batches)
            self.step += 1
            self._report_stream()
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
                    self._report_stream(checkpoint=True)
                window_start += time.perf_counter() - paused
            if self.on_progress is not None and self.info.is_main:
                self.on_progress(self.step, self.total_steps)
        del batches  # stops the loader's workers
        self._stop_eval_loader()
        wall = time.perf_counter() - start_wall
        return self._summary(val_metrics, wall, self.tokens_seen - start_tokens)

    def _report_stream(self, checkpoint: bool = False) -> None:
        """Tell a stream's capture side what this rank consumed (and rank 0: what it saved), so it can delete."""
        if self.stream is not None:
            self.stream.report(self.info.rank, self.step, checkpoint=checkpoint and self.info.is_main)

    def _synchronize(self) -> float:
        """Wait for the queued device work; returns the time after it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # ------------------------------------------------------------------ reporting

    def _log_train(self, window: Tensor, tokens: int, window_start: float, grad_norm: Tensor) -> None:
        """Report the window's metrics (all ranks summed); the .item() here is the loop's only
        regular wait for the device, so the time read after it covers the window's compute."""
        window = all_reduce_sum(window.clone(), self.info)
        tok = all_reduce_sum(torch.tensor(float(tokens), device=self.device), self.info).item()
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
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
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
                    {"optimizer": optim_sd, "scheduler": self.scheduler.state_dict(), "rng": rng_state()}, p),
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
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, strict=False)
            set_model_state_dict(self.module, {f"draft.{k}": v for k, v in model_sd.items()}, options=opts)
            set_optimizer_state_dict(self.module, self.optimizer, train_state["optimizer"], options=opts)
        else:
            self.draft.load_state_dict(model_sd, strict=False)
            self.optimizer.load_state_dict(train_state["optimizer"])
        self.scheduler.load_state_dict(train_state["scheduler"])
        set_rng_state(train_state["rng"])
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
