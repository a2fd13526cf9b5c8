"""Chat masks, prompts, regeneration (local and real HTTP), shards, resume, datasets, head."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import httpx
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast

import eagle3.data as data_mod
import eagle3.tiny_target as tiny_target_mod
from eagle3.capture import capture_hidden_states
from eagle3.chat import assistant_char_spans, tokenize_chat
from eagle3.config import DataConfig, RegenerateConfig, TargetConfig
from eagle3.data import (
    HiddenStateDataset,
    InsufficientDiskSpaceError,
    RegenerationLog,
    TargetFeatureExtractor,
    TokenizedDataset,
    builtin_conversations,
    chat_completions_url,
    collate_hidden_states,
    estimate_hidden_state_bytes,
    generate_dataset,
    load_target_head,
    read_prompts_jsonl,
    split_ids,
)
from eagle3.tiny_target import CHAT_TEMPLATE, CONTINUE_PREFIX, DOCSTRING_PREFIX, load_target
from tests.helpers import serve_in_thread

# --------------------------------------------------------------------------- chat template + mask


@pytest.fixture(scope="module")
def char_tokenizer():
    """Byte-level tokenizer without merges (1 token per character) and the tiny chat template."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = ["<|bos|>", "<|eos|>", "<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(specials + alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _spelled(tokenizer, chat) -> list[tuple[str, int]]:
    return list(zip(tokenizer.convert_ids_to_tokens(chat.input_ids), chat.loss_mask, strict=True))


def test_mask_covers_assistant_content_and_its_end_token(char_tokenizer):
    end = char_tokenizer.convert_tokens_to_ids("<|end|>")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x=1"}]
    chat = tokenize_chat(char_tokenizer, msgs, max_length=100, stop_ids=[end])
    # "<|bos|><|user|>\nhi<|end|>\n<|assistant|>\nx=1<|end|>\n" ("Ċ" is the byte-level "\n")
    assert _spelled(char_tokenizer, chat) == [
        ("<|bos|>", 0), ("<|user|>", 0), ("Ċ", 0), ("h", 0), ("i", 0), ("<|end|>", 0), ("Ċ", 0),
        ("<|assistant|>", 0), ("Ċ", 0), ("x", 1), ("=", 1), ("1", 1), ("<|end|>", 1), ("Ċ", 0),
    ]


def test_mask_multi_turn_repeated_text_and_truncation(char_tokenizer):
    end = char_tokenizer.convert_tokens_to_ids("<|end|>")
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "ab"},  # same text as the prompt: must be found after it
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    chat = tokenize_chat(char_tokenizer, msgs, max_length=100, stop_ids=[end])
    text = (
        "<|bos|><|system|>\ns<|end|>\n<|user|>\nab<|end|>\n<|assistant|>\nab<|end|>\n"
        "<|user|>\nc<|end|>\n<|assistant|>\nd<|end|>\n"
    )
    assert chat.input_ids == char_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert assistant_char_spans(char_tokenizer, msgs, text) == [(60, 62), (102, 103)]  # "d" not in "<|end|>"
    assert chat.loss_mask == [
        0, 0, 0, 0, 0, 0,  # <|bos|> <|system|> \n s <|end|> \n
        0, 0, 0, 0, 0, 0,  # <|user|> \n a b <|end|> \n
        0, 0, 1, 1, 1, 0,  # <|assistant|> \n a b <|end|> \n
        0, 0, 0, 0, 0,  # <|user|> \n c <|end|> \n
        0, 0, 1, 1, 0,  # <|assistant|> \n d <|end|> \n
    ]
    cut = tokenize_chat(char_tokenizer, msgs, max_length=16, stop_ids=[end])  # cuts before the first <|end|>
    assert cut.loss_mask == chat.loss_mask[:16] and cut.num_assistant_tokens == 2


def test_mask_of_empty_and_whitespace_answers(char_tokenizer):
    end = char_tokenizer.convert_tokens_to_ids("<|end|>")
    user = {"role": "user", "content": "q"}
    empty = tokenize_chat(char_tokenizer, [user, {"role": "assistant", "content": ""}], 100, [end])
    # <|bos|> <|user|> \n q <|end|> \n <|assistant|> \n <|end|> \n: the target stopped at once
    assert empty.loss_mask == [0, 0, 0, 0, 0, 0, 0, 0, 1, 0]
    blank = tokenize_chat(char_tokenizer, [user, {"role": "assistant", "content": "  "}], 100, [end])
    assert blank.loss_mask == [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0]


