"""Chapter 14's exercise checkers accept the worked solutions and reject wrong answers."""

import pytest
import torch
from exercise_checks import checker_tests

from kda_edu.exercises import WrongAnswer, ch14


def _counts_at_model_width(d, config):
    """Wrong: treats the routed experts as reading the model width even in a latent MoE."""
    E, h, k = config.num_experts, config.expert_hidden, config.top_k
    total = d * E + E * 3 * d * h + config.num_shared * 3 * d * h
    return total, total - (E - k) * 3 * d * h


def _mix_without_norm(sources, query):
    values = torch.stack(sources)
    return (torch.softmax(values @ query, dim=0)[..., None] * values).sum(0)


CASES = [
    (ch14.check_moe_counts, ch14.solution_moe_counts, _counts_at_model_width),
    (ch14.check_depth_mix, ch14.solution_depth_mix, _mix_without_norm),
    (
        ch14.check_bias_update,
        ch14.solution_bias_update,
        lambda bias, load, rate: bias - rate * (load - load.mean()),
    ),
]


test_solution_passes, test_wrong_answer_is_rejected = checker_tests(CASES)


def test_bad_return_values_are_named():
    with pytest.raises(WrongAnswer, match="return \\(total, active\\)"):
        ch14.check_moe_counts(lambda d, config: 3)
    with pytest.raises(WrongAnswer, match="return a tensor of shape"):
        ch14.check_depth_mix(lambda sources, query: 0.0)
