"""The DPLR recurrence (chapter 5's view of KDA's transition): its loop and chunked forms agree, KDA is the
case a = beta k, b = exp(g) * k with the value beta v, and `kda_transition` is the matrix one KDA step applies."""

import pytest
import torch
import torch.nn.functional as F

from kda_edu.ops.dplr import chunk_cost, dplr_chunked, dplr_recurrent, kda_transition
from kda_edu.ops.kda import kda_recurrent


def inputs(B=2, T=37, H=2, K=8, V=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(generator=gen, dtype=torch.float64)
    q = torch.randn(B, T, H, K, **f64)
    k = F.normalize(torch.randn(B, T, H, K, **f64), dim=-1)
    v = torch.randn(B, T, H, V, **f64)
    g = -torch.rand(B, T, H, K, **f64)
    beta = torch.rand(B, T, H, **f64)
    return q, k, v, g, beta


def test_kda_is_the_dplr_recurrence_with_tied_vectors():
    q, k, v, g, beta = inputs()
    a, b = beta[..., None] * k, g.exp() * k
    o, S = dplr_recurrent(q, k * beta[..., None], v, g, a, b, scale=8**-0.5)
    # the write k_t v_t^T with the value beta v: pass beta k as the write key, v as the value
    ref_o, ref_S = kda_recurrent(q, k, v, g, beta, output_final_state=True)
    torch.testing.assert_close(o, ref_o, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(S, ref_S, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("T, chunk", [(1, 16), (16, 16), (37, 16), (37, 8), (64, 32)])
def test_chunked_equals_the_loop_for_free_vectors(T, chunk):
    q, k, v, g, _ = inputs(T=T, seed=T)
    gen = torch.Generator().manual_seed(1)
    a = 0.3 * torch.randn(*k.shape, generator=gen, dtype=torch.float64)
    b = 0.3 * torch.randn(*k.shape, generator=gen, dtype=torch.float64)
    h0 = torch.randn(2, 2, 8, 6, generator=gen, dtype=torch.float64)
    ref = dplr_recurrent(q, k, v, g, a, b, scale=0.5, initial_state=h0)
    got = dplr_chunked(q, k, v, g, a, b, scale=0.5, initial_state=h0, chunk_size=chunk)
    for x, y in zip(got, ref, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-10)


def test_kda_transition_is_the_step_the_loop_takes():
    q, k, v, g, beta = inputs(T=1)
    S0 = torch.randn(2, 2, 8, 6, dtype=torch.float64)
    _, S1 = kda_recurrent(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    A = kda_transition(k[:, 0], g[:, 0], beta[:, 0])  # [B, H, K, K]
    write = beta[:, 0, :, None, None] * k[:, 0, :, :, None] * v[:, 0, :, None, :]
    torch.testing.assert_close(A @ S0 + write, S1, rtol=1e-12, atol=1e-12)


def test_tying_the_vectors_saves_work():
    untied, tied = chunk_cost(64, 128, 128, tied=False), chunk_cost(64, 128, 128, tied=True)
    assert sum(tied.values()) < sum(untied.values())
