"""Chapter 4's exercise checkers: each accepts the worked solution, rejects a wrong answer with a one-line hint,
and rejects the shortcut its exercise forbids."""

import pytest
import torch
from exercise_checks import checker_tests

from kda_edu.exercises import WrongAnswer, ch04

CASES = [
    # (checker, worked solution, a wrong answer)
    (
        ch04.check_repeated_read,
        ch04.solution_repeated_read,
        lambda g, beta: beta,
    ),  # forgot the earlier writes
    (
        ch04.check_reset_after_marker,
        ch04.solution_reset_after_marker,
        lambda ends: torch.where(ends, -30.0, 0.0),  # reset at the marker: erases the document it closes
    ),
    (
        ch04.check_decay_matrix,
        ch04.solution_decay_matrix,
        lambda g: g.cumsum(0).exp()[:, None].expand(-1, len(g)),
    ),
]

test_solution_passes, test_wrong_answer_is_rejected = checker_tests(CASES)


@pytest.mark.parametrize("check, solution, wrong", CASES, ids=lambda x: getattr(x, "__name__", "wrong"))
def test_placeholder_repeats_the_question(check, solution, wrong):
    # the wrong answer's one-line hint is checked by checker_tests (as the page shows it, "Not yet: " included)
    assert check(lambda *args: None).startswith("Not answered yet")


def _simulated_read(g, beta):
    # right to 1e-12, but by iterating the recurrence along k instead of solving for its fixed point
    r = torch.zeros_like(g)
    for _ in range(2000):
        r = g.exp() * (1 - beta) * r + beta
    return r


def _row_by_row(g):
    # right, but one row of the matrix per Python iteration
    T = g.shape[0]
    D = torch.zeros(T, T, dtype=g.dtype)
    for t in range(T):
        D[t, : t + 1] = (g[: t + 1].flip(0).cumsum(0).flip(0) - g[: t + 1]).exp()
    return D


def _factorised(g):
    # exp(G_t) exp(-G_s): right for gentle gates, inf * 0 = NaN once the gates add up to less than -745
    G = g.cumsum(0)
    return (G.exp()[:, None] * (-G).exp()[None, :]).tril()


@pytest.mark.parametrize(
    "check, shortcut, message",
    [
        (ch04.check_repeated_read, _simulated_read, "closed form"),
        (ch04.check_reset_after_marker, lambda ends: torch.where(ends.roll(1), -30.0, 0.0), "later markers"),
        (ch04.check_decay_matrix, _row_by_row, "remove the loop"),
        (ch04.check_decay_matrix, _factorised, "subtract before exp"),
    ],
    ids=["simulated_read", "reads_the_future", "row_by_row", "factorised"],
)
def test_shortcuts_are_rejected(check, shortcut, message):
    with pytest.raises(WrongAnswer, match=message):
        check(shortcut)


def test_bad_return_values_are_named():
    with pytest.raises(WrongAnswer, match="shape"):
        ch04.check_reset_after_marker(lambda ends: torch.zeros(3))
    with pytest.raises(WrongAnswer, match="<= 0"):
        ch04.check_reset_after_marker(lambda ends: torch.where(ends, 30.0, 0.0))
    with pytest.raises(WrongAnswer, match="raised"):
        ch04.check_decay_matrix(lambda g: g @ torch.ones(3))
