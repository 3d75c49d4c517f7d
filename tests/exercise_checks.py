"""The two tests every chapter's exercise checkers get: the worked solution passes, a wrong answer is rejected,
each verdict one short line."""

import pytest

from kda_edu.exercises import WrongAnswer

LONGEST = 110  # characters of a verdict, "Correct! " included: one line of the page


def checker_tests(cases):
    """Both tests, parametrised over `(check, solution, wrong)` triples; assign them to module-level names."""
    parametrize = pytest.mark.parametrize(
        "check, solution, wrong", cases, ids=lambda x: getattr(x, "__name__", "wrong")
    )

    @parametrize
    def test_solution_passes(check, solution, wrong):
        verdict = check(solution)
        assert verdict.startswith("Correct!")
        assert "\n" not in verdict and len(verdict) <= LONGEST, verdict  # one short line on the page

    @parametrize
    def test_wrong_answer_is_rejected(check, solution, wrong):
        with pytest.raises(WrongAnswer) as error:
            check(wrong)
        hint = "Not yet: " + str(error.value)  # as the page shows it
        assert "\n" not in hint and len(hint) <= LONGEST, hint

    return test_solution_passes, test_wrong_answer_is_rejected
