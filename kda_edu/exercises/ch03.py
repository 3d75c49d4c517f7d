"""Exercises of chapter 3 (the delta rule): checkers and worked solutions.

Each `check_*` takes the reader's function, runs it on a few inputs and compares it with what the delta
rule (or autograd) actually does; while the function returns the book's placeholder None, the checker only
repeats the question. Each `solution_*` is the worked solution the book shows.
"""

import math

import torch

from kda_edu.exercises import OperationLog, WrongAnswer, as_number, expect, not_answered, passed, run_refusing
from kda_edu.ops.delta_rule import delta_rule_recurrent
from kda_edu.ops.online_regression import gradient_step, regression_loss


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


# Exercise 1: weight decay on the memory.

_AUTOGRAD = (
    (torch.autograd, ("grad", "backward")),
    (torch.Tensor, ("backward",)),
    (torch.func, ("grad", "grad_and_value", "vjp", "jacrev")),
)


def solution_weight_decay_step(S, k, v, beta, lam):
    """One gradient step on `1/2 |S^T k - v|^2 + lam/2 |S|_F^2`: the delta-rule step, minus `beta lam S`.

    The gradient of `lam/2 |S|_F^2 = lam/2 sum_ij S_ij^2` is `lam S`, so the step is
    `((1 - beta lam) I - beta k k^T) S + beta k v^T`: the memory shrinks by `1 - beta lam` at every token,
    beside the erase. That is not Gated DeltaNet's step `a (I - beta k k^T) S + beta k v^T`, whose decay
    also scales the erase term: the two differ by `(1 - a) beta k k^T S`.
    """
    return gradient_step(S, k, v, beta) - beta * lam * S


def check_weight_decay_step(step) -> str:
    """`step(S, k, v, beta, lam)`: one gradient step (rate beta) on `1/2 |S^T k - v|^2 + lam/2 |S|_F^2`.

    Compared with autograd's gradient; the step itself may not call autograd (the gradient is derived).
    """
    gen = torch.Generator().manual_seed(5)
    probe = torch.zeros(2, 2, dtype=torch.float64)
    advice = "derive the penalty's gradient by hand"
    if run_refusing(step, (probe, probe[:, 0] + 1, probe[0], 0.5, 0.1), _AUTOGRAD, advice) is None:
        return not_answered("write step(S, k, v, beta, lam), returning the new state.")
    for beta, lam in ((0.5, 0.1), (1.0, 0.02), (0.2, 1.0)):
        S = torch.randn(6, 4, generator=gen, dtype=torch.float64)
        k = _unit(torch.randn(6, generator=gen, dtype=torch.float64))
        v = torch.randn(4, generator=gen, dtype=torch.float64)
        S_leaf = S.clone().requires_grad_(True)
        loss = regression_loss(S_leaf, k, v) + lam / 2 * S_leaf.pow(2).sum()
        (grad,) = torch.autograd.grad(loss, S_leaf)
        expected = S - beta * grad
        got = run_refusing(step, (S.clone(), k, v, beta, lam), _AUTOGRAD, advice)
        expect(
            isinstance(got, torch.Tensor) and got.shape == S.shape,
            f"your function must return the new state, a tensor of shape {tuple(S.shape)}",
        )
        expect(
            torch.allclose(got, expected, atol=1e-10, rtol=1e-10),
            f"beta = {beta}, lam = {lam}: off by up to {(got - expected).abs().max():.3g}. "
            "Hint: the gradient of lam/2 sum_ij S_ij^2?",
        )
    return passed(
        "((1 - beta lam) I - beta k k^T) S + beta k v^T: a shrink by 1 - beta lam beside the erase."
    )


# Exercise 2: two overlapping keys written in turn.


