"""Attention residuals: the softmax over depth, its zero-query limit (the ordinary residual), the memory each
form keeps, and the model option."""

import math

import pytest
import torch

from kda_edu.layers.attn_residuals import DepthAttention, DepthStream, kept_vectors
from kda_edu.layers.ffn import FFNConfig
from kda_edu.layers.kda_layer import KDAConfig
from kda_edu.layers.mla import MLAConfig
from kda_edu.models.model import HybridConfig, HybridLM

VOCAB = 40


def config(**overrides) -> HybridConfig:
    base = dict(
        vocab_size=VOCAB,
        d_model=24,
        n_layers=4,
        kda=KDAConfig(num_heads=2, head_dim=8, chunk_size=8),
        mla=MLAConfig(num_heads=2, kv_rank=12, qk_head_dim=8, v_head_dim=8),
        ffn=FFNConfig(hidden=32),
        norm_eps=1e-30,  # RMSNorm(c h) = RMSNorm(h) exactly only without its epsilon
    )
    return HybridConfig(**{**base, **overrides})


def model(seed=0, **overrides) -> HybridLM:
    torch.manual_seed(seed)
    return HybridLM(config(**overrides)).double().eval()


def ids(B=2, T=11, seed=1):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def test_zero_query_is_the_mean_of_the_sources():
    depth = DepthAttention(6).double()
    sources = [torch.randn(2, 3, 6, dtype=torch.float64) for _ in range(4)]
    torch.testing.assert_close(depth(sources), sum(sources) / 4, rtol=1e-12, atol=1e-12)


def test_weights_are_the_softmax_of_query_dot_normalised_keys():
    depth = DepthAttention(5, eps=1e-30).double()
    with torch.no_grad():
        depth.query.copy_(torch.randn(5, dtype=torch.float64))
    sources = [torch.randn(1, 1, 5, dtype=torch.float64) * (i + 1) for i in range(3)]  # different sizes
    keys = torch.stack([v / v.square().mean().sqrt() for v in sources])  # RMS-normalised: the size drops out
    logits = (keys * depth.query).sum(-1)
    torch.testing.assert_close(depth.weights(sources), torch.softmax(logits, dim=0), rtol=1e-12, atol=1e-12)
    expected = sum(a * v for a, v in zip(torch.softmax(logits, dim=0), sources, strict=True))
    torch.testing.assert_close(depth(sources), expected, rtol=1e-12, atol=1e-12)


def test_a_large_query_along_one_source_selects_it():
    depth = DepthAttention(8).double()
    sources = [torch.randn(1, 1, 8, dtype=torch.float64) for _ in range(5)]
    target = sources[2] / sources[2].norm()
    with torch.no_grad():
        depth.query.copy_(60.0 * target.flatten())
    alpha = depth.weights(sources)[:, 0, 0]
    assert alpha[2] > 0.99, alpha


@pytest.mark.parametrize("form, block", [("full", 4), ("block", 2), ("block", 3), ("block", 100)])
def test_zero_queries_give_the_ordinary_residual_model(form, block):
    """Same weights, pseudo-queries at their zero initialisation: the same logits as the pre-norm model
    (float64; the sources' mean is the residual sum over its count, which the next RMSNorm removes)."""
    plain = model()
    attn = model(attn_residuals=form, attn_res_block_size=block)
    missing, unexpected = attn.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and all(name.startswith("depth.") for name in missing)
    x = ids()
    torch.testing.assert_close(attn(x), plain(x), rtol=1e-10, atol=1e-10)


def test_trained_queries_change_the_model_and_receive_gradients():
    plain = model()
    attn = model(attn_residuals="block", attn_res_block_size=2).train()
    attn.load_state_dict(plain.state_dict(), strict=False)
    logits = attn(ids())
    logits.square().mean().backward()
    assert all(q.query.grad is not None and q.query.grad.abs().sum() > 0 for q in attn.depth[1:])
    with torch.no_grad():
        for q in attn.depth:
            q.query.normal_()
    assert (attn(ids()) - plain(ids())).abs().max() > 1e-3


@pytest.mark.parametrize("form, block", [("full", 1), ("block", 3)])
def test_decoding_token_by_token_equals_the_full_forward(form, block):
    m = model(attn_residuals=form, attn_res_block_size=block)
    with torch.no_grad():
        for q in m.depth:
            q.query.normal_()
    x = ids(T=9)
    full = m(x)
    cache = m.new_cache()
    steps = torch.cat([m(x[:, t : t + 1], cache=cache) for t in range(x.shape[1])], dim=1)
    torch.testing.assert_close(steps, full, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("L, block", [(0, 1), (1, 1), (8, 1), (8, 3), (12, 12), (13, 12), (186, 12)])
def test_kept_vectors_is_what_a_stream_holds(L, block):
    stream = DepthStream(torch.zeros(1, 1, 2), block)
    for _ in range(L):
        stream.add(torch.ones(1, 1, 2))
    assert len(stream.sources()) == kept_vectors(L, block) == 1 + math.ceil(L / block)
    assert stream.max_kept == kept_vectors(L, block)
    total = sum(stream.sources())
    torch.testing.assert_close(total, torch.full((1, 1, 2), float(L)))  # the block sums lose no output


@pytest.mark.parametrize("form, block, kept", [("full", 1, 9), ("block", 2, 5), ("block", 3, 4)])
def test_a_model_pass_keeps_the_counted_vectors(form, block, kept):
    m = model(attn_residuals=form, attn_res_block_size=block)
    _, stream = m.depth_residuals(m.embed(ids()))
    assert stream.max_kept == kept == kept_vectors(2 * m.config.n_layers, block)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="HybridConfig.attn_residuals must be 'none', 'full' or 'block'"):
        config(attn_residuals="dense")
    with pytest.raises(ValueError, match="HybridConfig.attn_res_block_size must be >= 1"):
        config(attn_residuals="block", attn_res_block_size=0)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        DepthStream(torch.zeros(1, 1, 2), 0)
    with pytest.raises(ValueError, match="need num_sublayers >= 0 and block_size >= 1"):
        kept_vectors(-1, 2)
