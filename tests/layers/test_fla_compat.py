"""kda_edu's KimiDeltaAttention against fla's: same constructor, same forward, same weights -> same outputs."""

import pytest
import torch
from test_kda_layer import pin_fla_autotuners

from kda_edu.layers.fla_compat import KimiDeltaAttention, from_fla_state_dict, to_fla_state_dict
from kda_edu.layers.kda_layer import KDACache, KDAConfig, KDALayer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D = 32
# Two GVA layers: the softplus gate, and the lower-bound gate with V = 2 K.
FLA_KWARGS = [
    dict(hidden_size=D, head_dim=16, num_heads=2, num_v_heads=4),
    dict(hidden_size=D, head_dim=8, expand_v=2, num_heads=2, lower_bound=-3.0, conv_size=3),
]


def _fla_layer(seed: int, **kwargs):
    fla_layers = pytest.importorskip("fla.layers.kda", reason="fla's layers need flash-linear-attention")
    from kda_edu.kernels._backend import interpreting

    if interpreting():
        pin_fla_autotuners()
    torch.manual_seed(seed)
    theirs = fla_layers.KimiDeltaAttention(mode="fused_recurrent", **kwargs)
    with torch.no_grad():  # fla's init leaves the output-gate bias and norm at 0 and 1: make them matter
        theirs.g_proj[1].bias.normal_()
        theirs.o_norm.weight.uniform_(0.5, 1.5)
    return theirs.to(DEVICE).eval()


@pytest.mark.parametrize("kwargs", FLA_KWARGS, ids=["softplus", "lower_bound"])
def test_fla_weights_give_fla_outputs(kwargs):
    """fla's layer (its fused_recurrent kernel: no gradient, T <= 64) and ours from its state dict agree, with
    the forward signature and return value of fla, for a full batch and for a right-padded one.
    Tolerance as test_kda_layer's comparison with fla: float32 kernels, different summation orders."""
    theirs = _fla_layer(0, **kwargs)
    ours = KimiDeltaAttention.from_fla_state_dict(theirs.state_dict(), **kwargs).eval()
    torch.manual_seed(1)
    x = torch.randn(2, 12, D, device=DEVICE)
    mask = torch.ones(2, 12, dtype=torch.long, device=DEVICE)
    mask[1, 8:] = 0
    with torch.no_grad():
        for m in (None, mask):
            expected, attn, _ = theirs(x, attention_mask=m)
            got, none, cache = ours(x, attention_mask=m)
            assert attn is None and none is None and cache is None
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=2e-5)


def test_state_dict_round_trip_both_ways():
    """fla -> ours -> fla gives back every fla tensor, and ours -> fla -> ours every one of ours."""
    kwargs = FLA_KWARGS[1]
    theirs = _fla_layer(2, **kwargs)
    fla_state = theirs.state_dict()
    ours = KimiDeltaAttention.from_fla_state_dict(fla_state, **kwargs)
    back = ours.to_fla_state_dict()
    assert back.keys() == fla_state.keys()
    for name, t in fla_state.items():
        assert back[name].shape == t.shape and torch.equal(back[name].to(t.device), t), name  # copies only
    plain = KDALayer(D, ours.config)
    plain.load_state_dict(from_fla_state_dict(to_fla_state_dict(ours), ours.config))
    for name, t in ours.state_dict().items():
        assert torch.equal(plain.state_dict()[name], t.cpu()), name  # plain lives on the CPU, ours on DEVICE


def test_use_cache_returns_a_cache_that_continues_the_sequence():
    """use_cache=True returns a KDACache; feeding the rest of the sequence with it equals one call."""
    layer = KimiDeltaAttention(**FLA_KWARGS[0], backend="torch").double()
    x = torch.randn(2, 11, D, dtype=torch.float64)
    full, _, _ = layer(x)
    first, _, cache = layer(x[:, :7], use_cache=True)
    assert isinstance(cache, KDACache) and cache.seq_len == 7
    second, _, same = layer(x[:, 7:], past_key_values=cache, use_cache=True)
    assert same is cache and cache.seq_len == 11
    torch.testing.assert_close(torch.cat([first, second], dim=1), full, rtol=1e-10, atol=1e-10)