def solution_alternating_writes(c: float, n: int) -> tuple[float, float]:
    """After n rounds of writing (k1, v1) then (k2, v2) with beta = 1 into an empty memory, k1 . k2 = c,
    reading k1 returns `alpha v1 + gamma v2`: returns `(alpha, gamma) = (1 - c^(2n), c^(2n-1))`.

    Let S* be a state that stores both pairs exactly (S*^T k_i = v_i) and E = S - S* the error, E_0 = -S*.
    With beta = 1 a write of (k, v) is E -> (I - k k^T) E: it zeroes the error along k. After the first
    write of round 1, k1^T E = 0; the write of k2 then leaves k1^T E = -c k2^T E = c (v2 - c v1)^T, the
    chapter's two-pair result. Every later round maps the error's part in the plane of the keys through two
    projections, which multiplies it by c^2 (the squared cosine between the keys), so after n rounds
    `S^T k1 - v1 = c^(2n-1) (v2 - c v1)`. The memory converges to S*, geometrically in c^2: the more the keys
    overlap, the slower.
    """
    return 1 - c ** (2 * n), c ** (2 * n - 1)


_PRODUCTS = {
    "mm",
    "bmm",
    "mv",
    "addmm",
    "matmul",
    "dot",
    "vdot",
    "baddbmm",
    "addmv",
    "addbmm",
    "outer",
    "ger",
}


def check_alternating_writes(read_back) -> str:
    """`read_back(c, n) -> (alpha, gamma)`: after n rounds of (k1, v1), (k2, v2), beta = 1, k1 . k2 = c, reading
    k1 returns alpha v1 + gamma v2. A formula in c and n: matrix products (a simulation) are refused."""
    if read_back(0.5, 1) is None:
        return not_answered("write read_back(c, n), returning the pair (alpha, gamma).")
    gen = torch.Generator().manual_seed(4)
    for c in (0.3, -0.6, 0.9):
        for n in (1, 2, 3, 7):
            basis = torch.linalg.qr(torch.randn(8, 2, generator=gen, dtype=torch.float64)).Q.T  # [2, 8]
            k1, k2 = basis[0], c * basis[0] + math.sqrt(1 - c * c) * basis[1]
            v = torch.randn(2, 6, generator=gen, dtype=torch.float64)
            keys, values = torch.stack([k1, k2]).repeat(n, 1), v.repeat(n, 1)  # [2n, 8], [2n, 6]
            ones = torch.ones(1, 2 * n, 1, dtype=torch.float64)
            _, S = delta_rule_recurrent(
                keys[None, :, None], keys[None, :, None], values[None, :, None], ones, output_final_state=True
            )
            read = S[0, 0].T @ k1
            right = (
                torch.linalg.lstsq(v.T, read[:, None]).solution[:, 0].tolist()
            )  # read = alpha v1 + gamma v2
            with OperationLog() as ops:
                got = read_back(c, n)
            products = [name for name in ops.names if name in _PRODUCTS or "linalg" in name]
            expect(
                not products,
                f"your function ran {len(products)} matrix products ({products[0] if products else ''}): "
                "derive a formula in c and n",
            )
            expect(
                isinstance(got, (tuple, list)) and len(got) == 2,
                "your function must return a pair (alpha, gamma)",
            )
            alpha, gamma = (as_number(float, x) for x in got)
            expect(
                abs(alpha - right[0]) < 1e-9 and abs(gamma - right[1]) < 1e-9,
                f"c = {c}, n = {n}: the read is {right[0]:.4f} v1 + {right[1]:.4f} v2, not {alpha:.4f} v1 + "
                f"{gamma:.4f} v2. Track S - S*.",
            )
    return passed("The error shrinks by c^2 per round: overlapping keys are stored, slowly.")


# Exercise 3: counting modulo 3 with write strengths up to 2.


