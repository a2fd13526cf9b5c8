"""The benchmark's prompt sets: built-in, from JSONL, rendered through the target's chat template, and the
held-out check against the training samples (a benchmark prompt the draft trained on would flatter it).

Used by the benchmark stage, the nightly gate and the served-traffic data source; needs only the stdlib at
import (eagle3.data and transformers are imported when a function needs them).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Message = dict[str, str]


def builtin_prompts(n: int, seed: int = 1) -> list[list[Message]]:
    """n single-turn user prompts from eagle3.data.prompts.builtin_conversations (answers dropped).

    The pool is the held-out stdlib text the training data also draws from: check the result
    with heldout_overlap against the draft's samples.jsonl.
    """
    from eagle3.data.prompts import builtin_conversations, prompt_part

    return [prompt_part(c) for c in builtin_conversations(n, seed)]


def _jsonl_record_prompt(record: Any, where: str) -> list[Message]:
    """One JSONL record -> the messages to answer.

    {"turns": [str, ...]} (MT-bench): the first turn only, since later turns need the model's
    own earlier answers; {"messages": [...]}: up to the last user message; {"prompt": str}.
    """
    from eagle3.data.chat import validate_messages
    from eagle3.data.prompts import prompt_part

    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {str(record)[:80]!r}")
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise ValueError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
        return [{"role": "user", "content": turns[0]}]
    if "messages" in record:
        return prompt_part(validate_messages(record["messages"], where), where)
    if isinstance(record.get("prompt"), str) and record["prompt"]:
        return [{"role": "user", "content": record["prompt"]}]
    raise ValueError(f"{where}: expected 'turns', 'messages' or a non-empty 'prompt', found keys {sorted(record)}")


def load_prompts_jsonl(path: str | Path) -> list[list[Message]]:
    """Benchmark prompts from a JSONL file (see _jsonl_record_prompt); bad lines -> ValueError 'file:line'."""
    from eagle3.data.prompts import read_jsonl_records

    return read_jsonl_records(Path(path), _jsonl_record_prompt)


def render_prompts(conversations: Sequence[Sequence[Message]], tokenizer_dir: str | Path) -> list[list[int]]:
    """Conversations -> prompt ids through the target's chat template with the generation prompt,
    tokenized without extra special tokens (the template writes bos), as the server's chat endpoint does."""
    from transformers import AutoTokenizer

    from eagle3.data.chat import render_chat

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if not tokenizer.chat_template:
        raise ValueError(f"{tokenizer_dir}: the tokenizer has no chat template")
    texts = [render_chat(tokenizer, list(c), add_generation_prompt=True) for c in conversations]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def _user_turns(prompt: str | Sequence[Message], where: str) -> list[str]:
    if isinstance(prompt, str):
        return [prompt.strip()]
    if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in prompt):
        raise ValueError(f"{where}: expected a str or chat messages (check before render_prompts), "
                         f"got {str(prompt)[:80]}")
    return [m["content"].strip() for m in prompt if m.get("role") == "user"]


def heldout_overlap(prompts: Sequence[str | Sequence[Message]], samples_jsonl: str | Path,
                    split: str | None = None,
                    render_ids: Callable[[Sequence[str | Sequence[Message]]], list[list[int]]] | None = None,
                    ) -> list[int]:
    """Indices of prompts the draft has seen in samples_jsonl (optionally one split): a user turn
    (whitespace-stripped) equal to a sample's user turn, or -- for served samples (data.source: served,
    which carry the prompt's ids as served and maybe no messages) -- prompt ids equal to the sample's
    prompt ids. `render_ids` turns the prompts into the ids the benchmark sends (render_prompts); it is
    called only when the file holds served samples, and without it served samples are not compared."""
    path = Path(samples_jsonl)
    if not path.is_file():
        raise FileNotFoundError(f"samples file not found: {path}")
    seen: set[str] = set()
    seen_ids: set[tuple[int, ...]] = set()
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                sample = json.loads(line)
                if split is None or sample["split"] == split:
                    seen.update(_user_turns(sample["messages"], f"{path}:{lineno}"))
                    if "num_prompt_tokens" in sample:  # a served sample: input_ids = prompt ids + answer ids
                        seen_ids.add(tuple(sample["input_ids"][: sample["num_prompt_tokens"]]))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a sample with 'messages' ({type(e).__name__}: {e})") from e
    found = {i for i, p in enumerate(prompts) if any(turn in seen for turn in _user_turns(p, f"prompts[{i}]"))}
    if seen_ids and render_ids is not None:
        found |= {i for i, ids in enumerate(render_ids(prompts)) if tuple(ids) in seen_ids}
    return sorted(found)