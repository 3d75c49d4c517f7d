"""Checkers and worked solutions for the exercises of chapter 5, Kimi Delta Attention.

Each `check_*` compares the reader's answer with what KDA, its gates or the dtypes actually do; while the answer
is still the book's placeholder None, the checker only repeats the question. Each `solution_*` is the worked
solution the book shows.
"""

import math

import torch

from kda_edu.chapters.ch05_gate_bounds import log_max
from kda_edu.chapters.ch05_two_timescales import channel_gates, make_task, retrieval_errors
from kda_edu.exercises import expect, not_answered, passed
from kda_edu.ops.dplr import kda_transition
from kda_edu.ops.gates import kda_gate

# Exercise 4 always uses this task (the chapter's CPU size), whatever device the book runs on.
EXERCISE_TASK = dict(batch=32, half=8, value_dim=8, n_facts=4, n_stream=124, recent=2, noise=0.5, seed=0)


# Exercise 1: KDA's transition as diagonal plus rank one.


def check_dplr_vectors(fn) -> str:
    """`fn(k, g, beta) -> (d, a, b)` with `Diag(d) - a b^T == (I - beta k k^T) Diag(exp(g))`."""
    gen = torch.Generator().manual_seed(5)
    for K in (3, 8, 16):  # from K = 3 on, a diagonal plus a rank-one part is unique
        k = torch.randn(K, generator=gen, dtype=torch.float64)  # not unit length on purpose
        g = -2 * torch.rand(K, generator=gen, dtype=torch.float64)
        beta = torch.rand((), generator=gen, dtype=torch.float64)
        answer = fn(k, g, beta)
        if answer is None:
            return not_answered(
                "write dplr_vectors(k, g, beta): Diag(d) - a b^T = (I - beta k k^T) Diag(exp(g))."
            )
        d, a, b = (torch.as_tensor(x, dtype=torch.float64) for x in answer)
        expect(
            d.shape == a.shape == b.shape == (K,),
            f"return three vectors of shape [K] = [{K}], got {tuple(d.shape)}, {tuple(a.shape)}, {tuple(b.shape)}",
        )
        want = kda_transition(k, g, beta)
        expect(
            torch.allclose(d, g.exp(), atol=1e-12),
            "the diagonal part is Diag(alpha) with alpha = exp(g): the erase term contributes the rank-one part",
        )
        got = torch.diag(d) - torch.outer(a, b)
        expect(
            torch.allclose(got, want, atol=1e-12),
            "Diag(d) - a b^T differs from (I - beta k k^T) Diag(alpha): multiply k k^T Diag(alpha) out; "
            "Diag(alpha) acts on the right, so it scales the second vector",
        )
    return passed("KDA's transition is Diag(alpha) - (beta k)(alpha * k)^T: both vectors come from k.")


