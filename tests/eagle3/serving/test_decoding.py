"""eagle3.serving.decoding: exactness of speculative decoding, acceptance accounting, draft trees, sampling.

Targets are tiny random-init Llamas (exactness needs no trained model). The bulk equivalence
test uses a scripted drafter that knows the target's greedy continuation and corrupts it at
random, so every setting sees full, partial and zero acceptance and every cache rollback path.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from transformers import AutoConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM

from eagle3.data.capture import aux_ids_to_hf_indices
from eagle3.data.target import load_target
from eagle3.draft.model import DraftModelConfig, Eagle3DraftModel
from eagle3.serving.decoding import (
    DraftTree,
    Eagle3Drafter,
    OracleDrafter,
    RandomDrafter,
    SamplingParams,
    SpecConfig,
    SpeculativeEngine,
    TargetModel,
    build_draft_tree,
    verify_chain_rejection,
    verify_tree_target_only,
)

SETTINGS = [SpecConfig(3, 1, 4), SpecConfig(7, 1, 8), SpecConfig(5, 4, 8), SpecConfig(4, 2, 6)]
SETTING_IDS = ["chain-3-1-4", "chain-7-1-8", "tree-5-4-8", "tree-4-2-6"]
VOCAB = 96
GREEDY = SamplingParams(max_new_tokens=20, ignore_eos=True)


def make_target(vocab: int = VOCAB, layers: int = 4, hidden: int = 64, seed: int = 0, logit_scale: float = 1.0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """Tiny models run fastest on one thread; two threads on a shared 2-core box spin-wait."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target_model():
    return make_target()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (int(torch.randint(2, 24, (), generator=g)),), generator=g).tolist()
            for _ in range(50)]


@pytest.fixture(scope="module")
def greedy_refs(target_model, prompts):
    plain = SpeculativeEngine(TargetModel(target_model))
    return {tuple(p): plain.generate(p, GREEDY).output_ids for p in prompts}


@pytest.fixture(scope="module")
def long_refs(target_model, prompts):
    """Greedy continuations past GREEDY.max_new_tokens: a draft of the last verify may run past the cut."""
    plain = SpeculativeEngine(TargetModel(target_model))
    return {tuple(p): plain.generate(p, SamplingParams(max_new_tokens=40, ignore_eos=True)).output_ids for p in prompts}


class ScriptedDrafter:
    """Drafter that proposes the known greedy continuation, each token corrupted with prob `noise`.

    Trees are grown by build_draft_tree (SGLang's selection) from logits that favour the scripted
    token, so tree shapes, partial acceptance and rollbacks all occur.
    """

    aux_hidden_indices = ()

    def __init__(self, refs: dict[tuple, list[int]], vocab: int, noise: float, seed: int = 0) -> None:
        self.refs, self.vocab, self.noise = refs, vocab, noise
        self.gen = torch.Generator().manual_seed(seed)

    def start(self, input_ids, aux):
        committed = input_ids.tolist()
        for prompt, out in self.refs.items():
            if committed[: len(prompt)] == list(prompt) and committed[len(prompt)] == out[0]:
                return {"prompt": prompt, "committed": committed}
        raise AssertionError("unknown prompt")

    def extend(self, state, tokens, aux):
        state["committed"].extend(tokens.tolist())

    def propose(self, state, spec, sample_temperature, generator):
        ref = list(state["prompt"]) + self.refs[state["prompt"]] + [0] * 16
        pos = len(state["committed"])

        def logits(good: list[bool], depth: int) -> torch.Tensor:
            out = torch.randn(len(good), self.vocab, generator=self.gen)
            for r, ok in enumerate(good):
                hit = ref[pos + depth] if torch.rand((), generator=self.gen) > self.noise else \
                    int(torch.randint(0, self.vocab, (), generator=self.gen))
                out[r, hit] += 8.0 if ok else 2.0
            return out

        rows, depth = [True], [0]

        def expand(parent_rows, tokens):
            depth[0] += 1
            good = [rows[p] and int(t) == ref[pos + depth[0] - 1] for p, t in zip(parent_rows, tokens.tolist())]
            rows[:] = good
            return logits(good, depth[0])

        return build_draft_tree(state["committed"][-1], logits([True], 0)[0], expand, spec,
                                target_vocab_size=self.vocab, sample_temperature=sample_temperature,
                                generator=generator)


