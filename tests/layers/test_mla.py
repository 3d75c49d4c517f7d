"""MLA: both attention modes agree, decoding with the latent cache equals a full forward pass."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kda_edu.layers.mla import MLA, MLACache, MLAConfig
from kda_edu.ops import attention
from kda_edu.ops.attention import causal_attention

D = 32


def make_layer(output_gate: bool = False, seed: int = 0) -> MLA:
    torch.manual_seed(seed)
    config = MLAConfig(num_heads=4, kv_rank=24, qk_head_dim=8, v_head_dim=12, output_gate=output_gate)
    return MLA(D, config).double()


def test_causal_attention_matches_explicit_loop():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 2, 5), torch.randn(2, 7, 2, 5), torch.randn(2, 7, 2, 4)
    out = causal_attention(q, k, v, scale=0.5)
    for i in range(3):
        visible = 7 - 3 + i + 1  # query i sits at position 4 + i
        p = torch.softmax(torch.einsum("bhd,bshd->bhs", q[:, i], k[:, :visible]) * 0.5, dim=-1)
        torch.testing.assert_close(out[:, i], torch.einsum("bhs,bshd->bhd", p, v[:, :visible]))


@pytest.mark.parametrize("T", [1, 3])
def test_shared_head_equals_expanded_heads_in_any_slices(T, monkeypatch):
    torch.manual_seed(0)
    q = torch.randn(2, T, 4, 6, dtype=torch.float64)
    k, v = torch.randn(2, 9, 1, 6, dtype=torch.float64), torch.randn(2, 9, 1, 5, dtype=torch.float64)
    expanded = causal_attention(q, k.expand(-1, -1, 4, -1), v.expand(-1, -1, 4, -1), scale=0.4)
    for numbers in (attention.MQA_SLICE_NUMBERS, 2 * 6 * 4, 1):  # one slice; slices of 4 positions; of 1
        monkeypatch.setattr(attention, "MQA_SLICE_NUMBERS", numbers)
        torch.testing.assert_close(causal_attention(q, k, v, scale=0.4), expanded, rtol=1e-12, atol=1e-12)
        same = causal_attention(q, k, k, scale=0.4)  # keys that are the values, as in MLA
        torch.testing.assert_close(same, causal_attention(q, k, k.clone(), scale=0.4))


class LargestNewTensor(TorchDispatchMode):
    """Records the bytes of the largest tensor storage any operation returns."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.nbytes = max(self.nbytes, t.untyped_storage().nbytes())
        return out


def test_decoding_step_makes_no_per_head_copy_of_the_cache(monkeypatch):
    """MQA mode must read the latents as they are: a broadcasting matmul against `[B, 1, r, S]` keys would
    copy them once per head (64 GiB for one layer at S = 4096, batch 256, on the GPU). The largest tensor a
    step creates is the longer cache itself; float32 slices of it stay within MQA_SLICE_NUMBERS."""
    layer = make_layer().float()  # H = 4, r = 24
    B, S, r = 2, 300, layer.config.kv_rank
    cache = layer.new_cache()
    with torch.no_grad():
        layer(torch.randn(B, S, D), cache=cache)
        monkeypatch.setattr(attention, "MQA_SLICE_NUMBERS", B * r * 50)  # 50 positions per slice
        with LargestNewTensor() as largest:
            layer(torch.randn(B, 1, D), cache=cache)
    assert largest.nbytes == B * (S + 1) * r * 4  # torch.cat's new cache; H copies would be 4 times that


@pytest.mark.parametrize("output_gate", [False, True])
def test_mha_mode_equals_mqa_mode(output_gate):
    layer = make_layer(output_gate)
    x = torch.randn(2, 9, D, dtype=torch.float64)
    torch.testing.assert_close(layer(x, mode="mha"), layer(x, mode="mqa"), rtol=1e-10, atol=1e-10)