def solution_dplr_vectors(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    alpha = g.exp()
    # k k^T Diag(alpha) = k (Diag(alpha) k)^T = k (alpha * k)^T
    return alpha, beta * k, alpha * k


# Exercise 2: how many steps of the most negative gate fit in a dtype.

_SAFE_STEP_CASES = [
    (-5.0, torch.float32),
    (-5.0, torch.bfloat16),
    (-5.0, torch.float16),
    (-1.0, torch.float16),
    (-2.5, torch.float32),
    (-0.5, torch.bfloat16),
    (-8.0, torch.float32),
]


def check_max_safe_steps(fn) -> str:
    """`fn(lower_bound, dtype) -> n`: the most steps at the bound whose growth factor exp(n |bound|) is finite."""
    for lower_bound, dtype in _SAFE_STEP_CASES:
        n = fn(lower_bound, dtype)
        if n is None:
            return not_answered(
                "write max_safe_steps(lower_bound, dtype), the most steps at the bound that fit."
            )
        expect(isinstance(n, int), f"return a Python int, got {type(n).__name__}")
        limit = log_max(dtype)
        expect(
            n * -lower_bound < limit,
            f"lower_bound={lower_bound}, {dtype}: exp({n} * {-lower_bound}) overflows: the largest finite "
            f"value of {dtype}, torch.finfo(dtype).max, is exp({limit:.2f})",
        )
        expect(
            (n + 1) * -lower_bound >= limit,
            f"lower_bound={lower_bound}, {dtype}: {n + 1} steps still fit below torch.finfo(dtype).max = "
            f"exp({limit:.2f}); give the largest n",
        )
    return passed(
        "float32 and bfloat16 hold 17 steps at -5, so a 16-step sub-chunk fits; float16 holds only 2."
    )


def solution_max_safe_steps(lower_bound: float, dtype: torch.dtype) -> int:
    # n steps at the bound grow the key factor exp(-G) to exp(n |lower_bound|); it must stay below finfo.max.
    return math.floor(math.log(torch.finfo(dtype).max) / -lower_bound)


# Exercise 3: dt_bias from half-lives.


def check_half_life_bias(fn) -> str:
    """`fn(half_lives) -> dt_bias` so that `kda_gate(x=0, A_log=0, dt_bias)` halves channel c in half_lives[c]."""
    half_lives = torch.tensor([1.0, 3.0, 16.0, 100.0, 1000.0, 1e5], dtype=torch.float64)
    answer = fn(half_lives)
    if answer is None:
        return not_answered(
            "write half_life_bias(half_lives), the dt_bias that gives each channel its half-life."
        )
    dt_bias = torch.as_tensor(answer, dtype=torch.float64)
    K = half_lives.shape[0]
    expect(dt_bias.shape == (K,), f"return one dt_bias per channel, shape [{K}], got {tuple(dt_bias.shape)}")
    g = kda_gate(
        torch.zeros(1, 1, 1, K, dtype=torch.float64), torch.zeros(1, dtype=torch.float64), dt_bias[None]
    )
    expect(bool((g < 0).all()), "every g must be negative: g = -softplus(dt_bias) at x = 0, A_log = 0")
    got = math.log(2) / -g[0, 0, 0]
    expect(
        torch.allclose(got, half_lives, rtol=1e-6),
        f"half-lives {got.tolist()} instead of {half_lives.tolist()}: solve softplus(dt_bias) = ln(2) / h "
        "exactly (softplus(z) ~ exp(z) only for very negative z)",
    )
    return passed("dt_bias = log(expm1(ln 2 / h)): slow channels need very negative biases.")


def solution_half_life_bias(half_lives: torch.Tensor) -> torch.Tensor:
    # exp(n g) = 1/2 at n = h  =>  g = -ln(2) / h; with x = 0 and A_log = 0, g = -softplus(dt_bias),
    # and softplus(z) = log(1 + e^z) = y  <=>  z = log(e^y - 1) = log(expm1(y)).
    return torch.log(torch.expm1(math.log(2) / half_lives))


# Exercise 4: per-channel gates for the two-timescale task.


def check_two_timescale_gates(gates) -> str:
    """`gates`: one log decay per key channel `[K]` in [-5, 0] that beats every scalar gate by 20%."""
    if gates is None:
        K = 2 * EXERCISE_TASK["half"]
        return not_answered(f"choose one log decay per key channel in [-5, 0], a tensor of shape [{K}].")
    task = make_task(**EXERCISE_TASK)
    K = 2 * task.half
    gates = torch.as_tensor(gates, dtype=torch.float32)
    expect(gates.shape == (K,), f"give one gate per key channel, shape [{K}], got {tuple(gates.shape)}")
    expect(
        bool(((gates >= -5) & (gates <= 0)).all()),
        "gates must lie in [-5, 0], the range of the lower-bounded gate",
    )
    grid = torch.cat([torch.zeros(1), -torch.logspace(-3, math.log10(5), 60)])
    fact, recent = retrieval_errors(task, channel_gates(grid, grid, task.half))
    best_scalar = ((fact + recent) / 2).min().item()
    fact, recent = retrieval_errors(task, gates[None])
    yours = ((fact + recent) / 2).item()
    expect(
        yours <= 0.8 * best_scalar,
        f"your error is {yours:.3f}; the best scalar gate reaches {best_scalar:.3f} and you need <= "
        f"{0.8 * best_scalar:.3f}. Facts (channels 0-{task.half - 1}) must last {EXERCISE_TASK['n_stream']} "
        f"steps; the scratchpad (channels {task.half}-{K - 1}) only needs the last few items",
    )
    return passed(f"error {yours:.3f} against {best_scalar:.3f} for the best scalar gate.")


def solution_two_timescale_gates() -> torch.Tensor:
    # No decay on the slow half (facts must survive the whole episode); on the fast half a decay whose
    # half-life, ln 2 / 0.2 ~ 3.5 steps, keeps the last couple of items and forgets older ones.
    return channel_gates(torch.tensor([0.0]), torch.tensor([-0.2]), half=EXERCISE_TASK["half"])[0]
