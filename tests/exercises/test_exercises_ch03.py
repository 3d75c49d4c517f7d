"""Chapter 3's exercise checkers accept the worked solutions and reject wrong answers."""

import pytest

from kda_edu.exercises import WrongAnswer, ch03
from kda_edu.ops.online_regression import gradient_step

CASES = [
    (ch03.check_repeated_writes, ch03.solution_repeated_writes, lambda beta, n: beta * n),
    (ch03.check_max_stable_beta, ch03.solution_max_stable_beta, lambda key_norm: 1 / key_norm**2),
    (
        ch03.check_weight_decay_step,
        ch03.solution_weight_decay_step,
        lambda S, k, v, beta, lam: gradient_step(S, k, v, beta),
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


def test_checkers_reject_answers_of_the_wrong_type():
    with pytest.raises(WrongAnswer):
        ch03.check_repeated_writes(lambda beta, n: "half")
    with pytest.raises(WrongAnswer):
        ch03.check_max_stable_beta(lambda key_norm: -1.0)
    with pytest.raises(WrongAnswer):
        ch03.check_weight_decay_step(lambda S, k, v, beta, lam: 0.0)
