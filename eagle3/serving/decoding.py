"""Reference speculative decoder: an HF target with a KV cache plus an EAGLE-3 (or test) drafter.

Owns the decode loop SGLang 0.5.23 runs for EAGLE-3, at batch size 1 per request:
prefill -> [draft tree -> one target verify forward -> accept -> roll the caches back] ...,
and plain decoding in the same engine for baselines. Draft trees follow SGLang's scheme
(`srt/speculative/spec_utils.py: select_top_k_tokens`, `eagle_utils.py: organize_draft_results`):
step 1 keeps the topk draft tokens, each later step expands the topk frontier nodes by topk and
keeps the topk best by cumulative probability, then the num_draft_tokens-1 best nodes overall
(plus the root) are verified in ONE target forward under a tree attention mask.

Verification: greedy -> the longest path whose tokens equal the target's argmax (SGLang's
`verify_tree_greedy`). Temperature > 0 -> chains (topk=1) use the standard speculative-sampling
rule (draft tokens sampled from q, accept with min(1, p/q), resample from norm(max(0, p-q)));
trees use SGLang's target-only tree sampling (at each node one coin against the target's
cumulative probability of the children; otherwise sample from p with the children removed).
Both leave the output distribution equal to the target's.

Risk: index shifting. The draft entry at position j pairs the target feature of position j with
the token at j+1 and predicts the token at j+2 (EAGLE-3 training alignment); a one-off error
here only lowers acceptance, never breaks correctness, so the tests record the draft's inputs.
Differences from SGLang: draft tree steps attend to each node's true ancestors (SGLang's
draft-decode KV indices give frontier slot r the entries of whatever node held slot r before,
an approximation); tie-breaking in the node selection is stable (parents before children).
Both only change which tokens are proposed, never what is output.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Protocol, Sequence

import torch
from transformers import DynamicCache

from eagle3.data.capture import decoder_layers

GREEDY_EPS = 1e-6  # SGLang sampling_params._SAMPLING_EPS: a lower temperature means greedy (top_k = 1)


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class SpecConfig:
    """Effective speculative settings (after `sglang_args.resolve_speculative_args`)."""

    num_steps: int
    topk: int
    num_draft_tokens: int

    def __post_init__(self) -> None:
        if self.num_steps < 1 or self.topk < 1 or self.num_draft_tokens < 2:
            raise ValueError(
                f"expected num_steps >= 1, topk >= 1, num_draft_tokens >= 2; found "
                f"{self.num_steps}/{self.topk}/{self.num_draft_tokens}"
            )
        if self.topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(
                f"a chain (topk=1) verifies num_steps + 1 = {self.num_steps + 1} tokens, found num_draft_tokens="
                f"{self.num_draft_tokens}; SGLang rewrites it (resolve the argv with eagle3.serving.sglang_args first)"
            )
        capacity = self.topk + (self.num_steps - 1) * self.topk**2
        if self.num_draft_tokens - 1 > capacity:
            raise ValueError(
                f"num_draft_tokens - 1 = {self.num_draft_tokens - 1} exceeds the {capacity} candidates a "
                f"{self.num_steps}-step, topk-{self.topk} draft tree offers"
            )


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling (SGLang `sampling_params` subset)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1


# --------------------------------------------------------------------------- forward timings


class ForwardTimer:
    """Wall seconds of each forward, by SGLang's device-timer category (`srt/utils/device_timer.py` callers:
    `extend` = prefill, `decode` = a plain decode step, `target_verify`, `eagle_draft_extend`, `eagle_draft` =
    the whole multi-step draft), handed to `on_forward(category, seconds)`; a no-op while that is None."""

    def __init__(self, on_forward: Callable[[str, float], None] | None = None) -> None:
        self.on_forward = on_forward

    @contextmanager
    def __call__(self, category: str):
        if self.on_forward is None:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.on_forward(category, time.perf_counter() - start)


# --------------------------------------------------------------------------- target


class TargetModel:
    """An HF causal LM with a DynamicCache, returning logits and (optionally) aux hidden states.

    Args:
        model: a transformers `*ForCausalLM` in eval mode.
        aux_hidden_indices: HF `output_hidden_states` indices concatenated (ascending) into the
            aux features EAGLE-3 needs (eagle3.data.capture.aux_ids_to_hf_indices of the draft's ids).
            Captured by hooks as eagle3.data.capture does: index j < L is the residual stream entering
            decoder layer j, index L the last layer's pre-norm output.
    """

    def __init__(self, model: torch.nn.Module, aux_hidden_indices: Sequence[int] = ()) -> None:
        self.model = model.eval()
        self.config = model.config
        self.aux_hidden_indices = tuple(sorted(set(aux_hidden_indices)))
        self.vocab_size = int(self.config.vocab_size)
        self.max_positions = int(getattr(self.config, "max_position_embeddings", 1 << 30))
        eos = getattr(model, "generation_config", None)
        eos = getattr(eos, "eos_token_id", None) if eos is not None else None
        if eos is None:
            eos = self.config.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.dtype = next(model.parameters()).dtype
        self._layers = decoder_layers(model)
        if any(not 0 <= i <= len(self._layers) for i in self.aux_hidden_indices):
            raise ValueError(f"aux hidden indices must be in [0, {len(self._layers)}], found {self.aux_hidden_indices}")

    def _capture_hooks(self, store: dict[int, torch.Tensor]) -> list:
        """Hooks filling store[j] for each aux index during one forward (removed right after)."""
        def pre(j, module, args, kwargs):
            store[j] = args[0] if args else kwargs["hidden_states"]

        def post(j, module, args, output):
            store[j] = output[0] if isinstance(output, tuple) else output

        n = len(self._layers)
        return [self._layers[j].register_forward_pre_hook(partial(pre, j), with_kwargs=True) if j < n
                else self._layers[-1].register_forward_hook(partial(post, j)) for j in self.aux_hidden_indices]

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: DynamicCache,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        with_aux: bool = False,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run [1, N] new tokens after the cached ones.

        Returns logits [N, V] (or [1, V] with last_only) in float32 and aux [N, k*H_t] or None.
        attention_mask: additive float mask [1, 1, N, S_past + N] for tree verification.
        """
        store: dict[int, torch.Tensor] = {}
        handles = self._capture_hooks(store) if with_aux else []
        try:
            out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                             cache=cache, use_cache=True, logits_to_keep=1 if last_only else 0)
        finally:
            for h in handles:
                h.remove()
        aux = torch.cat([store[j][0] for j in self.aux_hidden_indices], dim=-1) if store else None  # [N, k*H_t]
        return out.logits[0].float(), aux


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def keep_cache_entries(cache: DynamicCache, keep: int | torch.Tensor) -> None:
    """Roll a DynamicCache back: keep the first `keep` positions, or the positions in index tensor `keep`."""
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        if isinstance(keep, int):
            layer.keys = layer.keys[:, :, :keep]
            layer.values = layer.values[:, :, :keep]
        else:
            layer.keys = layer.keys.index_select(2, keep)
            layer.values = layer.values.index_select(2, keep)


