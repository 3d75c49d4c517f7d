"""Chapter 3's exercise checkers: the worked solutions pass, wrong answers and forbidden shortcuts are rejected."""

import math

import pytest
import torch
from exercise_checks import LONGEST, checker_tests

from kda_edu.exercises import WrongAnswer, ch03
from kda_edu.ops.online_regression import gradient_step, regression_loss


def _parity_steps(bit):
    # chapter 3's parity machine: one reflection per one counts mod 2, not mod 3
    k = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    return k, torch.full((1,), 2.0 * bit, dtype=torch.float64)


def _autograd_step(S, k, v, beta, lam):
    # right, but the gradient comes from autograd instead of a derivation
    S_leaf = S.clone().requires_grad_(True)
    loss = regression_loss(S_leaf, k, v) + lam / 2 * S_leaf.pow(2).sum()
    (grad,) = torch.autograd.grad(loss, S_leaf)
    return S - beta * grad


def _backward_step(S, k, v, beta, lam):
    S_leaf = S.clone().requires_grad_(True)
    (regression_loss(S_leaf, k, v) + lam / 2 * S_leaf.pow(2).sum()).backward()
    return S - beta * S_leaf.grad


def _simulated(c, n):
    # right, but a simulation: two keys in the plane, n rounds of the delta rule, then a least-squares fit
    k = torch.tensor([[1.0, 0.0], [c, math.sqrt(1 - c * c)]], dtype=torch.float64)
    v = torch.eye(2, dtype=torch.float64)
    S = torch.zeros(2, 2, dtype=torch.float64)
    for _ in range(n):
        for i in range(2):
            S = gradient_step(S, k[i], v[i], 1.0)
    read = S.T @ k[0]
    return read[0].item(), read[1].item()


def _rotation_by_scaling(bit):
    # a rotation by 120 degrees from strengths above 2 (keys of length 1, beta = 3): unstable, refused
    k = torch.tensor([[1.0, 0.0], [0.5, math.sqrt(3) / 2]], dtype=torch.float64)
    return k, torch.full((2,), 3.0 * bit, dtype=torch.float64)


def _long_keys(bit):
    # beta = 2 on keys of length sqrt(2) is beta = 4 on unit keys: refused
    keys, betas = ch03.solution_count_mod3(bit)
    return keys * math.sqrt(2), betas


def _gentle_rotation(bit):
    # beta <= 1 only: contracts along the keys, so three ones never bring the state back
    keys, betas = ch03.solution_count_mod3(bit)
    return keys, betas / 2


CASES = [
    # (checker, worked solution, a wrong answer)
    (
        ch03.check_weight_decay_step,
        ch03.solution_weight_decay_step,
        lambda S, k, v, beta, lam: gradient_step(S, k, v, beta),  # the penalty forgotten
    ),
    (
        ch03.check_alternating_writes,
        ch03.solution_alternating_writes,
        lambda c, n: (1 - c**2, c),
    ),  # one round
    (ch03.check_count_mod3, ch03.solution_count_mod3, _parity_steps),
]

test_solution_passes, test_wrong_answer_is_rejected = checker_tests(CASES)


@pytest.mark.parametrize("check", [c[0] for c in CASES], ids=lambda c: c.__name__)
def test_placeholder_is_not_answered(check):
    assert check(lambda *args: None).startswith("Not answered yet")


@pytest.mark.parametrize(
    "check, shortcut, message",
    [
        (ch03.check_weight_decay_step, _autograd_step, "torch.autograd.grad"),
        (ch03.check_weight_decay_step, _backward_step, "backward"),
        (ch03.check_alternating_writes, _simulated, "matrix products"),
        (ch03.check_alternating_writes, lambda c, n: (1 - c ** (2 * n), c ** (2 * n)), "not"),
        (ch03.check_count_mod3, _rotation_by_scaling, r"\[0, 2\]"),
        (ch03.check_count_mod3, _long_keys, "unit length"),
        (ch03.check_count_mod3, _gentle_rotation, "apart"),
        (ch03.check_weight_decay_step, lambda S, k, v, beta, lam: 0.0, "shape"),
    ],
    ids=[
        "autograd",
        "backward",
        "simulation",
        "wrong_power",
        "beta_3",
        "long_keys",
        "beta_1",
        "not_a_tensor",
    ],
)
def test_shortcuts_are_rejected_in_one_line(check, shortcut, message):
    with pytest.raises(WrongAnswer, match=message) as error:
        check(shortcut)
    assert "\n" not in str(error.value) and len("Not yet: " + str(error.value)) <= LONGEST, str(error.value)


def test_autograd_is_restored_after_a_refusal():
    grad = torch.autograd.grad
    with pytest.raises(WrongAnswer):
        ch03.check_weight_decay_step(_autograd_step)
    assert torch.autograd.grad is grad
