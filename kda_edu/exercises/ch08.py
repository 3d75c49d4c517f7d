"""Exercises of chapter 8 (the chunked KDA kernel): checkers and worked solutions.

1. `check_design_bytes`: the bytes per token and head that a two-kernel design (one prepare kernel, then the scan) moves.
2. `check_scan_kernel`: a Triton kernel for the sequential part (the state pass), checked against the loop.
3. `check_crossover`: the sequence length where one method overtakes another, from timings at a few lengths.
"""

import math

import torch
import torch.nn.functional as F
import triton.language as tl

from kda_edu.chapters.ch08_chunk_kernel import (
    CHUNK,
    crossover,
    design_traffic,
    floor_bytes,
    reference_intermediates,
)
from kda_edu.exercises import expect, passed, raised
from kda_edu.exercises.ch07 import expect_kernel, launch_kernel
from kda_edu.kernels._backend import jit
from kda_edu.ops.kda import kda_recurrent

_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# ---------------------------------------------------------------------------------------------------------
# Exercise 1: bytes per token and head


def solution_design_bytes(K: int, V: int, C: int, in_bytes: int, mid_bytes: int) -> float:
    """Bytes per token and value head through memory of a two-kernel design (one prepare kernel, then
    the scan): inputs once, intermediates written and read back, o once.

    That prepare kernel read k and g a second time (its pass 2), moments after the first read and by the same
    program; that read is assumed to hit the L2 cache and is not counted.

    Inputs: q, k (K each), v (V), beta (1) at `in_bytes`, g (K) in float32. Between the kernels: w, qg, kd (K
    each), u (V), a row of Aqk (C) at `mid_bytes`, plus exp(gc_C), K float32 numbers per chunk of C tokens.
    Output: o (V) at `in_bytes`.
    """
    inputs = in_bytes * (2 * K + V + 1) + 4 * K
    between = mid_bytes * (3 * K + V + C) + 4 * K / C
    return inputs + 2 * between + in_bytes * V


def check_design_bytes(fn) -> str:
    """`fn(K, V, C, in_bytes, mid_bytes)`: bytes per token and value head through memory (no L2 re-read)."""
    for K, V, C, ib, mb in (
        (128, 128, 64, 2, 2),
        (64, 32, 64, 4, 4),
        (128, 256, 32, 2, 4),
        (96, 80, 64, 2, 2),
    ):
        try:
            got = float(fn(K, V, C, ib, mb))
        except (TypeError, ValueError, ZeroDivisionError) as error:
            raise raised(error) from None
        # the scan's reads of w, u, qg, kd, Aqk, exp(gc_C): the same tensors the current design's scan reads
        between = design_traffic(K, V, C, ib, mb)["scan reads w, u, qg, kd, Aqk, exp(gc_C)"]
        want = floor_bytes(K, V, ib) + 2 * between
        expect(
            not math.isclose(got, want + ib * K + 4 * K, rel_tol=1e-9),
            f"for K={K}, V={V}: {got:g} also counts the second read of k and g; it comes from L2, not "
            "memory.",
        )
        expect(
            not math.isclose(got, want - between, rel_tol=1e-9),
            f"for K={K}, V={V}: {got:g} counts the intermediates once; one kernel writes them, one reads "
            "them.",
        )
        expect(
            math.isclose(got, want, rel_tol=1e-9),
            f"K={K}, V={V}, C={C}, in/mid {ib}/{mb} B: want {want:g}, got {got:g}. Hint: g, exp(gc_C) are "
            "float32.",
        )
    return passed(
        f"At K = V = 128 in bf16 that is {solution_design_bytes(128, 128, 64, 2, 2):.0f} B per token and head, "
        f"{solution_design_bytes(128, 128, 64, 2, 2) / floor_bytes(128, 128):.1f}x the "
        f"{floor_bytes(128, 128)} B any forward must move."
    )


# ---------------------------------------------------------------------------------------------------------
# Exercise 2: the state pass as a Triton kernel


