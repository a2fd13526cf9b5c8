"""Chat rendering and the assistant-token loss mask.

Owns: applying the target's own chat template (the one SGLang serves with) and deriving
`loss_mask` from character offsets of the assistant contents in the rendered text.

Risk: template drift between training and serving (reference eagle3-training.md (e).3). We
never re-implement a template: the text is always `tokenizer.apply_chat_template`, and the
mask is found by locating each assistant message inside that text.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

Message = dict[str, str]
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class TokenizedChat:
    """A rendered conversation: `input_ids` [T] and `loss_mask` [T] (1 = assistant token)."""

    input_ids: list[int]
    loss_mask: list[int]

    @property
    def num_assistant_tokens(self) -> int:
        return sum(self.loss_mask)


def validate_messages(messages: Sequence[Message], where: str) -> list[Message]:
    """Check OpenAI-style messages (role in system/user/assistant, content a str); returns a copy."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {i} must be {{'role': one of {ROLES}, 'content': str}}, got {m!r}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def render_chat(tokenizer, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
    """The target's chat template applied to messages, as text."""
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)


def _content_start(text: str, content: str, lower: int) -> tuple[int, int] | None:
    """Span of content (or its stripped form, for templates that trim) at or after `lower`."""
    for candidate in (content, content.strip()):
        if candidate and text.startswith(candidate, lower):
            return lower, lower + len(candidate)
    for candidate in (content, content.strip()):
        found = text.find(candidate, lower) if candidate else -1
        if found >= 0:
            return found, found + len(candidate)
    return None


def assistant_char_spans(tokenizer, messages: Sequence[Message], text: str) -> list[tuple[int, int]]:
    """[start, end) character spans of each assistant content inside the rendered text.

    By template segments: the content of assistant message i starts where the rendering of
    messages[:i] with the generation prompt ends. A plain substring search would be fooled
    by short answers that also occur in template markup ("d" inside "<|end|>"). If a template
    renders earlier turns differently once more follow (e.g. strips reasoning), the content
    is searched from the end of the previous span instead. Raises ValueError when an
    assistant content does not appear verbatim (or stripped) in the text.
    """
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = render_chat(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        aligned = bool(i) and text.startswith(prefix) and len(prefix) >= cursor
        lower = len(prefix) if aligned else cursor
        if not m["content"]:
            # An empty answer (the target stopped at once) still owns its stop token.
            if aligned:
                spans.append((lower, lower))
            continue
        span = _content_start(text, m["content"], lower)
        if span is None:
            raise ValueError(
                f"assistant message {i} not found verbatim in the rendered chat after offset {lower}: "
                f"the template rewrites it ({m['content'][:60]!r})"
            )
        spans.append(span)
        cursor = span[1]
    return spans


def mask_from_spans(
    offsets: Sequence[tuple[int, int]], input_ids: Sequence[int], spans: Sequence[tuple[int, int]], stop_ids: set[int]
) -> list[int]:
    """Per-token 0/1: 1 if the token starts inside an assistant span, or is the stop token right after one.

    The stop token (e.g. `<|end|>`, `<|eot_id|>`) is what the assistant emits last, so the
    draft must learn to propose it too; template text after it (a newline) is not produced
    by the model at serving time and stays 0.
    """
    mask = [0] * len(input_ids)
    for start, end in spans:
        for t, (tok_start, tok_end) in enumerate(offsets):
            if start <= tok_start < end and tok_end > tok_start:
                mask[t] = 1
        following = next((t for t, (a, b) in enumerate(offsets) if a >= end and b > a), None)
        if following is not None and input_ids[following] in stop_ids:
            mask[following] = 1
    return mask


def tokenize_chat(
    tokenizer, messages: Sequence[Message], max_length: int, stop_ids: Sequence[int] = ()
) -> TokenizedChat:
    """Render with the chat template, tokenize, mask assistant tokens, truncate to max_length.

    Args:
        tokenizer: an HF fast tokenizer with a chat template.
        messages: the full conversation, assistant answers included.
        max_length: tokens kept (the tail is cut; the mask is cut with it).
        stop_ids: end-of-turn ids; the one right after an assistant content is masked in.
    Returns:
        TokenizedChat with input_ids [T] and loss_mask [T], T <= max_length.
    """
    text = render_chat(tokenizer, messages)
    # The template already writes bos; add_special_tokens=False avoids a second one.
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    spans = assistant_char_spans(tokenizer, messages, text)
    mask = mask_from_spans(enc["offset_mapping"], ids, spans, set(stop_ids))
    return TokenizedChat(ids[:max_length], mask[:max_length])


def tokenize_generated(tokenizer, prompt: Sequence[Message], answer_ids: Sequence[int], max_length: int) -> TokenizedChat:
    """A sample from the target's own generation: the prompt as it was rendered for generation
    (with the assistant header) followed by the generated ids, stop token included, masked in.

    Example: prompt ids [bos, <|user|>, "hi", <|end|>, <|assistant|>] + answer [a, b, <|end|>]
    -> input_ids [bos, <|user|>, "hi", <|end|>, <|assistant|>, a, b, <|end|>],
       loss_mask [0, 0, 0, 0, 0, 1, 1, 1].
    """
    prompt_ids = tokenizer(render_chat(tokenizer, prompt, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    ids = list(prompt_ids) + list(answer_ids)
    mask = [0] * len(prompt_ids) + [1] * len(answer_ids)
    return TokenizedChat(ids[:max_length], mask[:max_length])


def chat_template_sha256(tokenizer) -> str:
    """sha256 of the chat template text (recorded with the data to detect template drift)."""
    template = tokenizer.chat_template or ""
    if isinstance(template, dict):
        template = "\n".join(f"{k}\n{v}" for k, v in sorted(template.items()))
    return hashlib.sha256(template.encode()).hexdigest()


def turn_stop_ids(tokenizer, generation_eos: int | Sequence[int] | None = None) -> list[int]:
    """End-of-turn ids: the generation config's eos ids (if given) plus the tokenizer's eos."""
    if generation_eos is None:
        ids = []
    else:
        ids = [generation_eos] if isinstance(generation_eos, int) else list(generation_eos)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))
