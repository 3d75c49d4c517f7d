"""Exercises of chapter 7 (Triton from zero): four kernel puzzles, their checkers and worked solutions.

In the style of Sasha Rush's Triton Puzzles: each puzzle fixes a kernel's signature and its grid, the reader
writes the `@triton.jit` body, and the checker launches it on random inputs (through the interpreter on a
CPU, compiled on a GPU) and compares the result with a PyTorch spec. Outputs live inside a larger buffer
whose tail holds a sentinel, so a store without a mask is caught, and they start as NaN, so an element the
kernel forgot to write is caught too. The puzzles build toward the chunked KDA kernel of chapter 8:

1. `check_outer`: a 2-D grid of tiles and 2-D masks (`z = x y^T`).
2. `check_chunk_end_decay`: the gates' cumulative sum inside a chunk and the decay to the chunk's end.
3. `check_causal_scores`: a `tl.dot` per chunk and a causal mask.
4. `check_chunk_states`: a loop over chunks that carries a state in registers.
"""

import math

import torch
import triton
import triton.language as tl

from kda_edu.exercises import WrongAnswer, expect, passed
from kda_edu.kernels._backend import jit, launchable

_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_SENTINEL = 12345.0
_GUARD = 1024  # numbers after the output that a kernel must not touch (plus as many as the output holds)


def expect_kernel(kernel) -> None:
    expect(
        hasattr(kernel, "fn") and hasattr(kernel, "__getitem__"),
        "pass the kernel itself, a function decorated with @triton.jit (not a launcher, not its result)",
    )


def _output(*shape) -> tuple[torch.Tensor, torch.Tensor]:
    """An output of `shape` filled with NaN, at the start of a buffer whose tail is a sentinel.

    The tail is longer than the output, so that a kernel whose stores ignore a mask writes into the tail
    (which the checker sees) rather than into memory it does not own.
    """
    n = math.prod(shape)
    buf = torch.full((2 * n + _GUARD,), _SENTINEL, device=_DEVICE)
    buf[:n] = torch.nan
    return buf[:n].view(*shape), buf


def launch_kernel(kernel, grid, *args, **meta) -> None:
    try:
        launchable(kernel)[grid](*args, **meta)
    except WrongAnswer:
        raise
    except (
        Exception
    ) as error:  # a compile error, a bad keyword, an interpreter failure: all the reader's to fix
        text = str(error).strip().splitlines()
        raise WrongAnswer(
            f"your kernel failed: {type(error).__name__}: {' / '.join(text[-3:])[:400]}"
        ) from None


def _compare(out, buf, ref, n, what, hint, tol=1e-5, size=None) -> None:
    """Check the sentinel, the NaNs and the values: within `tol` of the largest reference value, or, with
    `size` (the products' |a| |b|, for results of tl.dot), within `tol * size` element by element."""
    expect(
        bool((buf[n:] == _SENTINEL).all()),
        f"your kernel wrote past the end of {what}: a store is missing its mask",
    )
    expect(
        not torch.isnan(out).any(),
        f"{int(torch.isnan(out).sum())} elements of {what} were never written (or are NaN): does your grid "
        "cover the whole output, and do masked loads give `other=0.0`?",
    )
    err = (out - ref).abs().max().item()
    if size is None:
        ok = err <= tol * max(1.0, ref.abs().max().item())
    else:
        ok = bool(((out - ref).abs() <= tol * size).all())
    expect(ok, f"{what} is off by up to {err:.3g}. {hint}")


def _dot_tolerance(depth: int) -> float:
    """What a tl.dot of `depth` terms may be off by, relative to |a| |b|, at the loosest precision a GPU uses
    by default (TF32): a correct kernel passes whether or not it asks for input_precision="ieee"."""
    from kda_edu.chapters.ch07_primer import dot_error_bound  # kda_edu.kernels is imported by now (triton is)

    return dot_error_bound("tf32", depth)


# ---------------------------------------------------------------------------------------------------------
# Puzzle 1: outer product, a 2-D grid of tiles


@jit
def solution_outer(x, y, z, N0, N1, B0: tl.constexpr, B1: tl.constexpr):
    """z[i, j] = x[i] * y[j] for z `[N0, N1]`; program (p0, p1) owns rows p0 B0.. and columns p1 B1..."""
    i = tl.program_id(0) * B0 + tl.arange(0, B0)
    j = tl.program_id(1) * B1 + tl.arange(0, B1)
    x_i = tl.load(x + i, mask=i < N0, other=0.0)
    y_j = tl.load(y + j, mask=j < N1, other=0.0)
    mask = (i[:, None] < N0) & (j[None, :] < N1)
    tl.store(z + i[:, None] * N1 + j[None, :], x_i[:, None] * y_j[None, :], mask=mask)


