"""Exercises of chapter 15 (context parallelism): checkers and worked solutions.

Each `check_*` takes the reader's function and compares it with something computed another way: the state
of the KDA loop at a shard boundary, the sizes of the tensors a rank sends, the gradient autograd finds
through the forward fold.
"""

import torch
import torch.nn.functional as F

from kda_edu.exercises import WrongAnswer, expect, passed, raised
from kda_edu.ops.kda import kda_recurrent
from kda_edu.parallel.context_parallel import reference_kernel, shard_layout, shard_map


def _call(fn, *args):
    try:
        return fn(*args)
    except (TypeError, ValueError, RuntimeError, IndexError) as error:
        raise raised(error) from None


def _shards(lengths, HV=2, K=4, V=3, seed=0):
    """Inputs of one sequence split into shards, their maps (as the ranks compute them) and the whole."""
    gen = torch.Generator().manual_seed(seed)
    T, f64 = sum(lengths), dict(generator=gen, dtype=torch.float64)
    whole = (
        F.normalize(torch.randn(1, T, 1, K, **f64), dim=-1),
        F.normalize(torch.randn(1, T, 1, K, **f64), dim=-1),
        torch.randn(1, T, HV, V, **f64),
        -torch.rand(1, T, HV, K, **f64),
        torch.rand(1, T, HV, **f64),
    )
    h0 = torch.randn(1, HV, K, V, **f64)
    maps, start = [], 0
    for r, n in enumerate(lengths):
        inputs = tuple(x[:, start : start + n] for x in whole)
        layout = shard_layout(lengths + [1], r, 1, None)  # one more rank: every shard sends its state on
        first = h0 if r == 0 else torch.zeros_like(h0)
        maps.append(shard_map(reference_kernel, inputs, first, layout, K**-0.5))
        start += n
    return whole, h0, maps


# Exercise 1: the state entering a rank, from the maps of the ranks before it.


def solution_fold(maps: list[tuple[torch.Tensor, torch.Tensor]], upto: int) -> torch.Tensor:
    """The state entering rank `upto`: apply `S -> M_r S + B_r` for r = 0 .. upto - 1, in that order."""
    S = torch.zeros_like(maps[0][1])
    for M, B in maps[:upto]:
        S = M @ S + B
    return S


def check_fold(fold) -> str:
    """`fold(maps, upto)`: maps a list of `(M [1, HV, K, K], B [1, HV, K, V])`, rank 0 first."""
    for lengths in ([5, 3, 7, 4], [1, 9, 2]):
        whole, h0, maps = _shards(lengths, seed=len(lengths))
        for upto in range(1, len(lengths) + 1):
            t = sum(lengths[:upto])
            _, want = kda_recurrent(*(x[:, :t] for x in whole), initial_state=h0, output_final_state=True)
            got = _call(fold, [(M.clone(), B.clone()) for M, B in maps], upto)
            expect(
                isinstance(got, torch.Tensor) and got.shape == want.shape,
                f"fold must return a tensor of shape {tuple(want.shape)}, got "
                f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}",
            )
            error = (got - want).abs().max().item()
            expect(
                error < 1e-9,
                f"shards {lengths}: state entering rank {upto} off by {error:.3g}. Hint: S -> M_r S + B_r, "
                "rank 0 first.",
            )
    return passed("A rank needs only the maps of the ranks before it, applied in order.")


# Exercise 2: what crosses a boundary.


def solution_boundary_bytes(scheme: str, H: int, K: int, V: int) -> int:
    """Bytes one rank sends per boundary in the forward, float32: a state, or a map and a state."""
    per_head = K * V if scheme == "sequential" else K * K + K * V
    return 4 * H * per_head


def check_boundary_bytes(boundary_bytes) -> str:
    """`boundary_bytes(scheme, H, K, V)` for scheme `"sequential"` or `"scan"`, float32 numbers."""
    for H, K, V in ((1, 4, 3), (32, 128, 128), (96, 128, 256)):
        for scheme, numbers in (("sequential", K * V), ("scan", K * K + K * V)):
            got = _call(boundary_bytes, scheme, H, K, V)
            want = 4 * H * numbers
            if scheme == "scan" and got == 4 * H * K * K:
                raise WrongAnswer("the scan sends the map's M, but also its B (what the shard adds).")
            expect(
                got == want,
                f"{scheme}, H={H}, K={K}, V={V}: want {want} B, got {got!r:.8}. "
                "Hint: state K x V; map K x K + K x V.",
            )
    return passed("At K = V the scan sends twice what state passing sends per boundary.")


# Exercise 3: the gradient of a rank's outgoing state.


def solution_fold_grads(Ms: list[torch.Tensor], G: list[torch.Tensor], after: int) -> torch.Tensor:
    """The gradient of the state leaving rank `after`: `dS_in_r = M_r^T dS_out_r + G_r` from the last rank
    back to rank `after + 1` (the state leaving `after` is the state entering `after + 1`)."""
    D = torch.zeros_like(G[0])
    for r in range(len(G) - 1, after, -1):
        D = Ms[r].transpose(-1, -2) @ D + G[r]
    return D


def check_fold_grads(fold_grads) -> str:
    """`fold_grads(Ms, G, after)`: Ms `[.., K, K]` per rank, G `[.., K, V]` per rank (the gradient each
    rank's outputs send to its incoming state); returns the total gradient of the state leaving `after`."""
    gen = torch.Generator().manual_seed(15)
    for n, K, V in ((4, 3, 2), (5, 4, 4)):
        Ms = [torch.randn(2, K, K, generator=gen, dtype=torch.float64) / K for _ in range(n)]
        Bs = [torch.randn(2, K, V, generator=gen, dtype=torch.float64) for _ in range(n)]
        G = [torch.randn(2, K, V, generator=gen, dtype=torch.float64) for _ in range(n)]
        for after in range(n - 1):
            carry = torch.randn(2, K, V, generator=gen, dtype=torch.float64, requires_grad=True)
            S, loss = carry, 0
            for r in range(
                after + 1, n
            ):  # the forward from rank after + 1 on, and what each rank's outputs see
                loss = loss + (S * G[r]).sum()
                S = Ms[r] @ S + Bs[r]
            (want,) = torch.autograd.grad(loss, carry)
            got = _call(fold_grads, [M.clone() for M in Ms], [x.clone() for x in G], after)
            expect(
                isinstance(got, torch.Tensor) and got.shape == want.shape,
                f"fold_grads must return a tensor of shape {tuple(want.shape)}",
            )
            error = (got - want).abs().max().item()
            expect(
                error < 1e-9,
                f"{n} ranks: gradient leaving rank {after} off by {error:.3g}. Hint: from the last rank "
                "back, through each M^T.",
            )
    return passed("The backward is the same fold, in reverse and with the maps transposed.")
