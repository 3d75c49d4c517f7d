"""Softmax attention: the parallel form against a per-query loop and PyTorch's SDPA; decoding with a KV cache."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from reference_inputs import TOL, make_inputs, rel_err, shapes

from kda_edu.ops.attention import softmax_attention, softmax_attention_step


def attention_loop(q, k, v, scale):
    """o_t = sum_{s <= t} softmax_s(scale q_t . k_s) v_s, one query and one value head at a time."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    o = torch.zeros(B, T, HV, v.shape[3], dtype=torch.float64)
    for t in range(T):
        for j in range(HV):
            h = j // (HV // H)
            p = torch.softmax(scale * torch.einsum("bk,bsk->bs", q[:, t, h], k[:, : t + 1, h]), dim=-1)
            o[:, t, j] = torch.einsum("bs,bsv->bv", p, v[:, : t + 1, j])
    return o


@settings(max_examples=20, deadline=None)
@given(case=shapes(max_T=24))
def test_parallel_equals_loop(case):
    x = make_inputs(*(case[n] for n in "B T H HV K V".split()), seed=case["seed"])
    o = softmax_attention(x["q"], x["k"], x["v"])
    assert rel_err(o, attention_loop(x["q"], x["k"], x["v"], case["K"] ** -0.5)) <= TOL[torch.float64]


def test_matches_torch_sdpa():
    x = make_inputs(2, 33, 3, 3, 16, 8, dtype=torch.float32, seed=1)
    o = softmax_attention(x["q"], x["k"], x["v"], scale=0.2)
    ref = F.scaled_dot_product_attention(
        *(x[n].transpose(1, 2) for n in "qkv"), is_causal=True, scale=0.2
    ).transpose(1, 2)
    assert o.dtype == torch.float32 and rel_err(o, ref) <= TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_decoding_with_a_growing_cache_replays_the_parallel_form(dtype):
    x = make_inputs(2, 11, 2, 4, 6, 5, dtype=dtype, seed=2)
    cache, outputs = None, []
    for t in range(11):
        new = [x[n][:, t : t + 1] for n in "qkv"]
        previous = None if cache is None else [c.clone() for c in cache]
        o_t, cache = softmax_attention_step(*new, kv_cache=cache)
        if previous is not None:
            assert torch.equal(cache[0][:, :t], previous[0]), "the cache grows by appending"
        assert cache[0].shape == (2, t + 1, 2, 6) and cache[1].shape == (2, t + 1, 4, 5)
        outputs.append(o_t)
    assert rel_err(torch.cat(outputs, dim=1), softmax_attention(x["q"], x["k"], x["v"])) <= TOL[dtype]


def test_bad_inputs():
    x = make_inputs(2, 3, 2, 4, 6, 5)
    q, k, v = x["q"], x["k"], x["v"]
    with pytest.raises(ValueError, match=r"v must have shape \[B, T, HV, V\]"):
        softmax_attention(q, k, v[:, :, :3])
    with pytest.raises(ValueError, match="T = 1"):
        softmax_attention_step(q, k, v)
    step = [t[:, :1] for t in (q, k, v)]
    _, cache = softmax_attention_step(*step)
    with pytest.raises(TypeError, match="kv_cache must be a tuple"):
        softmax_attention_step(*step, kv_cache=list(cache))
    with pytest.raises(ValueError, match=r"k_cache must have shape \[B, t, H, K\]"):
        softmax_attention_step(*step, kv_cache=(cache[0][..., :3], cache[1]))
    with pytest.raises(ValueError, match=r"v_cache must have shape \[B, t, HV, V\]"):
        softmax_attention_step(*step, kv_cache=(cache[0], cache[1][:1]))
    with pytest.raises(TypeError, match=r"v_cache of shape \[B, t, HV, V\] must have q's dtype"):
        softmax_attention_step(*step, kv_cache=(cache[0], cache[1].float()))
    with pytest.raises(ValueError, match="same number of tokens"):
        softmax_attention_step(*step, kv_cache=(torch.cat([cache[0]] * 2, dim=1), cache[1]))
