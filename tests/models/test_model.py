"""The hybrid model: cached decoding equals a full forward pass, generation, configs, cache sizes."""

import dataclasses

import pytest
import torch

from kda_edu.layers.ffn import FFNConfig, MoE
from kda_edu.layers.kda_layer import KDACache, KDAConfig, KDALayer
from kda_edu.layers.mla import MLA, MLACache, MLAConfig
from kda_edu.models.model import HYBRID, PURE_ATTENTION, PURE_KDA, HybridCache, HybridConfig, HybridLM

VOCAB = 50


def tiny_config(**overrides) -> HybridConfig:
    base = dict(
        vocab_size=VOCAB,
        d_model=32,
        n_layers=4,
        kda=KDAConfig(num_heads=2, head_dim=8, chunk_size=8),
        mla=MLAConfig(num_heads=2, kv_rank=16, qk_head_dim=8, v_head_dim=8),
        ffn=FFNConfig(hidden=48),
    )
    return HybridConfig(**{**base, **overrides})


def make_model(seed: int = 0, **overrides) -> HybridLM:
    torch.manual_seed(seed)
    return HybridLM(tiny_config(**overrides)).double().eval()


def ids(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def test_layer_pattern_sets_the_mixers():
    assert tiny_config().layer_kinds == "KKKA"
    assert tiny_config(n_layers=6).layer_kinds == "KKKAKK"
    model = make_model(n_layers=8)
    kinds = [type(b.mixer) for b in model.blocks]
    assert kinds == [KDALayer, KDALayer, KDALayer, MLA] * 2
    assert all(type(b.mixer) is KDALayer for b in make_model(layer_pattern=PURE_KDA).blocks)
    assert all(type(b.mixer) is MLA for b in make_model(layer_pattern=PURE_ATTENTION).blocks)
    assert HybridConfig().layer_pattern == HYBRID == "KKKA"


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"layer_pattern": PURE_KDA},
        {"layer_pattern": PURE_ATTENTION, "mla": MLAConfig(num_heads=2, kv_rank=16, output_gate=True)},
        {"ffn": FFNConfig(num_experts=4, top_k=2, expert_hidden=16), "tie_embeddings": False},
        {"kda": KDAConfig(num_heads=2, head_dim=8, num_v_heads=4, gate="lower_bound", chunk_size=4)},
    ],
    ids=["hybrid", "pure-kda", "pure-attention-gated", "moe-untied", "gva-lower-bound"],
)
def test_decoding_token_by_token_gives_the_full_forward_logits(overrides):
    model = make_model(**overrides)
    x = ids(2, 12)
    full = model(x)
    cache = model.new_cache()
    logits = [model(x[:, :5], cache=cache)]  # prefill
    logits += [model(x[:, t : t + 1], cache=cache) for t in range(5, 12)]  # one token at a time
    torch.testing.assert_close(torch.cat(logits, dim=1), full, rtol=1e-9, atol=1e-9)
    assert cache.seq_len == 12


def test_decoding_in_float32_within_1e_5():
    torch.manual_seed(0)
    model = HybridLM(tiny_config()).eval()
    x = ids(1, 10)
    full = model(x)
    cache = model.new_cache()
    steps = torch.cat([model(x[:, t : t + 1], cache=cache) for t in range(10)], dim=1)
    torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-5)


def test_greedy_generate_equals_argmax_of_repeated_full_forward():
    model = make_model()
    prompt = ids(2, 4)
    out = model.generate(prompt, max_new_tokens=6)
    assert out.shape == (2, 10) and torch.equal(out[:, :4], prompt)
    seq = prompt
    for _ in range(6):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


