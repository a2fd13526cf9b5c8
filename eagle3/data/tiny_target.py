"""Embedded tiny target: a BPE tokenizer and a small Llama trained on the local Python stdlib.

Owns the corpus (the interpreter's own standard-library sources, so every machine has it and
nothing is downloaded), the chat template, the chat-example makers shared with the builtin
prompts of `eagle3.data.prompts`, training, the held-out evaluation written to `eval.json`, and the
content-hash cache. Risk: the cache key must change whenever anything that shapes the weights
changes (config, corpus bytes, this file's code), or a stale target is silently reused.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import json
import math
import os
import random
import shutil
import sysconfig
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from eagle3.config import TinyTargetConfig
from eagle3.data.chat import tokenize_chat

ProgressFn = Callable[[str, int, int], None]

BOS, EOS, PAD, END = "<|bos|>", "<|eos|>", "<|pad|>", "<|end|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (BOS, EOS, PAD, END, *ROLE_TOKENS)

# One turn = role token, newline, content, <|end|>, newline. The assistant stops on <|end|>,
# so the draft's loss mask covers the content plus that token (see eagle3.data.chat).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

CONTINUE_PREFIX = "Continue this Python code:\n"
DOCSTRING_PREFIX = "Write the Python function `{name}` with this signature and docstring:\n"
PROMPT_MAX_CHARS = 400
RESPONSE_MAX_CHARS = 400
# Tests, IDLE and lib2to3 fixtures are not library code; encodings/ is generated charmap tables
# and pydoc_data/ one 750 KB prose string: both would teach the model noise, not Python.
_EXCLUDED_DIRS = {
    "site-packages", "test", "tests", "idlelib", "turtledemo", "lib2to3", "__pycache__", "encodings", "pydoc_data",
}
_HELDOUT_BUCKETS = 8  # 1 file in 8 (by path hash) is never trained on: eval + builtin prompts


# --------------------------------------------------------------------------- corpus


@dataclass(frozen=True)
class CorpusFile:
    """One stdlib source file: path relative to the stdlib root, and its text."""

    relpath: str
    text: str


def stdlib_root() -> Path:
    """Directory of this interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=4)