def check_outer(kernel) -> str:
    """`kernel(x, y, z, N0, N1, B0, B1)`, grid `(cdiv(N0, B0), cdiv(N1, B1))`: z = outer(x, y), z row-major."""
    expect_kernel(kernel)
    gen = torch.Generator().manual_seed(71)
    for N0, N1, B0, B1 in ((16, 16, 16, 16), (37, 50, 16, 32), (5, 70, 8, 16)):
        x, y = (torch.randn(n, generator=gen).to(_DEVICE) for n in (N0, N1))
        z, buf = _output(N0, N1)
        launch_kernel(kernel, (triton.cdiv(N0, B0), triton.cdiv(N1, B1)), x, y, z, N0, N1, B0=B0, B1=B1)
        _compare(
            z, buf, torch.outer(x, y), N0 * N1, f"z [{N0}, {N1}] (blocks {B0} x {B1})",
            "Hint: element (i, j) sits at z + i * N1 + j; broadcast with x_i[:, None] * y_j[None, :].",
        )  # fmt: skip
    return passed("A 2-D grid: each program owns one B0 x B1 tile, and the masks trim the ragged edges.")


# ---------------------------------------------------------------------------------------------------------
# Puzzle 2: the decay from each step to the end of its chunk


@jit
def solution_chunk_end_decay(g, k, out, T, K, C: tl.constexpr, BK: tl.constexpr):
    """out[t] = k[t] * exp(gc_end - gc_t) for one head: g, k, out `[T, K]`; program n owns chunk n."""
    t = tl.program_id(0) * C + tl.arange(0, C)
    c = tl.arange(0, BK)
    mask = (t[:, None] < T) & (c[None, :] < K)
    offs = t[:, None] * K + c[None, :]
    g_n = tl.load(g + offs, mask=mask, other=0.0)  # padded steps: g = 0, no decay
    gc = tl.cumsum(g_n, axis=0)
    gc_end = tl.sum(g_n, axis=0)  # gc at the chunk's last step
    k_n = tl.load(k + offs, mask=mask, other=0.0)
    tl.store(out + offs, k_n * tl.exp(gc_end[None, :] - gc), mask=mask)


def check_chunk_end_decay(kernel) -> str:
    """`kernel(g, k, out, T, K, C, BK)`, grid `(cdiv(T, C),)`: out[t] = k[t] exp(gc_end - gc_t), one head.

    gc is the cumulative sum of g inside t's chunk (steps nC .. t); gc_end is gc at the chunk's last step.
    """
    expect_kernel(kernel)
    gen = torch.Generator().manual_seed(72)
    for T, K, C in ((16, 16, 16), (50, 20, 16), (70, 8, 32)):
        g = -torch.rand(T, K, generator=gen).to(_DEVICE)
        k = torch.randn(T, K, generator=gen).to(_DEVICE)
        out, buf = _output(T, K)
        launch_kernel(kernel, (triton.cdiv(T, C),), g, k, out, T, K, C=C, BK=triton.next_power_of_2(K))
        pad = -T % C
        gc = torch.nn.functional.pad(g, (0, 0, 0, pad)).unflatten(0, (-1, C)).cumsum(1)  # [NC, C, K]
        ref = k * (gc[:, -1:] - gc).exp().flatten(0, 1)[:T]
        _compare(
            out, buf, ref, T * K, f"out [{T}, {K}] (chunk {C})",
            "Hint: tl.cumsum(g_n, axis=0) gives gc; its last row is tl.sum(g_n, axis=0) when padded steps load "
            "g = 0; every exponent gc_end - gc_t is <= 0.",
        )  # fmt: skip
    return passed(
        "Every exponent is <= 0, so the decay never overflows: the kernel of chapter 8 stores this as kd."
    )


# ---------------------------------------------------------------------------------------------------------
# Puzzle 3: causal scores of a chunk with tl.dot


@jit
def solution_causal_scores(q, k, out, T, D, C: tl.constexpr, BD: tl.constexpr):
    """out[n, i, j] = q_{nC+i} . k_{nC+j} for j <= i, else 0; q, k `[T, D]`, out `[NC, C, C]`."""
    n = tl.program_id(0)
    rows = tl.arange(0, C)
    t = n * C + rows
    c = tl.arange(0, BD)
    mask = (t[:, None] < T) & (c[None, :] < D)
    q_n = tl.load(q + t[:, None] * D + c[None, :], mask=mask, other=0.0)
    k_n = tl.load(k + t[:, None] * D + c[None, :], mask=mask, other=0.0)
    scores = tl.dot(q_n, tl.trans(k_n), input_precision="ieee")
    scores = tl.where(rows[:, None] >= rows[None, :], scores, 0.0)
    tl.store(out + n * C * C + rows[:, None] * C + rows[None, :], scores)


