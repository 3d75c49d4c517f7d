"""Chapter 4's exercise checkers accept the worked solutions and reject wrong answers."""

import math

import pytest
import torch

from kda_edu.exercises import WrongAnswer, ch04

CASES = [
    (ch04.check_gate_for_half_life, ch04.solution_gate_for_half_life, lambda h: -1 / h),
    (ch04.check_boundary_gate, ch04.solution_boundary_gate, lambda starts: torch.where(starts, -30.0, -0.01)),
    (
        ch04.check_decay_matrix,
        ch04.solution_decay_matrix,
        lambda g: g.cumsum(0).exp()[:, None].expand(-1, len(g)),
    ),
]


@pytest.mark.parametrize("check, solution, wrong", CASES, ids=lambda x: getattr(x, "__name__", ""))
def test_checker(check, solution, wrong):
    assert check(solution).startswith("Correct!")
    with pytest.raises(WrongAnswer):
        check(wrong)


@pytest.mark.parametrize("check, solution, wrong", CASES, ids=lambda x: getattr(x, "__name__", ""))
def test_placeholder_is_not_answered(check, solution, wrong):
    assert check(lambda *args: None).startswith("Not answered yet")


def test_checkers_reject_answers_of_the_wrong_kind():
    with pytest.raises(WrongAnswer):
        ch04.check_gate_for_half_life(lambda h: math.log(2) / h)  # positive: not a decay
    with pytest.raises(WrongAnswer):
        ch04.check_boundary_gate(lambda starts: torch.zeros(3))  # wrong shape
    with pytest.raises(WrongAnswer):
        ch04.check_decay_matrix(lambda g: torch.outer(g, g).exp().tril())
