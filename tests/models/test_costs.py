"""The cost formulas agree with what the layers do: FLOPs counted by torch, bytes of live caches."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from kda_edu.layers.kda_layer import KDAConfig, KDALayer
from kda_edu.layers.mla import MLA, MLAConfig
from kda_edu.models.costs import cache_bytes, kda_token_cost, mla_token_cost
from kda_edu.models.model import HybridConfig, HybridLM

D = 24


def counted_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("mode", ["mha", "mqa"])
@pytest.mark.parametrize("appended", [1, 3])
def test_mla_flops_match_torchs_count(mode, appended):
    config = MLAConfig(num_heads=3, kv_rank=10, qk_head_dim=4, v_head_dim=6, output_gate=True)
    torch.manual_seed(0)
    layer = MLA(D, config)
    cache = layer.new_cache()
    with torch.no_grad():
        layer(torch.randn(1, 5, D), cache=cache)
        flops = counted_flops(lambda: layer(torch.randn(1, appended, D), cache=cache, mode=mode))
    cost = mla_token_cost(config, D, context_len=5 + appended, mode=mode, appended=appended)
    assert cost.flops * appended == pytest.approx(flops)


def test_kda_decoding_step_flops_match_torchs_count_plus_the_elementwise_work():
    config = KDAConfig(num_heads=2, head_dim=4, num_v_heads=4, v_head_dim=6, gate_rank=5)
    torch.manual_seed(0)
    layer = KDALayer(D, config)
    cache = layer.new_cache()
    with torch.no_grad():
        layer(torch.randn(1, 5, D), cache=cache)
        flops = counted_flops(lambda: layer(torch.randn(1, 1, D), cache=cache))
    cost = kda_token_cost(config, D)
    state = 4 * 3 * 4 * 6  # decay (1) + rank-1 update (2) per state entry, 4 value heads of 4 x 6
    conv = 2 * 4 * (2 * 2 * 4 + 4 * 6)  # 2 W C: our short convolution is a sum of shifted copies
    elementwise = state + conv
    assert cost.flops == pytest.approx(flops + elementwise)


def test_mla_mqa_mode_costs_more_flops_per_context_token_with_deepseek_dimensions():
    """The attention FLOPs per context position: MQA `2 H (2 r + d_r)`, MHA `2 H (d_k + d_r + d_v)`."""
    config = MLAConfig(num_heads=128, kv_rank=512, qk_head_dim=128, v_head_dim=128)
    mha = mla_token_cost(config, 7168, context_len=4096, mode="mha", rope_head_dim=64)
    mqa = mla_token_cost(config, 7168, context_len=4096, mode="mqa", rope_head_dim=64)
    assert mqa.parts["attention"] / mha.parts["attention"] == pytest.approx((2 * 512 + 64) / (128 + 64 + 128))
    assert mqa.bytes < mha.bytes  # MQA reads only the latents; MHA materialises per-head keys and values


def test_kda_cost_does_not_grow_with_context_and_state_bytes_amortise():
    config = KDAConfig(num_heads=4, head_dim=32)
    one, chunk = kda_token_cost(config, 128), kda_token_cost(config, 128, appended=64)
    assert one.bytes == pytest.approx(64 * chunk.bytes)
    with pytest.raises(ValueError, match="appended must be >= 1"):
        kda_token_cost(config, 128, appended=0)
    with pytest.raises(ValueError, match="context_len must be >= appended = 4"):
        mla_token_cost(MLAConfig(), 128, context_len=3, mode="mqa", appended=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_bytes_formula_matches_live_caches(dtype):
    config = HybridConfig(
        vocab_size=30,
        d_model=16,
        n_layers=5,
        kda=KDAConfig(num_heads=2, head_dim=8, num_v_heads=4, chunk_size=8),
        mla=MLAConfig(num_heads=2, kv_rank=12),
    )
    torch.manual_seed(0)
    model = HybridLM(config).to(dtype)
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.randint(0, 30, (3, 9)), cache=cache)
    expected = cache_bytes(config, context_len=9, batch_size=3, dtype_bytes=torch.finfo(dtype).bits // 8)
    assert cache.nbytes_by_kind() == expected


@pytest.mark.parametrize("mode", ["mha", "mqa"])
def test_kimi_linear_attention_flops_per_position_are_what_torch_counts(mode):
    """Kimi Linear 48B's MLA (H = 32, r = 512, d_k/d_r/d_v = 128/64/128): FlopCounterMode over a live layer
    (meta device) gives the formula's FLOPs per cached position, and the two modes' ratio is 1088 / 320."""
    from kda_edu.models.costs import (
        KIMI_LINEAR_48B,
        attention_flops_per_position,
        counted_attention_flops_per_position,
    )

    config = KIMI_LINEAR_48B.mla
    counted = counted_attention_flops_per_position(config, KIMI_LINEAR_48B.d_model, mode)
    assert counted == pytest.approx(attention_flops_per_position(config, mode))
    ratio = attention_flops_per_position(config, "mqa") / attention_flops_per_position(config, "mha")
    assert ratio == pytest.approx(1088 / 320)
    assert config.cache_width == 576 and KIMI_LINEAR_48B.layer_kinds.count("A") == 7


def test_cache_bytes_count_the_kept_rope_slot():
    config = HybridConfig(
        vocab_size=30,
        d_model=16,
        n_layers=2,
        layer_pattern="KA",
        kda=KDAConfig(num_heads=2, head_dim=8),
        mla=MLAConfig(num_heads=2, kv_rank=12, qk_head_dim=8, v_head_dim=8, rope_head_dim=4),
    )
    model = HybridLM(config)
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.randint(0, 30, (1, 7)), cache=cache)
    assert cache.nbytes_by_kind()["mla"] == cache_bytes(config, 7)["mla"] == 7 * (12 + 4) * 4
