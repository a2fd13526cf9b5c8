"""The training objective: the training-time-test (TTT) unroll of the draft on one batch, and the
per-step statistics it reports (loss_k, acc_k, simulated accept length).

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
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle3.config import TrainConfig
from eagle3.draft.losses import soft_cross_entropy_steps, soft_cross_entropy_unroll
from eagle3.draft.model import Eagle3DraftModel, TTTCache

STAT_ROWS = 4  # ce_sum, counted positions, correct, loss-masked positions


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
        # the layer's weights (and fc's) fused and cast once per unroll; each one's gradient is summed in its GEMMs
        weights = draft.fused_layer_weights(torch.get_autocast_dtype(device_type)
                                            if torch.is_autocast_enabled(device_type) else None)
        hidden = draft.project(aux_hidden_states, weights)  # [B, T, H]
        positions = torch.arange(t, device=input_ids.device)[None].expand(b, t)
        counted_all = loss_mask & in_vocab
        cache, normed_steps, counts, masked = TTTCache(), [], [], []
        steps = min(self.ttt_steps, t - 1)  # step k needs a teacher at t + k + 1 <= T - 1
        for k in range(steps):
            s = k + 1
            ids_k = F.pad(input_ids[:, s:], (0, s))  # token t+s at query t
            hidden, normed = draft.ttt_step(ids_k, hidden, positions + k, cache, self.attention,
                                            weights=weights, return_normed=True)
            normed_steps.append(normed)  # [B, T, H]; query t learns teacher t + s
            counts.append(counted_all[:, s:].sum())
            masked.append(loss_mask[:, s:].sum())
        counts_t = torch.stack(counts).float()
        decay = self.step_decay ** torch.arange(steps, device=input_ids.device, dtype=torch.float32)
        divisor = counts_t.clamp(min=1) if loss_norm is None else loss_norm[:steps].to(counts_t)
        scales = (decay / divisor).repeat_interleave(b)  # per (step, sequence) block
        if _unroll_loss:  # all steps' loss in one kernel per teacher block (losses.soft_cross_entropy_unroll)
            loss, ce, correct_k = soft_cross_entropy_unroll(normed_steps, draft.lm_head.weight, target_p,
                                                            target_ids, counted_all, scales)
            ce_k, correct_k = ce.sum(1), correct_k.float()
        else:
            loss, ce_k, correct_k = self._loss_per_step(normed_steps, target_p, target_ids, counted_all, scales)
        stats = torch.stack([ce_k, counts_t, correct_k, torch.stack(masked).float()])
        if stats.shape[1] < self.ttt_steps:  # sequences shorter than the unroll: later steps count nothing
            stats = F.pad(stats, (0, self.ttt_steps - stats.shape[1]))
        return loss, stats


    def _loss_per_step(self, normed_steps: list[Tensor], target_p: Tensor, target_ids: Tensor, counted: Tensor,
                       scales: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The loss one step at a time (`soft_cross_entropy_steps`, one loss kernel per step and chunk);
        returns (loss, CE sum per step [K], correct rows per step [K])."""
        b, t = counted.shape
        steps = len(normed_steps)
        # one contiguous [n, .] block per sequence: shifted [B, T, Vd] teacher slices are not
        # contiguous across the batch, and reshaping them would copy the teacher every step
        normed_rows = [normed[i, : t - k - 1] for k, normed in enumerate(normed_steps) for i in range(b)]
        targets = [(target_p[i, k + 1 :], target_ids[i, k + 1 :], counted[i, k + 1 :])
                   for k in range(steps) for i in range(b)]
        loss, ce, correct = soft_cross_entropy_steps(normed_rows, self.draft.lm_head.weight, targets, scales,
                                                     self.loss_chunk)
        rows_per_step = [(t - k - 1) * b for k in range(steps)]
        correct_k = torch.stack([c.sum() for c in correct.split(rows_per_step)]).float()
        return loss, ce.view(steps, b).sum(1), correct_k


_unroll_loss = True


def set_unroll_loss(enabled: bool) -> None:
    """True: every TTT step's loss in one kernel per teacher block (the teacher read once for all steps);
    False: one loss kernel per step (benchmarks compare both)."""
    global _unroll_loss
    _unroll_loss = enabled


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


def simulated_accept_length(acc_k: Sequence[float]) -> float:
    """1 + sum_k prod_{j<=k} acc_j: expected tokens per verify of a chain draft, bonus included."""
    total, running = 1.0, 1.0
    for acc in acc_k:
        running *= acc
        total += running
    return total
