"""Chapter 10's exercise checkers accept the worked solutions and reject wrong answers."""

import pytest
import torch
from exercise_checks import checker_tests

from kda_edu.exercises import WrongAnswer, ch10

CASES = [
    # (checker, worked solution, a wrong answer)
    (
        ch10.check_conv_step,
        ch10.solution_conv_step,
        lambda window, x_t, weight: (
            torch.nn.functional.silu(x_t * weight[:, -1]),
            torch.cat([window, x_t[:, None]], dim=1)[:, 1:],
        ),
    ),
    (
        ch10.check_lower_bound_gate,
        ch10.solution_lower_bound_gate,
        lambda x, A_log, dt_bias, lower_bound: lower_bound * torch.sigmoid(x + dt_bias),
    ),
    (
        ch10.check_kda_cache_bytes,
        ch10.solution_kda_cache_bytes,
        lambda config, batch, dtype: batch * config.hv * config.head_dim * config.v_dim * 4,
    ),
]


test_solution_passes, test_wrong_answer_is_rejected = checker_tests(CASES)


def test_bad_return_values_are_named():
    with pytest.raises(WrongAnswer, match="pair"):
        ch10.check_conv_step(lambda window, x_t, weight: x_t)
    with pytest.raises(WrongAnswer, match="raised"):
        ch10.check_lower_bound_gate(lambda x, A_log, dt_bias, lower_bound: x @ torch.ones(3))
