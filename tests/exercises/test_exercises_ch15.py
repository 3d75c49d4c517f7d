"""Chapter 15's exercise checkers accept the worked solutions and reject wrong answers."""

import pytest
import torch
from exercise_checks import checker_tests

from kda_edu.exercises import WrongAnswer, ch15


def fold_later_first(maps, upto):
    S = torch.zeros_like(maps[0][1])
    for M, B in reversed(maps[:upto]):
        S = M @ S + B
    return S


def fold_grads_untransposed(Ms, G, after):
    D = torch.zeros_like(G[0])
    for r in range(len(G) - 1, after, -1):
        D = Ms[r] @ D + G[r]
    return D


CASES = [
    # (checker, worked solution, a wrong answer)
    (ch15.check_fold, ch15.solution_fold, fold_later_first),
    (ch15.check_boundary_bytes, ch15.solution_boundary_bytes, lambda scheme, H, K, V: 4 * H * K * V),
    (ch15.check_fold_grads, ch15.solution_fold_grads, fold_grads_untransposed),
]


test_solution_passes, test_wrong_answer_is_rejected = checker_tests(CASES)


def test_bad_return_values_are_named():
    with pytest.raises(WrongAnswer, match="shape"):
        ch15.check_fold(lambda maps, upto: maps[0][0])
    with pytest.raises(WrongAnswer, match="raised"):
        ch15.check_fold_grads(lambda Ms, G, after: Ms[after + 5])
    with pytest.raises(WrongAnswer, match="also its B"):
        ch15.check_boundary_bytes(lambda scheme, H, K, V: 4 * H * K * (V if scheme == "sequential" else K))
