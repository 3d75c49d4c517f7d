"""Chapter 2's exercise checkers accept the worked solutions and reject wrong answers."""

import pytest
import torch

from kda_edu.exercises import WrongAnswer, ch02


def test_solutions_pass():
    ch02.check_state_from_pairs(ch02.solution_state_from_pairs)
    ch02.check_perfect_keys(ch02.solution_perfect_keys())
    ch02.check_best_state(ch02.solution_best_state)
    ch02.check_linear_step(ch02.solution_linear_step)


def test_placeholders_are_not_checked():
    assert ch02.check_perfect_keys(None).startswith("Not answered")
    assert ch02.check_best_state(lambda k, v: None).startswith("Not answered")
    assert ch02.check_linear_step(lambda S, q, k, v, scale: None).startswith("Not answered")


def _read_then_write(S, q, k, v, scale):
    return S.T @ (scale * q), S + torch.outer(k, v)


@pytest.mark.parametrize(
    "check, wrong",
    [
        (ch02.check_state_from_pairs, lambda k, v: v.T @ k),
        (ch02.check_state_from_pairs, lambda k, v: k.T @ v / k.shape[0]),
        (ch02.check_perfect_keys, 2 * torch.eye(16)),
        (ch02.check_perfect_keys, torch.randn(16, 16, generator=torch.Generator().manual_seed(0))),
        (ch02.check_perfect_keys, torch.eye(8)),
        (ch02.check_best_state, lambda k, v: k.T @ v),  # linear attention's state: not the best
        (ch02.check_best_state, lambda k, v: torch.linalg.pinv(k.T @ k) @ k.T @ v / 2),  # half the answer
        (ch02.check_linear_step, _read_then_write),
    ],
)
def test_wrong_answers_are_rejected(check, wrong):
    with pytest.raises(WrongAnswer):
        check(wrong)
