"""Chapter 9's exercise checkers accept the worked solutions and reject wrong answers."""

import pytest
import torch
from exercise_checks import checker_tests

from kda_edu.exercises import WrongAnswer, ch09

CASES = [
    # (checker, worked solution, a wrong answer)
    (ch09.check_dg_from_dgc, ch09.solution_dg_from_dgc, lambda dgc, C: dgc.flip(1).cumsum(1).flip(1)),
    (ch09.check_dg_from_dgc, ch09.solution_dg_from_dgc, lambda dgc, C: dgc.cumsum(1)),
    (
        ch09.check_solve_backward,
        ch09.solution_solve_backward,
        lambda A, u, du: (-(du @ u.T).tril(-1), du),
    ),
    (
        ch09.check_decode_floor_ms,
        ch09.solution_decode_floor_ms,
        lambda B, HV, K, V, bw: 4 * B * HV * K * V / (bw * 1e12) * 1e3,
    ),
]


test_solution_passes, test_wrong_answer_is_rejected = checker_tests(CASES)


def test_bad_return_values_are_named():
    with pytest.raises(WrongAnswer, match="shape"):
        ch09.check_dg_from_dgc(lambda dgc, C: dgc[:, :1])
    with pytest.raises(WrongAnswer, match="pair"):
        ch09.check_solve_backward(lambda A, u, du: torch.zeros(1))
    with pytest.raises(WrongAnswer, match="read alone"):
        ch09.check_decode_floor_ms(lambda B, HV, K, V, bw: 4 * B * HV * K * V / (bw * 1e12) * 1e3)
