"""Chapter 1's exercise checkers accept the worked solutions and reject wrong answers."""

import pytest
import torch

from kda_edu.exercises import WrongAnswer, ch01


def test_solutions_pass():
    ch01.check_kv_cache_gib(ch01.solution_kv_cache_gib())
    ch01.check_attention_one_head(ch01.solution_attention_one_head)
    ch01.check_longest_scores(ch01.solution_longest_scores())
    ch01.check_sequences_per_gpu(ch01.solution_sequences_per_gpu())


def test_placeholders_are_not_checked():
    assert ch01.check_kv_cache_gib(None).startswith("Not answered")
    assert ch01.check_attention_one_head(lambda q, k, v: None).startswith("Not answered")


def _no_mask(q, k, v):
    return (q @ k.T / q.shape[1] ** 0.5).softmax(dim=-1) @ v


def _no_scale(q, k, v):
    mask = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
    return (q @ k.T).masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v


@pytest.mark.parametrize(
    "check, wrong",
    [
        (ch01.check_kv_cache_gib, 320.0),  # counted all 64 query heads instead of the 8 KV heads
        (ch01.check_kv_cache_gib, 20.0),  # forgot the values
        (ch01.check_attention_one_head, _no_mask),
        (ch01.check_attention_one_head, _no_scale),
        (ch01.check_longest_scores, 141422),
        (ch01.check_longest_scores, 100000),
        (ch01.check_longest_scores, 141421.0),
        (ch01.check_sequences_per_gpu, 8),
    ],
)
def test_wrong_answers_are_rejected(check, wrong):
    with pytest.raises(WrongAnswer):
        check(wrong)
