"""The embedded tiny target: corpus, chat template, HF dir layout, eval.json, content-hash cache."""

from __future__ import annotations

import json
import math
import random
import time

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

import eagle3.data.tiny_target as tiny_target_mod
from eagle3.data.target import load_target
from eagle3.data.tiny_target import (
    CONTINUE_PREFIX,
    build_tiny_target,
    corpus_sha256,
    encode_documents,
    encode_heldout_tokens,
    heldout_corpus,
    is_heldout,
    make_docstring_example,
    training_corpus,
    unigram_baselines,
)
from eagle3.data.tiny_target import tiny_target_key as key_of


def test_training_corpus_is_deterministic_bounded_and_disjoint_from_heldout():
    first, second = training_corpus(60_000, seed=0), training_corpus(60_000, seed=0)
    assert corpus_sha256(first) == corpus_sha256(second)
    assert corpus_sha256(training_corpus(60_000, seed=1)) != corpus_sha256(first)
    assert 59_996 <= sum(len(f.text.encode()) for f in first) <= 60_000  # last file cut at a char boundary
    assert not any(is_heldout(f.relpath) for f in first)
    heldout = heldout_corpus()
    assert heldout and all(is_heldout(f.relpath) for f in heldout)
    assert not {f.relpath for f in heldout} & {f.relpath for f in training_corpus(10**9)}


def test_docstring_example_is_the_documented_function():
    text = 'import os\n\n\ndef area(w, h):\n    """Area of a w x h rectangle."""\n    return w * h\n'
    example = make_docstring_example(text, random.Random(0))
    assert example.prompt == (
        "Write the Python function `area` with this signature and docstring:\n"
        "def area(w, h):\nArea of a w x h rectangle."
    )
    assert example.response == 'def area(w, h):\n    """Area of a w x h rectangle."""\n    return w * h'
    assert example.messages() == [
        {"role": "user", "content": example.prompt},
        {"role": "assistant", "content": example.response},
    ]


