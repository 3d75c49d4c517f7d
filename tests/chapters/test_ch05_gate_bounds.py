"""The exponents of the factorised intra-block scores, and where the split is anchored."""

import pytest
import torch

from kda_edu.chapters.ch05_gate_bounds import subchunk_scores


def _block(g_min):
    k = torch.nn.functional.normalize(torch.randn(16, 8, generator=torch.Generator().manual_seed(0)), dim=-1)
    return k.double(), torch.full((16, 8), g_min, dtype=torch.float64)


@pytest.mark.parametrize("anchor", [0, 8])
def test_factorised_equals_pairwise_where_nothing_overflows(anchor):
    k, g = _block(-2.0)
    exact = subchunk_scores(k, g, torch.float64, factorised=False)
    torch.testing.assert_close(subchunk_scores(k, g, torch.float64, True, anchor=anchor), exact)


def test_a_middle_anchor_halves_the_span():
    # 16 steps at -8: the start split needs exp(128) (float32 overflows), the middle split exp(64).
    k, g = _block(-8.0)
    exact = subchunk_scores(k, g, torch.float64, factorised=False)
    assert not subchunk_scores(k, g, torch.float32, True, anchor=0).isfinite().all()
    middle = subchunk_scores(k, g, torch.float32, True, anchor=8).double()
    assert ((middle - exact).abs().max() / exact.abs().max()) < 1e-5
    k, g = _block(-12.0)  # 8 * 12 = 96 > 88.7: the middle split overflows too
    assert not subchunk_scores(k, g, torch.float32, True, anchor=8).isfinite().all()


def test_anchor_out_of_range_is_an_error():
    k, g = _block(-1.0)
    with pytest.raises(ValueError, match="anchor must be in"):
        subchunk_scores(k, g, torch.float32, True, anchor=17)
