"""Draft model: SGLang names, layer math, KV-cache decoding, TTT/decoding alignment, RoPE."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eagle3.draft.model import DraftModelConfig, Eagle3DraftModel, TTTCache, compute_rope_inv_freq, target_rope_settings

TARGET = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 8,
    "vocab_size": 80,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0},
    "hidden_act": "silu",
}




def tiny_config(**overrides) -> DraftModelConfig:
    return DraftModelConfig.from_target_config(TARGET, draft_vocab_size=40, aux_layer_ids=[1, 3, 4], **overrides)


def tiny_model(seed: int = 0, **overrides) -> Eagle3DraftModel:
    torch.manual_seed(seed)
    model = Eagle3DraftModel(tiny_config(**overrides))
    with torch.no_grad():  # non-trivial norms so a swapped norm shows up
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def test_config_from_target_reads_transformers5_rope_and_overrides():
    cfg = tiny_config()
    assert (cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads, cfg.vocab_size) == (32, 8, 2, 80)
    assert cfg.rope_theta == 5000.0 and cfg.rope_scaling is None and cfg.rms_norm_eps == 1e-5
    assert cfg.target_hidden_size == 32 and cfg.num_aux_hidden_states == 3
    wide = tiny_config(hidden_size=64, intermediate_size=None)
    assert (wide.hidden_size, wide.head_dim, wide.target_hidden_size, wide.intermediate_size) == (64, 16, 32, 48)
    assert not wide.shares_target_embedding
    with pytest.raises(ValueError, match="unknown override"):
        tiny_config(hidden_sise=64)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DraftModelConfig.from_target_config(TARGET, draft_vocab_size=81, aux_layer_ids=[1])


def test_target_rope_settings_both_layouts():
    legacy = {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    assert target_rope_settings(legacy) == (500000.0, {"rope_type": "llama3", "factor": 8.0})
    v5 = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}}
    assert target_rope_settings(v5) == (500000.0, {"rope_type": "llama3", "factor": 8.0})
    assert target_rope_settings({}) == (10000.0, None)


def test_state_dict_names_are_sglangs():
    keys = set(tiny_model().state_dict())
    assert keys == {
        "embed_tokens.weight",
        "fc.weight",
        "midlayer.self_attn.q_proj.weight",
        "midlayer.self_attn.k_proj.weight",
        "midlayer.self_attn.v_proj.weight",
        "midlayer.self_attn.o_proj.weight",
        "midlayer.mlp.gate_proj.weight",
        "midlayer.mlp.up_proj.weight",
        "midlayer.mlp.down_proj.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.input_layernorm.weight",
        "midlayer.post_attention_layernorm.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    }
    model = tiny_model()
    assert model.midlayer.self_attn.q_proj.weight.shape == (32, 64)  # q/k/v read 2H
    assert model.midlayer.self_attn.k_proj.weight.shape == (16, 64)
    assert model.fc.weight.shape == (32, 96)
    assert model.lm_head.weight.shape == (40, 32)
    assert model.d2t.dtype == torch.int64 and model.t2d.dtype == torch.bool


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_layer(model, input_ids, hidden, positions):
    """Independent re-statement of sglang llama_eagle3.LlamaDecoderLayer.forward (causal)."""
    c, p = model.config, dict(model.named_parameters())
    eps, d = c.rms_norm_eps, c.head_dim
    b, t, _ = hidden.shape
    embeds = _rms(model.embed_tokens.weight[input_ids], p["midlayer.input_layernorm.weight"], eps)
    x = torch.cat([embeds, _rms(hidden, p["midlayer.hidden_norm.weight"], eps)], -1)
    q = (x @ p["midlayer.self_attn.q_proj.weight"].T).view(b, t, -1, d).transpose(1, 2)
    k = (x @ p["midlayer.self_attn.k_proj.weight"].T).view(b, t, -1, d).transpose(1, 2)
    v = (x @ p["midlayer.self_attn.v_proj.weight"].T).view(b, t, -1, d).transpose(1, 2)
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2).float() / d))
    ang = positions[..., None].float() * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]

    def rot(z):
        z1, z2 = z[..., : d // 2], z[..., d // 2 :]
        return z * cos + torch.cat([-z2, z1], -1) * sin

    q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
    residual = hidden + attn @ p["midlayer.self_attn.o_proj.weight"].T
    h = _rms(residual, p["midlayer.post_attention_layernorm.weight"], eps)
    mlp = (F.silu(h @ p["midlayer.mlp.gate_proj.weight"].T) * (h @ p["midlayer.mlp.up_proj.weight"].T)) @ p[
        "midlayer.mlp.down_proj.weight"
    ].T
    out = residual + mlp
    logits = _rms(out, p["norm.weight"], eps) @ p["lm_head.weight"].T
    return out, logits


def test_decoder_step_matches_sglang_layer_math():
    model = tiny_model()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 80, (2, 7), generator=g)
    aux = torch.randn(2, 7, 96, generator=g)
    pos = torch.arange(7)[None].expand(2, 7) + 5
    hidden = model.project(aux)
    out, (k, v) = model.decoder_step(ids, hidden, pos)
    ref_out, ref_logits = _reference_layer(model, ids, hidden, pos)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.compute_logits(out), ref_logits, atol=1e-5, rtol=1e-5)
    assert k.shape == v.shape == (2, 2, 7, 8)


def test_decoder_step_kv_cache_equals_full_forward():
    model = tiny_model()
    g = torch.Generator().manual_seed(4)
    ids, hidden = torch.randint(0, 80, (1, 6), generator=g), torch.randn(1, 6, 32, generator=g)
    pos = torch.arange(6)[None]
    full, _ = model.decoder_step(ids, hidden, pos)
    first, cache = model.decoder_step(ids[:, :4], hidden[:, :4], pos[:, :4])
    rest, cache = model.decoder_step(ids[:, 4:], hidden[:, 4:], pos[:, 4:], past_key_value=cache)
    torch.testing.assert_close(torch.cat([first, rest], 1), full, atol=1e-5, rtol=1e-5)
    assert cache[0].shape[2] == 6
    explicit = torch.ones(1, 1, 2, 6, dtype=torch.bool)
    explicit[..., 5] = False
    explicit[0, 0, 1, 5] = True
    masked, _ = model.decoder_step(ids[:, 4:], hidden[:, 4:], pos[:, 4:], attention_mask=explicit,
                                   past_key_value=(cache[0][:, :, :4], cache[1][:, :, :4]))
    torch.testing.assert_close(masked, rest, atol=1e-5, rtol=1e-5)


MLA = dict(architecture="deepseek_mla", q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4,
           v_head_dim=5)
VARIANTS = {"llama": {}, "llama-3.1": dict(fc_norm=True, norm_output=True), "mla": MLA,
            "mla-3.1": dict(MLA, fc_norm=True, norm_output=True)}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("attn_impl", ["fast", "dense"])
def test_ttt_unroll_equals_chain_decoding(attn_impl, variant):
    """The alignment contract: TTT step k at query t == a decoder chain started at t.

    Step 0 runs over the whole sequence (token t+1 at position t); step k for query t reads
    token t+1+k at position t+k, the previous step's output of that query, and attends to the
    step-0 keys 0..t plus its own earlier keys -- exactly a KV-cached decode. For each draft variant: GQA,
    MLA, each with the EAGLE-3.1 options (the hidden a step hands on is then normed, in both forms).
    """
    model = tiny_model(**VARIANTS[variant])
    g = torch.Generator().manual_seed(5)
    t_len, steps = 8, 3
    ids = torch.randint(0, 80, (1, t_len), generator=g)
    hidden0 = model.project(torch.randn(1, t_len, 96, generator=g))
    pos = torch.arange(t_len)[None]
    cache, hidden, ttt_out = TTTCache(), hidden0, []
    for k in range(steps):
        shifted = F.pad(ids[:, k + 1 :], (0, k + 1))
        hidden = model.ttt_step(shifted, hidden, pos + k, cache, attn_impl)
        ttt_out.append(hidden)

    step0, (k0, v0) = model.decoder_step(F.pad(ids[:, 1:], (0, 1)), hidden0, pos)
    torch.testing.assert_close(ttt_out[0], step0, atol=1e-5, rtol=1e-5)
    for t in range(t_len - steps):
        past = (k0[:, :, : t + 1], v0[:, :, : t + 1])
        h = step0[:, t : t + 1]
        for k in range(1, steps):
            tok = ids[:, t + 1 + k : t + 2 + k]
            h, past = model.decoder_step(tok, h, torch.tensor([[t + k]]), past_key_value=past)
            torch.testing.assert_close(h, ttt_out[k][:, t : t + 1], atol=1e-5, rtol=1e-5)


def test_mla_draft_takes_its_dims_from_the_target_and_refuses_what_sglang_cannot_build():
    kimi = {**TARGET, "num_attention_heads": 4, "q_lora_rank": 12, "kv_lora_rank": 8, "qk_nope_head_dim": 6,
            "qk_rope_head_dim": 4, "v_head_dim": 5}
    config = DraftModelConfig.from_target_config(kimi, 40, [1, 3, 4], architecture="deepseek_mla", kv_lora_rank=16)
    assert (config.q_lora_rank, config.kv_lora_rank, config.head_dim, config.num_key_value_heads) == (12, 16, 10, 4)
    assert config.rope_dim == 4 and config.is_mla
    with pytest.raises(ValueError, match="q_lora_rank"):  # SGLang's Eagle3 MLA layer requires it
        DraftModelConfig.from_target_config(TARGET, 40, [1, 3, 4], architecture="deepseek_mla")
    with pytest.raises(ValueError, match="YaRN"):
        tiny_config(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    llama = DraftModelConfig.from_target_config(kimi, 40, [1, 3, 4])  # the MLA dims do not leak into a GQA draft
    assert llama.q_lora_rank is None and not llama.is_mla


def test_a_kimi_k2_config_gives_the_mla_draft_its_language_models_dims():
    """Kimi-K2.5's config.json is a multimodal wrapper: the DeepSeek-V3 language model's keys are in text_config
    (values of the Kimi-K2 family: 64 MLA heads, latent ranks 1536/512, DeepSeek YaRN)."""
    text = {"hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64, "num_key_value_heads": 64,
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "vocab_size": 163840, "num_hidden_layers": 61, "rms_norm_eps": 1e-5,
            "rope_theta": 50000.0, "max_position_embeddings": 262144, "hidden_act": "silu",
            "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                             "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}
    kimi = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": text, "vision_config": {}}
    config = DraftModelConfig.from_target_config(kimi, 32000, [2, 30, 58], architecture="deepseek_mla")
    assert (config.hidden_size, config.num_attention_heads, config.head_dim, config.v_head_dim) == (7168, 64, 192, 128)
    assert (config.q_lora_rank, config.kv_lora_rank, config.rope_dim) == (1536, 512, 64)
    assert config.rope_scaling["factor"] == 64.0 and config.vocab_size == 163840 and config.shares_target_embedding


def test_vocab_mapping_and_draft_to_target():
    model = tiny_model()
    used = torch.tensor(sorted(torch.randperm(80, generator=torch.Generator().manual_seed(0))[:40].tolist()))
    t2d = torch.zeros(80, dtype=torch.bool)
    t2d[used] = True
    model.set_vocab_mapping(used - torch.arange(40), t2d)
    assert torch.equal(model.draft_to_target(torch.arange(40)), used)
    assert torch.equal(model.draft_vocab_columns(), t2d.nonzero().squeeze(-1))  # the teacher's columns
    with pytest.raises(ValueError, match="ascending"):
        model.set_vocab_mapping(used.flip(0) - torch.arange(40), t2d)
    with pytest.raises(ValueError, match="expected d2t"):
        model.set_vocab_mapping(torch.zeros(39, dtype=torch.long), t2d)


def test_load_target_embedding_freezes_and_checks_shape():
    model = tiny_model()
    weight = torch.randn(80, 32)
    model.load_target_embedding(weight)
    assert torch.equal(model.embed_tokens.weight, weight) and not model.embed_tokens.weight.requires_grad
    with pytest.raises(ValueError, match="target embedding"):
        model.load_target_embedding(torch.randn(80, 16))
    wide = tiny_model(hidden_size=64)
    assert wide.embed_tokens.weight.requires_grad  # cannot share a 32-wide target embedding


def test_project_rejects_wrong_width():
    with pytest.raises(ValueError, match="aux_hidden_states"):
        tiny_model().project(torch.randn(1, 3, 64))


def test_llama3_rope_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    hf = LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                     rope_parameters={"rope_theta": 500000.0, **scaling})
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    torch.testing.assert_close(compute_rope_inv_freq(128, 500000.0, scaling), ref.float(), rtol=1e-6, atol=0)
    linear = compute_rope_inv_freq(8, 100.0, {"rope_type": "linear", "factor": 2.0})
    torch.testing.assert_close(linear, compute_rope_inv_freq(8, 100.0, None) / 2)
    with pytest.raises(ValueError, match="rope_scaling"):
        tiny_config(rope_scaling={"rope_type": "yarn", "factor": 4.0})


def test_bf16_cast_keeps_rope_frequencies_fp32():
    model = tiny_model().to(torch.bfloat16)
    assert model.rotary_emb.inv_freq.dtype == torch.float32
    assert model.fc.weight.dtype == torch.bfloat16 and model.t2d.dtype == torch.bool


def test_accumulating_linear_sums_every_use_and_hands_the_sum_over_once():
    """Three uses of one fused weight (as three TTT steps): the gradients the two master parameters
    receive are the sum of the three x_i^T g_i, computed here by plain autograd; a use that never gets a
    backward is reported."""
    from eagle3.draft.fused_layer import WeightGradSlot, accumulating_linear

    g = torch.Generator().manual_seed(0)
    masters = [torch.randn(n, 7, generator=g, dtype=torch.float64, requires_grad=True) for n in (2, 3)]
    xs = [torch.randn(2, 3, 7, generator=g, dtype=torch.float64) for _ in range(3)]
    upstream = [torch.randn(2, 3, 5, generator=g, dtype=torch.float64) for _ in range(3)]

    def unroll(linear):
        h, total = xs[0], 0
        for x, u in zip(xs, upstream):
            out = linear(x + 0.1 * h.sum(-1, keepdim=True))  # each use depends on the last
            total = total + (out * u).sum()
            h = out.sum(-1, keepdim=True).expand(2, 3, 7)
        return total

    slot = WeightGradSlot(masters, None)
    total = unroll(lambda x: accumulating_linear(x, slot))
    assert slot.uses == 3
    total.backward()
    assert slot.uses == 0 and slot.grad is None
    refs = [m.detach().clone().requires_grad_() for m in masters]
    unroll(lambda x: F.linear(x, torch.cat(refs))).backward()
    for got, want in zip(masters, refs):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-12)

    weights = tiny_model().fused_layer_weights(None)
    weights.linear("o", torch.randn(2, 3, 32))  # a use whose output reaches no loss
    assert weights.pending() == ["o"]
