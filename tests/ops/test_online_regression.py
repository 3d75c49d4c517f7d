"""Chapter 3's reading of the delta rule as online regression: its update is a gradient step on the loss,
its transition matrix reproduces the update, and its checks name what is wrong."""

import pytest
import torch

from kda_edu.ops.online_regression import gradient_step, read, regression_loss, transition


def pair(K=5, V=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    S = torch.randn(K, V, generator=gen, dtype=torch.float64)
    k = torch.randn(K, generator=gen, dtype=torch.float64)
    v = torch.randn(V, generator=gen, dtype=torch.float64)
    return S, k, v


def test_the_update_is_a_gradient_step_on_the_loss():
    S, k, v = pair()
    S_req = S.clone().requires_grad_()
    regression_loss(S_req, k, v).backward()  # autograd's gradient, not the formula's
    torch.testing.assert_close(gradient_step(S, k, v, 0.3), S - 0.3 * S_req.grad)


def test_a_full_step_on_a_unit_key_stores_the_value_exactly():
    S, k, v = pair(seed=1)
    k = k / k.norm()
    torch.testing.assert_close(read(gradient_step(S, k, v, 1.0), k), v)


def test_the_transition_matrix_reproduces_the_update():
    S, k, v = pair(seed=2)
    beta = 0.7
    expected = transition(k, beta) @ S + beta * k[:, None] * v[None, :]
    torch.testing.assert_close(gradient_step(S, k, v, beta), expected)


def test_mismatched_shapes_are_named():
    S, k, v = pair()
    with pytest.raises(ValueError, match=r"got S \(5, 3\), k \(4,\), v \(3,\)"):
        regression_loss(S, k[:-1], v)
