"""Chapter 1's exercise checkers accept the worked solutions and reject wrong answers."""

import pytest
import torch

from kda_edu.exercises import WrongAnswer, ch01


def test_solutions_pass():
    ch01.check_kv_cache_gib(ch01.solution_kv_cache_gib())
    ch01.check_attention_one_head(ch01.solution_attention_one_head)
    ch01.check_attention_in_blocks(ch01.solution_attention_in_blocks)
    ch01.check_sequences_per_gpu(ch01.solution_sequences_per_gpu())


def test_placeholders_are_not_checked():
    assert ch01.check_kv_cache_gib(None).startswith("Not answered")
    assert ch01.check_attention_one_head(lambda q, k, v: None).startswith("Not answered")
    assert ch01.check_attention_in_blocks(lambda q, k, v, block: None).startswith("Not answered")


def _blocks_without_rescale(q, k, v, block):
    # keeps a running sum but never rescales it when the maximum grows: right only for one block
    T, d = q.shape
    m, total, acc = torch.full((T, 1), -1e30, dtype=q.dtype), torch.zeros(T, 1, dtype=q.dtype), 0
    rows = torch.arange(T)[:, None]
    for start in range(0, T, block):
        cols = torch.arange(start, min(start + block, T))
        s = (q @ k[cols].T / d**0.5).masked_fill(cols[None, :] > rows, float("-inf"))
        m = torch.maximum(m, s.max(dim=1, keepdim=True).values)
        p = torch.exp(s - m)
        total, acc = total + p.sum(1, keepdim=True), acc + p @ v[cols]
    return acc / total


def _blocks_plain_exp(q, k, v, block):
    mask = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
    p = torch.exp(q @ k.T / q.shape[1] ** 0.5).masked_fill(~mask, 0)
    return (p @ v) / p.sum(1, keepdim=True)


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
        (ch01.check_attention_in_blocks, _blocks_without_rescale),
        (ch01.check_attention_in_blocks, _blocks_plain_exp),  # overflows at large scores
        (ch01.check_sequences_per_gpu, 8),
    ],
)
def test_wrong_answers_are_rejected(check, wrong):
    with pytest.raises(WrongAnswer):
        check(wrong)
