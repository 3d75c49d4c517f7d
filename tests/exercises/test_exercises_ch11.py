"""Chapter 11's exercise checkers accept the worked solutions and reject wrong answers."""

import pytest
import torch
from exercise_checks import checker_tests

from kda_edu.exercises import WrongAnswer, ch11


def _no_cache_after_prompt(model, ids, n):
    out = ids
    with torch.no_grad():
        for _ in range(n):
            out = torch.cat([out, model(out)[:, :1].argmax(-1)], dim=1)  # first position: wrong
    return out


CASES = [
    # (checker, worked solution, a wrong answer)
    (
        ch11.check_absorb_query,
        ch11.solution_absorb_query,
        lambda q, w_uk: torch.einsum("thd,hdr->thr", q, w_uk.flip(0)),  # heads swapped
    ),
    (
        ch11.check_mqa_over_mha,
        ch11.solution_mqa_over_mha,
        lambda config, dr: config.kv_rank / config.qk_head_dim,
    ),
    (ch11.check_greedy_decode, ch11.solution_greedy_decode, _no_cache_after_prompt),
]


test_solution_passes, test_wrong_answer_is_rejected = checker_tests(CASES)


def test_bad_return_values_are_named():
    with pytest.raises(WrongAnswer, match="shape"):
        ch11.check_absorb_query(lambda q, w_uk: q)
