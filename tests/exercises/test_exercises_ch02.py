"""Chapter 2's exercise checkers: the worked solutions pass, wrong answers and forbidden shortcuts are rejected."""

import pytest
import torch
from exercise_checks import LONGEST, checker_tests

from kda_edu.exercises import WrongAnswer, ch02


def _unnormalised_step(state, q, k, v):
    # linear attention's cell, without the denominator
    S = torch.outer(k, v) if state is None else state + torch.outer(k, v)
    return S.T @ q, S


def _kv_cache_step(state, q, k, v):
    # right outputs, but a cache of every key and value: the state grows with t
    keys, values = (
        (k[None], v[None])
        if state is None
        else (torch.cat([state[0], k[None]]), torch.cat([state[1], v[None]]))
    )
    scores = keys @ q
    return scores @ values / scores.sum(), (keys, values)


_HISTORY = []


def _global_history_step(state, q, k, v):
    # right outputs for one sequence, but the history lives outside the state: two interleaved sequences mix
    _HISTORY.append((k, v))
    keys, values = torch.stack([h[0] for h in _HISTORY]), torch.stack([h[1] for h in _HISTORY])
    scores = keys @ q
    return scores @ values / scores.sum(), q.new_zeros(1)


def _plain_loop(q, k, v, a, C):
    # right, but one step per token: C plays no part
    S, rows = k.new_zeros(k.shape[1], v.shape[1]), []
    for t in range(k.shape[0]):
        S = a * S + torch.outer(k[t], v[t])
        rows.append(S.T @ q[t])
    return torch.stack(rows), S


def _whole_matrix(q, k, v, a, C):
    # right, but the parallel form: a [T, T] matrix of decays and scores
    t = torch.arange(k.shape[0], dtype=k.dtype)
    decay = torch.where(t[:, None] >= t, a ** (t[:, None] - t).clamp(min=0), 0.0)
    o = (decay * (q @ k.T)) @ v
    return o, (k * (a ** (t[-1] - t))[:, None]).T @ v


def _global_rescaling(q, k, v, a, C):
    # a^(t-s) = a^t a^-s over the whole sequence, then chapter 2's chunked form: a^-T overflows on long inputs
    from kda_edu.exercises.ch02 import solution_decayed_chunked

    t = torch.arange(k.shape[0], dtype=k.dtype)
    o, S = solution_decayed_chunked(q * (a**t)[:, None], k * (a**-t)[:, None], v, 1.0, C)
    return o, S * a ** (k.shape[0] - 1)


def _calls_the_library(q, k, v, a, C):
    from kda_edu.ops.linear_attention import linear_attention_chunked

    return _plain_loop(q, k, v, a, C) if a != 1.0 else linear_attention_chunked(q, k, v)


def _no_decay(q, k, v, a, C):
    return ch02.solution_decayed_chunked(q, k, v, 1.0, C)


CASES = [
    # (checker, worked solution, a wrong answer)
    (ch02.check_normalised_step, ch02.solution_normalised_step, _unnormalised_step),
    (ch02.check_dual_queries, ch02.solution_dual_queries, lambda k: k),  # the plain read: crosstalk
    (ch02.check_decayed_chunked, ch02.solution_decayed_chunked, _no_decay),
]

test_solution_passes, test_wrong_answer_is_rejected = checker_tests(CASES)


@pytest.mark.parametrize("check", [c[0] for c in CASES], ids=lambda c: c.__name__)
def test_placeholder_is_not_answered(check):
    assert check(lambda *args: None).startswith("Not answered yet")


@pytest.mark.parametrize(
    "check, shortcut, message",
    [
        (ch02.check_normalised_step, _kv_cache_step, "keep it fixed"),
        (ch02.check_normalised_step, _global_history_step, "differ from the definition"),
        (ch02.check_dual_queries, lambda k: torch.linalg.qr(k.T).Q.T, "off by"),  # orthonormalised keys
        (ch02.check_decayed_chunked, _plain_loop, "not chunked"),
        (ch02.check_decayed_chunked, _whole_matrix, "a tensor of"),
        (ch02.check_decayed_chunked, _global_rescaling, "outputs off"),
        (ch02.check_decayed_chunked, _calls_the_library, "linear_attention_chunked"),
    ],
    ids=[
        "kv_cache",
        "global_history",
        "orthonormalised",
        "token_loop",
        "t_by_t",
        "global_rescale",
        "library",
    ],
)
def test_shortcuts_are_rejected_in_one_line(check, shortcut, message):
    _HISTORY.clear()
    with pytest.raises(WrongAnswer, match=message) as error:
        check(shortcut)
    assert "\n" not in str(error.value) and len("Not yet: " + str(error.value)) <= LONGEST, str(error.value)


def test_the_library_is_restored_after_a_refusal():
    from kda_edu.ops import linear_attention

    original = linear_attention.linear_attention_chunked
    with pytest.raises(WrongAnswer):
        ch02.check_decayed_chunked(_calls_the_library)
    assert linear_attention.linear_attention_chunked is original
