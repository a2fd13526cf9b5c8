"""Streamed vs offline hidden states for the same samples, in ONE run: end-to-end tok/s of capture +
training on one GPU, the capture's own rate in each mode, and the recapture cost per epoch.

Target: a Llama-3.1-8B-shaped LlamaForCausalLM with random bf16 weights, saved to a temp folder and
loaded by the HF engine's own path (eagle3.data.target.load_engine_target: the placement on cuda:0).
Samples: N of T random tokens, all in the loss; a few held out for validation. Draft: the target's
shape (H 4096, FFN 14336), TTT 7, batch 1, compiled, bf16 -- eagle3's real train_draft.
  offline   dump_hidden_states of the train split (the data stage), then train_draft on the shards
  stream    a stream session; `python -m eagle3.training.streaming.producer` as its own process on the
            same GPU, capturing within --budget-gb, while train_draft trains on the streamed shards
Both modes start from the target on disk (page cache) and count every second from the first load to
the last step, torch.compile included (the same in both). Each epoch of the stream is captured again:
its capture seconds per epoch are the streaming mode's extra cost over one offline capture.

    python tests/benchmarks/bench_stream.py                       # CUDA: 8B shape, 256 x 2048 tokens, 2 epochs
    python tests/benchmarks/bench_stream.py --shape llama-3.2-1b --samples 128 --no-compile   # a short run
    python tests/benchmarks/bench_stream.py --tiny                # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from eagle3.config import DataConfig, StreamConfig, TargetConfig, TrainConfig  # noqa: E402
from eagle3.data.capture import TargetFeatureExtractor, default_aux_layer_ids  # noqa: E402
from eagle3.data.dump import dump_hidden_states  # noqa: E402
from eagle3.data.samples import SAMPLES_FILE, write_samples  # noqa: E402
from eagle3.data.target import load_engine_target  # noqa: E402
from eagle3.draft.vocab import build_or_load_draft_vocab  # noqa: E402
from eagle3.training.streaming.layout import plan_stream, start_session  # noqa: E402
from eagle3.training.train import train_draft  # noqa: E402

LLAMA31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
                  max_position_embeddings=131072)
LLAMA32_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=64, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
                  max_position_embeddings=131072)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512, max_position_embeddings=256)


SHAPES = {"llama-3.1-8b": LLAMA31_8B, "llama-3.2-1b": LLAMA32_1B, "tiny": TINY}


def save_target(shape: dict, folder: Path, dtype: torch.dtype) -> Path:
    """A random-weight Llama of `shape`, saved as an HF folder (built on the GPU when there is one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, architectures=["LlamaForCausalLM"], tie_word_embeddings=False)
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return folder


def make_samples(num: int, val: int, seq: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"id": i, "split": "validation" if i < val else "train",
             "input_ids": torch.randint(0, vocab, (seq,), generator=g).tolist(), "loss_mask": [1] * seq}
            for i in range(num)]


