"""Exercises of chapter 9 (the backward pass and decoding): checkers and worked solutions.

Each `check_*` takes the reader's function, runs it on random float64 inputs and compares it with autograd;
each `solution_*` is the worked solution the book shows. Exercise 3's checker runs the reader's function with
autograd switched off (`torch.autograd.grad`, `backward` and `torch.func`'s transforms raise), so the pass must
be written by hand.
"""

import contextlib
from unittest import mock

import torch

from kda_edu.exercises import WrongAnswer, expect, passed, raised


def _call(fn, *args):
    try:
        return fn(*args)
    except (TypeError, ValueError, RuntimeError, IndexError) as error:
        raise raised(error) from None


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
            f"T={T}, C={C}: relative error {err:.3g}. Hint: restart at every chunk; T need not be a "
            "multiple of C.",
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
            f"C={C}: dA is off by {e_da:.3g} (relative). Hint: dX = -X dA X gives -X^T du u^T, strictly "
            "lower part.",
        )
    return passed("dA = -(X^T du) u^T: one extra solve, no second product with X.")


# Exercise 3: the state-gradient pass, chunk by chunk, last chunk first.


def solution_state_gradients(qg, kd, gl, w, Aqk, dO, dht):
    """The state gradients at the chunk boundaries of one head, from the last chunk to the first.

    Per chunk n (forward: U = u - w S0, O = qg S0 + Aqk U, S_C = Diag(gl) S0 + kd^T U):
    dU = Aqk^T dO + kd dS_C and dS0 = qg^T dO + Diag(gl) dS_C - w^T dU; chunk n's dS0 is chunk n-1's dS_C.
    Returns `[NC + 1, K, V]`: entry n is dL/dS at the boundary before chunk n, the last entry is dht.
    """
    dS = dht
    out = [dS]
    for n in reversed(range(qg.shape[0])):
        dU = Aqk[n].T @ dO[n] + kd[n] @ dS
        dS = qg[n].T @ dO[n] + gl[n][:, None] * dS - w[n].T @ dU
        out.insert(0, dS)
    return torch.stack(out)


def _chunk_pass(qg, kd, gl, w, u, Aqk, S0):
    """The forward state pass over the chunks: the outputs and every state at a chunk boundary."""
    states, outs = [S0], []
    for n in range(qg.shape[0]):
        S = states[-1]
        U = u[n] - w[n] @ S
        outs.append(qg[n] @ S + Aqk[n] @ U)
        states.append(gl[n][:, None] * S + kd[n].T @ U)
    return torch.stack(outs), states


class _AutogradCalled(Exception):
    pass


@contextlib.contextmanager
def _no_autograd():
    """Autograd's entry points raise inside: the reader's pass must compute the gradients itself."""

    def refuse(*args, **kwargs):
        raise _AutogradCalled

    names = [(torch.autograd, "grad"), (torch.autograd, "backward"), (torch.Tensor, "backward")]
    names += [(torch.func, n) for n in ("grad", "vjp", "jacrev", "grad_and_value")]
    with contextlib.ExitStack() as stack:
        for owner, name in dict.fromkeys(names):
            stack.enter_context(mock.patch.object(owner, name, refuse))
        yield


def check_state_gradients(state_gradients) -> str:
    """`state_gradients(qg, kd, gl, w, Aqk, dO, dht) -> [NC + 1, K, V]`, the state gradients of one head
    at every chunk boundary; compared with autograd of the loss sum(O dO) + sum(S_T dht) w.r.t. each state."""
    gen = torch.Generator().manual_seed(94)
    for NC, C, K, V in ((1, 4, 3, 2), (3, 8, 4, 5), (5, 16, 8, 8)):
        r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
        qg, kd, w, u, dO = r(NC, C, K), r(NC, C, K), 0.3 * r(NC, C, K), r(NC, C, V), r(NC, C, V)
        gl, Aqk, S0, dht = (
            torch.rand(NC, K, generator=gen, dtype=torch.float64),
            r(NC, C, C).tril(),
            r(K, V),
            r(K, V),
        )
        S0.requires_grad_()
        O, states = _chunk_pass(qg, kd, gl, w, u, Aqk, S0)
        loss = (O * dO).sum() + (states[-1] * dht).sum()
        want = torch.stack(torch.autograd.grad(loss, states, allow_unused=True)[:-1] + (dht,))
        args = [t.clone() for t in (qg, kd, gl, w, Aqk, dO, dht)]
        try:
            with _no_autograd():
                got = _call(state_gradients, *args)
        except _AutogradCalled:
            raise WrongAnswer("the pass calls autograd: write dU and dS by hand, chunk by chunk") from None
        err = _close(got, want)
        if err > 1e-10 and isinstance(got, torch.Tensor) and got.shape == want.shape and NC > 1:
            expect(
                _close(got[0], want[0]) < 1e-10 or _close(got[-2], want[-2]) > 1e-10,
                "the last chunk is right but not the earlier ones: run the chunks from last to first",
            )
        expect(
            err < 1e-10, f"NC={NC}: relative error {err:.1e} against autograd; dS0 = qg^T dO + gl dS - w^T dU"
        )
    return passed("dS runs from the last chunk to the first; each step needs dU of that chunk.")