@jit
def solution_scan_kernel(w, u, qg, kd, aqk, gl, o, NT, C: tl.constexpr, D: tl.constexpr):
    """One head, K = V = D: walk the NT chunks with S (D x D, float32) in registers.

    Chunk n's rows start at n * C in w, u, qg, kd `[NT * C, D]` and aqk `[NT * C, C]`; gl `[NT, D]`.
    U = u - w S;  O = qg S + Aqk U;  S = Diag(gl) S + kd^T U.
    """
    rows = tl.arange(0, C)
    c = tl.arange(0, D)
    S = tl.zeros([D, D], dtype=tl.float32)
    for n in range(NT):
        r = (n * C + rows)[:, None]
        w_n = tl.load(w + r * D + c[None, :])
        qg_n = tl.load(qg + r * D + c[None, :])
        kd_n = tl.load(kd + r * D + c[None, :])
        u_n = tl.load(u + r * D + c[None, :])
        a_n = tl.load(aqk + r * C + rows[None, :])
        decay = tl.load(gl + n * D + c)
        U = u_n - tl.dot(w_n, S, input_precision="ieee")
        o_n = tl.dot(qg_n, S, input_precision="ieee") + tl.dot(a_n, U, input_precision="ieee")
        tl.store(o + r * D + c[None, :], o_n)
        S = S * decay[:, None] + tl.dot(tl.trans(kd_n), U, input_precision="ieee")


# A right kernel passes at any input_precision: at Triton's GPU default (TF32) each of the two products a term
# passes through rounds both operands to 10 mantissa bits (2^-10 each, four in all), and the state carries
# those errors into later chunks; eight such roundings, 7.8e-3, leave room. A wrong update (no decay, the
# state after the chunk instead of before) is off by far more.
SCAN_TOL = 8 * 2.0**-10


def check_scan_kernel(kernel) -> str:
    """`kernel(w, u, qg, kd, aqk, gl, o, NT, C, D)`, grid `(1,)`: the outputs o `[NT * C, D]` of one head."""
    expect_kernel(kernel)
    gen = torch.Generator().manual_seed(81)
    D = 16
    for NT in (1, 3):
        T = NT * CHUNK
        q = F.normalize(torch.randn(1, T, 1, D, generator=gen, dtype=torch.float64), dim=-1)
        k = F.normalize(torch.randn(1, T, 1, D, generator=gen, dtype=torch.float64), dim=-1)
        v = torch.randn(1, T, 1, D, generator=gen, dtype=torch.float64)
        # mild gates: a chunk's state keeps about half its size to the next chunk, so the carry matters
        g = -0.02 * torch.rand(1, T, 1, D, generator=gen, dtype=torch.float64)
        beta = torch.rand(1, T, 1, generator=gen, dtype=torch.float64)
        ref = reference_intermediates(q, k, v, g, beta)
        args = [
            ref[n].reshape(-1, ref[n].shape[-1]).float().contiguous().to(_DEVICE)
            for n in ("w", "u", "qg", "kd", "aqk", "gl")
        ]
        o = torch.full((T, D), torch.nan, device=_DEVICE)
        launch_kernel(kernel, (1,), *args, o, NT, C=CHUNK, D=D)
        want = kda_recurrent(q, k, v, g, beta)[0][0, :, 0].float().to(_DEVICE)
        expect(not torch.isnan(o).any(), f"with {NT} chunk(s), some outputs were never written")
        err = ((o - want).norm() / want.norm()).item()
        expect(
            err < SCAN_TOL,
            f"NT = {NT}: off by {err:.3g} (relative). Hint: U uses the entering S; then S = Diag(gl) S + "
            "kd^T U.",
        )
    return passed(
        "Four tl.dot per chunk and the state never leaves the registers: that is _chunk_scan_kernel."
    )


# ---------------------------------------------------------------------------------------------------------
# Exercise 3: where one method overtakes another


solution_crossover = crossover


def check_crossover(fn) -> str:
    """`fn(T, t_a, t_b)`: the length where method a stops being slower than b, or None if it never does."""
    T = [1024 * 2**i for i in range(8)]
    cases = [(2e-4, 1, 1e-7, 2), (3e-4, 1, 1e-8, 2), (1e-3, 1.1, 2e-6, 1.9), (5e-3, 1, 1e-9, 2)]
    for ca, pa, cb, pb in cases:
        t_a, t_b = [ca * t**pa for t in T], [cb * t**pb for t in T]
        want = crossover(T, t_a, t_b)
        try:
            got = fn(list(T), t_a, t_b)
        except (TypeError, ValueError, ZeroDivisionError, IndexError) as error:
            raise raised(error) from None
        if want is None:
            expect(
                got is None,
                f"method a is never faster here ({t_a[-1]:.3g} vs {t_b[-1]:.3g} at the longest); return None",
            )
            continue
        exact = (ca / cb) ** (1 / (pb - pa))
        shown = f"{got:.6g}" if isinstance(got, (int, float)) else repr(got)[:8]
        expect(
            got is not None and math.isclose(got, want, rel_tol=1e-6),
            f"for {ca:g} T^{pa} vs {cb:g} T^{pb}: want {exact:.6g}, got {shown}; interpolate "
            "log(t_a/t_b) in log T.",
        )
    return passed("Power laws are straight lines on log-log axes, so interpolate there.")
