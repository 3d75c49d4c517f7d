"""Exercises of chapter 2: linear attention, attention as an RNN.

Each `check_*` takes the reader's answer; `None` (the placeholder in the book) only prints what is asked.
The worked solutions are the `solution_*` functions, shown in the book's hidden cells.
"""

import torch

from kda_edu.exercises import expect, not_answered, passed
from kda_edu.ops.linear_attention import linear_attention_recurrent


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


# Exercise 3: the best state any rule could write, and its error (the least-squares floor).
def solution_best_state(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The `[d_k, d_v]` state S minimising `sum_i |S^T k_i - v_i|^2` over n pairs (k `[n, d_k]`, v `[n, d_v]`).

    The normal equations `K^T K S = K^T V` have many solutions when n < d_k; the pseudo-inverse picks the one of
    least norm. With n > d_k the best state is the projection of V onto the d_k-dimensional column space of
    K: the other n - d_k dimensions of the values are lost, hence an expected error of (n - d_k) / n for
    Gaussian values.
    """
    return torch.linalg.pinv(k) @ v


def check_best_state(fn) -> str:
    """Exercise 3: `fn(k, v)` must return the least-squares state; its error must be the floor (n - d_k) / n."""
    k, v = _pairs(8, 16, 4, seed=3)
    if fn(k, v) is None:
        return not_answered("Make your function return the [d_k, d_v] state.")
    for n, d_k in ((8, 16), (16, 16), (40, 16), (64, 16)):
        k, v = _pairs(n, d_k, 32, seed=n)
        k = k / k.norm(dim=1, keepdim=True)
        S = fn(k, v)
        expect(
            isinstance(S, torch.Tensor) and S.shape == (d_k, 32),
            f"expected a state of shape ({d_k}, 32), got {getattr(S, 'shape', type(S).__name__)}",
        )
        best = torch.linalg.lstsq(k, v).solution if n >= d_k else torch.linalg.pinv(k) @ v
        err, err_best = (
            ((k @ S - v).pow(2).sum() / v.pow(2).sum()).item(),
            ((k @ best - v).pow(2).sum() / v.pow(2).sum()).item(),
        )
        expect(
            err <= err_best + 1e-9,
            f"n = {n}, d_k = {d_k}: your state's relative error is {err:.4f}, the best possible is {err_best:.4f}. "
            "Set the gradient of sum_i |S^T k_i - v_i|^2 to zero: K^T K S = K^T V.",
        )
        if n <= d_k:
            expect(
                err < 1e-9, f"with n = {n} <= d_k = {d_k} independent keys every pair can be stored exactly"
            )
    # the floor, pooled over many draws: (n - d_k) / n
    n, d_k, trials = 48, 16, 64
    g = torch.Generator().manual_seed(11)
    k = torch.nn.functional.normalize(torch.randn(trials, n, d_k, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(trials, n, 32, generator=g, dtype=torch.float64)
    S = torch.stack([fn(k[b], v[b]) for b in range(trials)])
    pooled = ((k @ S - v).pow(2).sum() / v.pow(2).sum()).item()
    expect(
        abs(pooled - (n - d_k) / n) < 0.03,
        f"pooled over {trials} memories of n = {n} pairs in d_k = {d_k}, the error is {pooled:.3f}, not the floor "
        f"{(n - d_k) / n:.3f}",
    )
    return passed(
        f"exact up to n = d_k, then (n - d_k) / n ({pooled:.3f} at n = 3 d_k): no state does better."
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
