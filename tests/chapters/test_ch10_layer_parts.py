"""Chapter 10's measurements: parameter and FLOP counts by part, the convolution's receptive field."""

import torch

from kda_edu.chapters.ch10_layer_parts import (
    conv_dependence,
    flops_by_part,
    kda_layer_parameters,
    parameters_by_part,
    transition_eigenvalues,
)
from kda_edu.layers.kda_layer import KDAConfig, KDALayer
from kda_edu.models.costs import kda_token_cost


def test_parameter_formula_matches_live_module():
    for cfg in (
        KDAConfig(num_heads=2, head_dim=8),
        KDAConfig(num_heads=2, head_dim=8, num_v_heads=6, v_head_dim=5, gate_rank=3, conv_size=2),
    ):
        layer = KDALayer(20, cfg)
        assert parameters_by_part(layer) == kda_layer_parameters(20, cfg)
        assert sum(kda_layer_parameters(20, cfg).values()) == sum(p.numel() for p in layer.parameters())


def test_projection_flops_match_formula():
    cfg = KDAConfig(num_heads=2, head_dim=8, num_v_heads=4, gate_rank=5, chunk_size=8)
    layer = KDALayer(24, cfg)
    with torch.no_grad():
        counts = flops_by_part(lambda: layer(torch.randn(1, 16, 24)))
    projections = sum(v for k, v in counts.items() if k != "recurrence")
    assert projections == 16 * kda_token_cost(cfg, 24, appended=16).parts["projections"]
    assert counts["recurrence"] > 0


def test_conv_dependence_is_a_causal_band():
    layer = KDALayer(8, KDAConfig(num_heads=1, head_dim=4, conv_size=3))
    dep = conv_dependence(layer.conv, 7)
    t, s = torch.meshgrid(torch.arange(7), torch.arange(7), indexing="ij")
    assert torch.equal(dep, (s <= t) & (s > t - 3))


def test_transition_eigenvalues():
    k = torch.tensor([3.0, 4.0]) / 5
    assert torch.allclose(transition_eigenvalues(k, 0.5), torch.tensor([0.5, 1.0], dtype=torch.float64))
