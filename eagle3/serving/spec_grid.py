"""The grid of speculative settings a serving plan chooses from, each as SGLang 0.5.23 would run it.

Owns: `Setting` (num_steps, eagle_topk, num_draft_tokens as SGLang runs them, or speculation off) and
`resolve_grid`, which puts every asked combination through SGLang's own resolution rules
(`eagle3.serving.sglang_args.resolve_speculative_args`, the rules the deploy preflight applies): a chain
(topk 1) verifies num_steps + 1 tokens whatever was asked, so chains asked with other draft-token counts
collapse into one setting; a tree asked for more draft tokens than its steps can propose would crash
SGLang at the first decode and is left out, with SGLang's reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from eagle3.serving.sglang_args import resolve_speculative_args


@dataclass(frozen=True, order=True)
class Setting:
    """Effective speculative settings; num_steps 0 = speculation off (the baseline)."""

    num_steps: int
    eagle_topk: int
    num_draft_tokens: int

    @property
    def speculative(self) -> bool:
        return self.num_steps > 0

    @property
    def chain(self) -> bool:
        return self.speculative and self.eagle_topk == 1

    @property
    def label(self) -> str:
        return f"{self.num_steps}/{self.eagle_topk}/{self.num_draft_tokens}" if self.speculative else "off"

    def launch_flags(self) -> list[str]:
        """SGLang launch flags for this setting (none: speculation off)."""
        if not self.speculative:
            return []
        return ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", str(self.num_steps),
                "--speculative-eagle-topk", str(self.eagle_topk),
                "--speculative-num-draft-tokens", str(self.num_draft_tokens)]

    @classmethod
    def of(cls, effective: dict | None) -> Setting:
        """From an effective-settings dict (num_steps, eagle_topk, num_draft_tokens); None = off."""
        if not effective:
            return OFF
        return cls(int(effective["num_steps"]), int(effective["eagle_topk"]), int(effective["num_draft_tokens"]))

    @classmethod
    def parse(cls, label: str) -> Setting:
        """`3/1/4` or `off`."""
        if label == "off":
            return OFF
        parts = label.split("/")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"expected a setting as num_steps/eagle_topk/num_draft_tokens (e.g. 3/1/4) or 'off', "
                             f"found {label!r}")
        return cls(*map(int, parts))


OFF = Setting(0, 0, 0)


def resolve_setting(num_steps: int, topk: int, draft_tokens: int,
                    target_architecture: str = "LlamaForCausalLM") -> tuple[Setting | None, str | None]:
    """One asked combination as SGLang runs it -> (setting, None), or (None, SGLang's reason it cannot run)."""
    argv = ["--model-path", "/config-only", "--device", "cuda", "--speculative-algorithm", "EAGLE3",
            "--speculative-num-steps", str(num_steps), "--speculative-eagle-topk", str(topk),
            "--speculative-num-draft-tokens", str(draft_tokens)]
    res = resolve_speculative_args(argv, target_architecture=target_architecture)
    if not res.ok:
        return None, "; ".join(res.errors + res.runtime_errors)
    return Setting(res.speculative_num_steps, res.speculative_eagle_topk, res.speculative_num_draft_tokens), None


def resolve_grid(steps: Sequence[int], topks: Sequence[int], draft_tokens: Sequence[int],
                 target_architecture: str = "LlamaForCausalLM") -> tuple[list[Setting], list[str]]:
    """Every (steps, topk, draft tokens) combination as SGLang runs it, once each, sorted; and one line per
    combination SGLang cannot run (`3/4/64: <SGLang's reason>`)."""
    settings: set[Setting] = set()
    refused: list[str] = []
    for s, k, n in _combinations(steps, topks, draft_tokens):
        setting, reason = resolve_setting(s, k, n, target_architecture)
        if setting is None:
            refused.append(f"{s}/{k}/{n}: {reason}")
        else:
            settings.add(setting)
    return sorted(settings), refused


def _combinations(steps: Iterable[int], topks: Iterable[int], draft_tokens: Iterable[int]):
    """Chains are asked once per depth (SGLang fixes their draft tokens); trees at every draft-token count."""
    for s in sorted(set(steps)):
        for k in sorted(set(topks)):
            for n in ([s + 1] if k == 1 else sorted(set(draft_tokens))):
                yield s, k, n
