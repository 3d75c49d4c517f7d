"""Exercises of chapter 4 (Gated DeltaNet): checkers and worked solutions.

Each `check_*` runs the reader's function and compares what it gives with what Gated DeltaNet actually does
(the float64 recurrence, run by the checker); while the function returns the book's placeholder None, the
checker only repeats the question. Each `solution_*` is the worked solution the book shows.
"""

import torch

from kda_edu.exercises import call_and_record, expect, not_answered, passed
from kda_edu.ops.gated_delta import gated_delta_recurrent


def _tensor(out, shape, what: str) -> torch.Tensor:
    expect(
        isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(shape),
        f"{what} must be a tensor of shape {list(shape)}",
    )
    return out.to(torch.float64)


# Exercise 1: the same pair, written again and again.


def solution_repeated_read(g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """The factor c with `S_t^T k -> c v` when (k, v), k a unit key, is written at every step with gate g
    and strength beta.

    Read the recurrence along k: `r_t = S_t^T k = alpha (r_{t-1} - beta r_{t-1}) + beta v`, because
    `k^T (I - beta k k^T) = (1 - beta) k^T`. So `r_t = alpha (1 - beta) r_{t-1} + beta v`, a scalar
    recurrence whose fixed point is `r = beta v / (1 - alpha (1 - beta))`, reached from any state since
    `alpha (1 - beta) < 1` when beta > 0.
    """
    return beta / (1 - g.exp() * (1 - beta))


def check_repeated_read(read) -> str:
    """`read(g, beta)`: for tensors g `[n]` (<= 0) and beta `[n]` (in (0, 1]), the factor c `[n]` with
    `S_t^T k -> c v` when the same pair (k, v), k a unit key, is written at every step, in closed form."""
    grid = torch.tensor([0.0, -0.01, -0.1, -1.0, -3.0], dtype=torch.float64)
    g, beta = (
        x.reshape(-1) for x in torch.meshgrid(grid, torch.tensor([0.1, 0.5, 1.0]).double(), indexing="ij")
    )
    out, ops = call_and_record(read, g.clone(), beta.clone())
    if out is None:
        return not_answered("write read(g, beta), the factor c with S^T k -> c v, one per (g, beta).")
    c = _tensor(out, g.shape, "read(g, beta)")
    # Measure: write (k, v) 300 times into a random state, one batch row per (g, beta); read along k.
    n, K, T = g.shape[0], 6, 300
    gen = torch.Generator().manual_seed(41)
    k = torch.nn.functional.normalize(torch.randn(n, 1, 1, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(n, 1, 1, 1, generator=gen, dtype=torch.float64).expand(n, T, 1, 1)
    S0 = torch.randn(n, 1, K, 1, generator=gen, dtype=torch.float64)
    o, _ = gated_delta_recurrent(
        k.expand(n, T, 1, K),
        k.expand(n, T, 1, K),
        v,
        g[:, None, None].expand(n, T, 1),
        beta[:, None, None].expand(n, T, 1),
        scale=1.0,
        initial_state=S0,
    )
    measured = o[:, -1, 0, 0] / v[:, -1, 0, 0]
    error = (c - measured).abs().max().item()
    worst = int((c - measured).abs().argmax())
    expect(
        error < 1e-9,
        f"at g = {g[worst]:.2f}, beta = {beta[worst]:.1f} the read is {measured[worst]:.4f} v, not "
        f"{c[worst]:.4f} v. Hint: read the recurrence along k.",
    )
    expect(
        len(ops) <= 30,
        f"right, but {len(ops)} tensor operations: that is a simulation; give c in closed form.",
    )
    return passed("c = beta / (1 - alpha (1 - beta)): only beta = 1 reads v back whatever the decay.")


# Exercise 2: a reset after an end-of-document marker.


def solution_reset_after_marker(ends: torch.Tensor) -> torch.Tensor:
    """g = -30 (alpha ~ 1e-13) at the token after each end marker, 0 elsewhere.

    The decay of step t acts before step t's write, so a reset at the marker itself would erase the
    document the marker closes and carry the marker into the next one; the reset belongs one step later.
    The gate of step t reads the marker of step t - 1, so it stays causal (a model gets the previous token
    through its short convolution).
    """
    after = torch.zeros_like(ends)
    after[1:] = ends[:-1]
    return torch.where(after, -30.0, 0.0)


def check_reset_after_marker(gate) -> str:
    """`gate(ends)`: from a bool tensor `[T]` marking the last token of each document, the log decay `[T]`
    with which Gated DeltaNet forgets everything before a document and nothing inside one, causally."""
    T, K = 24, 8
    ends = torch.zeros(T, dtype=torch.bool)
    ends[[8, 16, T - 1]] = True
    out, _ = call_and_record(gate, ends.clone())
    if out is None:
        return not_answered("write gate(ends), the log decay [T] for a bool tensor ends [T].")
    g = _tensor(out, (T,), "gate(ends)")
    expect(bool((g <= 0).all()), "a log decay must be <= 0 at every step")
    for p in (5, 9, 10, 17, 20):  # causal: the gate of steps < p may not change with the markers from p on
        prefix = _tensor(call_and_record(gate, ends[:p].clone())[0], (p,), f"gate(ends[:{p}])")
        expect(
            torch.equal(prefix, g[:p]),
            f"gate(ends[:{p}]) differs from gate(ends)[:{p}]: step t's gate may not read later markers.",
        )
    gen = torch.Generator().manual_seed(6)
    k = torch.nn.functional.normalize(torch.randn(1, T, 1, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(1, T, 1, K, generator=gen, dtype=torch.float64)
    beta = torch.full((1, T, 1), 0.8, dtype=torch.float64)
    g = g.reshape(1, T, 1)
    for first, last in ((0, 8), (9, 16), (17, T - 1)):
        end = last + 1
        _, whole = gated_delta_recurrent(
            k[:, :end], k[:, :end], v[:, :end], g[:, :end], beta[:, :end], output_final_state=True
        )
        part = slice(first, end)
        _, alone = gated_delta_recurrent(
            k[:, part],
            k[:, part],
            v[:, part],
            torch.zeros_like(g[:, part]),
            beta[:, part],
            output_final_state=True,
        )
        expect(
            torch.allclose(whole, alone, atol=1e-5, rtol=0),
            f"at the marker of step {last} the state differs from that of the document alone by "
            f"{(whole - alone).abs().max():.2g}",
        )
    return passed("Decay acts before the write: the reset goes one step after the marker.")


# Exercise 3: the decay between any two steps.


def solution_decay_matrix(g: torch.Tensor) -> torch.Tensor:
    """`D[t, s] = exp(g_{s+1} + ... + g_t)` for s <= t, else 0, from cumulative sums of g `[T]`.

    With `G = cumsum(g)`, the sum is `G_t - G_s`: the difference is taken before `exp`, because `exp(G_t)`
    underflows and `exp(-G_s)` overflows once the gates add up to less than about -745 (float64). Above the
    diagonal `G_t - G_s` is positive and could overflow too, so it is set to -inf first (exp(-inf) = 0).
    """
    G = g.cumsum(dim=0)
    diff = G[:, None] - G[None, :]
    causal = torch.ones_like(diff, dtype=torch.bool).tril()
    return diff.masked_fill(~causal, float("-inf")).exp()


def _measured_decays(g: torch.Tensor) -> torch.Tensor:
    """The decay matrix measured with Gated DeltaNet: write e_s -> e_s at step s (orthonormal keys, beta =
    1), read e_s at every step t; batch row s reads the key of step s. `[t, s]`."""
    T = g.shape[0]
    eye = torch.eye(T, dtype=torch.float64)
    k = eye.reshape(1, T, 1, T).expand(T, T, 1, T)
    q = eye.reshape(T, 1, 1, T).expand(T, T, 1, T)
    o, _ = gated_delta_recurrent(
        q, k, k, g.expand(T, T)[..., None], torch.ones(T, T, 1, dtype=torch.float64), scale=1.0
    )
    return o[..., 0, :].diagonal(dim1=0, dim2=2)


def check_decay_matrix(decay_matrix) -> str:
    """`decay_matrix(g)`: for log decays g `[T]`, the `[T, T]` matrix of how much of the pair written at step
    s is left at step t (0 for s > t), without a Python loop."""
    gen = torch.Generator().manual_seed(7)
    counts = {}
    for T, scale in ((12, 1.0), (30, 60.0), (8, 1.0), (64, 1.0)):  # scale 60: gates that add up to -1800
        g = -scale * torch.rand(T, generator=gen, dtype=torch.float64)
        out, ops = call_and_record(decay_matrix, g.clone())
        if out is None:
            return not_answered("write decay_matrix(g), returning the [T, T] matrix of decays for g [T].")
        D = _tensor(out, (T, T), "decay_matrix(g)")
        error = (D - _measured_decays(g)).abs().max().item()
        expect(
            error < 1e-9,
            f"for T = {T}"
            + (", steep gates," if scale > 1 else "")
            + f" your matrix is off by {error:.2g}. "
            + ("Hint: subtract before exp." if scale > 1 else "Hint: a difference of two cumulative sums."),
        )
        counts[T] = len(ops)
    expect(
        counts[64] <= counts[8] + 4,
        f"right, but {counts[64]} operations for T = 64 against {counts[8]} for T = 8: remove the loop.",
    )
    return passed("Chapter 6's chunkwise algorithm builds exactly this matrix, chunk by chunk.")
