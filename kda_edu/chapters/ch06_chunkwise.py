"""Chapter 6: the whole chunked forward of KDA in one short listing (`chunked_kda`), and the chapter's figure
of how large the exponents of each way of splitting the decays get (`kda_edu.ops.chunkwise.largest_exponent`)."""

import math

import torch

from kda_edu.ops.chunkwise import largest_exponent


def chunked_kda(q, k, v, g, beta, chunk_size: int = 64):
    """KDA for one head from a zero state, chunk by chunk: the chapter's four stages in one listing.

    q, k, g `[T, K]` (g the log decay, <= 0), v `[T, V]`, beta `[T]`; any T >= 1 (the last chunk may be
    short). Returns `(o [T, V], S_T [K, V])`, as `kda_edu.ops.kda.kda_recurrent` for one head (scale K^-1/2).
    The decays inside a chunk are differences taken before `exp`, so no exponent is positive.
    """
    T, K = k.shape
    q, S, o = q * K**-0.5, k.new_zeros(K, v.shape[1]), torch.empty_like(v)
    for s in range(0, T, chunk_size):
        rows = slice(s, s + chunk_size)
        Q, Kc, V, b, gc = q[rows], k[rows], v[rows], beta[rows], g[rows].cumsum(dim=0)  # (1) gc
        n = len(gc)
        causal = torch.ones(n, n, dtype=torch.bool, device=k.device).tril()[..., None]  # j <= i
        decay = (gc[:, None] - gc[None]).masked_fill(~causal, -math.inf).exp()  # exp(gc_i - gc_j)
        A = b[:, None] * torch.einsum("ic,jc,ijc->ij", Kc, Kc, decay).tril(-1)  # (2) A and Aqk
        Aqk = torch.einsum("ic,jc,ijc->ij", Q, Kc, decay)
        eye = torch.eye(n, dtype=A.dtype, device=A.device)  # (3) UT transform: (I + A) [w, u] = rhs
        rhs = b[:, None] * torch.cat([Kc * gc.exp(), V], dim=1)
        wu = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        w, u = wu[:, :K], wu[:, K:]
        U = u - w @ S  # (4) state passing: the values written, the outputs, the state handed on
        o[rows] = (Q * gc.exp()) @ S + Aqk @ U
        S = gc[-1].exp()[:, None] * S + (Kc * (gc[-1] - gc).exp()).T @ U
    return o, S


def plot_exponent_budget(lower_bound: float = -5.0, sub_chunk: int = 16):
    """Plot the largest exponent each way of splitting the decays evaluates, against the chunk size (8 to 256).

    Gates sit at `lower_bound` (the worst case). Three schemes: the naive split at the chunk start, the
    split anchored every `sub_chunk` rows, and differences taken before `exp` (never above 0). The
    dashed lines are where `exp` overflows float32 and float16.
    """
    from kda_edu.plotting import figure, finish

    chunk_sizes = [8, 16, 32, 64, 128, 256]
    naive, anchored = [], []
    for C in chunk_sizes:
        gc = torch.full((C, 1), float(lower_bound), dtype=torch.float64).cumsum(dim=0)
        naive.append(largest_exponent(gc, C))
        anchored.append(largest_exponent(gc, sub_chunk))
    fig, (ax,) = figure(
        f"Anchoring every {sub_chunk} rows caps the exponent; the chunk-start split grows with C",
        [("chunk size C (steps)", "largest exponent x passed to exp(x)")],
    )
    ax.plot(chunk_sizes, naive, "o-", color="C3", label="split at the chunk start (naive)")
    ax.plot(chunk_sizes, anchored, "s-", color="C0", label=f"anchored every {sub_chunk} rows")
    ax.plot(chunk_sizes, [0] * len(chunk_sizes), "^-", color="C2", label="differences first (kda_chunked)")
    for dtype, color in ((torch.float32, "k"), (torch.float16, "gray")):
        ax.axhline(
            math.log(torch.finfo(dtype).max), ls="--", color=color, lw=1, label=f"exp overflows {dtype}"
        )
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
    finish(fig)