# --------------------------------------------------------------------------- draft tree


@dataclass
class DraftTree:
    """Verify input: node 0 is the root (last committed token), nodes 1.. are draft tokens.

    tokens: target ids [N]; parents[i] < i for i >= 1 (parents[0] = -1).
    q: for sampled chains only, the draft distribution over the target vocab each draft token was
       drawn from, [N-1, V] (row i belongs to node i+1).
    """

    tokens: list[int]
    parents: list[int]
    q: torch.Tensor | None = None

    def __post_init__(self) -> None:
        assert self.parents[0] == -1 and all(0 <= p < i for i, p in enumerate(self.parents) if i)
        depths = [0] * len(self.tokens)
        children: list[list[int]] = [[] for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            depths[i] = depths[self.parents[i]] + 1
            children[self.parents[i]].append(i)
        self.depths = depths
        self.children = children

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents) if i)

    def ancestor_mask(self) -> torch.Tensor:
        """Bool [N, N]: row i attends to node j iff j is i or an ancestor of i.

        Example (root 0; 1 and 2 children of 0; 3 child of 1):
            [[1,0,0,0],
             [1,1,0,0],
             [1,0,1,0],
             [1,1,0,1]]
        """
        n = len(self.tokens)
        mask = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            mask[i] |= mask[self.parents[i]]
        return mask

    def verify_inputs(
        self, prefix_len: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """input_ids [1, N], position_ids [1, N], additive mask [1, 1, N, prefix_len + N] (None for chains)."""
        input_ids = torch.tensor([self.tokens], dtype=torch.long)
        position_ids = (torch.tensor(self.depths, dtype=torch.long) + prefix_len).unsqueeze(0)
        if self.is_chain:
            return input_ids, position_ids, None
        allowed = torch.cat([torch.ones(len(self.tokens), prefix_len, dtype=torch.bool), self.ancestor_mask()], dim=1)
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        return input_ids, position_ids, mask[None, None]


ExpandFn = Callable[[list[int], torch.Tensor], torch.Tensor]


def build_draft_tree(
    root_token: int,
    first_logits: torch.Tensor,
    expand: ExpandFn,
    spec: SpecConfig,
    hot_token_ids: torch.Tensor | None = None,
    target_vocab_size: int | None = None,
    sample_temperature: float | None = None,
    generator: torch.Generator | None = None,
) -> DraftTree:
    """Grow SGLang's draft tree from a drafter's logits (topk = 1: a chain of argmax tokens).

    Args:
        first_logits: [V_d] draft logits for the token after the root.
        expand: expand(parent_rows, tokens) runs one draft step for the new frontier: row r has
            target token tokens[r] and descends from row parent_rows[r] of the previous frontier
            (row 0 = the root for the first call); returns logits [len(tokens), V_d].
        hot_token_ids: draft index -> target id ([V_d]); None = identity.
        sample_temperature: chains only; sample each draft token from softmax(logits / T) and
            return those distributions (scattered to the target vocab) as `q`.
    """
    to_target = (lambda ids: hot_token_ids[ids]) if hot_token_ids is not None else (lambda ids: ids)
    if sample_temperature is not None:
        assert spec.topk == 1, "sampled draft proposals are for chains"
    if spec.topk == 1:
        return _chain(root_token, first_logits, expand, spec.num_steps, to_target, sample_temperature, generator,
                      hot_token_ids, target_vocab_size)
    k = spec.topk
    probs = torch.softmax(first_logits.float(), dim=-1)
    top_p, top_i = torch.topk(probs, k)  # step 1: [k]
    scores, tokens = [top_p], [to_target(top_i)]
    cand_parent = [-1] * k  # candidate index of each candidate's parent (-1 = root)
    frontier_cand, frontier_scores, frontier_tokens = list(range(k)), top_p, tokens[0]
    parent_rows = [0] * k
    for _ in range(1, spec.num_steps):
        probs = torch.softmax(expand(parent_rows, frontier_tokens).float(), dim=-1)
        child_p, child_i = torch.topk(probs, k, dim=-1)  # [k, k]
        expand_scores = (frontier_scores[:, None] * child_p).flatten()  # [k*k], cumulative path probability
        base = sum(s.numel() for s in scores)
        scores.append(expand_scores)
        tokens.append(to_target(child_i.flatten()))
        cand_parent += [c for c in frontier_cand for _ in range(k)]
        frontier_scores, sel = torch.topk(expand_scores, k)  # sglang select_top_k_tokens
        sel_list = sel.tolist()
        parent_rows = [s // k for s in sel_list]
        frontier_cand = [base + s for s in sel_list]
        frontier_tokens = tokens[-1][sel]
    return _organize_tree(root_token, torch.cat(scores), torch.cat(tokens).tolist(), cand_parent,
                          spec.num_draft_tokens - 1)


def _organize_tree(root_token: int, scores: torch.Tensor, tokens: list[int], cand_parent: list[int],
                   n_keep: int) -> DraftTree:
    """sglang organize_draft_results: the n_keep best candidates, in candidate order, plus the root.

    A child's score never exceeds its parent's, and the stable sort puts the parent (lower
    candidate index) first on ties, so every kept node's parent is kept too.
    """
    order = torch.sort(scores, descending=True, stable=True).indices[:n_keep]
    keep = sorted(order.tolist())
    node_of = {c: i + 1 for i, c in enumerate(keep)}
    parents = [-1] + [0 if cand_parent[c] < 0 else node_of[cand_parent[c]] for c in keep]
    return DraftTree(tokens=[root_token] + [tokens[c] for c in keep], parents=parents)


def _chain(root_token, first_logits, expand, num_steps, to_target, temperature, generator, hot_ids, vocab_size):
    """topk = 1: each draft token is the argmax (greedy; SGLang's top-1 of the same softmax), or a
    sample from q = softmax(logits / T) whose q is kept (scattered to the target vocab) for rejection sampling."""
    toks, qs, logits = [], [], first_logits
    for step in range(num_steps):
        if temperature is None:
            draft_idx = logits.argmax()
        else:
            q = torch.softmax(logits.float() / temperature, dim=-1)  # [V_d]
            draft_idx = torch.multinomial(q, 1, generator=generator)
            qs.append(q if hot_ids is None else torch.zeros(vocab_size).index_copy_(0, hot_ids, q))
        toks.append(int(to_target(draft_idx)))
        if step + 1 < num_steps:
            logits = expand([0], torch.tensor([toks[-1]]))[0]
    return DraftTree(tokens=[root_token] + toks, parents=list(range(-1, num_steps)), q=torch.stack(qs) if qs else None)


# --------------------------------------------------------------------------- drafters


class Drafter(Protocol):
    """What the engine needs from a draft model; per-request state lives in the returned object.

    The committed sequence x_0..x_{L-1} ends in the root x_{L-1}, which the target has not yet
    processed; the target has produced aux features for positions 0..L-2.
    """

    aux_hidden_indices: tuple[int, ...]

    def start(self, input_ids: torch.Tensor, aux: torch.Tensor | None) -> Any:
        """New request: input_ids [L] (prompt + first generated token), aux [L-1, k*H_t]."""

    def extend(self, state: Any, tokens: torch.Tensor, aux: torch.Tensor | None) -> None:
        """Commit tokens [n] after the root; aux [n, k*H_t] belongs to the old root and the accepted drafts."""

    def propose(self, state: Any, spec: SpecConfig, sample_temperature: float | None,
                generator: torch.Generator | None) -> DraftTree:
        """Draft tree rooted at the last committed token."""


@dataclass
class _OracleState:
    committed: list[int]
    cache: DynamicCache


class OracleDrafter:
    """Proposes the target's own greedy continuation (test drafter: everything is accepted greedily).

    For trees the greedy path gets probability 0.9 at every step and the other branches random
    leftovers, so SGLang's selection keeps the full greedy path whenever num_draft_tokens - 1 >= steps.
    """

    aux_hidden_indices: tuple[int, ...] = ()

    def __init__(self, target: TargetModel, seed: int = 0) -> None:
        self.target = target
        self.generator = torch.Generator().manual_seed(seed)

    def start(self, input_ids, aux):
        return _OracleState(committed=input_ids.tolist(), cache=self.target.new_cache())

    def extend(self, state, tokens, aux):
        state.committed.extend(tokens.tolist())

    def propose(self, state, spec, sample_temperature, generator):
        greedy = self._greedy_continuation(state, spec.num_steps)
        v = self.target.vocab_size

        def path_logits(depth: int | None, n: int) -> torch.Tensor:
            noise = torch.rand(n, v, generator=self.generator) + 1e-3
            probs = 0.1 * noise / noise.sum(-1, keepdim=True)
            if depth is not None and depth < len(greedy):
                probs[:, greedy[depth]] = 0.9
            return probs.log()

        on_path = [True]  # per frontier row: does it continue the greedy path?
        depth = [0]

        def expand(parent_rows, tokens):
            nonlocal on_path
            rows_on = [on_path[r] and int(t) == greedy[depth[0]] for r, t in zip(parent_rows, tokens.tolist())]
            depth[0] += 1
            on_path = rows_on
            return torch.stack([path_logits(depth[0] if on else None, 1)[0] for on in rows_on])

        return build_draft_tree(state.committed[-1], path_logits(0, 1)[0], expand, spec,
                                target_vocab_size=v, sample_temperature=sample_temperature, generator=generator)

    @torch.inference_mode()
    def _greedy_continuation(self, state: _OracleState, n: int) -> list[int]:
        done = cache_length(state.cache)
        new = torch.tensor([state.committed[done:]])
        out = []
        for _ in range(n):
            logits, _ = self.target.forward(new, state.cache, last_only=True)
            out.append(int(logits[-1].argmax()))
            new = torch.tensor([[out[-1]]])
        keep_cache_entries(state.cache, len(state.committed) - 1)
        return out


class RandomDrafter:
    """Random draft trees (test drafter: the output must still be exactly the target's)."""

    aux_hidden_indices: tuple[int, ...] = ()

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def start(self, input_ids, aux):
        return [int(input_ids[-1])]

    def extend(self, state, tokens, aux):
        state[0] = int(tokens[-1])

    def propose(self, state, spec, sample_temperature, generator):
        def logits(n: int) -> torch.Tensor:
            return 3.0 * torch.randn(n, self.vocab_size, generator=self.generator)

        return build_draft_tree(state[0], logits(1)[0], lambda rows, toks: logits(len(rows)), spec,
                                target_vocab_size=self.vocab_size, sample_temperature=sample_temperature,
                                generator=generator)


@dataclass
class _EagleState:
    cache: tuple[torch.Tensor, torch.Tensor] | None  # draft KV over committed entries, [1, n_kv, P, d] each
    committed_len: int  # P: draft entries j = 0..P-1 (feature j, token j+1)
    root_token: int
    pending_tokens: torch.Tensor  # [n] tokens for the next draft extend
    pending_aux: torch.Tensor  # [n, k*H_t]
    last_hidden: torch.Tensor | None = None  # [1, H] pre-norm output of the last committed entry
    first_logits: torch.Tensor | None = None  # [V_d] its draft logits (the token after the root)


class Eagle3Drafter:
    """EAGLE-3 draft model (eagle3.draft.model.Eagle3DraftModel API) as a Drafter.

    Args:
        model: the draft; `project`, `decoder_step`, `compute_logits`, `draft_to_target`.
        aux_hidden_indices: HF hidden-state indices of the target features the draft was trained on
            (eagle3.data.capture.aux_ids_to_hf_indices of the draft's aux_layer_ids).
    """

    def __init__(self, model: torch.nn.Module, aux_hidden_indices: Sequence[int]) -> None:
        self.model = model.eval()
        self.aux_hidden_indices = tuple(sorted(set(aux_hidden_indices)))
        vd = int(model.config.draft_vocab_size or model.config.vocab_size)
        self.hot_token_ids = model.draft_to_target(torch.arange(vd)).long()  # [V_d] draft index -> target id
        if torch.equal(self.hot_token_ids, torch.arange(vd)):
            self.hot_token_ids = None
        self.vocab_size = int(model.config.vocab_size)
        self.timer = ForwardTimer()  # the engine hands its own in: draft extend and draft steps timed apart

    def start(self, input_ids, aux):
        # entry j pairs feature j with token j+1: tokens x_1..x_{L-1}, features 0..L-2
        return _EagleState(cache=None, committed_len=0, root_token=int(input_ids[-1]),
                           pending_tokens=input_ids[1:], pending_aux=aux)

    def extend(self, state, tokens, aux):
        state.pending_tokens = torch.cat([state.pending_tokens, tokens])
        state.pending_aux = torch.cat([state.pending_aux, aux])
        state.root_token = int(tokens[-1])

    @torch.inference_mode()
    def propose(self, state, spec, sample_temperature, generator):
        with self.timer("eagle_draft_extend"):
            last_hidden, first_logits = self._draft_extend(state)
        with self.timer("eagle_draft"):
            return self._grow_tree(state, spec, sample_temperature, generator, last_hidden, first_logits)

    def _grow_tree(self, state, spec, sample_temperature, generator, last_hidden, first_logits):
        p = state.committed_len
        rows = _EagleRows(hidden=last_hidden, slots=[[]])  # frontier rows: input hidden + ancestor slots

        def expand(parent_rows: list[int], tokens: torch.Tensor) -> torch.Tensor:
            n_past = state.cache[0].shape[2]
            hidden = rows.hidden if parent_rows == [0] else rows.hidden[parent_rows]  # [k, H]
            slots = [rows.slots[r] for r in parent_rows]
            new_slots = [s + [n_past - p + i] for i, s in enumerate(slots)]
            mask = None
            if len(parent_rows) > 1:
                mask = torch.zeros(1, 1, len(parent_rows), n_past + len(parent_rows), dtype=torch.bool)
                mask[..., :p] = True
                for i, s in enumerate(new_slots):
                    mask[0, 0, i, [p + j for j in s]] = True
            depth = len(new_slots[0])
            positions = torch.full((1, len(parent_rows)), p + depth - 1, dtype=torch.long)
            out, state.cache = self.model.decoder_step(tokens.view(1, -1), hidden.unsqueeze(0), positions,
                                                       attention_mask=mask, past_key_value=state.cache)
            rows.hidden, rows.slots = out[0], new_slots
            return self.model.compute_logits(out)[0]  # [k, V_d]

        tree = build_draft_tree(state.root_token, first_logits, expand, spec, self.hot_token_ids,
                                self.vocab_size, sample_temperature, generator)
        state.cache = (state.cache[0][:, :, :p], state.cache[1][:, :, :p])
        return tree

    def _draft_extend(self, state: _EagleState) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the pending entries to the draft cache; return the last pre-norm hidden [1, H] and logits [V_d]."""
        n = state.pending_tokens.numel()
        if n == 0:  # proposing again without new tokens: same root, same first step
            return state.last_hidden, state.first_logits
        positions = torch.arange(state.committed_len, state.committed_len + n).unsqueeze(0)
        hidden = self.model.project(state.pending_aux.unsqueeze(0))  # [1, n, k*H_t] -> [1, n, H]
        out, state.cache = self.model.decoder_step(state.pending_tokens.view(1, -1), hidden, positions,
                                                   attention_mask=None, past_key_value=state.cache)
        state.committed_len += n
        state.pending_tokens = state.pending_tokens[:0]
        state.pending_aux = state.pending_aux[:0]
        last = out[:, -1:]  # [1, 1, H]
        state.last_hidden, state.first_logits = last[0], self.model.compute_logits(last)[0, 0]
        return state.last_hidden, state.first_logits


@dataclass
class _EagleRows:
    hidden: torch.Tensor  # [rows, H]
    slots: list[list[int]]  # per row: draft-step entries (offsets after the committed ones) of its ancestors


# --------------------------------------------------------------------------- engine


@dataclass
class RequestStats:
    """Speculative counters of one request (SGLang meta_info `spec_*` semantics)."""

    num_steps: int = 0
    num_draft_tokens: int = 0
    accepted_per_verify: list[int] = field(default_factory=list)  # correct drafts of each verify, in order

    def record(self, num_correct: int, spec: SpecConfig) -> None:
        self.num_steps, self.num_draft_tokens = spec.num_steps, spec.num_draft_tokens
        self.accepted_per_verify.append(num_correct)

    @property
    def verify_ct(self) -> int:
        return len(self.accepted_per_verify)

    @property
    def num_correct_drafts(self) -> int:
        return sum(self.accepted_per_verify)

    @property
    def num_proposed_drafts(self) -> int:
        return self.verify_ct * (self.num_draft_tokens - 1)

    @property
    def correct_drafts_histogram(self) -> list[int]:
        """Index a: verifies with exactly a correct drafts (a = 0..num_steps)."""
        hist = [0] * (self.num_steps + 1)
        for a in self.accepted_per_verify:
            hist[a] += 1
        return hist

    @property
    def accepted_by_position(self) -> list[int]:
        """Index k: verifies that accepted draft position k+1 (accept length by draft position)."""
        return [sum(a > k for a in self.accepted_per_verify) for k in range(self.num_steps)]


@dataclass
class RequestState:
    """One request in flight: committed tokens, caches and counters."""

    prompt_ids: list[int]
    sampling: SamplingParams
    output_ids: list[int]
    cache: DynamicCache
    draft_state: Any
    generator: torch.Generator
    stats: RequestStats
    started_at: float
    finish_reason: dict | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class GenerationResult:
    output_ids: list[int]
    finish_reason: dict
    prompt_tokens: int
    stats: RequestStats
    latency_s: float

    @property
    def accept_length(self) -> float:
        """SGLang's spec_accept_length: completion tokens / verify forwards (prefill token included)."""
        return len(self.output_ids) / self.stats.verify_ct if self.stats.verify_ct else 0.0


class SpeculativeEngine:
    """Plain or speculative decoding of one request at a time over a TargetModel.

    Args:
        target: the target model wrapper (its aux indices must cover the drafter's).
        drafter: None = plain decoding.
        spec: effective (steps, topk, draft tokens); required with a drafter.
        seed: base seed for requests without their own `seed`.
    """

    def __init__(self, target: TargetModel, drafter: Drafter | None = None, spec: SpecConfig | None = None,
                 seed: int = 0) -> None:
        if (drafter is None) != (spec is None):
            raise ValueError("give both drafter and spec (speculative) or neither (plain decoding)")
        missing = set(getattr(drafter, "aux_hidden_indices", ())) - set(target.aux_hidden_indices)
        if missing:
            raise ValueError(f"target returns aux indices {target.aux_hidden_indices}, drafter needs {sorted(missing)}")
        self.target, self.drafter, self.spec = target, drafter, spec
        self.timer = ForwardTimer()  # set timer.on_forward to receive each forward's seconds
        self._drafter_timed = hasattr(drafter, "timer")  # times its draft extend and its steps apart
        if self._drafter_timed:
            drafter.timer = self.timer
        self._seed = seed
        self._requests = 0

    @property
    def speculative(self) -> bool:
        return self.drafter is not None

    @torch.inference_mode()
    def start(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> RequestState:
        """Prefill the prompt and commit the first token (SGLang counts it as a completion token)."""
        if not prompt_ids:
            raise ValueError("expected a non-empty prompt")
        if len(prompt_ids) + sampling.max_new_tokens > self.target.max_positions:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) exceeds the "
                f"target's context length {self.target.max_positions}"
            )
        if max(prompt_ids) >= self.target.vocab_size or min(prompt_ids) < 0:
            raise ValueError(f"prompt token ids must be in [0, {self.target.vocab_size})")
        self._requests += 1
        seed = sampling.seed if sampling.seed is not None else self._seed * 1_000_003 + self._requests
        state = RequestState(list(prompt_ids), sampling, [], self.target.new_cache(), None,
                             torch.Generator().manual_seed(seed), RequestStats(), time.perf_counter())
        with self.timer("extend"):
            logits, aux = self.target.forward(torch.tensor([state.prompt_ids]), state.cache,
                                              with_aux=self.speculative, last_only=True)
        first = self._sample(logits, state)[0]
        self._commit(state, [first])
        if self.speculative and not state.finished:
            state.draft_state = self.drafter.start(torch.tensor(state.prompt_ids + [first]), aux)
        return state

    @torch.inference_mode()
    def step(self, state: RequestState) -> list[int]:
        """One decode iteration (one target forward); returns the tokens committed by it."""
        assert not state.finished
        if not self.speculative:
            position = torch.tensor([[cache_length(state.cache)]])
            with self.timer("decode"):
                logits, _ = self.target.forward(torch.tensor([[state.output_ids[-1]]]), state.cache, position)
            return self._commit(state, [self._sample(logits, state)[0]])
        return self._speculative_step(state)

    def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> GenerationResult:
        """Decode one request to completion."""
        state = self.start(prompt_ids, sampling)
        while not state.finished:
            self.step(state)
        return self.result(state)

    def result(self, state: RequestState) -> GenerationResult:
        return GenerationResult(state.output_ids, state.finish_reason, len(state.prompt_ids), state.stats,
                                time.perf_counter() - state.started_at)

    # ------------------------------------------------------------------ speculative step

    def _speculative_step(self, state: RequestState) -> list[int]:
        spec, sampling = self.spec, state.sampling
        sampled_chain = not sampling.greedy and spec.topk == 1
        with nullcontext() if self._drafter_timed else self.timer("eagle_draft"):
            tree = self.drafter.propose(state.draft_state, spec, sampling.temperature if sampled_chain else None,
                                        state.generator)
        prefix = cache_length(state.cache)
        input_ids, position_ids, mask = tree.verify_inputs(prefix, self.target.dtype)
        with self.timer("target_verify"):
            logits, aux = self.target.forward(input_ids, state.cache, position_ids, mask, with_aux=True)  # [N, V]
        if sampling.greedy:
            path, bonus = verify_greedy(tree, logits)
        elif sampled_chain:
            path, bonus = verify_chain_rejection(tree, self._probs(logits, sampling), state.generator)
        else:
            path, bonus = verify_tree_target_only(tree, self._probs(logits, sampling), state.generator)
        state.stats.record(len(path) - 1, spec)
        new_tokens = self._commit(state, [tree.tokens[i] for i in path[1:]] + [bonus])
        if not state.finished:
            if path[-1] == len(path) - 1:  # accepted nodes are 0..a: plain crop
                keep_cache_entries(state.cache, prefix + len(path))
            else:
                keep_cache_entries(state.cache, torch.cat([torch.arange(prefix), prefix + torch.tensor(path)]))
            self.drafter.extend(state.draft_state, torch.tensor(new_tokens), aux[path] if aux is not None else None)
        return new_tokens

    # ------------------------------------------------------------------ sampling and stopping

    def _probs(self, logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
        """Target sampling distribution(s) [N, V] after temperature, top-k and top-p."""
        probs = torch.softmax(logits / sampling.temperature, dim=-1)
        if 0 < sampling.top_k < probs.shape[-1]:
            kth = torch.topk(probs, sampling.top_k, dim=-1).values[:, -1:]
            probs = probs.masked_fill(probs < kth, 0.0)
        if sampling.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True, dim=-1)
            drop = sorted_p.cumsum(-1) - sorted_p > sampling.top_p  # keep the smallest prefix reaching top_p
            probs = probs.scatter(-1, idx, sorted_p.masked_fill(drop, 0.0))
        return probs / probs.sum(-1, keepdim=True)

    def _sample(self, logits: torch.Tensor, state: RequestState) -> list[int]:
        if state.sampling.greedy:
            return logits.argmax(-1).tolist()
        return torch.multinomial(self._probs(logits, state.sampling), 1, generator=state.generator)[:, 0].tolist()

    def _commit(self, state: RequestState, tokens: list[int]) -> list[int]:
        """Append tokens up to the first stop condition; sets finish_reason (SGLang's shapes)."""
        sp = state.sampling
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.target.eos_token_ids))
        taken = []
        for t in tokens:
            taken.append(t)
            state.output_ids.append(t)
            if t in stops:
                state.finish_reason = {"type": "stop", "matched": t}
                break
            if len(state.output_ids) >= sp.max_new_tokens:
                state.finish_reason = {"type": "length", "length": sp.max_new_tokens}
                break
        return taken


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """Longest path whose tokens equal the target argmax (sgl_kernel verify_tree_greedy).

    logits: target logits at each tree node [N, V]. Returns (accepted nodes from the root 0, bonus
    token = the target's choice after the last accepted node); the same return for the two below.
    """
    choice = logits.argmax(-1).tolist()  # [N]
    node, path = 0, [0]
    while True:
        nxt = next((c for c in tree.children[node] if tree.tokens[c] == choice[node]), None)
        if nxt is None:
            return path, choice[node]
        node = nxt
        path.append(node)


