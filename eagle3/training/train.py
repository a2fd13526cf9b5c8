"""The training stage: `train_draft` is the entry the Prefect task wraps. It builds the draft
from the target's config and the data stage's vocabulary, trains it on the offline shards, the
streamed ones (`out_dir/stream`, written by eagle3.training.streaming's capture side while it
trains) or online features, and writes checkpoints, `history.jsonl`, `summary.json` and the curves.

With devices > 1 outside torchrun it relaunches itself (`python -m eagle3.training.train`, each
rank's entry) under torchrun and relays the metrics rank 0 writes; a rank that dies is reported
by rank with its log tail (out_dir/torchrun_logs) and its process group is killed.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.elastic.multiprocessing.errors import record

from eagle3.config import TrainConfig
from eagle3.data.capture import aux_ids_to_hf_indices
from eagle3.draft.model import DraftModelConfig, Eagle3DraftModel
from eagle3.data.shards import SPLITS
from eagle3.training.checkpoints import load_initial_weights
from eagle3.training.streaming.dataset import StreamedDataset
from eagle3.training.streaming.layout import STREAM_DIR
from eagle3.training.curves import plot_training_curves
from eagle3.training.error_file import WholeErrorFile
from eagle3.training.torchrun import TORCHRUN_TAIL_LINES, describe_rank_failures, torchrun_command, torchrun_env
from eagle3.training.trainer import MetricsFn, ProgressFn, Trainer


def _load_vocab_mapping(data_dir: Path, out_dir: Path, vocab_size: int, draft_vocab_size: int, log) -> tuple[Tensor, Tensor]:
    """The dataset stage's map (`data_dir/vocab/vocab_map.safetensors`) when it has the requested
    size, else one counted here from the training split's assistant tokens (saved to out_dir/vocab)."""
    from eagle3.data.datasets import TokenizedDataset
    from eagle3.draft.vocab import (
        VOCAB_FILE,
        build_draft_vocab,
        count_masked_tokens,
        load_draft_vocab,
        save_draft_vocab,
    )

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


def _init_vocab_mapping(source: Path, mapping: tuple[Tensor, Tensor], log) -> tuple[Tensor, Tensor]:
    """The draft vocabulary of the weights training starts from (train.init_checkpoint), when it has one of the
    same size: its lm_head rows mean its own d2t-mapped tokens, so a refined draft keeps them. The data's map
    (`mapping`) otherwise; `load_initial_weights` names any other mismatch. The teacher's columns come from
    the draft's t2d at training time, so the shards serve any map. A served-traffic nightly starts from the
    champion while each night's data counts its own vocabulary: without this, a shift in traffic failed it."""
    from safetensors import safe_open

    weights = Path(source) / "model.safetensors"
    if not weights.is_file():
        return mapping
    with safe_open(str(weights), framework="pt") as f:
        if "d2t" not in f.keys():
            return mapping
        d2t = f.get_tensor("d2t").long()
    data_d2t, data_t2d = mapping
    if d2t.shape != data_d2t.shape or torch.equal(d2t, data_d2t):
        return mapping
    t2d = torch.zeros_like(data_t2d, dtype=torch.bool)
    t2d[torch.arange(len(d2t)) + d2t] = True
    log(f"draft vocabulary: {source}'s, which training starts from (this data counted another: "
        f"{int((t2d & data_t2d.bool()).sum())} of {len(d2t)} draft tokens in common)")
    return d2t, t2d


