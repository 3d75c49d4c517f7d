"""Chapter 7's kernel puzzles: the checkers accept the worked solutions and reject wrong kernels.

On a CPU the kernels run through Triton's interpreter (switched on by tests/conftest.py).
"""

import pytest
import triton
import triton.language as tl

from kda_edu.exercises import WrongAnswer, ch07


@triton.jit
def outer_without_store_mask(x, y, z, N0, N1, B0: tl.constexpr, B1: tl.constexpr):
    i = tl.program_id(0) * B0 + tl.arange(0, B0)
    j = tl.program_id(1) * B1 + tl.arange(0, B1)
    x_i = tl.load(x + i, mask=i < N0, other=0.0)
    y_j = tl.load(y + j, mask=j < N1, other=0.0)
    tl.store(z + i[:, None] * N1 + j[None, :], x_i[:, None] * y_j[None, :], mask=j[None, :] < N1)


@triton.jit
def decay_from_chunk_start(g, k, out, T, K, C: tl.constexpr, BK: tl.constexpr):
    t = tl.program_id(0) * C + tl.arange(0, C)
    c = tl.arange(0, BK)
    mask = (t[:, None] < T) & (c[None, :] < K)
    offs = t[:, None] * K + c[None, :]
    gc = tl.cumsum(tl.load(g + offs, mask=mask, other=0.0), axis=0)
    tl.store(out + offs, tl.load(k + offs, mask=mask, other=0.0) * tl.exp(gc), mask=mask)


@triton.jit
def scores_without_causal_mask(q, k, out, T, D, C: tl.constexpr, BD: tl.constexpr):
    rows = tl.arange(0, C)
    t = tl.program_id(0) * C + rows
    c = tl.arange(0, BD)
    mask = (t[:, None] < T) & (c[None, :] < D)
    q_n = tl.load(q + t[:, None] * D + c[None, :], mask=mask, other=0.0)
    k_n = tl.load(k + t[:, None] * D + c[None, :], mask=mask, other=0.0)
    scores = tl.dot(q_n, tl.trans(k_n), input_precision="ieee")
    tl.store(out + tl.program_id(0) * C * C + rows[:, None] * C + rows[None, :], scores)


@triton.jit
def states_of_each_chunk_alone(k, v, states, T, D, C: tl.constexpr, BD: tl.constexpr):
    rows = tl.arange(0, C)
    c = tl.arange(0, BD)
    for n in range(0, tl.cdiv(T, C)):
        t = n * C + rows
        mask = (t[:, None] < T) & (c[None, :] < D)
        k_n = tl.load(k + t[:, None] * D + c[None, :], mask=mask, other=0.0)
        v_n = tl.load(v + t[:, None] * D + c[None, :], mask=mask, other=0.0)
        S = tl.dot(tl.trans(k_n), v_n, input_precision="ieee")
        smask = (c[:, None] < D) & (c[None, :] < D)
        tl.store(states + n * D * D + c[:, None] * D + c[None, :], S, mask=smask)


WRONG = {
    "outer": outer_without_store_mask,
    "chunk_end_decay": decay_from_chunk_start,
    "causal_scores": scores_without_causal_mask,
    "chunk_states": states_of_each_chunk_alone,
}


@pytest.mark.parametrize("name", ch07.SOLUTIONS)
def test_solution_passes(name):
    check, solution = ch07.SOLUTIONS[name]
    assert check(solution).startswith("Correct!")


@pytest.mark.parametrize("name", ch07.SOLUTIONS)
def test_wrong_kernel_is_rejected(name):
    check, _ = ch07.SOLUTIONS[name]
    with pytest.raises(WrongAnswer):
        check(WRONG[name])


def test_missing_store_mask_is_named():
    with pytest.raises(WrongAnswer, match="mask"):
        ch07.check_outer(outer_without_store_mask)


def test_not_a_kernel_and_failing_kernel_are_named():
    with pytest.raises(WrongAnswer, match="triton.jit"):
        ch07.check_outer(lambda *args: None)
    with pytest.raises(WrongAnswer, match="failed"):
        ch07.check_causal_scores(ch07.solution_outer)  # wrong signature: C is not one of its parameters


@triton.jit
def causal_scores_at_default_precision(q, k, out, T, D, C: tl.constexpr, BD: tl.constexpr):
    rows = tl.arange(0, C)
    t = tl.program_id(0) * C + rows
    c = tl.arange(0, BD)
    mask = (t[:, None] < T) & (c[None, :] < D)
    q_n = tl.load(q + t[:, None] * D + c[None, :], mask=mask, other=0.0)
    k_n = tl.load(k + t[:, None] * D + c[None, :], mask=mask, other=0.0)
    scores = tl.where(rows[:, None] >= rows[None, :], tl.dot(q_n, tl.trans(k_n)), 0.0)  # TF32 on a GPU
    tl.store(out + tl.program_id(0) * C * C + rows[:, None] * C + rows[None, :], scores)


def test_a_right_kernel_passes_at_triton_default_precision():
    assert "Correct" in ch07.check_causal_scores(causal_scores_at_default_precision)