def test_unsupported_fla_options_and_bad_weights_are_named():
    with pytest.raises(ValueError, match="allow_neg_eigval=True is not supported"):
        KimiDeltaAttention(hidden_size=D, head_dim=8, num_heads=2, allow_neg_eigval=True)
    with pytest.raises(ValueError, match="conv_bias=True is not supported"):
        KimiDeltaAttention(hidden_size=D, head_dim=8, num_heads=2, conv_bias=True)
    with pytest.raises(ValueError, match="safe_gate=True needs a lower_bound"):
        KimiDeltaAttention(hidden_size=D, head_dim=8, num_heads=2, safe_gate=True)
    with pytest.raises(ValueError, match="head_dim \\* expand_v must be an integer"):
        KimiDeltaAttention(hidden_size=D, head_dim=8, num_heads=2, expand_v=0.3)
    layer = KimiDeltaAttention(hidden_size=D, head_dim=8, num_heads=2)
    state = layer.to_fla_state_dict()
    state["q_conv1d.bias"] = torch.zeros(16)
    with pytest.raises(ValueError, match=r"unexpected \['q_conv1d.bias'\]"):
        KimiDeltaAttention.from_fla_state_dict(state, hidden_size=D, head_dim=8, num_heads=2)
    with pytest.raises(ValueError, match="dt_bias \\(16,\\) \\(expected \\(32,\\)\\)"):
        KimiDeltaAttention.from_fla_state_dict(
            layer.to_fla_state_dict(), hidden_size=D, head_dim=8, num_heads=4
        )
    with pytest.raises(ValueError, match="low-rank gates only"):
        to_fla_state_dict(KDALayer(D, KDAConfig(num_heads=2, head_dim=8, full_rank="decay")))


@pytest.mark.parametrize("gates", [torch.bfloat16, torch.float32], ids=["bf16_gates", "float32_gates"])
def test_bf16_weights_keep_float32_gate_parameters(gates):
    """A bf16 state dict (its gates' A_log and dt_bias in bf16 too, or kept in float32 as fla creates them)
    converts to a layer whose projections are bf16 and whose A_log and dt_bias are float32, as KDALayer
    creates them, holding the source's values: bf16 -> float32 is exact, float32 stays as it is, so equality
    is exact. The conversion used to cast them to the weights' dtype, rounding float32 gates to bf16."""
    kwargs = dict(hidden_size=D, head_dim=8, num_heads=2)
    torch.manual_seed(3)
    source = KimiDeltaAttention(**kwargs).to_fla_state_dict()
    source["A_log"] = torch.randn(2)  # values bf16 cannot hold, so that a rounding to bf16 shows
    state = {n: t.to(gates if n in ("A_log", "dt_bias") else torch.bfloat16) for n, t in source.items()}
    converted = from_fla_state_dict(state, KimiDeltaAttention(**kwargs).config)
    layer = KimiDeltaAttention.from_fla_state_dict(state, **kwargs)
    assert layer.q_proj.weight.dtype == converted["q_proj.weight"].dtype == torch.bfloat16
    for name, fla_name in (("A_log", "A_log"), ("dt_bias", "dt_bias")):
        expected = state[fla_name].float().reshape(getattr(layer, name).shape)
        for got in (converted[name], getattr(layer, name).detach()):
            assert got.dtype == torch.float32, name
            assert torch.equal(got, expected), name
    if gates == torch.float32:  # the float32 values, not their bf16 rounding
        assert not torch.equal(layer.A_log.detach(), source["A_log"].bfloat16().float())
    with torch.no_grad():  # the mixed-precision layer runs: bf16 in, bf16 out, finite
        out, _, _ = layer(torch.randn(1, 5, D, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and bool(out.isfinite().all())
