"""The one loop every chapter shares (`recurrence_loop`, and `general_recurrence` around it), against a
transcription of its equations written here step by step: linear attention (no delta rule), the delta rule
with per-channel decay, grouped value heads and an initial state."""

import math

import pytest
import torch

from kda_edu.ops.recurrence import general_recurrence, recurrence_loop


def step_by_step(q, k, v, g, beta, delta_rule, scale, h0):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    S = h0.clone()
    out = torch.zeros(B, T, HV, V, dtype=torch.float64)
    for b in range(B):
        for j in range(HV):
            s = S[b, j]
            for t in range(T):
                kt, qt = k[b, t, j // G], q[b, t, j // G]
                s = g[b, t, j].exp()[:, None] * s
                if delta_rule:
                    s = s + beta[b, t, j] * torch.outer(kt, v[b, t, j] - s.T @ kt)
                else:
                    s = s + beta[b, t, j] * torch.outer(kt, v[b, t, j])
                out[b, t, j] = s.T @ (scale * qt)
            S[b, j] = s
    return out, S


@pytest.mark.parametrize("delta_rule", [True, False])
@pytest.mark.parametrize("per_channel", [True, False])
def test_matches_the_equations_step_by_step(delta_rule, per_channel):
    gen = torch.Generator().manual_seed(3)
    B, T, H, HV, K, V = 2, 9, 1, 2, 4, 3
    f64 = dict(generator=gen, dtype=torch.float64)
    q, k = torch.randn(B, T, H, K, **f64), torch.randn(B, T, H, K, **f64) / 2
    v = torch.randn(B, T, HV, V, **f64)
    g = -torch.rand(B, T, HV, K if per_channel else 1, **f64)
    beta, h0 = torch.rand(B, T, HV, **f64), torch.randn(B, HV, K, V, **f64)
    o, S = general_recurrence(
        q, k, v, g, beta, delta_rule=delta_rule, scale=0.5, initial_state=h0, output_final_state=True
    )
    ref_o, ref_S = step_by_step(q, k, v, g.expand(B, T, HV, K), beta, delta_rule, 0.5, h0)
    torch.testing.assert_close(o, ref_o)
    torch.testing.assert_close(S, ref_S)


@pytest.mark.parametrize("delta_rule", [True, False])
def test_the_wrapper_equals_the_core_the_chapters_show(delta_rule):
    """`general_recurrence` (grouped heads, float32 inputs computed in float32, the scale) against
    `recurrence_loop` run on the heads expanded by hand in float64: rounding only, 1e-5; and the core itself
    against the transcription above at 1e-12."""
    gen = torch.Generator().manual_seed(4)
    B, T, H, HV, K, V = 2, 7, 2, 4, 5, 3
    f32 = dict(generator=gen, dtype=torch.float32)
    q, k, v = (
        torch.randn(B, T, H, K, **f32),
        torch.randn(B, T, H, K, **f32) / 2,
        torch.randn(B, T, HV, V, **f32),
    )
    g, beta, h0 = (
        -torch.rand(B, T, HV, K, **f32),
        torch.rand(B, T, HV, **f32),
        torch.randn(B, HV, K, V, **f32),
    )
    o, S = general_recurrence(
        q, k, v, g, beta, delta_rule=delta_rule, scale=0.5, initial_state=h0, output_final_state=True
    )
    wide = [x.double().repeat_interleave(HV // H, dim=2) for x in (q, k)]
    core_o, core_S = recurrence_loop(
        0.5 * wide[0], wide[1], v.double(), g.double(), beta.double(), h0.double(), delta_rule
    )
    err = max((o.double() - core_o).abs().max().item(), (S.double() - core_S).abs().max().item())
    assert err < 1e-5, f"general_recurrence vs recurrence_loop: {err:.1e} (tolerance 1e-5)"
    ref_o, ref_S = step_by_step(
        q.double(), k.double(), v.double(), g.double(), beta.double(), delta_rule, 0.5, h0.double()
    )
    err = max((core_o - ref_o).abs().max().item(), (core_S - ref_S).abs().max().item())
    assert err < 1e-12, f"recurrence_loop vs the transcription: {err:.1e} (tolerance 1e-12)"


def test_a_bad_key_spoils_the_state_from_its_step_and_a_bad_query_its_own_read():
    """Non-finite handling lives in the wrapper: a NaN key at step 3 makes every read from step 3 on and the
    final state NaN, and leaves steps 0-2 equal to the clean run's; a NaN query spoils its own read only."""
    gen = torch.Generator().manual_seed(5)
    f64 = dict(generator=gen, dtype=torch.float64)
    q, k, v = torch.randn(1, 6, 1, 4, **f64), torch.randn(1, 6, 1, 4, **f64), torch.randn(1, 6, 1, 3, **f64)
    g, beta = -torch.rand(1, 6, 1, 4, **f64), torch.rand(1, 6, 1, **f64)
    clean, _ = general_recurrence(q, k, v, g, beta, delta_rule=True, scale=1.0)
    k_bad, q_bad = k.clone(), q.clone()
    k_bad[0, 3, 0, 1], q_bad[0, 1, 0, 2] = math.nan, math.nan
    o, S = general_recurrence(q, k_bad, v, g, beta, delta_rule=True, scale=1.0, output_final_state=True)
    assert torch.equal(o[:, :3], clean[:, :3]) and o[:, 3:].isnan().all() and S.isnan().all()
    o, S = general_recurrence(q_bad, k, v, g, beta, delta_rule=True, scale=1.0, output_final_state=True)
    assert o[:, 1].isnan().all() and torch.equal(o[:, [0, 2, 3, 4, 5]], clean[:, [0, 2, 3, 4, 5]])
    assert torch.isfinite(S).all()
