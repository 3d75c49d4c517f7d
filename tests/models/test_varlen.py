"""Sequences of different lengths: a padded batch equals its sequences one by one, packed equals separate."""

import pytest
import torch

from kda_edu.layers.kda_layer import KDAConfig, KDALayer
from kda_edu.layers.mla import MLA, MLAConfig
from kda_edu.models.model import HybridConfig, HybridLM
from kda_edu.ops.varlen import unpad

D = 24
LENGTHS = [5, 1, 9, 0, 4]  # an empty sequence too: it must change nothing


def _kda(backend: str = "torch") -> KDALayer:
    torch.manual_seed(0)
    return KDALayer(
        D, KDAConfig(num_heads=2, head_dim=8, num_v_heads=4, conv_size=3, chunk_size=4, backend=backend)
    )


def _mla() -> MLA:
    torch.manual_seed(1)
    return MLA(D, MLAConfig(num_heads=2, kv_rank=12, qk_head_dim=8, v_head_dim=6))


def _packed(lengths, dtype=torch.float64):
    torch.manual_seed(2)
    x = torch.randn(1, sum(lengths), D, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return x, cu


@pytest.mark.parametrize("make", [_kda, _mla], ids=["kda", "mla"])
def test_packed_sequences_equal_separate_calls(make):
    layer = make().double()
    x, cu = _packed(LENGTHS)
    got = layer(x, cu_seqlens=cu)
    c = cu.tolist()
    expected = torch.cat([layer(x[:, a:b]) for a, b in zip(c[:-1], c[1:], strict=True) if b > a], dim=1)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)  # float64: rounding only
    # and the sequences do see each other without cu_seqlens (the test could tell them apart)
    assert not torch.allclose(layer(x), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("make", [_kda, _mla], ids=["kda", "mla"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_equals_sequences_one_by_one(make, side):
    layer = make().double()
    lengths, T = [6, 2, 9], 9
    torch.manual_seed(3)
    x = torch.randn(3, T, D, dtype=torch.float64)
    mask = torch.zeros(3, T, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1 if side == "right" else 0
        if side == "left":
            mask[i, T - n :] = 1
    y = layer(x, attention_mask=mask)
    for i in range(3):
        tokens = mask[i].bool()
        torch.testing.assert_close(y[i, tokens], layer(x[i : i + 1, tokens])[0], rtol=1e-10, atol=1e-10)
        assert (y[i, ~tokens] == 0).all()


def test_packed_sequences_through_the_triton_kernel():
    """backend="triton" hands cu_seqlens to chunk_kda (the interpreter here, float32); it agrees with the
    PyTorch path sequence by sequence to 1e-5 relative (exact float32 products, different order; 1e-4 on a GPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled kernels take CUDA tensors only
    x, cu = _packed([7, 3, 5], dtype=torch.float32)
    x, cu = x.to(device), cu.to(device)
    with torch.no_grad():
        got = _kda("triton").to(device)(x, cu_seqlens=cu)
        expected = _kda("torch").to(device)(x, cu_seqlens=cu)
    tol = 1e-5 if device == "cpu" else 1e-4  # the GPU's float32 kernels: another summation order, FMA
    assert (got - expected).norm() <= tol * expected.norm()


@pytest.mark.parametrize("pattern", ["KA"])
def test_model_padded_and_packed_equal_sequences_alone(pattern):
    torch.manual_seed(4)
    config = HybridConfig(
        vocab_size=50,
        d_model=D,
        n_layers=2,
        layer_pattern=pattern,
        kda=KDAConfig(num_heads=2, head_dim=8, chunk_size=4),
        mla=MLAConfig(num_heads=2, kv_rank=12, qk_head_dim=8, v_head_dim=8),
    )
    model = HybridLM(config).double()
    ids = torch.randint(0, 50, (2, 8))
    mask = torch.tensor([[1] * 8, [0] * 3 + [1] * 5])
    logits = model(ids, attention_mask=mask)
    torch.testing.assert_close(logits[0], model(ids[:1])[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(logits[1, 3:], model(ids[1:, 3:])[0], rtol=1e-10, atol=1e-10)
    assert (logits[1, :3] == 0).all()
    packed, _, cu = unpad(ids, mask.bool())
    torch.testing.assert_close(
        model(packed, cu_seqlens=cu), logits[mask.bool()][None], rtol=1e-10, atol=1e-10
    )


def test_bad_masks_and_lengths_are_named():
    layer, model = _kda(), HybridLM(HybridConfig(vocab_size=10, d_model=D, n_layers=1, layer_pattern="K"))
    x = torch.randn(2, 5, D)
    with pytest.raises(ValueError, match=r"attention_mask must be a \[B, T\] = \(2, 5\) padding mask"):
        layer(x, attention_mask=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="attention_mask .* must be bool or an integer 0/1 tensor"):
        layer(x, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="must hold only 0"):
        layer(x, attention_mask=torch.full((2, 5), 2))
    with pytest.raises(ValueError, match="with cu_seqlens the batch size must be 1"):
        layer(x, cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end at T = 5"):
        layer(x[:1], cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="not both"):
        model(
            torch.zeros(1, 5, dtype=torch.long),
            attention_mask=torch.ones(1, 5),
            cu_seqlens=torch.tensor([0, 5]),
        )


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_prefill_into_an_empty_cache_then_decoding(side):
    """A padded prompt batch prefilled into an empty cache leaves each row's own state and convolution window:
    decoding on from it equals running every sequence alone (float64: rounding only)."""
    layer = _kda().double()
    lengths, T = [6, 1, 4], 6
    torch.manual_seed(5)
    x = torch.randn(3, T + 3, D, dtype=torch.float64)  # T prompt positions, then 3 decoded tokens
    mask = torch.zeros(3, T, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1 if side == "right" else 0
        if side == "left":
            mask[i, T - n :] = 1
    cache = layer.new_cache()
    layer(x[:, :T], cache=cache, attention_mask=mask)
    steps = []
    for t in range(T, T + 3):
        full_mask = torch.cat(
            [mask, torch.ones(3, t - T + 1, dtype=torch.long)], dim=1
        )  # as generate keeps it
        steps.append(layer(x[:, t : t + 1], cache=cache, attention_mask=full_mask))
    steps = torch.cat(steps, dim=1)
    for i in range(3):
        alone = torch.cat([x[i : i + 1, :T][:, mask[i].bool()], x[i : i + 1, T:]], dim=1)
        torch.testing.assert_close(steps[i], layer(alone)[0, -3:], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="padding only in the first call"):
        layer(x[:, :1], cache=cache, attention_mask=torch.zeros(3, 1, dtype=torch.long))


def test_packed_prefill_into_an_empty_cache_decodes_the_sequences_as_a_batch():
    layer = _kda().double()
    x, cu = _packed([3, 7, 2])
    cache = layer.new_cache()
    layer(x, cache=cache, cu_seqlens=cu)
    assert cache.state.shape[0] == 3 and cache.conv_window.shape[0] == 3
    nxt = torch.randn(3, 1, D, dtype=torch.float64)
    got = layer(nxt, cache=cache)
    c = cu.tolist()
    for i, (a, b) in enumerate(zip(c[:-1], c[1:], strict=True)):
        alone = layer(torch.cat([x[:, a:b], nxt[i : i + 1]], dim=1))[0, -1]
        torch.testing.assert_close(got[i, 0], alone, rtol=1e-10, atol=1e-10)
    used = layer.new_cache()
    layer(x[:, :2], cache=used)
    with pytest.raises(ValueError, match="cu_seqlens starts new sequences"):
        layer(x, cache=used, cu_seqlens=cu)


@pytest.mark.parametrize("make", [_kda, _mla], ids=["kda", "mla"])
def test_a_batch_without_tokens_gives_zeros(make):
    """Every row padding (or every packed sequence empty) is a batch like any other: zeros at the padding,
    nothing at all for T = 0; the empty sequences change nothing, as in a batch that has tokens."""
    layer = make().double()
    x = torch.randn(2, 4, D, dtype=torch.float64)
    y = layer(x, attention_mask=torch.zeros(2, 4, dtype=torch.long))
    assert y.shape == (2, 4, D) and (y == 0).all()
    empty = layer(x[:1, :0], cu_seqlens=torch.tensor([0, 0, 0], dtype=torch.int32))
    assert empty.shape == (1, 0, D)


def test_an_all_padding_prefill_leaves_every_row_at_its_start():
    """Prefilling an all-padding batch into an empty cache: each row's state and window are those of an empty
    sequence, so the next token decodes as if it were the first (float64: rounding only)."""
    layer = _kda().double()
    torch.manual_seed(6)
    x, nxt = torch.randn(2, 4, D, dtype=torch.float64), torch.randn(2, 1, D, dtype=torch.float64)
    cache, mask = layer.new_cache(), torch.zeros(2, 4, dtype=torch.long)
    layer(x, cache=cache, attention_mask=mask)
    got = layer(nxt, cache=cache, attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1))
    torch.testing.assert_close(got, layer(nxt), rtol=1e-10, atol=1e-10)


def test_model_logits_of_an_all_padding_batch_are_zero():
    torch.manual_seed(7)
    config = HybridConfig(
        vocab_size=50,
        d_model=D,
        n_layers=2,
        layer_pattern="KA",
        kda=KDAConfig(num_heads=2, head_dim=8, chunk_size=4),
        mla=MLAConfig(num_heads=2, kv_rank=12, qk_head_dim=8, v_head_dim=8),
    )
    model = HybridLM(config)
    logits = model(torch.randint(0, 50, (2, 3)), attention_mask=torch.zeros(2, 3, dtype=torch.long))
    assert logits.shape == (2, 3, 50) and (logits == 0).all()


def test_a_mask_of_the_wrong_rank_beside_a_filled_cache_is_named():
    layer, x = _kda(), torch.randn(2, 4, D)
    cache = layer.new_cache()
    layer(x[:, :3], cache=cache)
    for mask in (torch.ones(4, dtype=torch.long), torch.ones(2, 1, 4, dtype=torch.long)):
        with pytest.raises(
            ValueError, match=r"with a cache of S = 3 tokens, attention_mask must be \[B, T\] or"
        ):
            layer(x[:, 3:], cache=cache, attention_mask=mask)