def list_stdlib_sources(root: str | None = None) -> tuple[CorpusFile, ...]:
    """All eligible stdlib `.py` files, sorted by relative path.

    Tests, IDLE, lib2to3 (Python-2 fixtures), site-packages and the machine-specific
    `_sysconfigdata*` are left out; files that are not UTF-8 are skipped.
    """
    base = Path(root) if root else stdlib_root()
    files = []
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base)
        if _EXCLUDED_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("_sysconfigdata"):
            continue
        if any(part.startswith("config-") for part in rel.parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            files.append(CorpusFile(rel.as_posix(), text))
    return tuple(files)


def _path_hash(relpath: str, salt: str = "") -> str:
    return hashlib.sha256(f"{salt}{relpath}".encode()).hexdigest()


def is_heldout(relpath: str) -> bool:
    """True for the fixed 1-in-8 share of files (by path hash) that is never trained on."""
    return int(_path_hash(relpath)[:8], 16) % _HELDOUT_BUCKETS == 0


def training_corpus(max_bytes: int, seed: int = 0) -> list[CorpusFile]:
    """Deterministic training subset: non-held-out files in seeded hash order, up to max_bytes.

    Hash order mixes packages (sorted order would be all `asyncio/` first); the last file is
    cut so the total is exactly min(max_bytes, available) UTF-8 bytes.
    """
    pool = [f for f in list_stdlib_sources() if not is_heldout(f.relpath)]
    pool.sort(key=lambda f: _path_hash(f.relpath, salt=f"{seed}:"))
    chosen, used = [], 0
    for f in pool:
        size = len(f.text.encode())
        if used + size > max_bytes:
            cut = f.text.encode()[: max_bytes - used].decode("utf-8", errors="ignore")
            if cut.strip():
                chosen.append(CorpusFile(f.relpath, cut))
            break
        chosen.append(f)
        used += size
    return chosen


def heldout_corpus() -> list[CorpusFile]:
    """The held-out files, in path-hash order (independent of any seed)."""
    pool = [f for f in list_stdlib_sources() if is_heldout(f.relpath)]
    return sorted(pool, key=lambda f: _path_hash(f.relpath))


def corpus_sha256(files: Sequence[CorpusFile]) -> str:
    """Content hash of a corpus (paths and texts, in order)."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.relpath.encode() + b"\0" + f.text.encode() + b"\0")
    return h.hexdigest()


# --------------------------------------------------------------------------- chat examples


@dataclass(frozen=True)
class ChatExample:
    """A single-turn conversation made from corpus text; `response` is the true continuation."""

    prompt: str
    response: str
    kind: str  # "continue" or "docstring"

    def messages(self, with_response: bool = True) -> list[dict[str, str]]:
        """OpenAI-style messages; without the response when it is to be regenerated."""
        msgs = [{"role": "user", "content": self.prompt}]
        if with_response:
            msgs.append({"role": "assistant", "content": self.response})
        return msgs


def _take_lines(lines: Sequence[str], max_chars: int, max_lines: int) -> list[str]:
    """Leading whole lines of `lines` within both caps (at least one line)."""
    taken, used = [], 0
    for line in lines[:max_lines]:
        if taken and used + len(line) > max_chars:
            break
        taken.append(line[:max_chars])
        used += len(line)
    return taken


def make_continue_example(text: str, rng: random.Random) -> ChatExample | None:
    """Prompt = 3-10 lines of code from a random non-blank line; response = the next lines."""
    lines = text.splitlines()
    if len(lines) < 8:
        return None
    start = rng.randrange(0, len(lines) - 4)
    if not lines[start].strip():
        return None
    prompt_lines = _take_lines(lines[start:], PROMPT_MAX_CHARS, rng.randint(3, 10))
    rest = lines[start + len(prompt_lines) :]
    response_lines = _take_lines(rest, RESPONSE_MAX_CHARS, rng.randint(4, 16))
    # An answer opens with code, not with the blank line that may follow the snippet.
    prompt, response = "\n".join(prompt_lines).rstrip(), "\n".join(response_lines).strip("\n").rstrip()
    if not prompt.strip() or not response.strip():
        return None
    return ChatExample(CONTINUE_PREFIX + prompt, response, "continue")


@functools.lru_cache(maxsize=4096)
def _documented_functions(text: str) -> tuple[tuple[str, str, str, str], ...]:
    """(name, def header, docstring, source) of every documented function, dedented."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return ()
    lines = text.splitlines()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno:
            doc = ast.get_docstring(node)
            if doc:
                header_end = max(node.body[0].lineno - 1, node.lineno)  # the def line(s), not the docstring
                header = textwrap.dedent("\n".join(lines[node.lineno - 1 : header_end]))
                source = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
                found.append((node.name, header, doc, source))
    return tuple(found)


def make_docstring_example(text: str, rng: random.Random) -> ChatExample | None:
    """Prompt = a function's signature and docstring; response = the function's source (capped).

    The answer restates the prompt's signature and docstring before the body, so much of it
    is copying from context: learnable by a small target, and predictable for the draft.
    """
    functions = _documented_functions(text)
    if not functions:
        return None
    name, header, doc, source = functions[rng.randrange(len(functions))]
    doc_lines = _take_lines(doc.splitlines(), PROMPT_MAX_CHARS - len(header), 12)
    response = "\n".join(_take_lines(source.splitlines(), RESPONSE_MAX_CHARS, 24)).rstrip()
    if not response.strip() or len(header) > PROMPT_MAX_CHARS:
        return None
    prompt = DOCSTRING_PREFIX.format(name=name) + header + "\n" + "\n".join(doc_lines).rstrip()
    return ChatExample(prompt, response, "docstring")


def sample_chat_examples(
    files: Sequence[CorpusFile], count: int, seed: int, strict: bool = True
) -> list[ChatExample]:
    """Up to `count` distinct examples drawn from `files`, alternating continue/docstring.

    When the preferred kind fails on the drawn file (no documented function, a blank line),
    the other kind is tried on it. With strict=True, fewer than `count` raises ValueError.
    """
    if not files:
        raise ValueError("sample_chat_examples: no corpus files to draw examples from")
    rng = random.Random(seed)
    makers = (make_continue_example, make_docstring_example)
    seen, examples = set(), []
    for _ in range(50 * count + 1000):
        if len(examples) == count:
            break
        text = files[rng.randrange(len(files))].text
        first = len(examples) % 2
        for maker in (makers[first], makers[1 - first]):
            example = maker(text, rng)
            if example is not None and (example.prompt, example.response) not in seen:
                seen.add((example.prompt, example.response))
                examples.append(example)
                break
    if strict and len(examples) < count:
        raise ValueError(f"only {len(examples)} distinct chat examples could be made, {count} requested")
    return examples


# --------------------------------------------------------------------------- tokenizer + model


def train_tokenizer(files: Sequence[CorpusFile], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE over the corpus with the special tokens and the chat template attached."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((f.text for f in files), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[END, *ROLE_TOKENS],
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def stop_token_ids(tokenizer) -> list[int]:
    """Ids that end an assistant turn: `<|end|>` and eos."""
    return [tokenizer.convert_tokens_to_ids(END), tokenizer.eos_token_id]


def build_model_config(cfg: TinyTargetConfig, tokenizer) -> LlamaConfig:
    """LlamaConfig for the tiny target; vocab = the trained tokenizer's actual size."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=stop_token_ids(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
    )


def encode_documents(tokenizer, files: Sequence[CorpusFile]) -> torch.Tensor:
    """One token stream: bos + file + eos for each file, concatenated. -> [N] int64."""
    encoded = tokenizer([f.text for f in files], add_special_tokens=False)["input_ids"]
    stream = []
    for ids in encoded:
        stream.extend([tokenizer.bos_token_id, *ids, tokenizer.eos_token_id])
    return torch.tensor(stream, dtype=torch.long)


def encode_heldout_tokens(tokenizer, files: Sequence[CorpusFile], n_tokens: int, per_file: int = 2048) -> torch.Tensor:
    """n_tokens from the start of each file in turn, at most per_file each (so the eval spans
    many modules rather than one big file), encoding only as many files as needed. -> [n] int64
    """
    parts, have = [], 0
    for f in files:
        if have >= n_tokens:
            break
        parts.append(encode_documents(tokenizer, [f])[:per_file])
        have += len(parts[-1])
    return torch.cat(parts)[:n_tokens]


def encode_chats(tokenizer, examples: Sequence[ChatExample], max_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rendered examples as (input_ids [T], labels [T]); labels are -100 outside the answer.

    Only the answer and its `<|end|>` are trained (the prompt's code is LM data anyway): with
    loss on the template too, a small model learns "after a newline comes <|assistant|>" and
    its greedy replies degenerate into role tokens.
    """
    pairs = []
    for example in examples:
        chat = tokenize_chat(tokenizer, example.messages(), max_len, stop_token_ids(tokenizer))
        ids = torch.tensor(chat.input_ids, dtype=torch.long)
        labels = torch.where(torch.tensor(chat.loss_mask, dtype=torch.bool), ids, -100)
        if chat.num_assistant_tokens:
            pairs.append((ids, labels))
    return pairs


# --------------------------------------------------------------------------- training


def resolve_precision(precision: str) -> str:
    """`auto` -> bfloat16 where the CPU has native bf16 (AMX or AVX512-BF16), else float32."""
    if precision != "auto":
        return precision
    native = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)() or getattr(
        torch.cpu, "_is_avx512_bf16_supported", lambda: False
    )()
    return "bfloat16" if native else "float32"


def _lr_at(step: int, cfg: TinyTargetConfig) -> float:
    """Linear warmup over 5% of the steps, then cosine down to 10% of the peak."""
    warmup = max(1, cfg.train_steps // 20)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.train_steps - warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _token_loss_sum(model, input_ids, labels, attention_mask, autocast: bool) -> torch.Tensor:
    """Summed next-token cross-entropy; labels == -100 are ignored. [B, T] x 3 -> scalar.

    attention_mask None = no padding, which lets SDPA take its causal fast path.
    """
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [B, T, V]
    return F.cross_entropy(
        logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
    )


def _lm_batch(stream: torch.Tensor, rows: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """Random windows of the document stream. -> [rows, seq_len]"""
    starts = torch.randint(0, len(stream) - seq_len, (rows,), generator=gen)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


def _chat_batch(chats, rows: int, pad_id: int, gen: torch.Generator):
    """Random chat samples, right-padded to the longest. -> ids, labels, attention_mask [rows, T]"""
    picks = torch.randint(0, len(chats), (rows,), generator=gen).tolist()
    width = max(len(chats[i][0]) for i in picks)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    labels = torch.full((rows, width), -100, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for r, i in enumerate(picks):
        n = len(chats[i][0])
        ids[r, :n], labels[r, :n], mask[r, :n] = chats[i][0], chats[i][1], 1
    return ids, labels, mask


def _train_step(model, stream, chats, cfg: TinyTargetConfig, pad_id: int, gen, autocast: bool) -> torch.Tensor:
    """Loss of one batch: lm rows of stream windows + chat rows, averaged over real tokens."""
    chat_rows = round(cfg.batch_size * cfg.chat_fraction) if chats else 0
    lm_rows = cfg.batch_size - chat_rows
    loss_sum, tokens = torch.zeros(()), 0
    if lm_rows:
        window = _lm_batch(stream, lm_rows, cfg.seq_len, gen)
        loss_sum = loss_sum + _token_loss_sum(model, window, window, None, autocast)
        tokens += lm_rows * (cfg.seq_len - 1)
    if chat_rows:
        ids, labels, mask = _chat_batch(chats, chat_rows, pad_id, gen)
        loss_sum = loss_sum + _token_loss_sum(model, ids, labels, mask, autocast)
        tokens += int((labels[:, 1:] != -100).sum())
    return loss_sum / max(tokens, 1)


def train_model(
    model: LlamaForCausalLM,
    stream: torch.Tensor,
    chats: Sequence[tuple[torch.Tensor, torch.Tensor]],
    cfg: TinyTargetConfig,
    pad_id: int,
    on_progress: ProgressFn | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, float]:
    """Next-token training on stream windows mixed with chat samples (share cfg.chat_fraction).

    Chat rows start at position 0 with bos, as they will at inference, so they go through a
    separate forward pass instead of being packed into the stream windows.
    """
    autocast = resolve_precision(cfg.precision) == "bfloat16"
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    recent: list[float] = []
    for step in range(cfg.train_steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, cfg)
        loss = _train_step(model, stream, chats, cfg, pad_id, gen, autocast)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent = (recent + [loss.item()])[-20:]
        if not cfg.num_threads and step % 20 == 19:  # the machine's load moves: look again
            choice = thread_choice(0, own_threads=torch.get_num_threads())
            if choice.threads != torch.get_num_threads() and log:
                log(f"tiny target step {step + 1}: {choice.describe()}")
            torch.set_num_threads(choice.threads)
        if on_progress:
            on_progress("train", step + 1, cfg.train_steps)
    model.eval()
    return {"train_loss_last20": sum(recent) / len(recent), "precision": "bfloat16" if autocast else "float32"}


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, seq_len: int, batch_size: int) -> tuple[float, int]:
    """Mean next-token loss (nats) over non-overlapping windows of a held-out stream, in fp32."""
    n_windows = max(1, (len(stream) - 1) // seq_len)
    windows = [stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n_windows)]
    total, count = 0.0, 0
    for b in range(0, len(windows), batch_size):
        batch = torch.nn.utils.rnn.pad_sequence(windows[b : b + batch_size], batch_first=True, padding_value=-100)
        total += _token_loss_sum(model, batch.clamp(min=0), batch, (batch != -100).long(), autocast=False).item()
        count += int((batch[:, 1:] != -100).sum())
    return total / count, count


def unigram_baselines(train_stream: torch.Tensor, eval_stream: torch.Tensor, vocab_size: int) -> dict[str, float]:
    """Unigram entropy of the training tokens and its cross-entropy on the eval tokens (nats).

    Add-one smoothing keeps unseen eval tokens finite; this is the loss of a model that
    ignores context, so a real LM must be well below it.
    """
    counts = torch.bincount(train_stream, minlength=vocab_size).double() + 1.0
    log_p = (counts / counts.sum()).log()
    entropy = float(-(log_p.exp() * log_p).sum())
    cross = float(-log_p[eval_stream[1:]].mean())
    return {"unigram_entropy_train": entropy, "unigram_cross_entropy_heldout": cross}


@torch.no_grad()
def chat_response_loss(model, tokenizer, examples: Sequence[ChatExample], max_len: int) -> float:
    """Mean loss (nats) on the answer tokens (+ `<|end|>`) of held-out chat examples."""
    total, count = 0.0, 0
    for ids, labels in encode_chats(tokenizer, examples, max_len):
        total += _token_loss_sum(model, ids[None], labels[None], None, autocast=False).item()
        count += int((labels[1:] != -100).sum())
    return total / max(count, 1)


@torch.no_grad()
def greedy_reply(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """The target's greedy answer to one user prompt (for eval.json, a human sanity check)."""
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        generation_config=GenerationConfig(
            do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=stop_token_ids(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
        ),
    )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def evaluate_target(model, tokenizer, cfg: TinyTargetConfig, train_stream: torch.Tensor) -> dict:
    """Held-out LM loss vs. the unigram baseline, held-out chat loss and one greedy sample."""
    heldout = heldout_corpus()
    eval_stream = encode_heldout_tokens(tokenizer, heldout, cfg.eval_tokens + 1)
    loss, n_tokens = heldout_loss(model, eval_stream, cfg.seq_len, cfg.batch_size)
    result = {"heldout_loss": loss, "heldout_perplexity": math.exp(loss), "heldout_tokens": n_tokens}
    result.update(unigram_baselines(train_stream, eval_stream, len(tokenizer)))
    result["loss_vs_unigram"] = loss - result["unigram_cross_entropy_heldout"]
    examples = sample_chat_examples(heldout, 16, seed=cfg.seed + 1)
    result["heldout_chat_response_loss"] = chat_response_loss(model, tokenizer, examples, cfg.max_position_embeddings)
    # the shortest prompt, so prompt + reply fits the context of even the test-size target
    shortest = min(examples, key=lambda e: len(e.prompt))
    result["sample_prompt"] = shortest.prompt
    result["sample_reply"] = greedy_reply(model, tokenizer, shortest.prompt, 48)
    return result


# --------------------------------------------------------------------------- build + cache


def code_sha256() -> str:
    """Hash of this module's source: any edit here invalidates cached targets."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def tiny_target_key(cfg: TinyTargetConfig, corpus_sha: str) -> str:
    """Cache key = sha256(config without num_threads, resolved precision, corpus, code)."""
    fields = cfg.model_dump(exclude={"num_threads"})
    payload = {
        "config": fields,
        "precision": resolve_precision(cfg.precision),
        "corpus": corpus_sha,
        "code": code_sha256(),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class ThreadChoice:
    """How many torch CPU threads a stage runs at, and the figures that decided it (logged by the stage)."""

    threads: int
    cores: int
    requested: int = 0
    load_elsewhere: float | None = None  # 1-minute load average minus our own threads
    busy_elsewhere: float | None = None  # cores busy now outside this process tree (looked only when the load says so)
    speedup: float | None = None  # parallel_speedup(threads), measured when more than one core is free

    def describe(self) -> str:
        if self.requested:
            return f"CPU threads: {self.threads} (requested)"
        seen = [f"load elsewhere {self.load_elsewhere:.2f}"] if self.load_elsewhere is not None else []
        if self.busy_elsewhere is not None:
            seen.append(f"busy elsewhere now {self.busy_elsewhere:.2f} cores")
        if self.speedup is not None:
            seen.append(f"{self.cores - self._busy()} threads measured {self.speedup:.2f}x one "
                        f"(needs {MIN_PARALLEL_SPEEDUP}x)")
        return f"CPU threads: {self.threads} of {self.cores} cores ({'; '.join(seen)})"

    def _busy(self) -> int:
        others = self.load_elsewhere or 0.0
        if self.busy_elsewhere is not None:
            others = min(others, self.busy_elsewhere)
        return int(others + 0.5)


def thread_choice(requested: int, own_threads: int = 0) -> ThreadChoice:
    """Requested threads, or (0) the usable cores that other processes are not keeping busy.

    On a shared machine, OpenMP threads that outnumber the free cores spin in barriers while
    a peer is descheduled: measured on 2 cores with another job running, a training step
    went from 1.0 s (1 thread) to 5 s (2 threads) and a generate step from 7 ms to 200 ms.
    The 1-minute load average minus our own threads estimates the busy cores; more than one thread only
    where a quick measurement (parallel_speedup) shows they pay on this machine.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if requested:
        return ThreadChoice(requested, cores, requested)
    load = max(0.0, os.getloadavg()[0] - own_threads) if hasattr(os, "getloadavg") else 0.0
    # the load average also counts this process's last minute (the stage before): look now
    busy = busy_cores_elsewhere() if load >= 0.5 else None
    choice = ThreadChoice(1, cores, 0, load, busy)
    free = cores - choice._busy()
    if free <= 1:
        return choice
    speedup = parallel_speedup(free)
    return replace(choice, threads=free if speedup >= MIN_PARALLEL_SPEEDUP else 1, speedup=speedup)


def _thread_count(requested: int, own_threads: int = 0) -> int:
    return thread_choice(requested, own_threads).threads


def busy_cores_elsewhere(window_s: float = 0.3) -> float:
    """Cores kept busy over the next `window_s` by processes other than this one (its reaped children neither)."""
    import psutil  # imported where used, as in eagle3.data.placement

    me = psutil.Process()

    def busy() -> tuple[float, float]:
        t, own = psutil.cpu_times(), me.cpu_times()
        return (t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0),
                own.user + own.system + own.children_user + own.children_system)

    (machine0, own0), start = busy(), time.monotonic()
    time.sleep(window_s)
    (machine1, own1), elapsed = busy(), time.monotonic() - start
    return max(0.0, (machine1 - machine0) - (own1 - own0)) / elapsed


# More threads must be at least this much faster to be used. Some machines lose from a second thread even with
# both cores idle: on the 2-vCPU VMs our CI runs on, 2 threads ran the demo's regeneration 3-5x slower than 1
# at load average 0.0 (issue 38).
MIN_PARALLEL_SPEEDUP = 1.3
# A measurement is kept for a few minutes when threads paid, for seconds when they did not: a probe taken while
# something else briefly ran (a server starting, the previous stage's teardown) must not pin a stage to 1 thread.
_SPEEDUP_TTL_S = {True: 300.0, False: 20.0}
_speedups: dict[int, tuple[float, float]] = {}  # threads -> (measured at, speedup)


def parallel_speedup(threads: int) -> float:
    """How much faster `threads` torch threads run a step shaped like the demo's ops than one thread does
    (a [2048, 64] x [64, 512] product and its softmax: small ops, where a second thread's fork and join costs
    most), best of 3 rounds each (~0.1 s on an idle machine), measured now and kept (_SPEEDUP_TTL_S)."""
    now = time.monotonic()
    if threads in _speedups:
        measured_at, speedup = _speedups[threads]
        if now - measured_at < _SPEEDUP_TTL_S[speedup >= MIN_PARALLEL_SPEEDUP]:
            return speedup
    rows, weight = torch.randn(2048, 64), torch.randn(64, 512)
    previous = torch.get_num_threads()

    def best_time(n: int) -> float:
        torch.set_num_threads(n)
        torch.softmax(rows @ weight, dim=-1)  # wake the thread pool
        rounds = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(4):
                torch.softmax(rows @ weight, dim=-1)
            rounds.append(time.perf_counter() - start)
        return min(rounds)

    try:
        speedup = best_time(1) / best_time(threads)
    finally:
        torch.set_num_threads(previous)
    _speedups[threads] = (now, speedup)
    return speedup


@contextlib.contextmanager
def cpu_threads(requested: int = 0, log: Callable[[str], None] | None = None):
    """Run a block with thread_choice(requested) torch CPU threads (`log` gets the choice and its figures),
    restoring the old count."""
    previous = torch.get_num_threads()
    choice = thread_choice(requested)
    if log:
        log(choice.describe())
    torch.set_num_threads(choice.threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)


def _save_target(model, tokenizer, out: Path, info: dict, evaluation: dict) -> None:
    """Write a standard HF model dir: weights, config, tokenizer (template inside), metadata."""
    model.save_pretrained(out)
    tokenizer.model_max_length = model.config.max_position_embeddings
    # save_jinja_files=False keeps the template inside tokenizer_config.json, where older
    # readers (and SGLang's tokenizer manager via transformers) look first.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=stop_token_ids(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    ).save_pretrained(out)
    (out / "build_info.json").write_text(json.dumps(info, indent=2))
    (out / "eval.json").write_text(json.dumps(evaluation, indent=2))


def _build_into(cfg: TinyTargetConfig, files: list[CorpusFile], out: Path, info: dict, progress: ProgressFn,
                log: Callable[[str], None] | None = None) -> None:
    """Tokenizer -> corpus encoding -> chat pool -> training -> evaluation -> save, into `out`."""
    timings = {}
    t0 = time.perf_counter()
    progress("tokenizer", 0, 1)
    tokenizer = train_tokenizer(files, cfg.vocab_size)
    stream = encode_documents(tokenizer, files)
    if len(stream) <= cfg.seq_len:
        raise ValueError(
            f"target.tiny.corpus_max_bytes={cfg.corpus_max_bytes} gives {len(stream)} tokens, "
            f"fewer than one training sequence (seq_len={cfg.seq_len})"
        )
    chat_rows = round(cfg.batch_size * cfg.chat_fraction)
    pool_size = min(max(chat_rows * cfg.train_steps, 1), 20_000) if chat_rows else 0
    examples = sample_chat_examples(files, pool_size, cfg.seed, strict=False) if pool_size else []
    chats = encode_chats(tokenizer, examples, cfg.seq_len) if examples else []
    progress("tokenizer", 1, 1)
    timings["tokenize_s"] = time.perf_counter() - t0

    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(build_model_config(cfg, tokenizer))
    t1 = time.perf_counter()
    stats = train_model(model, stream, chats, cfg, tokenizer.pad_token_id, progress, log)
    timings["train_s"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    progress("eval", 0, 1)
    evaluation = {**evaluate_target(model, tokenizer, cfg, stream), **stats}
    evaluation["train_tokens_seen"] = cfg.train_steps * cfg.batch_size * cfg.seq_len
    evaluation["corpus_tokens"] = len(stream)
    progress("eval", 1, 1)
    timings["eval_s"] = time.perf_counter() - t2
    evaluation["timings"] = timings
    evaluation["num_parameters"] = sum(p.numel() for p in model.parameters())
    _save_target(model, tokenizer, out, info, evaluation)


def build_tiny_target(cfg: TinyTargetConfig, cache_root: Path, on_progress: ProgressFn | None = None,
                      log: Callable[[str], None] | None = None) -> Path:
    """Build (or reuse from cache) the tiny target; returns its HF model directory.

    The directory is `cache_root/tiny-target-<key[:16]>`, key = tiny_target_key(...). It is
    built in a temporary sibling and renamed into place, so a present directory is complete;
    a concurrent builder that loses the rename race discards its copy and uses the winner's.
    """
    progress = on_progress or (lambda stage, done, total: None)
    files = training_corpus(cfg.corpus_max_bytes, cfg.seed)
    key = tiny_target_key(cfg, corpus_sha256(files))
    final = Path(cache_root) / f"tiny-target-{key[:16]}"
    if (final / "eval.json").is_file():
        progress("cached", 1, 1)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    info = {
        "key": key,
        "config": cfg.model_dump(),
        "corpus_files": len(files),
        "corpus_bytes": sum(len(f.text.encode()) for f in files),
        "corpus_sha256": corpus_sha256(files),
        "code_sha256": code_sha256(),
    }
    try:
        with cpu_threads(cfg.num_threads, log):
            _build_into(cfg, files, tmp, info, progress, log)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "eval.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
