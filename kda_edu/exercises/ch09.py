"""Exercises of chapter 9 (the backward pass and decoding): checkers and worked solutions.

Each `check_*` takes the reader's function, runs it on random float64 inputs and compares it with autograd
(exercises 1 and 2) or with the byte count the decode benchmark uses (exercise 3); each `solution_*` is the
worked solution the book shows.
"""

import torch

from kda_edu.exercises import WrongAnswer, expect, passed


def _call(fn, *args):
    try:
        return fn(*args)
    except (TypeError, ValueError, RuntimeError, IndexError) as error:
        raise WrongAnswer(f"your function raised {type(error).__name__}: {error}") from None


def _close(x, ref) -> float:
    expect(
        isinstance(x, torch.Tensor) and x.shape == ref.shape,
        f"expected a tensor of shape {tuple(ref.shape)}, got "
        f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}",
    )
    return ((x.double() - ref).norm() / ref.norm()).item()


# Exercise 1: the gate gradient from the gradient of its within-chunk cumulative sum.


def _chunk_cumsum(g: torch.Tensor, C: int) -> torch.Tensor:
    """gc: the cumulative sum of g `[B, T, HV, K]` along T, restarted at every chunk of C steps."""
    B, T, HV, K = g.shape
    pad = -T % C
    gp = torch.cat([g, g.new_zeros(B, pad, HV, K)], dim=1)
    return gp.unflatten(1, (-1, C)).cumsum(2).flatten(1, 2)[:, :T]


def solution_dg_from_dgc(dgc: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """dg `[B, T, HV, K]` from dgc: `gc_i = g_1 + ... + g_i` inside a chunk, so g_t reaches every gc_i with
    i >= t in its chunk, and `dg_t = sum_{i >= t} dgc_i`: a cumulative sum from the chunk's end."""
    B, T, HV, K = dgc.shape
    pad = -T % chunk_size
    d = torch.cat([dgc, dgc.new_zeros(B, pad, HV, K)], dim=1).unflatten(1, (-1, chunk_size))
    return d.flip(2).cumsum(2).flip(2).flatten(1, 2)[:, :T]


def check_dg_from_dgc(dg_from_dgc) -> str:
    """`dg_from_dgc(dgc, chunk_size)`: the gradient of g given the gradient of its within-chunk cumsum gc."""
    gen = torch.Generator().manual_seed(91)
    for B, T, HV, K, C in ((1, 16, 1, 4, 16), (2, 70, 2, 8, 32), (1, 130, 1, 4, 64)):
        g = torch.randn(B, T, HV, K, generator=gen, dtype=torch.float64, requires_grad=True)
        dgc = torch.randn(B, T, HV, K, generator=gen, dtype=torch.float64)
        (_chunk_cumsum(g, C) * dgc).sum().backward()
        err = _close(_call(dg_from_dgc, dgc.clone(), C), g.grad)
        if err > 1e-12:
            forward = _chunk_cumsum(dgc, C)
            expect(
                _close(_call(dg_from_dgc, dgc.clone(), C), forward) > 1e-12,
                "that is the cumulative sum from the chunk's start; g_t feeds gc_i for i >= t, so sum from the end",
            )
        expect(
            err < 1e-12,
            f"B={B}, T={T}, C={C}: relative error {err:.2e} against autograd. Hint: restart the sum at every "
            "chunk boundary (T need not be a multiple of C).",
        )
    return passed("dg is a reverse cumulative sum of dgc inside each chunk.")


# Exercise 2: the backward of the unit lower-triangular solve (the UT transform).


def solution_solve_backward(A: torch.Tensor, u: torch.Tensor, du: torch.Tensor):
    """For u = (I + A)^-1 b with A strictly lower triangular: db = (I + A)^-T du, one solve with the
    transpose (upper triangular); dA = -db u^T, kept below the diagonal (A's other entries are fixed at 0)."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype)
    db = torch.linalg.solve_triangular((eye + A).transpose(-1, -2), du, upper=True, unitriangular=True)
    return -(db @ u.transpose(-1, -2)).tril(-1), db


def check_solve_backward(solve_backward) -> str:
    """`solve_backward(A, u, du) -> (dA, db)` for `u = (I + A)^-1 b`, A strictly lower triangular `[C, C]`."""
    gen = torch.Generator().manual_seed(92)
    for C, D in ((4, 3), (16, 8), (64, 16)):
        A = (0.3 * torch.randn(C, C, generator=gen, dtype=torch.float64)).tril(-1).requires_grad_()
        b = torch.randn(C, D, generator=gen, dtype=torch.float64, requires_grad=True)
        du = torch.randn(C, D, generator=gen, dtype=torch.float64)
        eye = torch.eye(C, dtype=torch.float64)
        u = torch.linalg.solve_triangular(eye + A, b, upper=False, unitriangular=True)
        (u * du).sum().backward()
        out = _call(solve_backward, A.detach().clone(), u.detach().clone(), du.clone())
        expect(isinstance(out, tuple) and len(out) == 2, "return a pair (dA, db)")
        e_db = _close(out[1], b.grad)
        expect(e_db < 1e-10, f"C={C}: db is off by {e_db:.2e} (relative). Hint: u = X b gives db = X^T du.")
        e_da = _close(out[0], A.grad.tril(-1))
        expect(
            e_da < 1e-10,
            f"C={C}: dA is off by {e_da:.2e} (relative). Hint: d(X) = -X dA X, so dL/dA = -X^T du u^T; keep only "
            "the strictly lower part.",
        )
    return passed("dA = -(X^T du) u^T: one extra solve, no second product with X.")


# Exercise 3: the bytes a decoding step must move, and the floor they set.


def solution_decode_floor_ms(B: int, HV: int, K: int, V: int, bandwidth_TBps: float) -> float:
    """The float32 state (4 bytes a number) is read once and written once; at `bandwidth_TBps` (10^12 bytes
    per second) that takes 2 * 4 B HV K V / bandwidth seconds."""
    return 2 * 4 * B * HV * K * V / (bandwidth_TBps * 1e12) * 1e3


def check_decode_floor_ms(decode_floor_ms) -> str:
    """`decode_floor_ms(B, HV, K, V, bandwidth_TBps)`: the state's read + write time in milliseconds."""
    for B, HV, K, V, bw in (
        (64, 32, 128, 128, 4.244441459618731),
        (1, 16, 64, 64, 3.0),
        (8, 4, 128, 256, 2.0),
    ):
        got = _call(decode_floor_ms, B, HV, K, V, bw)
        want = solution_decode_floor_ms(B, HV, K, V, bw)
        expect(isinstance(got, (int, float)), f"return a number of milliseconds, got {type(got).__name__}")
        if abs(got - want / 2) < 1e-9 * want:
            raise WrongAnswer("that is the read alone: the updated state is written back too")
        expect(
            abs(got - want) <= 1e-6 * want,
            f"B={B}, HV={HV}, K={K}, V={V} at {bw} TB/s: expected about {want:.4g} ms, got {got:.4g}. Hint: "
            "the state is float32, 4 bytes a number, and 1 TB/s is 10^12 bytes per second.",
        )
    return passed("At B=64, HV=32, K=V=128 the state alone takes about 0.063 ms to stream through an H200.")
