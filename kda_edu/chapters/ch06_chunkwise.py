"""Chapter 6: the whole chunked forward of KDA in one short listing (`chunked_kda`), the gate-bound sweep of
the ways of splitting the decays (`gate_bound_errors`) and the chapter's figures."""

import math

import torch

from kda_edu.ops.chunkwise import kda_chunked_matmul, largest_exponent, random_inputs
from kda_edu.ops.kda import kda_chunked, kda_recurrent


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
        [("chunk size $C$ (steps)", "largest exponent $x$ passed to $e^{x}$")],
    )
    ax.plot(chunk_sizes, naive, "o-", color="C3", label="split at the chunk start (naive)")
    ax.plot(chunk_sizes, anchored, "s-", color="C0", label=f"anchored every {sub_chunk} rows")
    ax.plot(chunk_sizes, [0] * len(chunk_sizes), "^-", color="C2", label="differences first (kda_chunked)")
    for dtype, color in ((torch.float32, "k"), (torch.float16, "gray")):
        ax.axhline(
            math.log(torch.finfo(dtype).max), ls="--", color=color, lw=1, label=f"$e^{{x}}$ overflows {dtype}"
        )
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
    finish(fig)


SCHEMES = {
    "split at chunk start": lambda x: kda_chunked_matmul(**x, chunk_size=64, sub_chunk=64)[0],
    "anchored every 16 rows": lambda x: kda_chunked_matmul(**x, chunk_size=64, sub_chunk=16)[0],
    "kda_chunked": lambda x: kda_chunked(**x, chunk_size=64)[0],
}


def gate_bound_errors(bounds, T: int = 256, d: int = 32, seed: int = 6) -> dict[str, list[float]]:
    """Relative error of each of `SCHEMES` (float32, chunks of 64) against the float64 loop, per gate bound.

    For each lower bound in `bounds`, random inputs with half the key channels pinned at the bound; one head,
    d_k = d_v = d. A result with an inf or NaN counts as `math.inf`.
    """
    errors = {name: [] for name in SCHEMES}
    for lb in bounds:
        x32 = random_inputs(1, T, 1, d, d, lower_bound=lb, at_bound=0.5, seed=seed)
        ref = kda_recurrent(**{name: t.double() for name, t in x32.items()})[0]
        for name, fn in SCHEMES.items():
            o = fn(x32).double()
            errors[name].append(((o - ref).norm() / ref.norm()).item() if o.isfinite().all() else math.inf)
    return errors


def plot_gate_bound_errors(bounds, errors: dict[str, list[float]]):
    """Plot `gate_bound_errors`: relative error against the gate bound, a non-finite result drawn at 1."""
    from kda_edu.plotting import figure, finish

    fig, (ax,) = figure(
        "Bounded exponents hold to the gate bound their anchors were sized for",
        [(r"gate lower bound $g_{\min}$ (log decay per step)", "relative error vs float64 loop")],
    )
    for (name, errs), marker in zip(errors.items(), "ovs", strict=True):
        ax.semilogy(bounds, [min(e, 1.0) for e in errs], marker + "-", label=name)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.text(bounds[-1], 1.3, "non-finite (inf/NaN)", fontsize=8)
    ax.axvline(-math.log(torch.finfo(torch.float32).max) / 16, ls="--", color="gray", lw=0.8)
    ax.legend(fontsize=8)
    finish(fig)
    return fig


def plot_chunk_timings(lengths, t_loop, t_matmul_same_flops, t_chunked, t_matmul_form):
    """Time against the length (the loop, one matmul of the loop's FLOPs, `kda_chunked` per chunk size and
    `kda_chunked_matmul`), and each chunked form's speed-up over the loop. Times are dicts keyed by length;
    `t_chunked` maps a chunk size to such a dict."""
    from kda_edu.plotting import figure, finish

    fig, (ax1, ax2) = figure(
        "Beyond a few dozen tokens chunks beat the loop; the lead peaks where fixed costs stop mattering",
        [
            ("sequence length $T$ (tokens)", "time (s)"),
            ("sequence length $T$ (tokens)", "speed-up over the loop (x)"),
        ],
    )
    ax1.loglog(lengths, [t_loop[T] for T in lengths], "o-", color="k", label="loop")
    ax1.loglog(
        lengths, [t_matmul_same_flops[T] for T in lengths], "x:", color="gray", label="one matmul, same FLOPs"
    )
    forms = [(f"kda_chunked, $C = {C}$", ".-", t) for C, t in t_chunked.items()]
    for label, style, t in forms + [("matmul form, $C = 64$", "s--", t_matmul_form)]:
        ax1.loglog(lengths, [t[T] for T in lengths], style, label=label)
        ax2.loglog(lengths, [t_loop[T] / t[T] for T in lengths], style, label=label)
    ax2.axhline(1.0, color="gray", lw=0.8)
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
    finish(fig)
    return fig