def verify_chain_rejection(tree: DraftTree, probs: torch.Tensor, gen: torch.Generator) -> tuple[list[int], int]:
    """Standard speculative sampling on a chain: accept d with min(1, p(d)/q(d)), else resample norm(max(0, p-q)).

    probs: target distribution at each node [N, V]; tree.q[i-1]: the draft distribution node i was drawn from.
    """
    path = [0]
    for i in range(1, len(tree.tokens)):
        d, p, q = tree.tokens[i], probs[i - 1], tree.q[i - 1]
        if torch.rand((), generator=gen) * q[d] < p[d]:  # u < p/q without dividing by q(d)
            path.append(i)
            continue
        residual = (p - q).clamp_min(0.0)
        return path, int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
    return path, int(torch.multinomial(probs[len(tree.tokens) - 1], 1, generator=gen))


def verify_tree_target_only(tree: DraftTree, probs: torch.Tensor, gen: torch.Generator) -> tuple[list[int], int]:
    """SGLang's target-only tree sampling: child j of a node is taken with probability p(token_j).

    One coin u per node; children are scanned in order and child j accepted if u falls in its
    slice of the target's cumulative probability. If none is hit, the next token is drawn from p
    with the children's tokens removed. Either way the token follows p exactly. probs: [N, V].
    """
    node, path = 0, [0]
    while True:
        p = probs[node]
        u = float(torch.rand((), generator=gen))
        cum, hit = 0.0, None
        for c in tree.children[node]:
            cum += float(p[tree.tokens[c]])
            if u < cum:
                hit = c
                break
        if hit is None:
            residual = p.clone()
            residual[[tree.tokens[c] for c in tree.children[node]]] = 0.0
            if float(residual.sum()) <= 0.0:  # all mass on the children and u rounded past it
                hit = max(tree.children[node], key=lambda c: float(p[tree.tokens[c]]))
            else:
                return path, int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
        node = hit
        path.append(node)