class RecordingDrafter:
    """Wraps a drafter; records each proposed tree with the output length when it was proposed."""

    def __init__(self, inner) -> None:
        self.inner, self.aux_hidden_indices, self.proposals = inner, inner.aux_hidden_indices, []
        self.committed = 0

    def start(self, input_ids, aux):
        self.committed = 1  # the prefill's first token
        return self.inner.start(input_ids, aux)

    def extend(self, state, tokens, aux):
        self.committed += len(tokens)
        self.inner.extend(state, tokens, aux)

    def propose(self, state, spec, sample_temperature, generator):
        tree = self.inner.propose(state, spec, sample_temperature, generator)
        self.proposals.append((self.committed, tree))
        return tree


def expected_accepts(tree: DraftTree, reference: list[int], committed: int) -> int:
    """Drafts a greedy verify must accept: the deepest tree path spelling reference[committed:]."""
    node, accepted = 0, 0
    while committed + accepted < len(reference):
        nxt = [c for c in tree.children[node] if tree.tokens[c] == reference[committed + accepted]]
        if not nxt:
            break
        node, accepted = nxt[0], accepted + 1
    return accepted


def random_eagle3_drafter(target_model, draft_vocab: int = 48, seed: int = 0) -> Eagle3Drafter:
    """Random-init EAGLE-3 draft with a reduced vocab (d2t offsets) and the target's embedding."""
    torch.manual_seed(seed)
    cfg = target_model.config
    dcfg = DraftModelConfig.from_target_config(cfg.to_dict(), draft_vocab_size=draft_vocab, aux_layer_ids=[0, 1, 2])
    draft = Eagle3DraftModel(dcfg)
    hot = torch.sort(torch.randperm(cfg.vocab_size)[:draft_vocab]).values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[hot] = True
    draft.set_vocab_mapping(hot - torch.arange(draft_vocab), t2d)
    draft.load_target_embedding(target_model.get_input_embeddings().weight)
    with torch.no_grad():  # peakier draft logits, so trees differ from a flat random guess
        draft.lm_head.weight.mul_(20.0)
    indices = aux_ids_to_hf_indices("LlamaForCausalLM", dcfg.aux_layer_ids, cfg.num_hidden_layers)
    return Eagle3Drafter(draft.eval(), indices)


# --------------------------------------------------------------------------- plain decoding vs HF generate


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy `generate` (its KV cache, its positions), no stop token."""
    ids = torch.tensor([prompt])
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=None)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def tiny_targets(tiny_target_dir) -> dict[str, torch.nn.Module]:
    """The session tiny target as trained, and the same architecture re-initialised with larger
    weights: the trained one (10 steps) repeats one token, the re-initialised one's greedy output
    keeps changing, so a wrong cache entry or position shows up as a different token."""
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(tiny_target_dir)
    config.initializer_range = 0.4
    models = {"trained": load_target(tiny_target_dir)[0], "reinitialised": LlamaForCausalLM(config).eval()}
    for model in models.values():  # generate falls back to these stop ids when given None
        model.generation_config.eos_token_id = None
    return models


@pytest.mark.parametrize("which", ["trained", "reinitialised"])
def test_plain_decoding_equals_hf_generate_up_to_the_context_length(tiny_targets, which):
    """Greedy, every prompt decoded until prompt + output fill max_position_embeddings (256)."""
    model = tiny_targets[which]
    context = model.config.max_position_embeddings
    engine = SpeculativeEngine(TargetModel(model))
    g = torch.Generator().manual_seed(0)
    distinct = []
    for length in (1, 3, 17, 60, 130):
        prompt = torch.randint(4, model.config.vocab_size, (length,), generator=g).tolist()
        expected = hf_greedy(model, prompt, context - length)
        assert len(expected) == context - length  # HF ran to the end: no stop token cut it
        got = engine.generate(prompt, SamplingParams(max_new_tokens=context - length, ignore_eos=True))
        assert got.output_ids == expected, f"prompt length {length}"
        assert got.finish_reason == {"type": "length", "length": context - length}
        distinct.append(len(set(expected)))
    if which == "reinitialised":  # the oracle is only as strong as the output is varied
        assert max(distinct) > 50, distinct


def test_plain_decoding_equals_hf_generate_on_the_exactness_target(target_model, prompts, greedy_refs):
    """The references of the speculative exactness tests below are HF's greedy output."""
    for p in prompts:
        assert greedy_refs[tuple(p)] == hf_greedy(target_model, p, GREEDY.max_new_tokens), f"prompt {p}"


