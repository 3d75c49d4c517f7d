"""Chapter 13's exercise checkers accept the worked solutions and reject wrong answers."""

import pytest
from exercise_checks import checker_tests

from kda_edu.exercises import WrongAnswer, ch13

CASES = [
    # (checker, worked solution, a wrong answer)
    (ch13.check_crossover, ch13.solution_crossover, lambda config: config.kv_rank / 2),
    (
        ch13.check_growing_fraction,
        ch13.solution_growing_fraction,
        lambda pattern, n: pattern.count("A") / len(pattern),
    ),
    (
        ch13.check_bandwidth_tokens_per_s,
        ch13.solution_bandwidth_tokens_per_s,
        lambda w, c, b, bw: bw / (w + c),
    ),
]


test_solution_passes, test_wrong_answer_is_rejected = checker_tests(CASES)


def test_bad_return_values_are_named():
    with pytest.raises(WrongAnswer, match="finite number"):
        ch13.check_crossover(lambda config: "many")
