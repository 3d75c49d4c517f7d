"""Exercises of chapter 2: linear attention, attention as an RNN.

Each `check_*` takes the reader's answer; `None` (the placeholder in the book) only prints what is asked.
The worked solutions are the `solution_*` functions, shown in the book's hidden cells.
"""

import torch

from kda_edu.exercises import expect, not_answered, passed
from kda_edu.linear_attention import linear_attention_recurrent
from kda_edu.memory import linear_crosstalk


def _pairs(n: int, d_k: int, d_v: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_k, generator=g, dtype=torch.float64), torch.randn(
        n, d_v, generator=g, dtype=torch.float64
    )


# Exercise 1: the state written by n pairs, without a loop.
def solution_state_from_pairs(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`S = sum_i k_i v_i^T` is the matrix product `K^T V` of the stacked keys `[n, d_k]` and values `[n, d_v]`."""
    return k.T @ v


def check_state_from_pairs(fn) -> str:
    """Exercise 1: `fn(k [n, d_k], v [n, d_v])` must return linear attention's state after the n pairs."""
    k, v = _pairs(10, 6, 4, seed=3)
    out = fn(k, v)
    if out is None:
        return not_answered("Make your function return the [d_k, d_v] state.")
    right = linear_attention_recurrent(
        k[None, :, None], k[None, :, None], v[None, :, None], output_final_state=True
    )
    right = right[1][0, 0]
    expect(
        isinstance(out, torch.Tensor) and out.shape == right.shape,
        f"the state of one head is [d_k, d_v] = {tuple(right.shape)}, got {getattr(out, 'shape', type(out).__name__)}",
    )
    expect(
        torch.allclose(out, right, atol=1e-10),
        "S must be the sum over pairs of the outer products k_i v_i^T.",
    )
    return passed()


# Exercise 2: keys that a linear memory recalls perfectly.
def solution_perfect_keys() -> torch.Tensor:
    """Any orthonormal basis works: the rows of an orthogonal matrix, here the Q factor of a random matrix."""
    return torch.linalg.qr(torch.randn(16, 16, dtype=torch.float64)).Q


def check_perfect_keys(keys) -> str:
    """Exercise 2: 16 keys `[16, 16]` from which S = K^T V recalls any 16 values exactly, S^T k_i = v_i."""
    if keys is None:
        return not_answered("Give a [16, 16] tensor whose rows are the 16 keys.")
    expect(
        isinstance(keys, torch.Tensor) and keys.shape == (16, 16),
        f"expected 16 keys of dimension 16, a [16, 16] tensor, got {getattr(keys, 'shape', type(keys).__name__)}",
    )
    keys = keys.double()
    _, v = _pairs(16, 16, 8, seed=4)
    recalled = keys @ (keys.T @ v)  # row i is S^T k_i
    error = ((recalled - v).norm() / v.norm()).item()
    gram = keys @ keys.T
    off = gram - torch.diag(gram.diagonal())
    expect(
        off.abs().max() < 1e-6,
        f"two of your keys overlap (largest |k_i . k_j| = {off.abs().max():.3g}): their values leak into each "
        "other's recall. Make the keys orthogonal.",
    )
    expect(
        error < 1e-6,
        f"the keys are orthogonal but the recall is off by {error:.3g}: S^T k_i = |k_i|^2 v_i, so each key needs "
        "unit length.",
    )
    return passed("Orthonormal keys: every value comes back exactly, and 16 is the most 16 dimensions allow.")


# Exercise 3: how many random pairs before the memory is half noise.
def solution_pairs_at_half_error() -> int:
    """Solve (n - 1) / d_k = 0.5 for d_k = 128: n = 1 + 64."""
    return 1 + 128 // 2


def check_pairs_at_half_error(answer) -> str:
    """Exercise 3: the number n of random unit-key pairs at which the expected error of d_k = 128 is 0.5."""
    if answer is None:
        return not_answered(
            "Give the number of stored pairs n at which (expected) error = 0.5 for d_k = 128."
        )
    expect(isinstance(answer, int), f"n counts pairs, a whole number; got {answer!r}")
    expect(
        linear_crosstalk(answer, 128) == 0.5,
        f"with n = {answer} the expected error is {linear_crosstalk(answer, 128):.3f}. Each of the other n - 1 "
        "pairs adds 1/d_k of a value's energy as noise.",
    )
    return passed(
        f"n = {answer}, about half of d_k: every recalled value already carries half its energy in noise."
    )


# Exercise 4: one decoding step of linear attention.
def solution_linear_step(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Write first, then read: `S_t = S_{t-1} + k_t v_t^T`, `o_t = S_t^T (scale q_t)`."""
    S = S + torch.outer(k, v)
    return S.T @ (scale * q), S


def check_linear_step(fn) -> str:
    """Exercise 4: `fn(S [d_k, d_v], q [d_k], k [d_k], v [d_v], scale) -> (o [d_v], S_new)` for one token."""
    T, d_k, d_v = 9, 5, 3
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(T, d, generator=g, dtype=torch.float64) for d in (d_k, d_k, d_v))
    scale = d_k**-0.5
    S = torch.zeros(d_k, d_v, dtype=torch.float64)
    outputs = []
    for t in range(T):
        result = fn(S, q[t], k[t], v[t], scale)
        if result is None:
            return not_answered("Make your function return the pair (o, S_new).")
        o, S = result
        outputs.append(o)
    right = linear_attention_recurrent(q[None, :, None], k[None, :, None], v[None, :, None], scale=scale)[0][
        0, :, 0
    ]
    expect(
        all(isinstance(o, torch.Tensor) and o.shape == (d_v,) for o in outputs),
        f"o must be a [d_v] = [{d_v}] vector",
    )
    mine = torch.stack(outputs)
    read_first = right - scale * (q * k).sum(-1, keepdim=True) * v  # o_t read from S_{t-1}
    expect(
        not torch.allclose(mine, read_first, atol=1e-10),
        "you read the state before writing: token t must see its own pair, so write k_t v_t^T first.",
    )
    expect(
        torch.allclose(mine, right, atol=1e-10), "the outputs differ from linear attention's. Is q scaled?"
    )
    return passed("Run it for T tokens and you have linear attention: an RNN with a matrix state.")
