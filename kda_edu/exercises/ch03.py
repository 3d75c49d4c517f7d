"""Exercises of chapter 3 (the delta rule): checkers and worked solutions.

Each `check_*` takes the reader's function, runs it on a few inputs and compares it with what the delta
rule (or autograd) actually does; while the function returns the book's placeholder None, the checker only
repeats the question. Each `solution_*` is the worked solution the book shows.
"""

import torch

from kda_edu.exercises import as_number, expect, not_answered, passed
from kda_edu.ops.delta_rule import delta_rule_recurrent
from kda_edu.ops.online_regression import gradient_step, regression_loss, transition


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


# Exercise 1: writing the same pair again and again.


def solution_repeated_writes(beta: float, n: int) -> float:
    """Fraction of v returned after n writes of (k, v), |k| = 1, into an empty memory.

    The read-out r_n = S_n^T k is a multiple of v. One write moves it a fraction beta of the way to v:
    r_n = r_{n-1} + beta (v - r_{n-1}), so v - r_n = (1 - beta) (v - r_{n-1}) and, from r_0 = 0,
    v - r_n = (1 - beta)^n v.
    """
    return 1 - (1 - beta) ** n


def check_repeated_writes(fraction) -> str:
    """`fraction(beta, n)`: the fraction of v that `S^T k` returns after writing (k, v) n times, |k| = 1."""
    if fraction(0.5, 1) is None:
        return not_answered("write fraction(beta, n), the multiple of v returned after n writes.")
    gen = torch.Generator().manual_seed(3)
    k = _unit(torch.randn(1, 1, 1, 8, generator=gen, dtype=torch.float64))
    v = torch.randn(1, 1, 1, 8, generator=gen, dtype=torch.float64)
    for beta in (0.1, 0.5, 0.9, 1.0):
        for n in (1, 2, 5, 20):
            ks, vs = k.expand(1, n, 1, 8), v.expand(1, n, 1, 8)
            o, _ = delta_rule_recurrent(
                ks, ks, vs, torch.full((1, n, 1), beta, dtype=torch.float64), scale=1.0
            )
            measured = float((o[0, -1, 0] @ v[0, 0, 0]) / v.pow(2).sum())
            got = as_number(fraction, beta, n)
            expect(
                abs(got - measured) < 1e-9,
                f"for beta = {beta} and n = {n} your function gives {got:.6f}, but the memory returns "
                f"{measured:.6f} of v. Hint: how does the read-out after n writes follow from the one after "
                "n - 1 writes? Look at the gap v - S^T k.",
            )
    return passed("The gap to v shrinks by (1 - beta) per write.")


# Exercise 2: the largest stable write strength for keys that are not unit length.


def solution_max_stable_beta(key_norm: float) -> float:
    """Largest beta with every eigenvalue of I - beta k k^T in [-1, 1]: |1 - beta |k|^2| <= 1."""
    return 2 / key_norm**2


def check_max_stable_beta(max_beta) -> str:
    """`max_beta(key_norm)`: the largest beta for which no eigenvalue of `I - beta k k^T` exceeds 1 in size."""
    if max_beta(1.0) is None:
        return not_answered("write max_beta(key_norm), the largest stable write strength.")
    gen = torch.Generator().manual_seed(4)
    for norm in (0.5, 1.0, 2.0, 4.0, 8.0):
        k = _unit(torch.randn(16, generator=gen, dtype=torch.float64)) * norm
        beta = as_number(max_beta, norm)
        expect(beta > 0, f"for |k| = {norm} your function gives beta = {beta}; a write strength must be > 0")

        def radius(b, k=k):
            return torch.linalg.eigvalsh(transition(k, b)).abs().max().item()

        expect(
            radius(beta) <= 1 + 1e-9,
            f"for |k| = {norm}, beta = {beta:.6g} is too large: I - beta k k^T has an eigenvalue of size "
            f"{radius(beta):.4g} > 1. Hint: find the eigenvalue along k itself.",
        )
        expect(
            radius(beta * 1.01) > 1 + 1e-6,
            f"for |k| = {norm}, beta = {beta:.6g} is stable, but so is a larger beta: you want the largest one.",
        )
    return passed("Stable means beta |k|^2 <= 2; with |k| = 1 every beta in [0, 1] is safe.")


# Exercise 3: weight decay on the memory.


def solution_weight_decay_step(S, k, v, beta, lam):
    """One gradient step on `1/2 |S^T k - v|^2 + lam/2 |S|_F^2`: the delta-rule step, minus `beta lam S`.

    The gradient of `lam/2 |S|_F^2` is `lam S`, so the step is `((1 - beta lam) I - beta k k^T) S + beta k v^T`:
    the memory shrinks by `1 - beta lam` at every token, beside the erase. That is not Gated DeltaNet's step
    `a (I - beta k k^T) S + beta k v^T`, whose decay also scales the erase term: the two differ by
    `(1 - a) beta k k^T S`.
    """
    return gradient_step(S, k, v, beta) - beta * lam * S


def check_weight_decay_step(step) -> str:
    """`step(S, k, v, beta, lam)`: one gradient step (rate beta) on `1/2 |S^T k - v|^2 + lam/2 |S|_F^2`."""
    gen = torch.Generator().manual_seed(5)
    probe = torch.zeros(2, 2, dtype=torch.float64)
    if step(probe, probe[:, 0] + 1, probe[0], 0.5, 0.1) is None:
        return not_answered("write step(S, k, v, beta, lam), returning the new state.")
    for beta, lam in ((0.5, 0.1), (1.0, 0.02), (0.2, 1.0)):
        S = torch.randn(6, 4, generator=gen, dtype=torch.float64)
        k = _unit(torch.randn(6, generator=gen, dtype=torch.float64))
        v = torch.randn(4, generator=gen, dtype=torch.float64)
        S_leaf = S.clone().requires_grad_(True)
        loss = regression_loss(S_leaf, k, v) + lam / 2 * S_leaf.pow(2).sum()
        (grad,) = torch.autograd.grad(loss, S_leaf)
        expected = S - beta * grad
        got = step(S.clone(), k, v, beta, lam)
        expect(
            isinstance(got, torch.Tensor) and got.shape == S.shape,
            f"your function must return the new state, a tensor of shape {tuple(S.shape)}",
        )
        expect(
            torch.allclose(got, expected, atol=1e-10, rtol=1e-10),
            f"for beta = {beta}, lam = {lam} your step is off by up to {(got - expected).abs().max():.3g}. "
            "Hint: what is the gradient of lam/2 |S|_F^2 = lam/2 sum_ij S_ij^2 with respect to S?",
        )
    return passed(
        "((1 - beta lam) I - beta k k^T) S + beta k v^T: a shrink by 1 - beta lam beside the erase."
    )
