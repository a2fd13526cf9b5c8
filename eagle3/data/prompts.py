"""Prompts and conversations: the built-in held-out chats of the tiny target, `.jsonl` prompt
files (`{"prompt": str}` or `{"messages": [...]}` per line, bad lines named by file:line), and
the part of a conversation the target answers anew.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from eagle3.config import DataConfig
from eagle3.data.chat import Message, validate_messages
from eagle3.data.files import LogFn
from eagle3.data.tiny_target import heldout_corpus, sample_chat_examples

T = TypeVar("T")


def builtin_conversations(num_samples: int, seed: int) -> list[list[Message]]:
    """Deterministic single-turn chats from stdlib files the tiny target never trained on.

    Half "Continue this Python code:" snippets, half docstring -> function prompts; each
    carries the true continuation as its assistant message (used when regeneration is off).
    """
    return [ex.messages() for ex in sample_chat_examples(heldout_corpus(), num_samples, seed)]


def _record_messages(record: object, where: str) -> list[Message]:
    """Messages of one jsonl record: {"prompt": str} or {"messages": [...]}."""
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return [{"role": "user", "content": record["prompt"]}]
    if isinstance(record, dict) and "messages" in record:
        return validate_messages(record["messages"], where)
    raise ValueError(f"{where}: expected {{'prompt': str}} or {{'messages': [...]}}, got {str(record)[:120]!r}")


def read_jsonl_records(path: Path, parse: Callable[[object, str], T]) -> list[T]:
    """`parse(record, "file:line")` for every non-empty line of a .jsonl file; bad lines raise
    ValueError naming file and line, an absent file FileNotFoundError, an empty one ValueError."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file not found: {path}")
    parsed = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON ({exc.msg})") from exc
            parsed.append(parse(record, where))
    if not parsed:
        raise ValueError(f"{path}: no prompts")
    return parsed


def read_prompts_jsonl(path: Path) -> list[list[Message]]:
    """All conversations in a .jsonl file; a bad line raises ValueError naming file and line."""
    return read_jsonl_records(path, _record_messages)


def load_conversations(data_cfg: DataConfig, log: LogFn = print) -> list[list[Message]]:
    """data.prompts -> up to num_samples conversations (a seeded subset when the file has more)."""
    if data_cfg.prompts == "builtin":
        return builtin_conversations(data_cfg.num_samples, data_cfg.seed)
    conversations = read_prompts_jsonl(Path(data_cfg.prompts))
    if len(conversations) > data_cfg.num_samples:
        keep = sorted(random.Random(data_cfg.seed).sample(range(len(conversations)), data_cfg.num_samples))
        conversations = [conversations[i] for i in keep]
    elif len(conversations) < data_cfg.num_samples:
        log(f"data: {data_cfg.prompts} has {len(conversations)} conversations (< num_samples={data_cfg.num_samples})")
    return conversations


def prompt_part(messages: Sequence[Message], where: str = "conversation") -> list[Message]:
    """Messages up to and including the last user message: what the target answers anew."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        raise ValueError(f"{where}: no user message to answer")
    return list(messages[: last_user + 1])