def test_mask_without_stop_ids_and_template_rewrite_error(char_tokenizer):
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ok"}]
    chat = tokenize_chat(char_tokenizer, msgs, max_length=100)
    assert sum(chat.loss_mask) == 2  # "o", "k" only
    with pytest.raises(ValueError, match="assistant message 1 not found verbatim"):
        assistant_char_spans(char_tokenizer, msgs, "<|bos|><|user|>\nq<|end|>\n<|assistant|>\nOK<|end|>\n")


# --------------------------------------------------------------------------- prompts + helpers


def test_builtin_prompts_are_deterministic_and_mixed():
    a, b = builtin_conversations(6, seed=3), builtin_conversations(6, seed=3)
    assert a == b and a != builtin_conversations(6, seed=4)
    kinds = [c[0]["content"].startswith(CONTINUE_PREFIX) for c in a]
    assert kinds.count(True) >= 2 and kinds.count(False) >= 2
    assert all(c[0]["content"].startswith(DOCSTRING_PREFIX.split("`")[0]) for c, k in zip(a, kinds) if not k)
    assert all([m["role"] for m in c] == ["user", "assistant"] and c[1]["content"] for c in a)


def test_jsonl_prompts_and_bad_line(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text(
        '{"prompt": "hello"}\n\n'
        '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n'
    )
    assert read_prompts_jsonl(good) == [
        [{"role": "user", "content": "hello"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": "ok"}\n{"prompt": 3}\n')
    with pytest.raises(ValueError, match=rf"{bad}:3: expected"):
        read_prompts_jsonl(bad)
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=rf"{bad}:2: invalid JSON"):
        read_prompts_jsonl(bad)
    bad.write_text('{"messages": [{"role": "tool", "content": "x"}]}\n')
    with pytest.raises(ValueError, match=rf"{bad}:1: message 0 must be"):
        read_prompts_jsonl(bad)


def test_split_estimate_url_and_collate():
    val = split_ids(10, 0.2, seed=0)
    assert len(val) == 2 and val == split_ids(10, 0.2, seed=0) and val <= set(range(10))
    assert len(split_ids(3, 0.1, seed=0)) == 1 and split_ids(5, 0.0, seed=0) == set()
    assert estimate_hidden_state_bytes(1000, 4096) == 1000 * 4 * 4096 * 2 == 32_768_000
    assert estimate_hidden_state_bytes(10, 32, num_aux=2, dtype_bytes=4) == 10 * 3 * 32 * 4
    assert chat_completions_url("http://h:1/") == "http://h:1/v1/chat/completions"
    assert chat_completions_url("http://h:1/v1") == "http://h:1/v1/chat/completions"
    items = [
        {"input_ids": torch.tensor([5, 6]), "loss_mask": torch.tensor([0, 1]), "aux_hidden_states": torch.ones(2, 3)},
        {
            "input_ids": torch.tensor([7, 8, 9]),
            "loss_mask": torch.tensor([1, 1, 0]),
            "aux_hidden_states": torch.ones(3, 3),
        },
    ]
    batch = collate_hidden_states(items)
    assert batch["input_ids"].tolist() == [[5, 6, 0], [7, 8, 9]]
    assert batch["loss_mask"].tolist() == [[0, 1, 0], [1, 1, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch["aux_hidden_states"].shape == (2, 3, 3) and batch["aux_hidden_states"][0, 2].sum() == 0


# --------------------------------------------------------------------------- generate_dataset (local)


def _data_cfg(**overrides) -> DataConfig:
    fields = dict(
        num_samples=10,
        max_length=256,  # the test target's context; prompts of >= 256 tokens are dropped
        validation_fraction=0.2,
        shard_size=3,
        draft_vocab_size=64,
        capture_batch_size=4,
        regenerate=RegenerateConfig(max_new_tokens=12, batch_size=4),
    )
    return DataConfig(**(fields | overrides))


@pytest.fixture(scope="module")
def offline_run(tiny_target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("offline")
    events = []
    summary = generate_dataset(
        tiny_target_dir, TargetConfig(), _data_cfg(), out, lambda *e: events.append(e), log=lambda m: None
    )
    return out, summary, events


def test_offline_summary_and_manifest(offline_run):
    out, summary, events = offline_run
    n = summary["num_samples"]
    kept = n["train"] + n["validation"]
    assert kept + summary["num_dropped"] == 10 and kept >= 5 and n["validation"] == round(kept * 0.2)
    assert summary["aux_layer_ids"] == [1, 2, 3] and summary["hf_indices"] == [2, 3, 4]
    assert summary["architecture"] == "LlamaForCausalLM" and summary["hidden_size"] == 32
    assert 0 < summary["loss_mask_fraction"] < 1
    assert {stage for stage, _, _ in events} == {"prompts", "regenerate", "tokenize", "vocab", "hidden_states"}
    assert events[-1] == ("hidden_states", 10 - summary["num_dropped"], 10 - summary["num_dropped"])
    manifest = json.loads((out / "hidden_states" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["dtype"] == "bfloat16" and manifest["num_aux"] == 3
    tokens = summary["num_tokens"]["train"] + summary["num_tokens"]["validation"]
    assert sum(e["num_tokens"] for e in manifest["shards"]) == tokens
    assert [e["file"] for e in manifest["shards"]][0] == "train-00000.safetensors"
    assert all(e["sha256"] == data_mod.file_sha256(out / "hidden_states" / e["file"]) for e in manifest["shards"])
    assert summary["hidden_states_bytes"] == sum(e["bytes"] for e in manifest["shards"])
    assert summary["hidden_states_estimate_bytes"] >= estimate_hidden_state_bytes(tokens, 32)
    assert (out / "vocab" / "vocab_map.safetensors").is_file() and summary["vocab"]["draft_vocab_size"] == 64


def test_samples_are_greedy_target_answers(offline_run, tiny_target_dir):
    out, _, _ = offline_run
    sample = json.loads((out / "samples.jsonl").read_text().splitlines()[0])
    model, tokenizer = load_target(tiny_target_dir)
    prompt = tokenizer.apply_chat_template(sample["messages"][:-1], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    stop = [tokenizer.convert_tokens_to_ids("<|end|>"), tokenizer.eos_token_id]
    new = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids),
        generation_config=GenerationConfig(do_sample=False, max_new_tokens=12, eos_token_id=stop, pad_token_id=2),
    )[0, ids.shape[1]:].tolist()
    new = new[: next((i for i, t in enumerate(new) if t in stop), len(new))]
    assert sample["messages"][-1]["content"] == tokenizer.decode(new, skip_special_tokens=True)


def test_hidden_state_dataset_matches_a_fresh_capture(offline_run, tiny_target_dir):
    out, summary, _ = offline_run
    train = HiddenStateDataset(out / "hidden_states", "train")
    assert len(train) == summary["num_samples"]["train"]
    assert len(HiddenStateDataset(out, "validation")) == summary["num_samples"]["validation"]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    first = next(s for s in samples if s["split"] == "train")
    item = train[0]
    assert set(item) == {"input_ids", "loss_mask", "aux_hidden_states", "last_hidden_states"}
    assert item["input_ids"].tolist() == first["input_ids"] and item["loss_mask"].tolist() == first["loss_mask"]
    assert item["input_ids"].dtype == torch.int64 and item["loss_mask"].dtype == torch.int64
    t = len(first["input_ids"])
    assert item["aux_hidden_states"].shape == (t, 96) and item["last_hidden_states"].shape == (t, 32)
    assert item["aux_hidden_states"].dtype == torch.bfloat16
    model, _ = load_target(tiny_target_dir)
    ids = torch.tensor([first["input_ids"]])
    aux, last = capture_hidden_states(model, ids, torch.ones_like(ids), [1, 2, 3])
    torch.testing.assert_close(item["aux_hidden_states"].float(), aux[0], atol=0.05, rtol=0.02)
    torch.testing.assert_close(item["last_hidden_states"].float(), last[0], atol=0.05, rtol=0.02)
    batch = collate_hidden_states([train[0], train[1]])
    assert batch["aux_hidden_states"].shape[:2] == batch["attention_mask"].shape == batch["input_ids"].shape


def test_regeneration_log_cut_mid_line_is_dropped_and_rewritten(tmp_path):
    path = tmp_path / "regenerated.jsonl"
    log = RegenerationLog(path)
    for i in range(3):
        log.add(i, f"answer {i}\nsecond line", [i, i + 1])
    log.close()
    full = path.read_bytes()
    path.write_bytes(full[:-7])  # killed while writing record 2
    log = RegenerationLog(path)
    assert log.done == {0: "answer 0\nsecond line", 1: "answer 1\nsecond line"}
    assert log.token_ids == {0: [0, 1], 1: [1, 2]}
    assert path.read_bytes() == full[: full.index(b'{"i": 2')]  # the partial record is cut off
    log.add(2, "answer 2 again", [7])
    log.add(3, "answer 3")
    log.close()
    again = RegenerationLog(path)
    again.close()
    assert again.done == {0: "answer 0\nsecond line", 1: "answer 1\nsecond line", 2: "answer 2 again",
                          3: "answer 3"}
    assert again.token_ids == {0: [0, 1], 1: [1, 2], 2: [7]}
    lines = path.read_text().splitlines()
    assert [json.loads(line)["i"] for line in lines] == [0, 1, 2, 3]
    # a damaged complete line is not a kill: refused, naming file and line
    path.write_text(lines[0] + "\n" + lines[1][:-1] + "\n" + lines[2] + "\n")
    with pytest.raises(ValueError, match=r"regenerated\.jsonl:2: corrupt regeneration record"):
        RegenerationLog(path)


DATA_WORKER = textwrap.dedent(
    """
    import json, sys, threading
    from pathlib import Path
    import torch
    import eagle3.tiny_target
    from eagle3.config import DataConfig, TargetConfig
    from eagle3.data import generate_dataset

    # one thread in every run: the killed, resumed and uninterrupted runs must compute alike
    eagle3.tiny_target._thread_count = lambda requested=0, own_threads=0: 1
    torch.set_num_threads(1)
    target, out, pause_stage, pause_at, cfg_json = sys.argv[1:6]

    def emit(*event):
        print(json.dumps(event), flush=True)

    def on_progress(stage, done, total):
        emit("progress", stage, done, total)
        if stage == pause_stage and done >= int(pause_at):
            emit("paused", stage, done, total)
            threading.Event().wait()  # until the test's SIGKILL

    summary = generate_dataset(Path(target), TargetConfig(), DataConfig.model_validate_json(cfg_json), Path(out),
                               on_progress=on_progress, log=lambda m: emit("log", m))
    emit("summary", summary)
    """
)


def _run_data_worker(script: Path, target: Path, out: Path, cfg: DataConfig, pause: tuple[str, int] | None):
    """Run DATA_WORKER; with `pause`, SIGKILL it once it reports that point (its output is on disk
    by then). Returns the events it printed."""
    stage, at = pause or ("never", 0)
    cmd = [sys.executable, str(script), str(target), str(out), stage, str(at), cfg.model_dump_json()]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    with open(out.parent / f"{out.name}-stderr.txt", "a") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True)
    watchdog = threading.Timer(300, proc.kill)  # a hung child fails the test instead of hanging it
    watchdog.start()
    events = []
    try:
        for line in proc.stdout:
            if line.startswith("["):
                events.append(json.loads(line))
            if events and events[-1][0] == "paused":
                os.killpg(proc.pid, signal.SIGKILL)
                break
        proc.wait(timeout=60)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()
    expected_rc = -signal.SIGKILL if pause else 0
    assert proc.returncode == expected_rc, (out.parent / f"{out.name}-stderr.txt").read_text()[-3000:]
    return events


def _logs(events) -> list[str]:
    return [e[1] for e in events if e[0] == "log"]


def test_sigkilled_data_stage_resumes_to_the_uninterrupted_dataset(tiny_target_dir, tmp_path, monkeypatch):
    """A real SIGKILL in regeneration, a regeneration log cut mid-line, a SIGKILL after the first
    shard; the resumed dataset equals an uninterrupted run's and finished work is not redone."""
    cfg = _data_cfg(num_samples=8, validation_fraction=0.25, shard_size=2, capture_batch_size=2,
                    hidden_states_dtype="float32", regenerate=RegenerateConfig(max_new_tokens=12, batch_size=1))
    script = tmp_path / "data_worker.py"
    script.write_text(DATA_WORKER)
    out = tmp_path / "killed"

    # 1. killed in regeneration, after some answers were recorded
    _run_data_worker(script, tiny_target_dir, out, cfg, pause=("regenerate", 4))
    (log_path,) = out.glob(".regenerated-*.jsonl")
    records = log_path.read_bytes()
    complete = records.count(b"\n")
    assert complete >= 4 and not (out / "samples.jsonl").exists()
    log_path.write_bytes(records[:-9])  # as if the kill had landed in the middle of the last record
    kept = records[: records.rindex(b"\n", 0, len(records) - 1) + 1]  # the complete records before it

    # 2. resume; stop at tokenization, while the regeneration log is still on disk
    events = _run_data_worker(script, tiny_target_dir, out, cfg, pause=("tokenize", 0))
    assert f"regenerate: resuming, {complete - 1}/8 answers already done" in _logs(events)
    resumed_log = log_path.read_bytes()
    assert resumed_log.startswith(kept)  # earlier answers neither redone nor rewritten
    indices = [json.loads(line)["i"] for line in resumed_log.splitlines()]
    assert sorted(indices) == list(range(8))  # each prompt once; the cut record was answered again

    # 3. resume; killed right after the first shard
    _run_data_worker(script, tiny_target_dir, out, cfg, pause=("hidden_states", 1))
    hs = out / "hidden_states"
    assert sorted(p.name for p in hs.iterdir() if not p.name.startswith(".")) == \
        ["manifest.json", "train-00000.safetensors"]
    assert not json.loads((hs / "manifest.json").read_text())["complete"]
    with pytest.raises(ValueError, match="incomplete"):
        HiddenStateDataset(hs)
    kept_mtimes = {p: p.stat().st_mtime_ns for p in (out / "samples.jsonl", hs / "train-00000.safetensors")}

    # 4. resume to the end; then an uninterrupted run for comparison
    events = _run_data_worker(script, tiny_target_dir, out, cfg, pause=None)
    summary = events[-1][1]
    assert any("reusing" in m for m in _logs(events)) and summary["shards_reused"] == 1
    assert not [e for e in events if e[0] == "progress" and e[1] == "regenerate"]
    assert {p: p.stat().st_mtime_ns for p in kept_mtimes} == kept_mtimes  # finished work not rewritten
    straight = tmp_path / "straight"
    _run_data_worker(script, tiny_target_dir, straight, cfg, pause=None)
    files = sorted(p.relative_to(straight) for p in straight.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert Path("hidden_states/train-00001.safetensors") in files
    for rel in files:
        assert (out / rel).read_bytes() == (straight / rel).read_bytes(), rel

    # 5. a corrupted finished shard is found by its sha256 and rewritten; the others are reused
    shard = hs / "train-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    monkeypatch.setattr(tiny_target_mod, "_thread_count", lambda requested=0, own_threads=0: 1)  # as the workers
    again = generate_dataset(tiny_target_dir, TargetConfig(), cfg, out, log=lambda m: None)
    manifest = json.loads((hs / "manifest.json").read_text())
    assert again["shards_reused"] == len(manifest["shards"]) - 1
    assert again["bytes_written"] == shard.stat().st_size
    assert shard.read_bytes() == (straight / "hidden_states" / shard.name).read_bytes()


def test_disk_space_error_names_the_numbers(tiny_target_dir, tmp_path, monkeypatch):
    class Usage:
        free = 1000

    monkeypatch.setattr(data_mod.shutil, "disk_usage", lambda path: Usage)
    cfg = _data_cfg(num_samples=4, regenerate=RegenerateConfig(enabled=False))
    expected = r"need \d+ bytes .* but only 1000 bytes \(0\.000 GB\) are free"
    with pytest.raises(InsufficientDiskSpaceError, match=expected):
        generate_dataset(tiny_target_dir, TargetConfig(), cfg, tmp_path, log=lambda m: None)
    assert not list((tmp_path / "hidden_states").glob("*.safetensors"))


def test_online_mode_and_reference_answers(tiny_target_dir, tmp_path):
    cfg = _data_cfg(num_samples=6, hidden_states="online", regenerate=RegenerateConfig(enabled=False))
    summary = generate_dataset(tiny_target_dir, TargetConfig(aux_layer_ids=[0, 5]), cfg, tmp_path, log=lambda m: None)
    assert not (tmp_path / "hidden_states").exists() and summary["hidden_states_bytes"] == 0
    assert summary["aux_layer_ids"] == [0, 5] and summary["hf_indices"] == [1, 6]
    builtin = builtin_conversations(6, seed=0)
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    # the true continuations, not regenerated; order kept (prompts >= 256 tokens are dropped)
    positions = [builtin.index(s["messages"]) for s in samples]
    assert positions == sorted(positions) and len(positions) + summary["num_dropped"] == 6
    train = TokenizedDataset(tmp_path, "train")
    assert len(train) == summary["num_samples"]["train"] and set(train[0]) == {"input_ids", "loss_mask"}
    batch = collate_hidden_states([train[0], train[1]])
    extractor = TargetFeatureExtractor(tiny_target_dir, aux_layer_ids=[0, 5])
    aux, last = extractor(batch["input_ids"], batch["attention_mask"])
    assert aux.shape == (*batch["input_ids"].shape, 64) and last.shape == (*batch["input_ids"].shape, 32)


def test_draft_vocab_larger_than_target_is_rejected(tiny_target_dir, tmp_path):
    with pytest.raises(ValueError, match=r"draft_vocab_size=512 exceeds the target vocab \(300\)"):
        generate_dataset(tiny_target_dir, TargetConfig(), DataConfig(), tmp_path, log=lambda m: None)


# --------------------------------------------------------------------------- HTTP regeneration




@pytest.fixture()
def chat_server():
    """A real OpenAI-style server on 127.0.0.1 whose first request fails with 503."""
    state = {"requests": 0, "auth": set(), "bodies": []}
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        state["requests"] += 1
        state["auth"].add(request.headers.get("authorization"))
        state["bodies"].append(body)
        if state["requests"] == 1:
            return JSONResponse({"error": "warming up"}, status_code=503)
        prompt = body["messages"][-1]["content"]
        answer = f"def answer():\n    return {len(prompt)}"
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}]}

    with serve_in_thread(app) as url:
        yield url, state


def test_http_regeneration_retries_and_hides_the_key(chat_server, tiny_target_dir, tmp_path):
    url, state = chat_server
    secret = "sk-test-SECRET-123"
    regen = RegenerateConfig(
        backend="http", endpoint=url, api_key=secret, model="tiny", concurrency=3, retries=2,
        backoff_s=0.01, temperature=0.7, max_new_tokens=20,
    )
    cfg = _data_cfg(num_samples=5, hidden_states="online", regenerate=regen)
    logs = []
    summary = generate_dataset(tiny_target_dir, TargetConfig(), cfg, tmp_path, log=logs.append)
    assert state["requests"] == 6  # 5 prompts + the one 503 that was retried
    assert state["auth"] == {f"Bearer {secret}"}
    assert {(b["model"], b["temperature"], b["max_tokens"]) for b in state["bodies"]} == {("tiny", 0.7, 20)}
    assert any("-> 503; retry 1/2" in m for m in logs)
    assert secret not in "\n".join(logs) and secret not in json.dumps(summary)
    assert summary["regeneration"]["api_key_set"] is True and summary["regeneration"]["backend"] == "http"
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    for s in samples:
        assert s["messages"][-1]["content"] == f"def answer():\n    return {len(s['messages'][0]['content'])}"


def test_http_gives_up_on_client_errors(tmp_path):
    app = FastAPI()
    calls = []

    @app.post("/v1/chat/completions")
    async def chat():
        calls.append(1)
        return JSONResponse({"error": "bad model"}, status_code=400)

    with serve_in_thread(app) as url:
        record = data_mod.RegenerationLog(tmp_path / "r.jsonl")
        regen = RegenerateConfig(backend="http", endpoint=url, retries=3, backoff_s=0.01)
        with pytest.raises(RuntimeError, match="failed after 1 attempt.*400"):
            data_mod.regenerate_http([[{"role": "user", "content": "x"}]], regen, record, lambda *a: None, print)
        assert len(calls) == 1


# --------------------------------------------------------------------------- target head


def test_target_head_tied_and_untied(tiny_target_dir, tmp_path):
    head = load_target_head(tiny_target_dir)
    model, _ = load_target(tiny_target_dir)
    assert head["config"]["tie_word_embeddings"] is True
    assert head["lm_head"].shape == (300, 32)
    torch.testing.assert_close(head["lm_head"], model.lm_head.weight)
    torch.testing.assert_close(head["embed_tokens"], model.model.embed_tokens.weight)

    untied = tmp_path / "untied"
    untied.mkdir()
    config = {"tie_word_embeddings": False, "architectures": ["LlamaForCausalLM"]}
    (untied / "config.json").write_text(json.dumps(config))
    weights = {"model.embed_tokens.weight": torch.ones(5, 2), "lm_head.weight": torch.full((5, 2), 2.0)}
    save_file(weights, str(untied / "model.safetensors"))
    head = load_target_head(untied)
    assert head["lm_head"].tolist() == [[2.0, 2.0]] * 5 and head["embed_tokens"].tolist() == [[1.0, 1.0]] * 5

    save_file({"model.embed_tokens.weight": torch.ones(5, 2)}, str(untied / "model.safetensors"))
    with pytest.raises(ValueError, match="no 'lm_head.weight' and tie_word_embeddings is false"):
        load_target_head(untied)


def test_post_retries_timeouts_and_rejects_malformed_replies():
    calls, delays = [], []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.headers.get("authorization"))
        if len(calls) == 1:
            raise httpx.ConnectTimeout("slow", request=request)
        if len(calls) == 2:
            return httpx.Response(429, text="busy")
        if len(calls) == 3:
            return httpx.Response(200, json={"choices": [{"message": {"content": "ok"}}]})
        return httpx.Response(200, text="not json")

    regen = RegenerateConfig(backend="http", endpoint="http://x", retries=2, backoff_s=0.5)
    client = httpx.Client(transport=httpx.MockTransport(handler), headers={"Authorization": "Bearer k"})
    logs = []
    answer = data_mod.post_chat_completion(client, "http://x/v1/chat/completions", {}, regen, logs.append, delays.append)
    assert answer == "ok" and delays == [0.5, 1.0] and calls == ["Bearer k"] * 3
    assert logs[0].endswith("-> ConnectTimeout; retry 1/2 in 0.50s") and "-> 429; retry 2/2" in logs[1]
    with pytest.raises(RuntimeError, match="malformed chat completion: 'not json'"):
        data_mod.post_chat_completion(client, "http://x/v1/chat/completions", {}, regen, logs.append, delays.append)


def test_samples_carry_the_targets_own_greedy_token_stream(offline_run, tiny_target_dir):
    """Answers are kept as the ids the target generated, not re-tokenized from their text:
    serving decodes the target's own stream, so that is what the draft must train on."""
    out, _, _ = offline_run
    model, _ = load_target(tiny_target_dir)
    same = total = 0
    for sample in data_mod.read_samples(out / "samples.jsonl"):
        ids, mask = sample["input_ids"], sample["loss_mask"]
        start = mask.index(1)
        assert all(mask[start:])  # prompt masked out, the whole answer masked in
        with torch.inference_mode():
            greedy = model.generate(torch.tensor([ids[:start]]), max_new_tokens=len(ids) - start, do_sample=False)
        same += sum(a == b for a, b in zip(greedy[0, start:].tolist(), ids[start:]))
        total += len(ids) - start
    # Batched (left-padded) generation may flip a near-tie now and then, hence not == 1.
    assert same / total >= 0.95


def test_tokenize_generated_spells_out_prompt_and_answer(tiny_target_dir):
    from eagle3.chat import render_chat, tokenize_generated

    _, tokenizer = load_target(tiny_target_dir)
    prompt = [{"role": "user", "content": "def f(x):"}]
    prompt_ids = tokenizer(render_chat(tokenizer, prompt, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    got = tokenize_generated(tokenizer, prompt, [7, 9, end], max_length=64)
    assert got.input_ids == prompt_ids + [7, 9, end]
    assert got.loss_mask == [0] * len(prompt_ids) + [1, 1, 1]
    assert tokenize_generated(tokenizer, prompt, [7, 9, end], max_length=len(prompt_ids) + 1).loss_mask[-1] == 1