def test_modes_agree_against_a_filled_cache():
    layer = make_layer()
    x = torch.randn(2, 10, D, dtype=torch.float64)
    cache_mha, cache_mqa = layer.new_cache(), layer.new_cache()
    layer(x[:, :6], cache=cache_mha)
    layer(x[:, :6], cache=cache_mqa)
    out_mha = layer(x[:, 6:], cache=cache_mha, mode="mha")
    out_mqa = layer(x[:, 6:], cache=cache_mqa, mode="mqa")
    torch.testing.assert_close(out_mha, out_mqa, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("output_gate", [False, True])
def test_decoding_token_by_token_equals_full_forward(output_gate):
    layer = make_layer(output_gate)
    x = torch.randn(2, 11, D, dtype=torch.float64)
    full = layer(x)
    cache = layer.new_cache()
    prefix = layer(x[:, :4], cache=cache)  # prefill, MHA mode
    steps = [layer(x[:, t : t + 1], cache=cache) for t in range(4, 11)]  # decoding, MQA mode
    torch.testing.assert_close(torch.cat([prefix, *steps], dim=1), full, rtol=1e-10, atol=1e-10)
    assert cache.seq_len == 11


def test_decoding_in_float32_within_1e_5():
    layer = make_layer().float()
    x = torch.randn(1, 8, D)
    full = layer(x)
    cache = layer.new_cache()
    steps = [layer(x[:, t : t + 1], cache=cache) for t in range(8)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_output_only_depends_on_the_past():
    layer = make_layer()
    x = torch.randn(1, 8, D, dtype=torch.float64)
    y = x.clone()
    y[:, 5:] += 1.0
    torch.testing.assert_close(layer(x)[:, :5], layer(y)[:, :5])


def test_cache_holds_only_the_latent():
    layer = make_layer().float()
    cache = layer.new_cache()
    assert cache.nbytes() == 0 and cache.seq_len == 0
    layer(torch.randn(3, 5, D), cache=cache)
    assert cache.latent.shape == (3, 5, 24)
    assert cache.nbytes() == 3 * 5 * 24 * 4


def test_gradients_reach_every_parameter():
    layer = make_layer(output_gate=True)
    layer(torch.randn(2, 5, D, dtype=torch.float64)).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())


def test_bad_inputs_are_named():
    layer = make_layer()
    with pytest.raises(ValueError, match=r"x must be a tensor of shape \[B, T, D\] with D = 32"):
        layer(torch.randn(2, 5, 31, dtype=torch.float64))
    with pytest.raises(ValueError, match="mode must be"):
        layer(torch.randn(2, 5, D, dtype=torch.float64), mode="flash")
    with pytest.raises(TypeError, match="cache must be an MLACache"):
        layer(torch.randn(2, 5, D, dtype=torch.float64), cache={})
    cache = MLACache()
    layer(torch.randn(2, 5, D, dtype=torch.float64), cache=cache)
    with pytest.raises(ValueError, match="batch size 3 but the cache holds batch size 2"):
        layer(torch.randn(3, 1, D, dtype=torch.float64), cache=cache)
    with pytest.raises(ValueError, match="MLAConfig.kv_rank must be >= 1"):
        MLAConfig(kv_rank=0)


def test_output_gate_multiplies_each_channel_by_its_sigmoid():
    """With the gate's weights at zero every channel is multiplied by sigmoid(0) = 1/2: half the ungated
    layer's output (float64). With other weights, the gated layer is `W_o (o * sigmoid(W_g x))` where o is
    what the ungated layer feeds its output projection (read with a hook)."""
    gated, plain = make_layer(output_gate=True), make_layer()
    gated.load_state_dict(
        {**plain.state_dict(), "gate_proj.weight": torch.zeros_like(gated.gate_proj.weight)}
    )
    x = torch.randn(2, 6, D, dtype=torch.float64)
    torch.testing.assert_close(gated(x), plain(x) / 2, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        gated.gate_proj.weight.normal_()
    seen = {}
    handle = plain.o_proj.register_forward_hook(
        lambda module, inputs, output: seen.setdefault("o", inputs[0])
    )
    plain(x)
    handle.remove()
    expected = (seen["o"] * torch.sigmoid(gated.gate_proj(x))) @ plain.o_proj.weight.T
    torch.testing.assert_close(gated(x), expected, rtol=1e-12, atol=1e-12)


def make_rope_slot_layer(seed: int = 0) -> MLA:
    torch.manual_seed(seed)
    config = MLAConfig(num_heads=3, kv_rank=16, qk_head_dim=8, v_head_dim=6, rope_head_dim=4)
    return MLA(D, config).double()


def test_kept_rope_slot_modes_agree_and_decoding_equals_full_forward():
    """Kimi's layout: a 4-wide shared key slot beside the 16-wide latent, never rotated. Both modes and
    token-by-token decoding give the full forward's output (float64, 1e-10)."""
    layer = make_rope_slot_layer()
    x = torch.randn(2, 9, D, dtype=torch.float64)
    full = layer(x, mode="mha")
    torch.testing.assert_close(layer(x, mode="mqa"), full, rtol=1e-10, atol=1e-10)
    cache = layer.new_cache()
    steps = [layer(x[:, :3], cache=cache)] + [layer(x[:, t : t + 1], cache=cache) for t in range(3, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)
    assert cache.latent.shape == (2, 9, 16 + 4) and layer.config.cache_width == 20


def test_kept_rope_slot_changes_the_scores():
    """The slot is used: zeroing the slot's down-projection rows changes the output (it is not dead weight),
    while the latent's RMSNorm sees only the first r numbers (scaling the slot rows leaves the latent part of
    the cache unchanged)."""
    layer = make_rope_slot_layer()
    x = torch.randn(1, 6, D, dtype=torch.float64)
    before, latents = layer(x), layer.latents(x)
    with torch.no_grad():
        layer.kv_down.weight[16:] *= 3.0
    torch.testing.assert_close(layer.latents(x)[..., :16], latents[..., :16], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.latents(x)[..., 16:], 3.0 * latents[..., 16:], rtol=1e-12, atol=1e-12)
    assert (layer(x) - before).abs().max() > 1e-3


def test_negative_rope_head_dim_is_named():
    with pytest.raises(ValueError, match="MLAConfig.rope_head_dim must be >= 0"):
        MLAConfig(rope_head_dim=-1)
