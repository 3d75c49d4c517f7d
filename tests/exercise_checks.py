"""The two tests every chapter's exercise checkers get: the worked solution passes, a wrong answer is rejected."""

import pytest

from kda_edu.exercises import WrongAnswer


def checker_tests(cases):
    """Both tests, parametrised over `(check, solution, wrong)` triples; assign them to module-level names."""
    parametrize = pytest.mark.parametrize(
        "check, solution, wrong", cases, ids=lambda x: getattr(x, "__name__", "wrong")
    )

    @parametrize
    def test_solution_passes(check, solution, wrong):
        assert check(solution).startswith("Correct!")

    @parametrize
    def test_wrong_answer_is_rejected(check, solution, wrong):
        with pytest.raises(WrongAnswer):
            check(wrong)

    return test_solution_passes, test_wrong_answer_is_rejected
