"""Chapter 1's exercise checkers accept the worked solutions and reject wrong answers."""

import pytest
import torch

from kda_edu.exercises import WrongAnswer, ch01


def test_solutions_pass():
    ch01.check_grouped_attention(ch01.solution_grouped_attention)
    ch01.check_attention_one_head(ch01.solution_attention_one_head)
    ch01.check_attention_in_blocks(ch01.solution_attention_in_blocks)
    ch01.check_decode_step(ch01.solution_decode_step)


def test_placeholders_are_not_checked():
    assert ch01.check_grouped_attention(lambda q, k, v: None).startswith("Not answered")
    assert ch01.check_attention_one_head(lambda q, k, v: None).startswith("Not answered")
    assert ch01.check_attention_in_blocks(lambda q, k, v, block: None).startswith("Not answered")
    assert ch01.check_decode_step(lambda q, k, v, kc, vc, t: None).startswith("Not answered")


def _grouped_by_copying(q, k, v):
    # right outputs, but the weights are repeated once per value head: an [HV, T, T] tensor
    T, H, d = q.shape
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    p = (torch.einsum("ihd,jhd->hij", q, k) / d**0.5).masked_fill(~causal, float("-inf")).softmax(-1)
    p = p.repeat_interleave(v.shape[1] // H, dim=0)
    return torch.einsum("hij,jhv->ihv", p, v)


def _grouped_wrong_pairing(q, k, v):
    # value head j paired with query head j % H (interleaved) instead of j // G (consecutive)
    T, H, d = q.shape
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    p = (torch.einsum("ihd,jhd->hij", q, k) / d**0.5).masked_fill(~causal, float("-inf")).softmax(-1)
    G = v.shape[1] // H
    return torch.einsum("hij,jghv->ighv", p, v.view(T, G, H, -1)).reshape(T, H * G, -1)


def _decode_reads_whole_cache(q_t, k_t, v_t, k_cache, v_cache, t):
    k_cache[t], v_cache[t] = k_t, v_t
    return (k_cache @ q_t / q_t.shape[0] ** 0.5).softmax(0) @ v_cache


def _decode_own_copy(q_t, k_t, v_t, k_cache, v_cache, t):
    # concatenates into a new tensor each step and never writes the caches it was given
    keys = torch.cat([k_cache[:t].nan_to_num(), k_t[None]])
    values = torch.cat([v_cache[:t].nan_to_num(), v_t[None]])
    return (keys @ q_t / q_t.shape[0] ** 0.5).softmax(0) @ values


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


def _blocks_by_full_softmax(q, k, v, block):
    # the shortcut the exercise forbids: right outputs through the whole [T, T] score matrix
    T, d = q.shape
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return ((q @ k.T) / d**0.5).masked_fill(~causal, float("-inf")).softmax(-1) @ v


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
        (ch01.check_grouped_attention, _grouped_by_copying),
        (ch01.check_grouped_attention, _grouped_wrong_pairing),
        (ch01.check_attention_one_head, _no_mask),
        (ch01.check_attention_one_head, _no_scale),
        (ch01.check_attention_in_blocks, _blocks_without_rescale),
        (ch01.check_attention_in_blocks, _blocks_plain_exp),  # overflows at large scores
        (ch01.check_attention_in_blocks, _blocks_by_full_softmax),  # right outputs, a [T, T] score matrix
        (ch01.check_decode_step, _decode_reads_whole_cache),
        (ch01.check_decode_step, _decode_own_copy),
    ],
)
def test_wrong_answers_are_rejected(check, wrong):
    with pytest.raises(WrongAnswer):
        check(wrong)
