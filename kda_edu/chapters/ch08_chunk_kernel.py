"""Chapter 8's tools for taking `kda_edu.kernels.chunk` apart: stage by stage, byte by byte, and its benchmark.

- `prepare` runs only the first kernel (`_chunk_prepare_kernel`) and returns its intermediates (w, u, qg, kd,
  Aqk, exp(gc_C)) as `[B, HV, NT, C, *]` tensors; `scan` runs the second kernel on them.
- `reference_intermediates` computes the same intermediates in float64 PyTorch, from the chunkwise pieces of
  chapter 6 (`kda_edu.ops.chunkwise`).
- `diagonal_block_inverse` and `block_forward_substitution` are the kernel's triangular solve, written in
  PyTorch so that they can be checked against `torch.linalg.inv` / `torch.linalg.solve`: (I + L)^-1 B, 16
  rows at a time, with the 16 x 16 diagonal blocks inverted by forward substitution, row by row.
  `neumann_block_inverse` is the product form the kernel used before, kept to show why it was dropped.
- `design_traffic` and `design_flops` count what the two kernels move and compute per token and head.
- `crossover`, `plot_times` and `plot_rates` draw bench/results/h200_forward.json (read with
  `kda_edu.book.bench_result`).
- `LADDER` lists the versions of the forward the chapter builds, from `ch08_chunk_v0` to the kernels of
  `kda_edu.kernels.chunk`, each with its launcher and what it changed; bench/kernels/bench_ch08_ladder.py
  checks and times every entry.
"""

import math

import torch
import triton

from kda_edu.chapters.ch08_chunk_v0 import v0_forward
from kda_edu.kernels.chunk import CHUNK, KERNELS, SUB, chunk_kda_fwd, chunk_layout, pow2, prepare_chunks
from kda_edu.ops._chunks import chunk_inputs
from kda_edu.ops.chunkwise import intra_chunk_matrices, ut_transform

# ---------------------------------------------------------------------------------------------------------
# The ladder: every version of the forward, in the order the chapter builds them

# name -> (launcher, what this version changed). Every launcher takes validated inputs
# (q, k, v, g, beta, scale, initial_state, output_final_state) and returns (o, final_state).
LADDER = {
    "v0": (
        v0_forward,
        "one program per chunk holds all 64 rows; A and Aqk one key channel at a time with whole pairwise "
        "decays; (I + L)^-1 by 64-row forward substitution; one program per head carries the whole state",
    ),
    "chunk_kda": (
        chunk_kda_fwd,
        "kda_edu.kernels.chunk: 16 x 16 blocks with anchored decays as tensor-core products, block forward "
        "substitution, 16-bit intermediates, the state split over blocks of value columns",
    ),
}

# ---------------------------------------------------------------------------------------------------------
# The two kernels, one at a time