def test_sampling_is_reproducible_and_respects_top_k():
    model = make_model()
    prompt = ids(3, 4)
    a = model.generate(prompt, 5, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(7))
    b = model.generate(prompt, 5, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    logits = model(a[:, :-1])  # the logits each sampled token was drawn from
    top3 = logits[:, 3:].topk(3, dim=-1).indices
    assert (top3 == a[:, 4:, None]).any(dim=-1).all()
    greedy = model.generate(prompt, 5)
    assert torch.equal(model.generate(prompt, 5, temperature=2.0, top_k=1), greedy)
    assert torch.equal(model.generate(prompt, 0), prompt)


def test_sampling_follows_the_temperature_scaled_softmax():
    model = make_model()
    prompt = ids(1, 3)
    probs = torch.softmax(model(prompt)[0, -1] / 1.5, dim=-1)
    draws = model.generate(
        prompt.expand(4000, 3), 1, temperature=1.5, generator=torch.Generator().manual_seed(0)
    )
    freq = torch.bincount(draws[:, -1], minlength=VOCAB).double() / 4000
    assert (freq - probs).abs().max() < 0.03


@pytest.mark.parametrize("temperature", [1e-45, 1e-300, 5e-324])
def test_a_tiny_temperature_samples_the_most_likely_token(temperature):
    """A temperature so small that logits / temperature overflows is the greedy limit, not a NaN
    probability (it used to fail in torch.multinomial: "probability tensor contains either inf, nan or
    element < 0")."""
    model = make_model()
    prompt = ids(3, 4)
    greedy = model.generate(prompt, 5)
    sampled = model.generate(prompt, 5, temperature=temperature, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sampled, greedy)
    assert torch.equal(model.generate(prompt, 5, temperature=temperature, top_k=2), greedy)


def test_a_tiny_temperature_draws_uniformly_among_tied_maxima():
    from kda_edu.models.model import _pick

    logits = torch.tensor([[1.0, 3.0, -2.0, 3.0, float("-inf")]]).expand(2000, 5)
    draws = _pick(logits, 1e-300, None, torch.Generator().manual_seed(0))[:, 0]
    counts = torch.bincount(draws, minlength=5)
    assert counts[[0, 2, 4]].sum() == 0 and 800 < counts[1] < 1200 and counts[1] + counts[3] == 2000


def test_cache_objects_report_their_size():
    torch.manual_seed(0)
    model = HybridLM(tiny_config(n_layers=8))
    cache = model.new_cache()
    assert isinstance(cache, HybridCache) and cache.nbytes() == 0
    model(ids(2, 6), cache=cache)
    sizes = cache.nbytes_by_kind()
    assert sizes["mla"] == 2 * (2 * 6 * 16 * 4)  # two MLA layers, one fp32 latent of width 16 per token
    assert sum(sizes.values()) == cache.nbytes()
    model(ids(2, 1), cache=cache)
    grown = cache.nbytes_by_kind()
    assert grown["kda"] == sizes["kda"]  # fixed-size state and window
    assert grown["mla"] == 2 * (2 * 7 * 16 * 4)


def test_tied_and_untied_embeddings():
    tied, untied = make_model(), make_model(tie_embeddings=False)
    assert tied.lm_head.weight is tied.embed.weight
    assert untied.lm_head.weight is not untied.embed.weight
    assert untied.num_parameters() - tied.num_parameters() == VOCAB * 32


def test_training_step_reduces_the_loss():
    torch.manual_seed(0)
    model = HybridLM(tiny_config(ffn=FFNConfig(num_experts=3, top_k=1, expert_hidden=16)))
    x = ids(4, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert any(isinstance(b.ffn, MoE) for b in model.blocks)


def test_config_round_trips_through_a_dict():
    config = tiny_config(ffn=FFNConfig(num_experts=2, top_k=1), layer_pattern="KA")
    assert HybridConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match=r"HybridConfig.kda has unknown fields \['heads'\]"):
        HybridConfig.from_dict({**config.to_dict(), "kda": {"heads": 2}})


def test_bad_inputs_and_configs_are_named():
    model = make_model()
    with pytest.raises(ValueError, match=r"input_ids must be an int64 tensor of shape \[B, T\]"):
        model(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size = 50\)"):
        model(torch.tensor([[1, 50]]))
    with pytest.raises(
        ValueError, match="cache must have one layer cache per block, kinds 'KKKA', got 'KKAA'"
    ):
        model(ids(1, 2), cache=HybridCache([KDACache(), KDACache(), MLACache(), MLACache()]))
    with pytest.raises(TypeError, match="cache must be a HybridCache"):
        model(ids(1, 2), cache=[])
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        model.generate(ids(1, 2), 3, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k must be None or an int >= 1"):
        model.generate(ids(1, 2), 3, temperature=1.0, top_k=0)
    with pytest.raises(ValueError, match="layer_pattern must be a non-empty string of 'K'"):
        tiny_config(layer_pattern="KKKM")
    with pytest.raises(TypeError, match="HybridConfig.kda must be a KDAConfig"):
        dataclasses.replace(tiny_config(), kda={"num_heads": 2})


# --- Kimi K3's options -------------------------------------------------------------------------------------

K3_OPTIONS = dict(
    kda=KDAConfig(num_heads=2, head_dim=8, chunk_size=8, gate="lower_bound", full_rank="output"),
    mla=MLAConfig(num_heads=2, kv_rank=16, qk_head_dim=8, v_head_dim=8, output_gate=True),
    ffn=FFNConfig(hidden=40, num_experts=6, top_k=2, expert_hidden=12, num_shared=2, latent_dim=16),
    dense_layers=1,
    attn_residuals="block",
    attn_res_block_size=3,
    tie_embeddings=False,
)


def test_k3_options_decode_like_the_full_forward():
    model = make_model(**K3_OPTIONS)
    with torch.no_grad():
        for q in model.depth:
            q.query.normal_()
    x = ids(2, 10)
    cache = model.new_cache()
    steps = torch.cat([model(x[:, t : t + 1], cache=cache) for t in range(10)], dim=1)
    torch.testing.assert_close(steps, model(x), rtol=1e-9, atol=1e-9)


def test_k3_options_build_the_parts_they_name_and_count_them():
    from kda_edu.chapters.ch11_hybrid import hybrid_parameters
    from kda_edu.layers.ffn import LatentMoE, SwiGLU

    model = make_model(**K3_OPTIONS)
    assert type(model.blocks[0].ffn) is SwiGLU and model.blocks[0].ffn.up_proj.out_features == 40
    assert all(type(b.ffn) is LatentMoE for b in model.blocks[1:])
    assert len(model.depth) == 2 * 4 + 1
    assert model.blocks[3].mixer.gate_proj is not None and hasattr(model.blocks[0].mixer, "g_proj")
    assert sum(hybrid_parameters(model.config).values()) == model.num_parameters()
    assert sum(hybrid_parameters(tiny_config()).values()) == make_model().num_parameters()


def test_routing_bias_updates_reach_every_moe_block():
    model = make_model(**K3_OPTIONS).train()
    model(ids(2, 12))
    model.update_routing_bias(0.01)
    for block in model.blocks[1:]:
        assert block.ffn.load.sum() == 0 and torch.count_nonzero(block.ffn.route_bias) > 0


def test_k3_options_round_trip_and_are_checked():
    config = tiny_config(**K3_OPTIONS)
    assert HybridConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match=r"HybridConfig.dense_layers must lie in \[0, n_layers\]"):
        tiny_config(dense_layers=5)


def test_generate_stops_each_sequence_at_its_end_of_sequence_token():
    """Greedy generation with eos: a sequence keeps what it produced up to and including its first eos, then
    only pad; without eos the same model would have gone on (compared with a run without eos_token_id)."""
    model = make_model(seed=3)
    prompts = ids(3, 5, seed=4)
    free = model.generate(prompts, max_new_tokens=12)
    new = free[:, 5:]
    eos = int(new[0, 2])  # a token the first sequence produces at step 2: it must end there
    out = model.generate(prompts, max_new_tokens=12, eos_token_id=eos, pad_token_id=VOCAB - 1)
    for b in range(3):
        hits = (new[b] == eos).nonzero()
        end = int(hits[0]) + 1 if len(hits) else new.shape[1]
        got = out[b, 5:]
        assert torch.equal(got[:end], new[b, :end]), b  # token ids, not floats
        assert (got[end:] == VOCAB - 1).all(), b
    assert out.shape[1] <= free.shape[1]


def test_generate_stops_early_when_every_sequence_has_ended():
    model = make_model(seed=3)
    prompts = ids(2, 4, seed=5)
    free = model.generate(prompts, max_new_tokens=6)
    first = free[:, 4]  # both sequences end at their first token when every first token is an eos
    out = model.generate(prompts, max_new_tokens=6, eos_token_id=first.tolist())
    assert out.shape == (2, 5) and torch.equal(out, free[:, :5])
    with pytest.raises(ValueError, match="eos_token_id must be None, an int or a non-empty list"):
        model.generate(prompts, max_new_tokens=2, eos_token_id=VOCAB)
    with pytest.raises(ValueError, match="pad_token_id needs an eos_token_id"):
        model.generate(prompts, max_new_tokens=2, pad_token_id=0)


def test_generate_returns_a_new_tensor_even_with_no_new_token():
    """max_new_tokens = 0 gives the prompts, as a tensor of its own like every other call: writing into the
    result leaves the caller's prompts as they were."""
    model = make_model(seed=3)
    prompts = ids(2, 4, seed=6)
    kept = prompts.clone()
    out = model.generate(prompts, max_new_tokens=0)
    assert torch.equal(out, kept)
    out.add_(1)
    assert torch.equal(prompts, kept)
