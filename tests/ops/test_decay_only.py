"""Decay without the delta rule (RetNet, Mamba-2): the two forms in kda_edu.ops.linear_attention and the mixer kind."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kda_edu.layers.mixers import MixerConfig, TokenMixer
from kda_edu.ops.linear_attention import (
    decayed_linear_attention_chunked,
    decayed_linear_attention_recurrent,
    linear_attention_recurrent,
)

f64 = dict(dtype=torch.float64)


def _inputs(B, T, H, HV, K, V, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, K, generator=gen, **f64), torch.randn(B, T, H, K, generator=gen, **f64)
    v = torch.randn(B, T, HV, V, generator=gen, **f64)
    g = -2 * torch.rand(B, T, HV, generator=gen, **f64)
    S0 = torch.randn(B, HV, K, V, generator=gen, **f64)
    return q, k, v, g, S0


@settings(max_examples=15, deadline=None)
@given(
    T=st.integers(1, 40),
    C=st.sampled_from([1, 4, 16]),
    group=st.sampled_from([1, 2]),
    seed=st.integers(0, 99),
)
def test_chunked_equals_recurrent(T, C, group, seed):
    q, k, v, g, S0 = _inputs(2, T, 1, group, 4, 3, seed)
    o1, S1 = decayed_linear_attention_recurrent(q, k, v, g, initial_state=S0, output_final_state=True)
    o2, S2 = decayed_linear_attention_chunked(
        q, k, v, g, initial_state=S0, output_final_state=True, chunk_size=C
    )
    torch.testing.assert_close(o2, o1, rtol=0, atol=1e-11)  # float64, reordered sums over <= 40 steps
    torch.testing.assert_close(S2, S1, rtol=0, atol=1e-11)


def test_no_decay_is_linear_attention_and_the_state_decays():
    q, k, v, g, _ = _inputs(1, 12, 1, 1, 4, 3, 0)
    o = decayed_linear_attention_chunked(q, k, v, torch.zeros_like(g), chunk_size=5)[0]
    torch.testing.assert_close(o, linear_attention_recurrent(q, k, v)[0], rtol=0, atol=1e-12)
    # one write, then no writes: the state shrinks by exp(g) per step
    k1 = torch.zeros_like(k)
    k1[:, 0] = k[:, 0]
    S = decayed_linear_attention_chunked(q, k1, v, g, output_final_state=True, chunk_size=5)[1]
    want = g[0, 1:, 0].sum().exp() * torch.outer(k[0, 0, 0], v[0, 0, 0])
    torch.testing.assert_close(S[0, 0], want, rtol=1e-12, atol=0)


def test_bad_gate_is_named():
    q, k, v, g, _ = _inputs(1, 5, 1, 1, 4, 3, 0)
    with pytest.raises(ValueError, match=r"g must have rank 3, shape \[B, T, HV\]"):
        decayed_linear_attention_chunked(q, k, v, g[..., None])


def test_decay_only_mixer_is_causal_trains_every_parameter_and_ignores_chunk_size():
    torch.manual_seed(0)
    layer = TokenMixer(24, MixerConfig(kind="decay_only", num_heads=2, head_dim=8, chunk_size=4)).double()
    assert not hasattr(layer, "b_proj")  # no delta rule, no write strength
    x = torch.randn(2, 11, 24, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    changed = x.detach().clone()
    changed[:, 6:] = torch.randn(2, 5, 24, dtype=torch.float64)
    torch.testing.assert_close(layer(changed)[:, :6], y[:, :6].detach(), rtol=1e-10, atol=1e-10)
    y.square().sum().backward()
    unused = [n for n, p in layer.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not unused, f"parameters without a gradient: {unused}"
    layer.config.chunk_size = 3
    torch.testing.assert_close(layer(x), y, rtol=1e-10, atol=1e-10)
    assert MixerConfig(kind="decay_only", num_heads=2, head_dim=8).state_size == 2 * 8 * 8
