"""The benchmark's prompt sets (eagle3.serving.bench_prompts): JSONL formats and errors, the held-out check."""

from __future__ import annotations

import json

import pytest

from eagle3.serving.bench_prompts import builtin_prompts, heldout_overlap, load_prompts_jsonl


def test_load_prompts_jsonl_formats_and_errors(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text("\n".join([
        json.dumps({"question_id": 81, "turns": ["Write a poem.", "Now shorter."]}),
        json.dumps({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                 {"role": "assistant", "content": "Hello"}]}),
        "",
        json.dumps({"prompt": "2+2?"}),
    ]) + "\n")
    assert load_prompts_jsonl(good) == [
        [{"role": "user", "content": "Write a poem."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "2+2?"}],
    ]
    cases = {
        '{"prompt": "ok"}\n{"prompt": "x"\n': "p1.jsonl:2: invalid JSON",
        '{"prompt": "ok"}\n{"question": "x"}\n': "p2.jsonl:2: expected 'turns', 'messages'",
        '{"turns": []}\n': "p3.jsonl:1: 'turns' must be a non-empty list",
        '{"messages": [{"role": "user", "content": 3}]}\n': "p4.jsonl:1: message 0",
        '{"messages": [{"role": "assistant", "content": "a"}]}\n': "p5.jsonl:1: no user message",
        "\n\n": "p6.jsonl: no prompts",
    }
    for i, (text, message) in enumerate(cases.items(), start=1):
        bad = tmp_path / f"p{i}.jsonl"
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_prompts_jsonl(bad)
    with pytest.raises(FileNotFoundError):
        load_prompts_jsonl(tmp_path / "missing.jsonl")


def test_heldout_overlap_finds_trained_prompts(tmp_path):
    prompts = builtin_prompts(4, seed=3)
    assert len(prompts) == 4 and all(p[-1]["role"] == "user" for p in prompts)
    samples = tmp_path / "samples.jsonl"
    rows = [{"id": 0, "split": "train", "messages": [*prompts[2], {"role": "assistant", "content": "x"}]},
            {"id": 1, "split": "validation",
             "messages": [{"role": "user", "content": "  " + prompts[0][0]["content"]}]},
            {"id": 2, "split": "train", "messages": [{"role": "user", "content": "unrelated"}]}]
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert heldout_overlap(prompts, samples) == [0, 2]
    assert heldout_overlap(prompts, samples, split="train") == [2]
    assert heldout_overlap(["unrelated", "other"], samples) == [0]
    with pytest.raises(ValueError, match=r"prompts\[0\]: expected a str or chat messages"):
        heldout_overlap([[1, 2, 3]], samples)
    samples.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"id": 9}) + "\n")
    with pytest.raises(ValueError, match=r"samples.jsonl:2: not a sample"):
        heldout_overlap(prompts, samples)