def check_causal_scores(kernel) -> str:
    """`kernel(q, k, out, T, D, C, BD)`, grid `(cdiv(T, C),)`: the causal C x C score matrix of every chunk.

    out `[NC, C, C]`: out[n, i, j] = q_{nC+i} . k_{nC+j} for j <= i and 0 above the diagonal; rows and columns
    past T are 0 (load them as zeros).
    """
    expect_kernel(kernel)
    gen = torch.Generator().manual_seed(73)
    for T, D, C in ((16, 16, 16), (40, 20, 16), (50, 16, 32)):
        q, k = (torch.randn(T, D, generator=gen).to(_DEVICE) for _ in range(2))
        NC = triton.cdiv(T, C)
        out, buf = _output(NC, C, C)
        launch_kernel(kernel, (NC,), q, k, out, T, D, C=C, BD=max(16, triton.next_power_of_2(D)))
        qp, kp = (torch.nn.functional.pad(x, (0, 0, 0, NC * C - T)).unflatten(0, (NC, C)) for x in (q, k))
        ref = (qp @ kp.transpose(1, 2)).tril()
        size = (qp.abs() @ kp.abs().transpose(1, 2)).tril()
        _compare(
            out, buf, ref, NC * C * C, f"out [{NC}, {C}, {C}] (T = {T}, D = {D})",
            "Hint: tl.dot(q_n, tl.trans(k_n)) is the C x C product; keep j <= i with "
            "tl.where(rows[:, None] >= rows[None, :], ..., 0.0).",
            tol=_dot_tolerance(D), size=size,
        )  # fmt: skip
    return passed("One tl.dot per chunk and a causal mask: Aqk of chapter 8 is this matrix with decays.")


# ---------------------------------------------------------------------------------------------------------
# Puzzle 4: carry a state across chunks


@jit
def solution_chunk_states(k, v, states, T, D, C: tl.constexpr, BD: tl.constexpr):
    """states[n] = sum over steps t < (n + 1) C of k_t v_t^T; k, v `[T, D]`, states `[NC, D, D]`; one program."""
    rows = tl.arange(0, C)
    c = tl.arange(0, BD)
    S = tl.zeros([BD, BD], dtype=tl.float32)
    for n in range(0, tl.cdiv(T, C)):
        t = n * C + rows
        mask = (t[:, None] < T) & (c[None, :] < D)
        k_n = tl.load(k + t[:, None] * D + c[None, :], mask=mask, other=0.0)
        v_n = tl.load(v + t[:, None] * D + c[None, :], mask=mask, other=0.0)
        S += tl.dot(tl.trans(k_n), v_n, input_precision="ieee")
        smask = (c[:, None] < D) & (c[None, :] < D)
        tl.store(states + n * D * D + c[:, None] * D + c[None, :], S, mask=smask)


def check_chunk_states(kernel) -> str:
    """`kernel(k, v, states, T, D, C, BD)`, grid `(1,)`: the running state after every chunk.

    states `[NC, D, D]`: states[n] = sum_{t < min((n + 1) C, T)} k_t v_t^T. One program walks the chunks in
    order and keeps the state in registers.
    """
    expect_kernel(kernel)
    gen = torch.Generator().manual_seed(74)
    for T, D, C in ((16, 16, 16), (50, 12, 16), (90, 16, 32)):
        k, v = (torch.randn(T, D, generator=gen).to(_DEVICE) for _ in range(2))
        NC = triton.cdiv(T, C)
        out, buf = _output(NC, D, D)
        launch_kernel(kernel, (1,), k, v, out, T, D, C=C, BD=max(16, triton.next_power_of_2(D)))
        ends = [min((n + 1) * C, T) for n in range(NC)]
        ref = torch.stack([k[:e].T @ v[:e] for e in ends])
        size = torch.stack([k[:e].abs().T @ v[:e].abs() for e in ends])
        _compare(
            out, buf, ref, NC * D * D, f"states [{NC}, {D}, {D}] (T = {T}, chunk {C})",
            "Hint: start from S = tl.zeros([BD, BD], tl.float32) before the loop, add tl.dot(tl.trans(k_n), v_n) "
            "each chunk, and store S with a mask on both dimensions.",
            tol=_dot_tolerance(T), size=size,
        )  # fmt: skip
    return passed("The state never leaves the program: this is the loop of chapter 8's scan kernel.")


SOLUTIONS = {
    "outer": (check_outer, solution_outer),
    "chunk_end_decay": (check_chunk_end_decay, solution_chunk_end_decay),
    "causal_scores": (check_causal_scores, solution_causal_scores),
    "chunk_states": (check_chunk_states, solution_chunk_states),
}