def test_target_dir_is_a_standard_hf_dir(tiny_target_dir):
    config = json.loads((tiny_target_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (7, 32, 300)
    assert (tiny_target_dir / "model.safetensors").is_file()
    assert "<|assistant|>" in json.loads((tiny_target_dir / "tokenizer_config.json").read_text())["chat_template"]
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_target_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|bos|><|system|>\ns<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n"
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids)[:2] == ["<|bos|>", "<|system|>"]
    generation = json.loads((tiny_target_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokenizer.convert_tokens_to_ids("<|end|>"), tokenizer.eos_token_id]


@torch.no_grad()
def recomputed_heldout_loss(model, stream: torch.Tensor, seq_len: int) -> tuple[float, int]:
    """Mean next-token cross-entropy over back-to-back windows of seq_len + 1 tokens, one window
    at a time with plain F.cross_entropy (no padding, no batching: an independent recount)."""
    total, count = 0.0, 0
    for start in range(0, len(stream) - seq_len, seq_len):
        window = stream[start : start + seq_len + 1]
        logits = model(input_ids=window[None, :-1]).logits[0].float()
        total += float(F.cross_entropy(logits, window[1:], reduction="sum"))
        count += seq_len
    return total / count, count


def recomputed_unigram_cross_entropy(train: torch.Tensor, heldout: torch.Tensor, vocab: int) -> float:
    """Add-one unigram model of the training stream, scored on heldout tokens 1.. (those predicted)."""
    counts = [1.0] * vocab
    for t in train.tolist():
        counts[t] += 1.0
    total = sum(counts)
    return -sum(math.log(counts[t] / total) for t in heldout[1:].tolist()) / (len(heldout) - 1)


def test_eval_json_describes_the_saved_model(tiny_target_dir, tiny_target_config):
    """eval.json's numbers, recomputed from the saved weights and tokenizer."""
    cfg = tiny_target_config
    evaluation = json.loads((tiny_target_dir / "eval.json").read_text())
    model, tokenizer = load_target(tiny_target_dir)
    heldout = encode_heldout_tokens(tokenizer, heldout_corpus(), cfg.eval_tokens + 1)
    loss, count = recomputed_heldout_loss(model, heldout, cfg.seq_len)
    assert evaluation["heldout_tokens"] == count == cfg.eval_tokens
    assert evaluation["heldout_loss"] == pytest.approx(loss, rel=1e-5)
    train = encode_documents(tokenizer, training_corpus(cfg.corpus_max_bytes, cfg.seed))
    unigram = recomputed_unigram_cross_entropy(train, heldout, len(tokenizer))
    assert evaluation["unigram_cross_entropy_heldout"] == pytest.approx(unigram, rel=1e-9)
    assert evaluation["loss_vs_unigram"] == pytest.approx(loss - unigram, rel=1e-5, abs=1e-6)
    assert evaluation["train_tokens_seen"] == cfg.train_steps * cfg.batch_size * cfg.seq_len
    assert evaluation["num_parameters"] == sum(p.numel() for p in model.parameters())


def test_unigram_baseline_values():
    # train counts (+1 smoothing over V=4): token 0 x3, 1 x1, 2 x0, 3 x0 -> p = [4, 2, 1, 1] / 8
    base = unigram_baselines(torch.tensor([0, 0, 0, 1]), torch.tensor([9, 0, 1]), vocab_size=4)
    p = torch.tensor([4, 2, 1, 1]) / 8
    assert base["unigram_entropy_train"] == pytest.approx(float(-(p * p.log()).sum()))
    assert base["unigram_cross_entropy_heldout"] == pytest.approx(-(math.log(0.5) + math.log(0.25)) / 2)


def test_cache_hit_and_key(tiny_target_dir, tiny_target_config, monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("a cache hit must not build")

    monkeypatch.setattr(tiny_target_mod, "_build_into", no_build)
    before = {p.name: p.stat().st_mtime_ns for p in tiny_target_dir.iterdir()}
    siblings = set(tiny_target_dir.parent.iterdir())
    events = []
    again = build_tiny_target(tiny_target_config, tiny_target_dir.parent, lambda *e: events.append(e))
    assert again == tiny_target_dir and events == [("cached", 1, 1)]
    assert {p.name: p.stat().st_mtime_ns for p in tiny_target_dir.iterdir()} == before  # nothing rewritten
    assert set(tiny_target_dir.parent.iterdir()) == siblings  # no temp build dir either
    sha = "0" * 64
    assert key_of(tiny_target_config, sha) == key_of(tiny_target_config.model_copy(update={"num_threads": 2}), sha)
    assert key_of(tiny_target_config, sha) != key_of(tiny_target_config.model_copy(update={"seed": 1}), sha)
    assert key_of(tiny_target_config, sha) != key_of(tiny_target_config, "1" * 64)


def test_fresh_build_reports_progress_and_answers_in_chat_format(tmp_path, tiny_target_config):
    cfg = tiny_target_config.model_copy(update={"train_steps": 3, "corpus_max_bytes": 20_000, "eval_tokens": 256})
    events = []
    path = build_tiny_target(cfg, tmp_path, lambda *e: events.append(e))
    assert path.name.startswith("tiny-target-") and not list(tmp_path.glob(".*tmp*"))
    stages = [stage for stage, _, _ in events]
    assert stages[0] == "tokenizer" and ("train", 3, 3) in events and events[-1] == ("eval", 1, 1)
    assert [done for stage, done, _ in events if stage == "train"] == [1, 2, 3]
    model, tokenizer = load_target(path)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": CONTINUE_PREFIX + "x = 1"}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    stop_ids = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    no_stop = GenerationConfig(do_sample=False, max_new_tokens=4, eos_token_id=None, pad_token_id=None)
    model.generation_config.eos_token_id = None  # else generate falls back to the saved stop ids
    new = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=no_stop)[0, ids.shape[1]:]
    assert len(new) == 4
    with torch.no_grad():  # the greedy answer, token by token without a cache
        logits = model(input_ids=torch.cat([ids[0], new[:-1]])[None]).logits[0, ids.shape[1] - 1 :]
    assert new.tolist() == logits.argmax(-1).tolist()
    # the model on disk is the one evaluated: its greedy reply to eval.json's prompt is the recorded one
    evaluation = json.loads((path / "eval.json").read_text())
    messages = [{"role": "user", "content": evaluation["sample_prompt"]}]
    prompt_ids = torch.tensor([tokenizer(tokenizer.apply_chat_template(messages, tokenize=False,
                                                                       add_generation_prompt=True),
                                         add_special_tokens=False)["input_ids"]])
    reply = model.generate(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                           generation_config=GenerationConfig(do_sample=False, max_new_tokens=48, eos_token_id=stop_ids,
                                                              pad_token_id=tokenizer.pad_token_id))
    assert tokenizer.decode(reply[0, prompt_ids.shape[1]:], skip_special_tokens=True) == evaluation["sample_reply"]


def test_idle_cores_are_used_only_where_a_second_thread_measured_faster(monkeypatch):
    """Two idle cores (load 0): 2 threads where they measured 1.8x, 1 where they measured 0.3x (as on the
    2-vCPU CI machines, issue 38); a busy machine never asks; an explicit request is kept."""
    asked = []
    monkeypatch.setattr(tiny_target_mod.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(tiny_target_mod.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    for measured, expected in ((1.8, 2), (0.3, 1), (1.2, 1)):
        monkeypatch.setattr(tiny_target_mod, "parallel_speedup", lambda n, m=measured: asked.append(n) or m)
        assert tiny_target_mod._thread_count(0) == expected, measured
    assert asked == [2, 2, 2]
    monkeypatch.setattr(tiny_target_mod.os, "getloadavg", lambda: (1.2, 1.0, 1.0))
    monkeypatch.setattr(tiny_target_mod, "busy_cores_elsewhere", lambda: 1.0)  # one core busy elsewhere now
    assert tiny_target_mod._thread_count(0) == 1 and asked == [2, 2, 2]
    # the load average still counts this process's previous stage, but nothing else runs now
    monkeypatch.setattr(tiny_target_mod, "busy_cores_elsewhere", lambda: 0.1)
    assert tiny_target_mod._thread_count(0) == 1 and asked == [2, 2, 2, 2]  # 1: the last measured 1.2x
    assert tiny_target_mod._thread_count(3) == 3


def test_the_thread_choice_is_logged_with_the_figures_that_decided_it(monkeypatch):
    """The line a stage logs says how many threads and why: the load, the look at the machine, the probe."""
    monkeypatch.setattr(tiny_target_mod.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(tiny_target_mod.os, "getloadavg", lambda: (1.3, 1.0, 1.0))
    monkeypatch.setattr(tiny_target_mod, "busy_cores_elsewhere", lambda: 0.12)
    monkeypatch.setattr(tiny_target_mod, "parallel_speedup", lambda n: 1.21)
    lines = []
    with tiny_target_mod.cpu_threads(log=lines.append) as threads:
        assert threads == 1
    assert lines == ["CPU threads: 1 of 2 cores (load elsewhere 1.30; busy elsewhere now 0.12 cores; "
                     "2 threads measured 1.21x one (needs 1.3x))"]
    monkeypatch.setattr(tiny_target_mod.os, "getloadavg", lambda: (0.1, 0.1, 0.1))  # no look, a faster probe
    monkeypatch.setattr(tiny_target_mod, "parallel_speedup", lambda n: 1.97)
    choice = tiny_target_mod.thread_choice(0)
    assert (choice.threads, choice.busy_elsewhere) == (2, None)
    assert choice.describe() == "CPU threads: 2 of 2 cores (load elsewhere 0.10; 2 threads measured 1.97x one (needs 1.3x))"
    monkeypatch.setattr(tiny_target_mod, "busy_cores_elsewhere", lambda: 1.0)
    monkeypatch.setattr(tiny_target_mod.os, "getloadavg", lambda: (1.8, 1.0, 1.0))  # one core busy: no probe
    assert tiny_target_mod.thread_choice(0).describe() == ("CPU threads: 1 of 2 cores (load elsewhere 1.80; "
                                                           "busy elsewhere now 1.00 cores)")
    assert tiny_target_mod.thread_choice(3).describe() == "CPU threads: 3 (requested)"


def test_a_probe_that_found_no_speedup_is_taken_again_after_seconds_one_that_did_after_minutes(monkeypatch):
    """demo7 of issue 38: a probe taken while something else briefly ran must not keep every stage at 1 thread."""
    now = time.monotonic()
    monkeypatch.setattr(tiny_target_mod, "_speedups", {2: (now - 30, 0.9), 3: (now - 30, 1.9), 4: (now - 5, 0.9)})
    assert tiny_target_mod.parallel_speedup(3) == 1.9  # kept: threads paid 30 s ago
    assert tiny_target_mod.parallel_speedup(4) == 0.9  # kept: 5 s ago
    tiny_target_mod.parallel_speedup(2)  # measured again
    assert tiny_target_mod._speedups[2][0] >= now


def test_busy_cores_elsewhere_sees_another_process_spinning():
    import subprocess
    import sys

    spin = "import time\nend = time.time() + 3\nwhile time.time() < end: pass\n"
    burner = subprocess.Popen([sys.executable, "-c", spin], start_new_session=True)
    try:
        time.sleep(0.3)
        assert tiny_target_mod.busy_cores_elsewhere(0.5) >= 0.7  # one core's worth (and whatever else runs)
    finally:
        burner.kill()
        burner.wait()
