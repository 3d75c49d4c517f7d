"""Checkers and worked solutions for the exercises of chapter 5, Kimi Delta Attention.

Each `check_*` compares the reader's answer with what KDA actually does (the float64 recurrence or the
transition's matrix, computed by the checker); while the answer is still the book's placeholder None, the
checker only repeats the question. Each `solution_*` is the worked solution the book shows.
"""

import functools
import math

import torch

from kda_edu.chapters.ch05_two_timescales import TwoTimescaleTask, channel_gates, make_task, retrieval_errors
from kda_edu.exercises import call_and_record, expect, not_answered, passed
from kda_edu.ops.kda import kda_recurrent

# Exercise 2 always uses this task (the chapter's CPU size), whatever device the book runs on.
EXERCISE_TASK = dict(batch=32, half=8, value_dim=8, n_facts=4, n_stream=124, recent=2, noise=0.5, seed=0)


# Exercise 1: one key, two speeds of forgetting.


def solution_two_speed_key(p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A unit key `[8]` and gates `[8]` in [-5, 0] whose pair keeps at most p + 0.01 after one step and at
    least p - 0.01 after 200.

    Written into an empty state and read with its own key after a steps of decay, the pair gives
    `k^T Diag(alpha)^a k v = sum_c k_c^2 exp(a g_c) v`: a mixture of exponentials weighted by k_c^2. Put
    weight p on a channel that never decays and 1 - p on one at the floor, exp(-5) ~ 0.007 per step.
    """
    k = torch.zeros(8, dtype=torch.float64)
    k[0], k[1] = math.sqrt(p), math.sqrt(1 - p)
    g = torch.zeros(8, dtype=torch.float64)
    g[1:] = -5.0
    return k, g


def _strength(k: torch.Tensor, g: torch.Tensor, steps: int) -> torch.Tensor:
    """Measured with KDA: write (k, v = 1) into an empty state (beta = 1), then `steps` steps that write
    nothing (k = 0, beta = 0) and decay by g; read with k after each. `[steps + 1]`, age 0 first."""
    T, K = steps + 1, k.shape[0]
    keys = torch.zeros(1, T, 1, K, dtype=torch.float64)
    keys[0, 0, 0] = k
    v = torch.zeros(1, T, 1, 1, dtype=torch.float64)
    v[0, 0] = 1.0
    beta = torch.zeros(1, T, 1, dtype=torch.float64)
    beta[0, 0] = 1.0
    q = k.reshape(1, 1, 1, K).expand(1, T, 1, K)
    o, _ = kda_recurrent(q, keys, v, g.reshape(1, 1, 1, K).expand(1, T, 1, K), beta, scale=1.0)
    return o[0, :, 0, 0]


def check_two_speed_key(design) -> str:
    """`design(p) -> (k, g)`: a unit key `[8]` and per-channel log decays `[8]` in [-5, 0] such that the pair
    written with k keeps at most p + 0.01 of its strength after one step and at least p - 0.01 after 200."""
    n = 200
    for p in (0.2, 0.5, 0.9):
        out, _ = call_and_record(design, p)
        if out is None:
            return not_answered("write design(p), returning (k, g): a unit key [8] and gates [8].")
        expect(
            isinstance(out, tuple) and len(out) == 2 and all(isinstance(x, torch.Tensor) for x in out),
            "design(p) must return a pair of tensors (k, g)",
        )
        k, g = (x.to(torch.float64) for x in out)
        expect(
            k.shape == g.shape == (8,), f"k and g must have shape [8], got {list(k.shape)}, {list(g.shape)}"
        )
        expect(abs(k.norm().item() - 1) < 1e-6, f"k must be a unit key, |k| = {k.norm():.4f}")
        expect(bool(((g >= -5) & (g <= 0)).all()), "every gate must lie in [-5, 0], the bounded gate's range")
        s = _strength(k, g, n)
        expect(
            s[1] <= p + 0.01,
            f"for p = {p}, after 1 step it keeps {s[1]:.3f}. Hint: expand k^T Diag(alpha)^a k.",
        )
        expect(
            s[n] >= p - 0.01,
            f"for p = {p}, after {n} steps it keeps {s[n]:.3f}. Hint: expand k^T Diag(alpha)^a k.",
        )
    return passed(
        "One head, one key, two speeds: a scalar gate keeping p after 1 step keeps p^200 after 200."
    )


# Exercise 2: per-channel gates for the two-timescale task, channels shuffled.


@functools.cache
def _exercise_task() -> tuple[TwoTimescaleTask, float]:
    """The task and the error of the best scalar gate on it (a scalar gate is blind to the channels' order)."""
    task = make_task(**EXERCISE_TASK)
    grid = torch.cat([torch.zeros(1), -torch.logspace(-3, math.log10(5), 60)])
    fact, recent = retrieval_errors(task, channel_gates(grid, grid, task.half))
    return task, ((fact + recent) / 2).min().item()


def _shuffled(task: TwoTimescaleTask, perm: torch.Tensor) -> TwoTimescaleTask:
    return TwoTimescaleTask(
        task.k[..., perm], task.v, task.queries[..., perm], task.targets, task.n_facts, task.half
    )


def solution_choose_gates(k: torch.Tensor) -> torch.Tensor:
    """Gates `[K]` from the episodes' keys `[B, T, K]`: a channel written in the second half of the episode
    carries the stream, a channel never written then carries facts.

    The facts must last the whole episode: no decay. The scratchpad must keep its last couple of items and
    forget the rest: a decay whose half-life, ln 2 / 0.2 ~ 3.5 steps, is about that long.
    """
    late = k[:, k.shape[1] // 2 :].abs().amax(dim=(0, 1)) > 0
    return torch.where(late, -0.2, 0.0)


def check_choose_gates(choose) -> str:
    """`choose(k)`: from the keys `[B, T, K]` of a batch of two-timescale episodes whose channels are shuffled,
    one log decay per channel `[K]` in [-5, 0] that beats every scalar gate by 20%."""
    task, best_scalar = _exercise_task()
    K = 2 * task.half
    for seed in (1, 2, 3):
        perm = torch.randperm(K, generator=torch.Generator().manual_seed(seed))
        shuffled = _shuffled(task, perm)
        out, _ = call_and_record(choose, shuffled.k[:, :, 0].clone())
        if out is None:
            return not_answered(f"write choose(k), returning one log decay per channel, shape [{K}].")
        expect(
            isinstance(out, torch.Tensor) and out.shape == (K,),
            f"choose(k) must return a tensor of shape [{K}]",
        )
        gates = out.float()
        expect(
            bool(((gates >= -5) & (gates <= 0)).all()), "gates must lie in [-5, 0], the bounded gate's range"
        )
        fact, recent = retrieval_errors(shuffled, gates[None])
        yours = ((fact + recent) / 2).item()
        expect(
            yours <= 0.8 * best_scalar,
            f"error {yours:.3f} against {best_scalar:.3f} for the best scalar gate (need 20% less). "
            "Which channels carry facts?",
        )
    return passed(f"error {yours:.3f} against {best_scalar:.3f} for the best scalar gate.")


# Exercise 3: undo one KDA step.


def solution_undo_step(S, k, v, g, beta):
    """`S_{t-1}` from `S_t = (I - beta k k^T) Diag(alpha) S_{t-1} + beta k v^T`, in O(K V), no [K, K] matrix.

    Take away the write, `X = S_t - beta k v^T = (I - beta k k^T) Y` with `Y = Diag(alpha) S_{t-1}`. Try
    `(I - beta k k^T)^-1 = I + c k k^T`: the product is `I + (c - beta - c beta |k|^2) k k^T`, the identity
    when `c = beta / (1 - beta |k|^2)` (Sherman-Morrison). So `Y = X + c k (k^T X)`, and `S_{t-1} = Y / alpha`
    row by row. At `beta |k|^2 = 1` there is no inverse: the step projected k out.
    """
    X = S - beta * torch.outer(k, v)
    c = beta / (1 - beta * k.dot(k))
    Y = X + c * torch.outer(k, k @ X)
    return Y / g.exp()[:, None]


_SOLVERS = ("linalg_", "inverse", "triangular_solve", "cholesky", "_lu", "lu_", "_solve", "pinv")


def check_undo_step(undo) -> str:
    """`undo(S, k, v, g, beta)`: the state before one KDA step, given the state after it (`[K, V]`), the key
    `[K]` (any length), the value `[V]`, the log decays `[K]` and beta (a 0-dim tensor)."""
    gen = torch.Generator().manual_seed(52)
    for K, V in ((3, 2), (7, 5), (16, 4), (5, 12)):
        rand = lambda *shape: torch.rand(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
        S_prev = torch.randn(K, V, generator=gen, dtype=torch.float64)
        k = torch.randn(K, generator=gen, dtype=torch.float64)
        k = k / k.norm() * (0.4 + 0.8 * rand(()))  # |k| in (0.4, 1.2): not a unit key
        beta = 0.1 + 0.9 * rand(())
        if abs(1 - beta * k.dot(k)) < 0.15:  # keep away from beta |k|^2 = 1, where no inverse exists
            beta = beta / 2
        v, g = torch.randn(V, generator=gen, dtype=torch.float64), -2 * rand(K)
        transition = (torch.eye(K, dtype=torch.float64) - beta * torch.outer(k, k)) @ torch.diag(g.exp())
        S = transition @ S_prev + beta * torch.outer(k, v)
        out, names, shapes = call_and_record(
            undo, S.clone(), k.clone(), v.clone(), g.clone(), beta.clone(), shapes=True
        )
        if out is None:
            return not_answered("write undo(S, k, v, g, beta), the state [K, V] before the step.")
        expect(
            isinstance(out, torch.Tensor) and out.shape == (K, V),
            f"undo must return a tensor of shape [{K}, {V}]",
        )
        error = (out.to(torch.float64) - S_prev).abs().max().item()
        expect(
            error < 1e-9,
            f"for K = {K} your state is off by {error:.2g}. Hint: (I - beta k k^T)^-1 = I + c k k^T; find c.",
        )
        solver = next((n for n in names if any(b in n for b in _SOLVERS)), None)
        expect(solver is None, f"right, but through {solver}: invert the transition by hand, no solver.")
        square = next((s for s in shapes if len(s) >= 2 and s[-2:] == (K, K)), None)
        expect(square is None, f"right, but it built a [{K}, {K}] matrix: work with vectors and [K, V] only.")
    return passed("A KDA step is undone in O(K V), except at beta |k|^2 = 1, where it forgets.")