def _check_dataset_layers(manifest: dict, aux_layer_ids: list[int]) -> None:
    """The features on disk must come from the layers the draft will be served with: the ids asked, and
    the capture indices the engine actually hooked (recorded in the manifest) must be the ones SGLang
    captures for those ids."""
    stored = manifest.get("aux_layer_ids")
    if stored is not None and list(stored) != list(aux_layer_ids):
        raise ValueError(f"hidden states were captured at aux layers {stored}, training was asked for "
                         f"{list(aux_layer_ids)}; regenerate the dataset or pass the stored ids")
    engine = manifest.get("engine")
    if engine is None or "architecture" not in manifest:
        return
    fed = aux_ids_to_hf_indices(manifest["architecture"], list(aux_layer_ids), manifest["num_hidden_layers"])
    if list(engine["capture_indices"]) != fed:
        raise ValueError(f"{engine['name']} {engine['version']} captured HF hidden_states {engine['capture_indices']}, "
                         f"but SGLang feeds aux ids {list(aux_layer_ids)} from HF hidden_states {fed}: the shards "
                         "hold other layers than the draft will be served; regenerate the dataset")


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
    from eagle3.data.datasets import HiddenStateDataset, TokenizedDataset, collate_hidden_states
    from eagle3.data.target import load_target_head

    data_dir = Path(data_dir)
    head = load_target_head(Path(target_dir))
    if online_features is None:
        # fp8 shards are decoded by the trainer on its device (Trainer._prepare), not in the loader workers
        val_data = HiddenStateDataset(data_dir, "validation", decode="device")
        _check_dataset_layers(val_data.manifest, aux_layer_ids)
        if "train" in val_data.manifest.get("splits", SPLITS):
            train_data = HiddenStateDataset(data_dir, "train", decode="device")
        else:  # data.hidden_states: stream -- its capture side writes the train split beside the checkpoints
            train_data = StreamedDataset(out_dir / STREAM_DIR, val_data.manifest, decode="device")
    else:
        train_data, val_data = TokenizedDataset(data_dir, "train"), TokenizedDataset(data_dir, "validation")
        _check_dataset_layers({"aux_layer_ids": getattr(online_features, "aux_layer_ids", None)}, aux_layer_ids)
    config = DraftModelConfig.from_target_config(head["config"], draft_vocab_size, aux_layer_ids,
                                                 **cfg.draft.model_dump())
    torch.manual_seed(cfg.seed)
    draft = Eagle3DraftModel(config)
    if config.shares_target_embedding:
        draft.load_target_embedding(head["embed_tokens"])
    mapping = _load_vocab_mapping(data_dir, out_dir, config.vocab_size, draft_vocab_size, log)
    if cfg.init_checkpoint:
        mapping = _init_vocab_mapping(Path(cfg.init_checkpoint), mapping, log)
    draft.set_vocab_mapping(*mapping)
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
    """Run `python -m eagle3.training.train` under torchrun, relay its output and metrics; raise naming the
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
    # own session: torchrun's group, stopped as one (each rank runs in a session of its own: _kill_process_group)
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


def _kill_process_group(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """Stop torchrun (if still running: the caller was interrupted) and anything left in its group. SIGTERM first:
    torchrun forwards it to the ranks and waits for them. torch.distributed.elastic starts every rank in a session
    of its own, so the ranks' groups (a rank and its loader workers) are SIGKILLed too if torchrun outlives the wait
    (killing torchrun's group alone would leave them running)."""
    rank_groups = _rank_groups(proc) if proc.poll() is None else []
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    for group in (proc.pid, *rank_groups):
        with contextlib.suppress(ProcessLookupError, PermissionError):  # no member left: the usual case
            os.killpg(group, signal.SIGKILL)
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def _rank_groups(proc: subprocess.Popen) -> list[int]:
    """torchrun's children that lead a process group of their own: its ranks."""
    import psutil

    try:
        children = psutil.Process(proc.pid).children()
    except psutil.Error:
        return []
    return [child.pid for child in children if _group_of(child.pid) == child.pid]


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


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
    """torchrun entry: `python -m eagle3.training.train --data-dir D --target-dir T --out-dir O --config C.json ...`."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    for flag in ("--data-dir", "--target-dir", "--out-dir", "--config", "--aux-layer-ids", "--draft-vocab-size"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args(argv)
    # a raising rank leaves its traceback in the error file torchrun names (see describe_rank_failures)
    rank_main = record(_rank_main, error_handler=WholeErrorFile())
    rank_main(args, [int(i) for i in args.aux_layer_ids.split(",")])


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