def prepare(q, k, v, g, beta, scale: float | None = None, kc: int | None = None) -> dict:
    """Run `_chunk_prepare_kernel` alone (float32 inputs) and return its outputs, chunk by chunk.

    Returns a dict of `[B, HV, NT, C, *]` tensors, trimmed to K / V columns: `w`, `u`, `qg`, `kd` (`[.., K]` or
    `[.., V]`), `aqk` (`[.., C, C]`, lower triangle, zeros above), `gl`
    (`[B, HV, NT, K]`, exp(gc_C)), and `flat`: the padded buffers as the scan kernel reads them (layout
    `[HV, B * NT * C, cols]`: value head first, then the global chunk index, then the row). `kc` key columns
    per step of the kernel's column loops (the launcher's default when None).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    BT = CHUNK
    NT, NCH, _, _ = layout = chunk_layout(T, B)  # chunk i_c is chunk i_c % NT of sequence i_c // NT
    q, k, v, g, beta = (x.contiguous().float() for x in (q, k, v, g, beta))
    flat = prepare_chunks(q, k, v, g, beta, scale, layout, kc=kc)[0]  # the launch chunk_kda uses
    flat.pop("x")  # None: X is stored only for the backward

    def view(name, cols):  # [HV, B, NT, C, cols] -> [B, HV, NT, C, cols]
        return flat[name].view(HV, B, NT, BT, -1).permute(1, 0, 2, 3, 4)[..., :cols]

    out = dict(w=view("w", K), u=view("u", V), qg=view("qg", K), kd=view("kd", K), aqk=view("aqk", BT).tril())
    out["gl"] = flat["gl"].view(HV, B, NT, pow2(K)).permute(1, 0, 2, 3)[..., :K]
    out["flat"] = flat
    out["sizes"] = dict(B=B, T=T, HV=HV, K=K, V=V, NT=NT, NCH=NCH)
    return out


def scan(prepared: dict, initial_state: torch.Tensor | None = None, bv: int = 16):
    """Run `_chunk_scan_kernel` on the outputs of `prepare`; returns `(o [B, T, HV, V], final state)`.

    `bv` value columns per program; the pipeline depth follows the launcher `chunk_kda_fwd`.
    """
    s = prepared["sizes"]
    flat = prepared["flat"]
    dev = flat["w"].device
    o = torch.empty(s["B"], s["T"], s["HV"], s["V"], device=dev)
    ht = torch.empty(s["B"], s["HV"], s["K"], s["V"], device=dev)
    h0 = initial_state.contiguous().float() if initial_state is not None else None
    BK = pow2(s["K"])
    KERNELS["scan"][(triton.cdiv(s["V"], bv), s["B"] * s["HV"])](
        *flat.values(), o, h0, ht, None, None, s["T"], s["HV"], s["K"], s["V"], s["NT"], s["NCH"],
        BT=CHUNK, BK=BK, BVP=pow2(s["V"]), BV=bv, USE_H0=h0 is not None, STORE_HT=True, PREC="ieee",
        IS_VARLEN=False, num_warps=4,
        num_stages=1 if BK * 4 > 512 else 2,  # as the launcher: two stages of float32 tiles fit up to K = 128
    )  # fmt: skip
    return o, ht


def reference_intermediates(q, k, v, g, beta, scale: float | None = None) -> dict:
    """The prepare kernel's outputs computed in float64 PyTorch, `[B, HV, NT, C, *]` like `prepare`.

    Also returns `gc` (the within-chunk cumulative log decay), `A` (chapter 6's A, strictly lower triangular
    with beta inside: chapter 8's and the kernel's L = Diag(beta) A), `X` = (I + L)^-1 (which the forward
    kernel never forms; only the backward's STORE_X pass does) and `rhs` = Diag(beta) [K * exp(gc), V], the
    right-hand sides whose solutions are [w, u].
    """
    f64 = torch.float64
    q_c, k_c, v_c, _, gc, beta_c = chunk_inputs(q, k, v, g, beta, scale=scale, chunk_size=CHUNK, dtype=f64)
    A, aqk = intra_chunk_matrices(q_c, k_c, gc, beta_c, SUB)
    eye = torch.eye(CHUNK, dtype=f64, device=q.device)
    X = torch.linalg.inv(eye + A)
    rhs = beta_c[..., None] * torch.cat([k_c * gc.exp(), v_c], dim=-1)
    w, u = ut_transform(A, rhs).split([k.shape[3], v.shape[3]], -1)
    gc_end = gc[..., -1:, :]
    return dict(
        w=w, u=u, qg=q_c * gc.exp(), kd=k_c * (gc_end - gc).exp(), aqk=aqk, gl=gc_end.squeeze(-2).exp(),
        gc=gc, A=A, X=X, rhs=rhs,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# The triangular solve, 16 rows at a time


def diagonal_block_inverse(L: torch.Tensor) -> torch.Tensor:
    """`X = (I + L)^-1` of strictly lower-triangular blocks `[..., n, n]` by forward substitution, as the kernel.

    Row i of `(I + L) X = I` reads `X_i + sum_{j < i} L_ij X_j = e_i`: each row needs only the rows above it,
    so n - 1 steps of one row each (the kernel does the same with element-wise products, four blocks at once).
    """
    n = L.shape[-1]
    X = torch.eye(n, dtype=L.dtype, device=L.device).expand(L.shape).clone()
    for i in range(1, n):
        X[..., i, :] = X[..., i, :] - (L[..., i, :i, None] * X[..., :i, :]).sum(-2)
    return X


def neumann_block_inverse(L: torch.Tensor) -> torch.Tensor:
    """`(I + L)^-1` of strictly lower-triangular blocks `[..., n, n]` by products (the kernel's former way).

    L^n = 0, so the Neumann series I - L + L^2 - ... is finite, and with m = the next power of two >= n it
    factors as (I - L)(I + L^2)(I + L^4)...(I + L^(m/2)): for n = 16, three squarings and three updates,
    no loop over rows. Exact in exact arithmetic; in float32 its intermediate powers of L can be far larger
    than the inverse itself (nearly parallel keys), and their rounding shows in the result.
    """
    n = L.shape[-1]
    X = torch.eye(n, dtype=L.dtype, device=L.device) - L
    P = L
    for _ in range(max(0, math.ceil(math.log2(max(n, 1))) - 1)):
        P = P @ P  # L^2, L^4, ...
        X = X + X @ P  # X (I + P)
    return X


def block_forward_substitution(L: torch.Tensor, B: torch.Tensor, block: int = SUB) -> torch.Tensor:
    """`(I + L)^-1 B` for strictly lower-triangular L `[..., C, C]` and B `[..., C, n]`, the way the kernel does it.

    The rows are taken `block` at a time (block a = rows a*block .. a*block + block - 1): with X_a the inverse
    of the diagonal block I + L_aa (`diagonal_block_inverse`),

        R_a = X_a (B_a - sum_{c < a} L_ac R_c),

    so the only inverses formed are the C / block small ones; the blocks below the diagonal are used as they
    are. C must be a multiple of `block`.
    """
    C = L.shape[-1]
    if C % block:
        raise ValueError(f"the chunk ({C} rows) must be a whole number of blocks of {block}")
    rows = []
    for a in range(C // block):
        sl = slice(a * block, (a + 1) * block)
        rhs = B[..., sl, :]
        for c in range(a):
            rhs = rhs - L[..., sl, c * block : (c + 1) * block] @ rows[c]
        rows.append(diagonal_block_inverse(L[..., sl, sl]) @ rhs)
    return torch.cat(rows, dim=-2)


# ---------------------------------------------------------------------------------------------------------
# What the design moves and computes, per token and value head

L2_REREAD = "prepare re-reads k, g in pass 2 (assumed from L2)"


def design_traffic(K: int, V: int, C: int = CHUNK, in_bytes: int = 2, mid_bytes: int = 2) -> dict[str, float]:
    """Bytes per token and value head that the two kernels move (each tensor once through memory).

    `in_bytes`: element size of q, k, v, beta and o (2 for bfloat16); g is float32. `mid_bytes`: element size
    of the intermediates w, qg, kd (K columns), u (V columns) and Aqk (C columns; the kernel writes only the
    blocks on and below the diagonal, the scan reads the whole row: counted as C both ways). exp(gc_C) is
    float32, K numbers per chunk. The prepare kernel reads k and g a second time in pass 2; the same program
    read them moments before, so the second read is assumed to hit the L2 cache: it is listed under
    `L2_REREAD` and left out of `memory_bytes`.
    """
    between = mid_bytes * (3 * K + V + C) + 4 * K / C
    return {
        "prepare reads q, k, v, g, beta": in_bytes * (2 * K + V + 1) + 4 * K,
        L2_REREAD: in_bytes * K + 4 * K,
        "prepare writes w, u, qg, kd, Aqk, exp(gc_C)": between,
        "scan reads them back": between,
        "scan writes o": in_bytes * V,
    }


def memory_bytes(traffic: dict[str, float]) -> float:
    """The bytes of `design_traffic` that go through device memory: everything but the L2 re-read."""
    return sum(v for name, v in traffic.items() if name != L2_REREAD)


def floor_bytes(K: int, V: int, in_bytes: int = 2) -> int:
    """Bytes per token and value head any KDA forward must move: q, k, v, beta, o once, g in float32."""
    return in_bytes * (2 * K + 2 * V + 1) + 4 * K


def design_flops(K: int, V: int, C: int = CHUNK, sub: int = SUB) -> dict[str, float]:
    """FLOPs per token and value head of the two kernels, by phase (2 FLOPs per multiply-add)."""
    nb = C // sub  # blocks of rows per chunk
    pairs = nb * (nb + 1) // 2  # blocks (a, c) with c <= a: A and Aqk each, [sub, K] x [K, sub]
    return {
        "prepare: A and Aqk blocks": pairs * 2 * 2 * sub * sub * K / C,
        # forward substitution: sub - 1 row steps, each a masked [sub, sub] multiply and column sum
        "prepare: diagonal block inverses": nb * (sub - 1) * 2 * sub * sub / C,
        # per column: block a costs a products L_ac R_c and one X_a (..): nb (nb + 1) / 2 products [sub, sub]
        "prepare: w, u by block substitution": pairs * 2 * sub * sub * (K + V) / C,
        "scan: w S, qg S, kd^T U": 3 * 2 * K * V,
        "scan: Aqk U": 2 * C * V,
    }


def algorithm_flops(d: int, C: int = CHUNK) -> int:
    """The chunked algorithm's FLOPs per token and head, 6 d^2 + 3 C d + C^2 (the Kimi Linear report's count,
    arXiv:2510.26692, which the benchmark uses)."""
    return 6 * d * d + 3 * C * d + C * C


# ---------------------------------------------------------------------------------------------------------
# The committed benchmark


def times(rows: list[dict], method: str) -> tuple[list[int], list[float]]:
    """(T, ms) of `method` over benchmark rows, skipping rows where it did not run."""
    pts = [(r["T"], r["methods"][method]["ms"]) for r in rows if "ms" in r["methods"].get(method, {})]
    return [t for t, _ in pts], [m for _, m in pts]


def crossover(T: list[float], t_a: list[float], t_b: list[float]) -> float | None:
    """The length at which method a stops being slower than b (first sign change of t_a - t_b), or None.

    Between the two measured lengths that bracket the change, both times are taken as power laws (straight
    lines on log-log axes), so the crossover is where the lines meet.
    """
    r = [math.log(a / b) for a, b in zip(t_a, t_b, strict=True)]
    for i in range(len(T) - 1):
        if r[i] > 0 >= r[i + 1]:
            x0, x1 = math.log(T[i]), math.log(T[i + 1])
            return math.exp(x0 + (x1 - x0) * r[i] / (r[i] - r[i + 1]))
    return None


STYLE = {
    "kda_edu chunk_kda": dict(marker="o", color="C3"),
    "fla chunk_kda": dict(marker="s", color="C0"),
    "fla chunk_gated_delta_rule": dict(marker="^", color="C2"),
    "torch sdpa flash causal": dict(marker="x", color="k"),
    "kda_edu kda_chunked (PyTorch)": dict(marker="d", color="C7"),
}


def plot_times(ax, bench: dict) -> None:
    """Time against T (log-log) for every method of the benchmark's sweep."""
    for method, style in STYLE.items():
        T, ms = times(bench["sweep"], method)
        if T:
            ax.loglog(T, ms, label=method, **style)
    ax.legend(fontsize=8)


def plot_rates(axes, bench: dict) -> None:
    """Achieved GB/s and TFLOP/s of each method at the headline shapes, with the measured ceilings."""
    rows = bench["headline"]
    methods = [m for m in STYLE if any("ms" in r["methods"].get(m, {}) for r in rows)]
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        for ax, key in zip(axes, ("GBps", "TFLOPs"), strict=True):
            x = [i + j * width for i, r in enumerate(rows) if key in r["methods"][method]]
            y = [r["methods"][method][key] for r in rows if key in r["methods"][method]]
            ax.bar(x, y, width, label=method, color=STYLE[method]["color"])
    labels = [f"B={r['B']}\nT={r['T'] // 1024}K\nH={r['H']}" for r in rows]
    for ax, ceiling, name in zip(
        axes,
        (bench["copy_bandwidth_TBps"] * 1e3, bench["bf16_matmul_TFLOPs"]),
        ("copy", "bf16 matmul"),
        strict=True,
    ):
        ax.axhline(ceiling, color="k", ls="--", lw=1)
        ax.text(
            len(rows) - 0.2, ceiling * 0.75, f"{name} ceiling {ceiling:.0f}", fontsize=8, ha="right", va="top"
        )
        ax.set_yscale("log")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], labels, fontsize=8)
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