# --------------------------------------------------------------------------- trees


def test_ancestor_mask_matrix():
    # root 0; 1, 2 children of 0; 3 child of 1; 4 child of 3
    tree = DraftTree(tokens=[5, 6, 7, 8, 9], parents=[-1, 0, 0, 1, 3])
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(tree.ancestor_mask(), expected)
    assert tree.depths == [0, 1, 1, 2, 3]
    ids, pos, mask = tree.verify_inputs(prefix_len=3, dtype=torch.float32)
    assert pos.tolist() == [[3, 4, 4, 5, 6]]
    allowed = mask[0, 0] == 0
    assert torch.equal(allowed[:, :3], torch.ones(5, 3, dtype=torch.bool))
    assert torch.equal(allowed[:, 3:], expected)
    chain = DraftTree(tokens=[1, 2, 3], parents=[-1, 0, 1])
    assert chain.is_chain and chain.verify_inputs(4, torch.float32)[2] is None


def test_build_draft_tree_follows_sglang_selection():
    """topk=2, steps=2, 5 draft tokens (4 + root) from hand-set probabilities.

    step 1: p = {10: .6, 11: .25}; expanding 10 -> {20: .5, 21: .4}, 11 -> {22: .9, 23: .05}.
    Candidates by cumulative score: 10:.6, 11:.25 | 20:.30, 21:.24, 22:.225, 23:.0125.
    Best 4 = 10, 20, 11, 21 -> kept in candidate order [10, 11, 20, 21]; 22 loses despite p=.9.
    """
    first = torch.full((32,), -1e9)
    first[10], first[11], first[12] = math.log(0.6), math.log(0.25), math.log(0.15)
    second = torch.full((2, 32), -1e9)
    second[0, 20], second[0, 21], second[0, 24] = math.log(0.5), math.log(0.4), math.log(0.1)
    second[1, 22], second[1, 23], second[1, 25] = math.log(0.9), math.log(0.05), math.log(0.05)
    calls = []

    def expand(parent_rows, tokens):
        calls.append((parent_rows, tokens.tolist()))
        return second

    tree = build_draft_tree(99, first, expand, SpecConfig(2, 2, 5))
    assert calls == [([0, 0], [10, 11])]
    assert tree.tokens == [99, 10, 11, 20, 21]
    assert tree.parents == [-1, 0, 0, 1, 1]
    # a reduced draft vocab maps draft indices to target ids
    hot = torch.arange(32) * 3
    tree = build_draft_tree(99, first, expand, SpecConfig(2, 2, 5), hot_token_ids=hot)
    assert calls[-1] == ([0, 0], [30, 33]) and tree.tokens == [99, 30, 33, 60, 63]


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("spec", SETTINGS, ids=SETTING_IDS)
def test_greedy_speculative_equals_plain_over_50_prompts(spec, target_model, prompts, greedy_refs, long_refs):
    drafter = RecordingDrafter(ScriptedDrafter(greedy_refs, VOCAB, noise=0.3))
    engine = SpeculativeEngine(TargetModel(target_model), drafter, spec)
    hist = [0] * (spec.num_steps + 1)
    for p in prompts:
        drafter.proposals.clear()
        result = engine.generate(p, GREEDY)
        assert result.output_ids == greedy_refs[tuple(p)], f"prompt {p}"
        expected = [expected_accepts(tree, long_refs[tuple(p)], committed) for committed, tree in drafter.proposals]
        assert result.stats.accepted_per_verify == expected, f"prompt {p}"
        hist = [a + b for a, b in zip(hist, result.stats.correct_drafts_histogram)]
    # full, partial and zero acceptance all happened, so every rollback path ran
    assert hist[0] > 0 and hist[-1] > 0 and sum(hist[1:-1]) > 0


