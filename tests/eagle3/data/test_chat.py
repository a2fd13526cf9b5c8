"""Chat template, tokens and the loss mask (eagle3.data.chat)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from eagle3.data.chat import assistant_char_spans, tokenize_chat
from eagle3.data.target import load_target
from eagle3.data.tiny_target import CHAT_TEMPLATE


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


def test_tokenize_generated_spells_out_prompt_and_answer(tiny_target_dir):
    from eagle3.data.chat import render_chat, tokenize_generated

    _, tokenizer = load_target(tiny_target_dir)
    prompt = [{"role": "user", "content": "def f(x):"}]
    prompt_ids = tokenizer(render_chat(tokenizer, prompt, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    got = tokenize_generated(tokenizer, prompt, [7, 9, end], max_length=64)
    assert got.input_ids == prompt_ids + [7, 9, end]
    assert got.loss_mask == [0] * len(prompt_ids) + [1, 1, 1]
    assert tokenize_generated(tokenizer, prompt, [7, 9, end], max_length=len(prompt_ids) + 1).loss_mask[-1] == 1
