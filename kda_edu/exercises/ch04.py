"""Exercises of chapter 4 (Gated DeltaNet): checkers and worked solutions.

Each `check_*` runs the reader's function and compares what it gives with what Gated DeltaNet actually does;
while the function returns the book's placeholder None, the checker only repeats the question. Each
`solution_*` is the worked solution the book shows.
"""

import math

import torch

from kda_edu.chapters.ch04_recall import retrieval_strength
from kda_edu.exercises import as_number, expect, not_answered, passed
from kda_edu.ops.gated_delta import gated_delta_recurrent

# Exercise 1: the gate for a given half-life.


def solution_gate_for_half_life(half_life: float) -> float:
    """The log decay g with exp(g * half_life) = 1/2: g = -ln 2 / half_life."""
    return -math.log(2) / half_life


def check_gate_for_half_life(gate) -> str:
    """`gate(half_life)`: the constant log decay g that halves an association every `half_life` steps."""
    if gate(10.0) is None:
        return not_answered("write gate(half_life), the log decay g <= 0 with that half-life.")
    for half_life in (2, 10, 37):
        g = as_number(gate, float(half_life))
        expect(g <= 0, f"for a half-life of {half_life} you give g = {g}; a log decay must be <= 0")
        strength = retrieval_strength([g], 1.0, 16, half_life, orthogonal=True, batch=4)[0, -1].item()
        expect(
            abs(strength - 0.5) < 1e-4,
            f"with your g = {g:.5g}, a pair keeps {strength:.4f} of its value after {half_life} steps, not 0.5. "
            "Hint: after a steps the pair keeps exp(g)^a = exp(a g); solve exp(half_life * g) = 1/2.",
        )
    return passed("g = -ln 2 / half-life: a half-life of 100 tokens needs g = -0.0069.")


# Exercise 2: a gate that clears the memory at document boundaries.


def solution_boundary_gate(starts: torch.Tensor) -> torch.Tensor:
    """g = -30 (alpha = exp(-30) ~ 1e-13, a reset) where a document starts, 0 (keep everything) elsewhere."""
    return torch.where(starts, -30.0, 0.0)


def check_boundary_gate(gate) -> str:
    """`gate(starts)`: from a bool tensor `[T]` marking the first step of each document, the log decay `[T]`
    with which Gated DeltaNet forgets everything before a document and nothing inside one."""
    T, K = 24, 8
    starts = torch.zeros(T, dtype=torch.bool)
    starts[[0, 9, 17]] = True
    g = gate(starts)
    if g is None:
        return not_answered("write gate(starts), returning the log decay [T] for a bool tensor starts [T].")
    expect(
        isinstance(g, torch.Tensor) and g.shape == (T,),
        f"your gate must return a tensor of shape [T] = ({T},), one log decay per step",
    )
    expect(bool((g <= 0).all()), "a log decay must be <= 0 at every step")
    gen = torch.Generator().manual_seed(6)
    k = torch.nn.functional.normalize(torch.randn(1, T, 1, K, generator=gen), dim=-1)
    v = torch.randn(1, T, 1, K, generator=gen)
    beta = torch.full((1, T, 1), 0.8)
    g = g.float().reshape(1, T, 1)
    for first, end in ((9, 17), (17, T)):
        _, whole = gated_delta_recurrent(
            k[:, :end], k[:, :end], v[:, :end], g[:, :end], beta[:, :end], output_final_state=True
        )
        zero = torch.zeros_like(g[:, first:end])
        part = slice(first, end)
        _, alone = gated_delta_recurrent(
            k[:, part], k[:, part], v[:, part], zero, beta[:, part], output_final_state=True
        )
        expect(
            torch.allclose(whole, alone, atol=1e-5, rtol=0),
            f"at the end of the document that starts at step {first}, the state differs from that of a model "
            f"that read this document alone, with no decay, by up to {(whole - alone).abs().max():.3g}. Hint: "
            "alpha = exp(g) should be (nearly) 0 at a start and exactly 1 everywhere else.",
        )
    return passed("A data-dependent gate can reset the memory; a constant decay cannot.")


# Exercise 3: the decay between any two steps.


def solution_decay_matrix(g: torch.Tensor) -> torch.Tensor:
    """`D[t, s] = exp(g_{s+1} + ... + g_t)` for s <= t, else 0, from cumulative sums of g `[T]`.

    With `G = cumsum(g)`, the sum is `G_t - G_s`. Above the diagonal `G_t - G_s` is positive and could
    overflow `exp`, so it is set to -inf first (exp(-inf) = 0) rather than zeroed after.
    """
    G = g.cumsum(dim=0)
    diff = G[:, None] - G[None, :]
    causal = torch.ones_like(diff, dtype=torch.bool).tril()
    return diff.masked_fill(~causal, float("-inf")).exp()


def check_decay_matrix(decay_matrix) -> str:
    """`decay_matrix(g)`: for log decays g `[T]`, the `[T, T]` matrix of how much of the pair written at step
    s is left at step t (0 for s > t)."""
    T = 12
    g = -torch.rand(T, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    D = decay_matrix(g)
    if D is None:
        return not_answered("write decay_matrix(g), returning the [T, T] matrix of decays for g [T].")
    expect(
        isinstance(D, torch.Tensor) and D.shape == (T, T),
        f"decay_matrix must return a [T, T] = [{T}, {T}] tensor",
    )
    # Measure it: write e_s -> e_s at step s (orthonormal keys, beta = 1), read e_s at every step t.
    eye = torch.eye(T, dtype=torch.float64)
    k = eye.reshape(1, T, 1, T).expand(T, T, 1, T)  # the same stream in every batch row
    q = eye.reshape(T, 1, 1, T).expand(T, T, 1, T)  # batch row s reads the key of step s
    o, _ = gated_delta_recurrent(
        q, k, k, g.expand(T, T)[..., None], torch.ones(T, T, 1, dtype=torch.float64), scale=1.0
    )
    measured = o[..., 0, :].diagonal(dim1=0, dim2=2)  # [t, s]: entry s of S_t^T e_s
    expect(
        torch.allclose(D.to(torch.float64), measured, atol=1e-9, rtol=0),
        f"your matrix differs from the measured decays by up to {(D - measured).abs().max():.3g}. Hint: "
        "D[t, s] = exp(g[s+1] + ... + g[t]); write the sum as a difference of two cumulative sums.",
    )
    return passed("The chunkwise algorithm of chapter 6 builds exactly this matrix, chunk by chunk.")