@pytest.mark.parametrize("spec", SETTINGS, ids=SETTING_IDS)
def test_eagle3_drafter_greedy_equals_plain(spec, target_model, prompts, greedy_refs):
    drafter = random_eagle3_drafter(target_model)
    engine = SpeculativeEngine(TargetModel(target_model, drafter.aux_hidden_indices), drafter, spec)
    for p in prompts[:6]:
        assert engine.generate(p, GREEDY).output_ids == greedy_refs[tuple(p)]


@pytest.mark.parametrize("spec", [SETTINGS[0], SETTINGS[2]], ids=[SETTING_IDS[0], SETTING_IDS[2]])
def test_oracle_drafter_accepts_every_draft(spec, target_model, prompts, greedy_refs):
    target = TargetModel(target_model)
    engine = SpeculativeEngine(target, OracleDrafter(target), spec)
    for p in prompts[:4]:
        result = engine.generate(p, SamplingParams(max_new_tokens=1 + 3 * (spec.num_steps + 1), ignore_eos=True))
        assert result.output_ids == greedy_refs[tuple(p)][: len(result.output_ids)]
        s = result.stats
        assert s.verify_ct == 3 and s.num_correct_drafts == 3 * spec.num_steps
        assert s.correct_drafts_histogram[-1] == 3 and s.accepted_by_position == [3] * spec.num_steps
        # per verify: steps accepted drafts + 1 bonus token
        assert (len(result.output_ids) - 1) / s.verify_ct == spec.num_steps + 1


@pytest.mark.parametrize("spec", [SETTINGS[0], SETTINGS[3]], ids=[SETTING_IDS[0], SETTING_IDS[3]])
def test_random_drafter_still_yields_target_output(spec, target_model, prompts, greedy_refs, long_refs):
    """Random trees: the output is the target's, and each verify accepts exactly the drafts that
    spell the reference continuation (counted here from the recorded trees, not by the engine)."""
    drafter = RecordingDrafter(RandomDrafter(VOCAB, seed=3))
    engine = SpeculativeEngine(TargetModel(target_model), drafter, spec)
    for p in prompts[:5]:
        drafter.proposals.clear()
        result = engine.generate(p, GREEDY)
        ref = greedy_refs[tuple(p)]
        assert result.output_ids == ref
        expected = [expected_accepts(tree, long_refs[tuple(p)], committed) for committed, tree in drafter.proposals]
        assert result.stats.accepted_per_verify == expected
        # each verify commits its accepted drafts + 1 token; the last one is cut at max_new_tokens
        assert 1 + sum(a + 1 for a in expected[:-1]) < len(ref) <= 1 + sum(a + 1 for a in expected)


def test_stop_token_and_length_finish_reasons(target_model, prompts, greedy_refs):
    p = prompts[0]
    ref = greedy_refs[tuple(p)]
    engine = SpeculativeEngine(TargetModel(target_model), ScriptedDrafter(greedy_refs, VOCAB, noise=0.0), SETTINGS[1])
    stop = ref[5]
    result = engine.generate(p, SamplingParams(max_new_tokens=20, stop_token_ids=(stop,), ignore_eos=True))
    assert result.output_ids == ref[: ref.index(stop) + 1]
    assert result.finish_reason == {"type": "stop", "matched": stop}
    result = engine.generate(p, SamplingParams(max_new_tokens=9, ignore_eos=True))
    assert result.output_ids == ref[:9] and result.finish_reason == {"type": "length", "length": 9}


def test_engine_rejects_bad_requests(target_model):
    engine = SpeculativeEngine(TargetModel(target_model))
    with pytest.raises(ValueError, match="non-empty"):
        engine.start([], GREEDY)
    with pytest.raises(ValueError, match="context length"):
        engine.start([1] * 250, GREEDY)
    with pytest.raises(ValueError, match=r"\[0, 96\)"):
        engine.start([1, VOCAB], GREEDY)
    with pytest.raises(ValueError, match="num_steps \\+ 1"):
        SpecConfig(1, 1, 16)
    with pytest.raises(ValueError, match="candidates"):
        SpecConfig(2, 2, 32)


# --------------------------------------------------------------------------- EAGLE-3 adapter internals


