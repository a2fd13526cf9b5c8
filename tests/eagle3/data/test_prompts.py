"""Built-in and .jsonl prompts (eagle3.data.prompts)."""

from __future__ import annotations

import pytest

from eagle3.data.prompts import builtin_conversations, read_prompts_jsonl
from eagle3.data.tiny_target import CONTINUE_PREFIX, DOCSTRING_PREFIX


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