def solution_count_mod3(bit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta-rule steps (keys `[m, 2]`, strengths `[m]`) for one token, with v = 0, that count ones mod 3.

    With v = 0 and a unit key, a step is `S -> (I - beta k k^T) S`; at beta = 2 it is the reflection across
    the line orthogonal to k. Two reflections across lines at an angle theta compose to a rotation by
    2 theta, so two steps with keys 60 degrees apart rotate the state by 120 degrees: three ones bring it
    back. Nothing with beta <= 1 can do it: every such step shortens the state along its key, so it could
    never come back to where it started. A zero writes nothing (beta = 0).
    """
    e = torch.tensor([[1.0, 0.0], [math.cos(math.pi / 3), math.sin(math.pi / 3)]], dtype=torch.float64)
    return (
        (e, torch.full((2,), 2.0, dtype=torch.float64))
        if bit
        else (e[:1], torch.zeros(1, dtype=torch.float64))
    )


def _steps(transition_for, bit: int) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        out = transition_for(bit)
    except (TypeError, ValueError, RuntimeError, IndexError) as error:
        raise WrongAnswer(f"your function raised {type(error).__name__}: {error}") from None
    expect(
        isinstance(out, tuple) and len(out) == 2 and all(isinstance(x, torch.Tensor) for x in out),
        "return a pair of tensors (keys [m, d_k], betas [m])",
    )
    keys, betas = out[0].double(), out[1].double().reshape(-1)
    expect(
        keys.dim() == 2 and 1 <= keys.shape[0] <= 4 and keys.shape[0] == betas.numel(),
        f"keys must be [m, d_k] and betas [m], 1 <= m <= 4; got {tuple(out[0].shape)} and {tuple(out[1].shape)}",
    )
    expect(
        bool(((keys.norm(dim=-1) - 1).abs() < 1e-6).all()),
        f"every key must have unit length; yours have lengths {keys.norm(dim=-1).tolist()}",
    )
    expect(
        bool(((betas >= 0) & (betas <= 2)).all()),
        f"write strengths must lie in [0, 2] (stable); yours are {betas.tolist()}",
    )
    return keys, betas


def check_count_mod3(transition_for) -> str:
    """`transition_for(bit) -> (keys [m, d_k], betas [m])`: the delta-rule steps (v = 0) a token runs, so that
    from S_0 = e_1 the state tells the number of ones so far modulo 3. Unit keys, betas in [0, 2], m <= 4."""
    if transition_for(1) is None:
        return not_answered("return (keys [m, d_k], betas [m]) for a token with this bit.")
    steps = {bit: _steps(transition_for, bit) for bit in (0, 1)}
    d_k = steps[1][0].shape[1]
    expect(steps[0][0].shape[1] == d_k, "both bits must use keys of the same dimension d_k")

    def run(S, bit):  # the delta rule with v = 0: S <- S + beta k (0 - S^T k)^T, step by step
        for k, beta in zip(*steps[bit], strict=True):
            S = S - beta * torch.outer(k, S.T @ k)
        return S

    start = torch.zeros(d_k, 1, dtype=torch.float64)
    start[0] = 1.0
    after = [start, run(start, 1), run(run(start, 1), 1)]  # the state after 0, 1 and 2 ones
    gap = min((after[i] - after[j]).norm().item() for i, j in ((0, 1), (0, 2), (1, 2)))
    expect(
        gap > 0.1,
        f"after 0, 1 and 2 ones, two of the states are {gap:.2g} apart: they must differ to tell 0, 1, 2 apart",
    )
    gen = torch.Generator().manual_seed(9)
    for stream in [torch.ones(12, dtype=torch.long)] + [
        torch.randint(0, 2, (40,), generator=gen) for _ in range(6)
    ]:
        S, ones = start, 0
        for bit in stream.tolist():
            S, ones = run(S, bit), ones + bit
            error = (S - after[ones % 3]).norm().item()
            expect(
                error < 1e-6,
                f"after {ones} ones the state is {error:.2g} away from the state after {ones % 3}: "
                "it must depend on the count mod 3 only",
            )
    return passed("Two reflections 60 degrees apart: a 120-degree rotation, which beta <= 1 cannot make.")
