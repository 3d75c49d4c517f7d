"""Chapter 11's measurements: parameter formulas against live models, absorption with and without RoPE."""

import pytest
import torch

from kda_edu.chapters.ch11_hybrid import (
    absorption_residual,
    history_order_changes,
    hybrid_parameters,
    mla_parameters,
)
from kda_edu.layers.ffn import FFNConfig
from kda_edu.layers.kda_layer import KDAConfig, KDALayer
from kda_edu.layers.mla import MLA, MLAConfig
from kda_edu.models.model import HybridConfig, HybridLM


@pytest.mark.parametrize("pattern", ["K", "KKKA", "A"])
@pytest.mark.parametrize("moe", [False, True])
def test_parameter_formula_matches_live_model(pattern, moe):
    ffn = FFNConfig(num_experts=3, top_k=2, expert_hidden=8) if moe else FFNConfig(hidden=24)
    config = HybridConfig(
        vocab_size=30,
        d_model=16,
        n_layers=5,
        layer_pattern=pattern,
        ffn=ffn,
        tie_embeddings=not moe,
        kda=KDAConfig(num_heads=2, head_dim=8),
        mla=MLAConfig(num_heads=2, kv_rank=6, output_gate=moe),
    )
    assert sum(hybrid_parameters(config).values()) == HybridLM(config).num_parameters()
    assert sum(mla_parameters(16, config.mla).values()) == sum(
        p.numel() for p in MLA(16, config.mla).parameters()
    )


def test_rope_breaks_absorption_and_attention_sees_a_set():
    assert absorption_residual(rope=False) < 1e-12 < 0.1 < absorption_residual(rope=True)
    x = torch.randn(1, 12, 16, dtype=torch.float64)
    assert history_order_changes(MLA(16, MLAConfig(num_heads=2, kv_rank=6)).double(), x) < 1e-12
    assert history_order_changes(KDALayer(16, KDAConfig(num_heads=2, head_dim=8)).double(), x) > 1e-3