class RecordingDraft(torch.nn.Module):
    """Wraps an Eagle3DraftModel and records every decoder_step call."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config, self.calls = inner, inner.config, []

    def project(self, aux):
        return self.inner.project(aux)

    def compute_logits(self, h):
        return self.inner.compute_logits(h)

    def draft_to_target(self, ids):
        return self.inner.draft_to_target(ids)

    def decoder_step(self, input_ids, hidden_states, position_ids, attention_mask=None, past_key_value=None):
        past = 0 if past_key_value is None else past_key_value[0].shape[2]
        self.calls.append(dict(input_ids=input_ids.clone(), hidden=hidden_states.clone(),
                               positions=position_ids.clone(), past=past,
                               mask=None if attention_mask is None else attention_mask.clone()))
        return self.inner.decoder_step(input_ids, hidden_states, position_ids, attention_mask, past_key_value)


def test_eagle3_alignment_feature_t_with_token_t_plus_1(target_model):
    """Prefill of x_0..x_4 + first token f: the extend pairs feature j with token j+1 at RoPE position j."""
    base = random_eagle3_drafter(target_model)
    rec = RecordingDraft(base.model)
    drafter = Eagle3Drafter(rec, base.aux_hidden_indices)
    target = TargetModel(target_model, drafter.aux_hidden_indices)
    engine = SpeculativeEngine(target, drafter, SpecConfig(3, 1, 4))
    prompt = [3, 14, 15, 9, 26]
    state = engine.start(prompt, GREEDY)
    f = state.output_ids[0]
    engine.step(state)
    extend, step2, step3 = rec.calls[:3]
    assert extend["input_ids"].tolist() == [prompt[1:] + [f]]
    assert extend["positions"].tolist() == [[0, 1, 2, 3, 4]] and extend["past"] == 0
    out = target_model(torch.tensor([prompt]), output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i] for i in base.aux_hidden_indices], dim=-1)  # [1, 5, 3H]
    assert torch.allclose(extend["hidden"], base.model.project(aux), atol=1e-5)
    # chain steps: own token at the next position, continuing from the committed entries
    assert step2["positions"].tolist() == [[5]] and step2["past"] == 5
    assert step3["positions"].tolist() == [[6]] and step3["past"] == 6
    # the next round first rolls the draft cache back to the 5 committed entries, then extends it
    # with the accepted drafts + bonus token (fed at the positions of the tokens before them)
    new_tokens = state.output_ids[1:]
    engine.step(state)
    extend2 = rec.calls[3]
    assert extend2["past"] == 5 and extend2["input_ids"].tolist() == [new_tokens]
    assert extend2["positions"].tolist() == [list(range(5, 5 + len(new_tokens)))]


def test_eagle3_incremental_cache_equals_recomputation(target_model, prompts):
    """Proposals after many verify/rollback rounds equal a drafter rebuilt from scratch each round."""
    drafter = random_eagle3_drafter(target_model)
    target = TargetModel(target_model, drafter.aux_hidden_indices)
    spec = SpecConfig(3, 1, 4)
    engine = SpeculativeEngine(target, drafter, spec)
    state = engine.start(prompts[1], GREEDY)
    for _ in range(6):
        committed = state.prompt_ids + state.output_ids
        _, aux = target.forward(torch.tensor([committed[:-1]]), target.new_cache(), with_aux=True)
        fresh = drafter.start(torch.tensor(committed), aux)
        expected = drafter.propose(fresh, spec, None, None)
        got = drafter.propose(state.draft_state, spec, None, None)
        assert got.tokens == expected.tokens
        engine.step(state)


def test_eagle3_tree_steps_attend_to_ancestors_only(target_model, prompts):
    base = random_eagle3_drafter(target_model)
    rec = RecordingDraft(base.model)
    drafter = Eagle3Drafter(rec, base.aux_hidden_indices)
    engine = SpeculativeEngine(TargetModel(target_model, drafter.aux_hidden_indices), drafter, SpecConfig(4, 2, 6))
    state = engine.start(prompts[2], GREEDY)
    p = len(state.prompt_ids)
    rec.calls.clear()
    drafter.propose(state.draft_state, engine.spec, None, None)
    steps = rec.calls[1:]
    assert len(steps) == 3
    for depth, call in enumerate(steps, start=1):
        mask = call["mask"][0, 0]  # [2 rows, P + 2*depth]
        assert call["positions"].tolist() == [[p + depth - 1] * 2]
        assert mask.shape == (2, p + 2 * depth) and mask[:, :p].all()
        for row in range(2):
            blocks = mask[row, p:].view(depth, 2)
            assert blocks.sum(-1).tolist() == [1] * depth  # one ancestor per earlier step, then itself
            assert bool(blocks[-1, row])


# --------------------------------------------------------------------------- sampling exactness


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a / a.sum() - b / b.sum()).abs().sum())


def test_rejection_rules_reproduce_target_distribution():
    """Synthetic p/q over 4 tokens: the first two emitted tokens follow the target exactly."""
    v, n = 4, 20000
    g = torch.Generator().manual_seed(0)
    p1 = torch.softmax(torch.randn(v, generator=g) * 2, -1)  # target at the root
    p2 = torch.softmax(torch.randn(v, v, generator=g) * 2, -1)  # target after token a
    q1 = torch.softmax(torch.randn(v, generator=g) * 2, -1)  # draft proposals
    q2 = torch.softmax(torch.randn(v, v, generator=g) * 2, -1)
    exact = p1[:, None] * p2  # joint of the first two tokens
    counts_chain, counts_tree = torch.zeros(v, v), torch.zeros(v, v)
    for _ in range(n):
        a = int(torch.multinomial(q1, 1, generator=g))
        b = int(torch.multinomial(q2[a], 1, generator=g))
        tree = DraftTree([0, a, b], [-1, 0, 1], q=torch.stack([q1, q2[a]]))
        probs = torch.stack([p1, p2[a], torch.full((v,), 1 / v)])
        path, bonus = verify_chain_rejection(tree, probs, g)
        toks = [tree.tokens[i] for i in path[1:]] + [bonus]
        if len(toks) == 1:
            toks.append(int(torch.multinomial(p2[toks[0]], 1, generator=g)))
        counts_chain[toks[0], toks[1]] += 1
        # a tree: two children of the root (top-2 of q1), each with its top child
        c1, c2 = torch.topk(q1, 2).indices.tolist()
        d1, d2 = int(q2[c1].argmax()), int(q2[c2].argmax())
        tree = DraftTree([0, c1, c2, d1, d2], [-1, 0, 0, 1, 2])
        probs = torch.stack([p1, p2[c1], p2[c2], torch.full((v,), 1 / v), torch.full((v,), 1 / v)])
        path, bonus = verify_tree_target_only(tree, probs, g)
        toks = [tree.tokens[i] for i in path[1:]] + [bonus]
        if len(toks) == 1:
            toks.append(int(torch.multinomial(p2[toks[0]], 1, generator=g)))
        counts_tree[toks[0], toks[1]] += 1
    assert _tv(counts_chain, exact) < 0.025
    assert _tv(counts_tree, exact) < 0.025
    # the test can fail: the draft's own joint is far from the target's
    assert _tv(q1[:, None] * q2, exact) > 0.1


@pytest.mark.parametrize("spec", [SpecConfig(2, 1, 3), SpecConfig(2, 2, 4)], ids=["chain", "tree"])
def test_sampled_speculative_output_matches_target_distribution(spec):
    """End to end on a 6-token vocab: marginals of tokens 2 and 3 (both from verify steps)."""
    v, n = 6, 1500
    model = make_target(vocab=v, layers=1, hidden=16, seed=1, logit_scale=60.0)
    target = TargetModel(model)
    prompt = [1, 2]
    with torch.inference_mode():  # exact marginals by enumeration
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
        p2 = torch.stack([torch.softmax(model(torch.tensor([prompt + [a]])).logits[0, -1], -1) for a in range(v)])
        p3 = torch.zeros(v)
        for a, b in itertools.product(range(v), range(v)):
            p3 += p1[a] * p2[a, b] * torch.softmax(model(torch.tensor([prompt + [a, b]])).logits[0, -1], -1)
    exact2 = p1 @ p2
    assert float(exact2.max()) > 0.3  # peaked enough that a wrong sampler shows
    engine = SpeculativeEngine(target, RandomDrafter(v, seed=5), spec)
    c2, c3 = torch.zeros(v), torch.zeros(v)
    for i in range(n):
        out = engine.generate(prompt, SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True, seed=i))
        c2[out.output_ids[1]] += 1
        c3[out.output_ids[2]] += 1
    assert _tv(c2, exact2) < 0.05
    assert _tv(c3, p3) < 0.05
