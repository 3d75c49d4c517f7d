"""The one loop every chapter shares (`general_recurrence`), against a transcription of its equations written
here step by step: linear attention (no delta rule), the delta rule with per-channel decay, grouped value
heads and an initial state."""

import pytest
import torch

from kda_edu.ops.recurrence import general_recurrence


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