def write_dataset(folder: Path, samples: list[dict], vocab: int, draft_vocab: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_samples(samples, folder / SAMPLES_FILE)
    train = [s for s in samples if s["split"] == "train"]
    build_or_load_draft_vocab([s["input_ids"] for s in train], [s["loss_mask"] for s in train], draft_vocab, vocab,
                              folder / "vocab")


def capture(target: Path, target_cfg: TargetConfig, samples, data_cfg: DataConfig, folder: Path, splits) -> dict:
    """The data stage's dump of `splits`, the target loaded by the HF engine's path; its timings."""
    began = time.perf_counter()
    model, device_map = load_engine_target(target, target_cfg)
    extractor = TargetFeatureExtractor.from_model(model, None, device_map)
    loaded = time.perf_counter()
    summary = dump_hidden_states(extractor, samples, folder / "hidden_states", data_cfg, "bench", lambda *a: None,
                                 lambda m: None, splits=splits)
    done = time.perf_counter()
    del model, extractor
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {"load_s": loaded - began, "capture_s": done - loaded, "bytes": summary["bytes_written"],
            "devices": sorted(set(device_map.values()))}


def train(folder: Path, target: Path, cfg: TrainConfig, out: Path) -> dict:
    began = time.perf_counter()
    layers = SHAPES[ARGS.shape]["num_hidden_layers"]
    summary = train_draft(folder, target, cfg, out, aux_layer_ids=default_aux_layer_ids("LlamaForCausalLM", layers),
                          draft_vocab_size=ARGS.draft_vocab, log=lambda m: None)
    return {"train_s": time.perf_counter() - began, "steps": summary["steps"], "train_tok_s": summary["tokens_per_s"]}


def run_offline(target, target_cfg, samples, data_cfg, train_cfg, root) -> dict:
    folder = root / "offline"
    write_dataset(folder, samples, ARGS.vocab, ARGS.draft_vocab)
    result = capture(target, target_cfg, samples, data_cfg, folder, ("train", "validation"))
    result.update(train(folder, target, train_cfg, root / "offline-train"))
    result["wall_s"] = result["load_s"] + result["capture_s"] + result["train_s"]
    return result


def run_stream(target, target_cfg, samples, data_cfg, train_cfg, root) -> dict:
    folder, out = root / "stream", root / "stream-train"
    write_dataset(folder, samples, ARGS.vocab, ARGS.draft_vocab)
    validation = capture(target, target_cfg, samples, data_cfg, folder, ("validation",))
    train_samples = sum(s["split"] == "train" for s in samples)
    start_session(out / "stream", plan_stream(train_cfg, train_samples, 1, data_cfg.shard_size), stall_timeout_s=1800)
    config = root / "producer.json"
    config.write_text(json.dumps({"target": target_cfg.model_dump(mode="json"), "data": data_cfg.model_dump(mode="json")}))
    began = time.perf_counter()
    producer = subprocess.Popen([sys.executable, "-m", "eagle3.training.streaming.producer", "--target-dir", str(target),
                                 "--dataset-dir", str(folder), "--stream-dir", str(out / "stream"), "--config",
                                 str(config)], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    result = train(folder, target, train_cfg, out)
    output, _ = producer.communicate(timeout=3600)
    result["wall_s"] = time.perf_counter() - began
    done = [json.loads(line) for line in output.splitlines() if line.startswith('{"event": "done"')]
    if producer.returncode != 0 or not done:
        raise RuntimeError(f"the capture side failed: {output[-3000:]}")
    result["producer"] = done[0]["summary"]
    result["validation_capture_s"] = validation["capture_s"]
    return result


def main() -> None:
    cuda = torch.cuda.is_available()
    if not cuda and not ARGS.tiny:
        print("no CUDA device: run with --tiny for the CPU smoke test")
        return
    shape = SHAPES[ARGS.shape]
    dtype = torch.bfloat16 if cuda else torch.float32
    samples = make_samples(ARGS.samples + ARGS.val, ARGS.val, ARGS.seq, shape["vocab_size"])
    root = Path(tempfile.mkdtemp(prefix="bench-stream-", dir=ARGS.dir))
    target = save_target(shape, root / "target", dtype)
    target_cfg = TargetConfig(kind="hf", model_path=str(target), dtype="bfloat16" if cuda else "float32")
    data_cfg = DataConfig(num_samples=len(samples), max_length=ARGS.seq, shard_size=ARGS.shard_size,
                          capture_batch_size=ARGS.capture_batch, draft_vocab_size=ARGS.draft_vocab,
                          hidden_states="stream", stream=StreamConfig(disk_budget_gb=ARGS.budget_gb))
    offline_cfg = data_cfg.model_copy(update={"hidden_states": "offline", "stream": None})
    train_cfg = TrainConfig(ttt_steps=7, epochs=ARGS.epochs, batch_size=1, lr=1e-4, log_every=50, eval_every=10**6,
                            checkpoint_every=10**6, num_workers=2, precision="bf16" if cuda else "fp32",
                            compile=not ARGS.no_compile)
    tokens = sum(len(s["input_ids"]) for s in samples if s["split"] == "train")
    results = {"shape": ARGS.shape, "compiled": not ARGS.no_compile, "samples": ARGS.samples, "seq": ARGS.seq,
               "epochs": ARGS.epochs, "train_tokens_per_epoch": tokens, "budget_gb": ARGS.budget_gb}
    results["offline"] = run_offline(target, target_cfg, samples, offline_cfg, train_cfg, root)
    print(json.dumps({"offline": results["offline"]}), flush=True)  # what a cut-short run still shows
    results["stream"] = run_stream(target, target_cfg, samples, data_cfg, train_cfg, root)
    trained = tokens * ARGS.epochs
    for mode in ("offline", "stream"):
        results[mode]["end_to_end_tok_s"] = trained / results[mode]["wall_s"]
    results["stream_vs_offline"] = results["stream"]["end_to_end_tok_s"] / results["offline"]["end_to_end_tok_s"]
    results["offline"]["capture_tok_s"] = tokens / results["offline"]["capture_s"]
    print(json.dumps(results, indent=2))
    if ARGS.out:
        Path(ARGS.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: the tiny shape, a few samples")
    parser.add_argument("--shape", choices=["llama-3.1-8b", "llama-3.2-1b"], default="llama-3.1-8b")
    parser.add_argument("--no-compile", action="store_true", help="train eagerly (train.compile false), both modes")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--val", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--shard-size", type=int, default=16)
    parser.add_argument("--capture-batch", type=int, default=4)
    parser.add_argument("--budget-gb", type=float, default=8.0)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--dir", default=None, help="where the target, shards and checkpoints go (default: /tmp)")
    parser.add_argument("--out")
    ARGS = parser.parse_args()
    if ARGS.tiny:
        ARGS.samples, ARGS.seq, ARGS.draft_vocab, ARGS.budget_gb, ARGS.shard_size = 24, 64, 128, 0.002, 4
    if ARGS.tiny:
        ARGS.shape = "tiny"
    ARGS.vocab = SHAPES[ARGS.shape]["vocab_size"]
    main()
