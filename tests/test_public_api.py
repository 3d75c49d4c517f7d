"""`import kda_edu` gives the model, its layers and the reference operators (and never imports Triton:
tests/test_backend.py checks that in a fresh process)."""

import torch

import kda_edu
from kda_edu.ops.kda import kda_recurrent


def test_every_public_name_resolves():
    missing = [name for name in kda_edu.__all__ if not hasattr(kda_edu, name)]
    assert not missing


def test_the_hybrid_model_from_the_top_level_names_runs():
    config = kda_edu.HybridConfig(vocab_size=32, d_model=32, n_layers=4)
    model = kda_edu.HybridLM(config)
    kinds = {type(module) for module in model.modules()}
    assert kda_edu.KDALayer in kinds and kda_edu.MLA in kinds  # the 3:1 pattern uses both layers
    logits = model(torch.randint(0, 32, (2, 9)))
    assert logits.shape == (2, 9, 32) and torch.isfinite(logits).all()


def test_reference_operators_agree_through_the_top_level_names():
    torch.manual_seed(0)
    B, T, H, K = 1, 20, 2, 8
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=torch.float64), dim=-1) for _ in "qk")
    v, beta = torch.randn(B, T, H, K, dtype=torch.float64), torch.rand(B, T, H, dtype=torch.float64)
    g = -torch.rand(B, T, H, K, dtype=torch.float64)
    chunked = kda_edu.kda_chunked(q, k, v, g, beta, chunk_size=8)[0]
    # float64, T = 20: the chunked and the step-by-step forms differ only by rounding
    torch.testing.assert_close(chunked, kda_recurrent(q, k, v, g, beta)[0], rtol=1e-10, atol=1e-12)
