"""The chapter-6 module: the scan, the WY/UT pieces and the matrix-product chunked KDA against the loop."""

import pytest
import torch

from kda_edu.ops import chunkwise as cw
from kda_edu.ops.kda import kda_chunked, kda_recurrent


def rel(x, ref):
    return ((x - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("T, C, c", [(1, 16, 16), (37, 16, 4), (64, 64, 16), (100, 32, 32), (9, 4, 3)])
def test_matmul_form_matches_the_loop(T, C, c):
    x = cw.random_inputs(2, T, 1, 8, 6, HV=2, dtype=torch.float64, seed=T)
    S0 = torch.randn(2, 2, 8, 6, dtype=torch.float64)
    o_ref, S_ref = kda_recurrent(**x, initial_state=S0, output_final_state=True)
    o, S = cw.kda_chunked_matmul(**x, initial_state=S0, output_final_state=True, chunk_size=C, sub_chunk=c)
    assert rel(o, o_ref) < 1e-12 and rel(S, S_ref) < 1e-12


def test_scan_matches_the_loop_and_counts_its_compositions():
    x = cw.random_inputs(1, 45, 2, 5, 3, HV=4, dtype=torch.float64)
    o_ref, S_ref = kda_recurrent(**x, output_final_state=True)
    o, S = cw.kda_scan(**x)
    assert rel(o, o_ref) < 1e-12 and rel(S, S_ref) < 1e-12
    calls = []

    def counting(later, earlier):
        calls.append(later[0].shape[0])
        return cw.compose_affine(later, earlier)

    for T in (1, 2, 3, 8, 45, 64):
        calls.clear()
        cw.parallel_scan((torch.randn(T, 2, 2), torch.randn(T, 2, 1)), counting)
        assert sum(calls) == cw.scan_compositions(T) <= 2 * T


def test_wy_and_ut_transform():
    gen = torch.Generator().manual_seed(0)
    k = torch.nn.functional.normalize(torch.randn(12, 16, generator=gen, dtype=torch.float64), dim=-1)
    g, beta = (
        -torch.rand(12, 16, generator=gen, dtype=torch.float64),
        torch.rand(12, generator=gen, dtype=torch.float64),
    )
    gc = g.cumsum(0)
    A, _ = cw.intra_chunk_matrices(k, k, gc, beta, sub_chunk=4)
    rhs = beta[:, None] * k * gc.exp()
    W = cw.ut_transform(A, rhs)
    assert torch.allclose(W, cw.forward_substitution(A, rhs), atol=1e-13)
    P = torch.diag(gc[-1].exp()) - (k * (gc[-1] - gc).exp()).T @ W
    assert torch.allclose(P, cw.transition_product(k, g, beta), atol=1e-13)


def test_naive_split_overflows_and_anchors_do_not():
    x = cw.random_inputs(1, 256, 1, 16, 16, lower_bound=-5.0, at_bound=0.5)
    o_ref = kda_recurrent(**x)[0]
    assert not cw.kda_chunked_matmul(**x, chunk_size=64, sub_chunk=64)[0].isfinite().all()
    for o in (cw.kda_chunked_matmul(**x, chunk_size=64, sub_chunk=16)[0], kda_chunked(**x)[0]):
        assert o.isfinite().all() and rel(o, o_ref) < 1e-5
    gc = torch.full((64, 1), -5.0, dtype=torch.float64).cumsum(0)
    assert cw.largest_exponent(gc, 64) == 320 and cw.largest_exponent(gc, 16) == 80


def test_flop_counts():
    assert cw.recurrent_flops(10, 4, 3) == 10 * (7 * 12 + 6)
    total = sum(cw.chunked_flops(4096, 64, 128, 128).values())
    assert abs(total / (6 * 4096 * 128**2 + 5 * 4096 * 64 * 128) - 1) < 0.02
    assert cw.scan_compositions(64) == 2 * 64 - 2 - 6
