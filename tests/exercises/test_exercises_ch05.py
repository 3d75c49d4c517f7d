"""Chapter 5's exercise checkers: each accepts the worked solution, rejects a wrong answer with a one-line hint,
and rejects the shortcut its exercise forbids."""

import math

import pytest
import torch
from exercise_checks import checker_tests

from kda_edu.exercises import WrongAnswer, ch05


def _spread_evenly(p):
    # wrong: the key spread evenly over a kept half and a fast half keeps 1/2 whatever p is
    k = torch.full((8,), 8**-0.5, dtype=torch.float64)
    return k, torch.tensor([0.0] * 4 + [-5.0] * 4, dtype=torch.float64)


def _undo_without_correction(S, k, v, g, beta):
    # wrong: takes (I - beta k k^T)^-1 for I + beta k k^T
    X = S - beta * torch.outer(k, v)
    return (X + beta * torch.outer(k, k @ X)) / g.exp()[:, None]


CASES = [
    # (checker, worked solution, a wrong answer)
    (ch05.check_two_speed_key, ch05.solution_two_speed_key, _spread_evenly),
    (
        ch05.check_choose_gates,
        ch05.solution_choose_gates,
        lambda k: torch.where(ch05.solution_choose_gates(k) < 0, 0.0, -0.2),  # the halves swapped
    ),
    (ch05.check_undo_step, ch05.solution_undo_step, _undo_without_correction),
]

test_solution_passes, test_wrong_answer_is_rejected = checker_tests(CASES)


@pytest.mark.parametrize("check, solution, wrong", CASES, ids=lambda x: getattr(x, "__name__", "wrong"))
def test_placeholder_repeats_the_question(check, solution, wrong):
    # the wrong answer's one-line hint is checked by checker_tests (as the page shows it, "Not yet: " included)
    assert check(lambda *args: None).startswith("Not answered yet")


def _one_rate(p):
    # the per-head answer: a scalar gate that keeps p after one step keeps p^200 after 200
    k = torch.zeros(8, dtype=torch.float64)
    k[0] = 1.0
    return k, torch.full((8,), math.log(p), dtype=torch.float64)


def _solve(S, k, v, g, beta):
    # right, but through a linear solve of the [K, K] transition
    M = (torch.eye(k.shape[0], dtype=S.dtype) - beta * torch.outer(k, k)) * g.exp()
    return torch.linalg.solve(M, S - beta * torch.outer(k, v))


def _square_inverse(S, k, v, g, beta):
    # right, but it builds the [K, K] inverse instead of working with vectors
    inverse = torch.eye(k.shape[0], dtype=S.dtype) + beta / (1 - beta * k.dot(k)) * torch.outer(k, k)
    return inverse @ (S - beta * torch.outer(k, v)) / g.exp()[:, None]


@pytest.mark.parametrize(
    "check, shortcut, message",
    [
        (ch05.check_two_speed_key, _one_rate, "after 200 steps"),
        # the unshuffled answer: right for the chapter's channel order, not for a shuffled one
        (
            ch05.check_choose_gates,
            lambda k: ch05.solution_choose_gates(ch05._exercise_task()[0].k[:, :, 0]),
            "best scalar gate",
        ),
        (ch05.check_undo_step, _solve, "no solver"),
        (ch05.check_undo_step, _square_inverse, "matrix"),
    ],
    ids=["one_rate", "fixed_channels", "solve", "square_inverse"],
)
def test_shortcuts_are_rejected(check, shortcut, message):
    with pytest.raises(WrongAnswer, match=message):
        check(shortcut)


def test_bad_answers_are_named():
    with pytest.raises(WrongAnswer, match="unit key"):
        ch05.check_two_speed_key(lambda p: (torch.ones(8), torch.zeros(8)))
    with pytest.raises(WrongAnswer, match=r"\[-5, 0\]"):
        ch05.check_choose_gates(lambda k: torch.full((16,), -6.0))
    with pytest.raises(WrongAnswer, match="shape"):
        ch05.check_undo_step(lambda S, k, v, g, beta: S.T)
