"""Chapter 8's tools for taking `kda_edu.kernels.chunk` apart: stage by stage, byte by byte, and its benchmark.

- `prepare` runs only the three prepare kernels (`_chunk_gram_kernel`, `_chunk_inverse_kernel`,
  `_chunk_wu_kernel`, through `prepare_chunks`) and returns their intermediates (w, u, qg, kd, Aqk, exp(gc_C),
  and on request X = (I + L)^-1) as `[B, HV, NT, C, *]` tensors; `scan` runs the scan kernel on them.
- `reference_intermediates` computes the same intermediates in float64 PyTorch, from the chunkwise pieces of
  chapter 6 (`kda_edu.ops.chunkwise`).
- `diagonal_block_inverse`, `block_inverse` and `block_forward_substitution` are the inverse kernel's
  arithmetic written in PyTorch so that they can be checked against `torch.linalg.inv` / `torch.linalg.solve`:
  the 16 x 16 diagonal blocks of I + L inverted by forward substitution, row by row; the blocks of
  X = (I + L)^-1 left of the diagonal, block row by block row, as the kernel forms them; and (I + L)^-1 B
  16 rows at a time (with B = I it gives X). `neumann_block_inverse` is the product form an earlier kernel
  used for the diagonal blocks, kept to show why it was dropped.
- `design_traffic` and `design_flops` count what the four kernels move and compute per token and head.
- `crossover`, `plot_times` and `plot_rates` draw bench/results/h200_forward.json (read with
  `kda_edu.book.bench_result`).
- `programs_per_sm` is how many programs of a compiled kernel fit on one H200 multiprocessor by registers;
  `fixed_cost_lengths` finds where a sweep's time stops growing with T (a fixed cost per call dominates).
- `hopper_instructions` compiles kernels for the H200 (sm_90) without a GPU and counts the tensor-core
  instructions and TMA copies in their PTX: chunk_kda's four, and `tile_product` (one product) and
  `tile_product_tma` (the same through tensor descriptors). `block_pointer_copy` runs a kernel written with
  block pointers, to see whether the installed Triton still accepts them.
- `LADDER` lists the versions of the forward the chapter builds, from `ch08_chunk_v0` to the kernels of
  `kda_edu.kernels.chunk`, each with its launcher and what it changed; bench/kernels/bench_ch08_ladder.py
  checks and times every entry.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from kda_edu.chapters.ch08_chunk_v0 import v0_forward
from kda_edu.kernels._backend import jit
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
        "kda_edu.kernels.chunk: 16 x 16 blocks with anchored decays as tensor-core products, (I + L)^-1 from "
        "16 x 16 blocks, w and u as whole-chunk products, 16-bit intermediates, the state split over blocks of "
        "value columns",
    ),
}

# ---------------------------------------------------------------------------------------------------------
# The kernels, one stage at a time


def prepare(
    q, k, v, g, beta, scale: float | None = None, kc: int | None = None, store_x: bool = False
) -> dict:
    """Run the three prepare kernels alone (float32 inputs) and return their outputs, chunk by chunk.

    Returns a dict of `[B, HV, NT, C, *]` tensors, trimmed to K / V columns: `w`, `u`, `qg`, `kd` (`[.., K]` or
    `[.., V]`), `aqk` (`[.., C, C]`, lower triangle, zeros above), `gl`
    (`[B, HV, NT, K]`, exp(gc_C)), with `store_x` also `x` (`[.., C, C]`, X = (I + L)^-1 as the inverse kernel
    wrote it, float32), and `flat`: the padded buffers as the scan kernel reads them (layout
    `[HV, B * NT * C, cols]`: value head first, then the global chunk index, then the row). `kc` key columns
    per step of the kernels' column loops (the launcher's default when None).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    BT = CHUNK
    NT, NCH, _, _ = layout = chunk_layout(T, B)  # chunk i_c is chunk i_c % NT of sequence i_c // NT
    q, k, v, g, beta = (x.contiguous().float() for x in (q, k, v, g, beta))
    flat = prepare_chunks(q, k, v, g, beta, scale, layout, store_x=store_x, kc=kc)[0]  # chunk_kda's launch
    x_buf = flat.pop("x")  # X = (I + L)^-1, or None: returned only on request

    def view(name, cols):  # [HV, B, NT, C, cols] -> [B, HV, NT, C, cols]
        return flat[name].view(HV, B, NT, BT, -1).permute(1, 0, 2, 3, 4)[..., :cols]

    out = dict(w=view("w", K), u=view("u", V), qg=view("qg", K), kd=view("kd", K), aqk=view("aqk", BT).tril())
    out["gl"] = flat["gl"].view(HV, B, NT, pow2(K)).permute(1, 0, 2, 3)[..., :K]
    if store_x:
        out["x"] = x_buf.view(HV, B, NT, BT, BT).permute(1, 0, 2, 3, 4)
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
    """The prepare kernels' outputs computed in float64 PyTorch, `[B, HV, NT, C, *]` like `prepare`.

    Also returns `gc` (the within-chunk cumulative log decay), `A` (chapter 6's A, strictly lower triangular
    with beta inside: chapter 8's and the kernel's L = Diag(beta) A), `X` = (I + L)^-1 (what the inverse
    kernel writes over L) and `rhs` = Diag(beta) [K * exp(gc), V], the right-hand sides whose solutions are
    [w, u].
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
    """`X = (I + L)^-1` of strictly lower-triangular blocks `[..., n, n]` by forward substitution, as the
    inverse kernel does it for its four diagonal blocks (`_unit_lower_inverse`).

    Row i of `(I + L) X = I` reads `X_i + sum_{j < i} L_ij X_j = e_i`: each row needs only the rows above it,
    so n - 1 steps of one row each (the kernel does the same with element-wise products, four blocks at once).
    """
    n = L.shape[-1]
    X = torch.eye(n, dtype=L.dtype, device=L.device).expand(L.shape).clone()
    for i in range(1, n):
        X[..., i, :] = X[..., i, :] - (L[..., i, :i, None] * X[..., :i, :]).sum(-2)
    return X


def neumann_block_inverse(L: torch.Tensor) -> torch.Tensor:
    """`(I + L)^-1` of strictly lower-triangular blocks `[..., n, n]` by products (an earlier kernel's way).

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


def block_inverse(L: torch.Tensor, block: int = SUB) -> torch.Tensor:
    """`X = (I + L)^-1` for strictly lower-triangular L `[..., C, C]`, as `_chunk_inverse_kernel` forms it.

    The diagonal blocks X_aa by forward substitution (`diagonal_block_inverse`); then block row a of
    (I + L) X = I gives each block left of the diagonal, X_ac = -X_aa sum_{c <= b < a} L_ab X_bc, from the
    blocks of X already formed in the rows above. Only the blocks on and below the diagonal are multiplied:
    for C = 64 and 16-row blocks, 16 products of 16 x 16 blocks (`design_flops`).
    """
    C = L.shape[-1]
    if C % block:
        raise ValueError(f"the chunk ({C} rows) must be a whole number of blocks of {block}")
    nb = C // block

    def blk(M, a, c):
        return M[..., a * block : (a + 1) * block, c * block : (c + 1) * block]

    Xb = {(a, a): diagonal_block_inverse(blk(L, a, a)) for a in range(nb)}
    for a in range(nb):
        for c in range(a):
            acc = sum(blk(L, a, b) @ Xb[(b, c)] for b in range(c, a))
            Xb[(a, c)] = -(Xb[(a, a)] @ acc)
    zero = torch.zeros_like(Xb[(0, 0)])
    return torch.cat([torch.cat([Xb.get((a, c), zero) for c in range(nb)], -1) for a in range(nb)], -2)


def block_forward_substitution(L: torch.Tensor, B: torch.Tensor, block: int = SUB) -> torch.Tensor:
    """`(I + L)^-1 B` for strictly lower-triangular L `[..., C, C]` and B `[..., C, n]`, 16 rows at a time.

    (The single prepare kernel of the previous build solved for w and u this way; with B = I it gives X.)

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


def design_traffic(K: int, V: int, C: int = CHUNK, in_bytes: int = 2, mid_bytes: int = 2) -> dict[str, float]:
    """Bytes per token and value head that the four kernels move through memory, kernel by kernel.

    `in_bytes`: element size of q, k, v, beta and o (2 for bfloat16); g is float32. `mid_bytes`: element size
    of the intermediates w, qg, kd (K columns), u (V columns) and Aqk (C columns; the gram kernel writes the
    whole row, zeros above the diagonal, and the scan reads it). exp(gc_C) is float32, K numbers per chunk.
    L and X are float32 and go through the x buffer: the gram kernel writes the blocks of L on and below the
    diagonal (on average (C / 16 + 1) / 2 blocks of 16 columns per row), the inverse kernel reads them and
    writes X whole (zeros above), the w/u kernel reads X whole. The w/u kernel reads k, g and beta again: a
    separate launch, long after the gram kernel read them (at the benchmark's shapes k and g alone are
    larger than the H200's 50 MB L2 cache), so the second read is counted as memory traffic.
    """
    between = mid_bytes * (3 * K + V + C) + 4 * K / C
    l_cols = (C // SUB + 1) * SUB / 2  # columns of L on and below the diagonal, per row on average
    return {
        "gram reads q, k, g, beta": in_bytes * (2 * K + 1) + 4 * K,
        "gram writes qg, Aqk, L": mid_bytes * (K + C) + 4 * l_cols,
        "inverse reads L, writes X": 4 * l_cols + 4 * C,
        "w/u reads k, v, g, beta, X": in_bytes * (K + V + 1) + 4 * K + 4 * C,
        "w/u writes w, u, kd, exp(gc_C)": mid_bytes * (2 * K + V) + 4 * K / C,
        "scan reads w, u, qg, kd, Aqk, exp(gc_C)": between,
        "scan writes o": in_bytes * V,
    }


def memory_bytes(traffic: dict[str, float]) -> float:
    """The bytes of `design_traffic` through device memory: all of them."""
    return sum(traffic.values())


def floor_bytes(K: int, V: int, in_bytes: int = 2) -> int:
    """Bytes per token and value head any KDA forward must move: q, k, v, beta, o once, g in float32."""
    return in_bytes * (2 * K + 2 * V + 1) + 4 * K


def inverse_products(C: int = CHUNK, sub: int = SUB) -> int:
    """Products of sub x sub blocks the inverse kernel forms for the blocks of X left of the diagonal:
    block (a, c) takes a - c products L_ab X_bc and one X_aa (..)."""
    nb = C // sub
    return sum((a - c) + 1 for a in range(nb) for c in range(a))


def design_flops(K: int, V: int, C: int = CHUNK, sub: int = SUB) -> dict[str, float]:
    """FLOPs per token and value head of the four kernels, by phase (2 FLOPs per multiply-add)."""
    nb = C // sub  # blocks of rows per chunk
    pairs = nb * (nb + 1) // 2  # blocks (a, c) with c <= a: A and Aqk each, [sub, K] x [K, sub]
    return {
        "gram: A and Aqk blocks": pairs * 2 * 2 * sub * sub * K / C,
        # forward substitution: sub - 1 row steps, each a masked [sub, sub] multiply and column sum
        "inverse: diagonal block inverses": nb * (sub - 1) * 2 * sub * sub / C,
        "inverse: blocks of X left of the diagonal": inverse_products(C, sub) * 2 * sub**3 / C,
        # X [C, C] against Diag(beta) [K * 2^gc, V]: the whole chunk, zeros above the diagonal included
        "wu: X times [K * 2^gc, V]": 2 * C * (K + V),
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


def fixed_cost_lengths(T: list[int], t: list[float], growth: float = 1.5) -> list[int]:
    """The lengths of a sweep (T doubling from one length to the next) up to the first doubling that grows
    the time `t` by more than `growth`: where a cost per call that does not depend on T dominates.

    A time proportional to T doubles with T, a fixed cost does not grow at all; `growth` = 1.5 lies halfway.
    """
    if any(b != 2 * a for a, b in zip(T[:-1], T[1:], strict=True)):
        raise ValueError(f"the lengths must double from one to the next, got {T}")
    n = 1
    while n < len(T) and t[n] <= growth * t[n - 1]:
        n += 1
    return T[:n]


# ---------------------------------------------------------------------------------------------------------
# The H200: how many programs fit, and which instructions the compiler picks

# 132 multiprocessors; per multiprocessor (compute capability 9.0) 65,536 registers and at most 64 warps.
H200 = dict(sms=132, registers_per_sm=65536, warps_per_sm=64, warp=32)


def programs_per_sm(regs: int, warps: int, registers_per_sm: int = H200["registers_per_sm"]) -> int:
    """Programs of a kernel compiled to `regs` registers per thread, `warps` warps per program, that one
    multiprocessor's register file holds at once (registers are given out per warp, rounded up to 8 per thread)."""
    per_warp = math.ceil(regs / 8) * 8 * H200["warp"]
    return registers_per_sm // (per_warp * warps)


@jit
def tile_product(a, b, c, M: tl.constexpr, N: tl.constexpr, KK: tl.constexpr):
    """c = a @ b for one tile: a [M, KK], b [KK, N] (16-bit), c [M, N] float32, all row-major."""
    m, n, kk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, KK)
    x = tl.load(a + m[:, None] * KK + kk[None, :])
    y = tl.load(b + kk[:, None] * N + n[None, :])
    tl.store(c + m[:, None] * N + n[None, :], tl.dot(x, y))


@jit
def tile_product_tma(a, b, c, M: tl.constexpr, N: tl.constexpr, KK: tl.constexpr):
    """`tile_product` with its two loads through tensor descriptors (`tl.make_tensor_descriptor`), which on a
    GPU with a TMA become copies by the TMA unit."""
    x = tl.make_tensor_descriptor(a, shape=[M, KK], strides=[KK, 1], block_shape=[M, KK]).load([0, 0])
    y = tl.make_tensor_descriptor(b, shape=[KK, N], strides=[N, 1], block_shape=[KK, N]).load([0, 0])
    m, n = tl.arange(0, M), tl.arange(0, N)
    tl.store(c + m[:, None] * N + n[None, :], tl.dot(x, y))


@jit
def _copy_block_ptr(src, dst, M: tl.constexpr, N: tl.constexpr):
    """dst = src for one [M, N] row-major tile, loaded through a block pointer (`tl.make_block_ptr`)."""
    x = tl.load(
        tl.make_block_ptr(src, shape=(M, N), strides=(N, 1), offsets=(0, 0), block_shape=(M, N), order=(1, 0))
    )
    m, n = tl.arange(0, M), tl.arange(0, N)
    tl.store(dst + m[:, None] * N + n[None, :], x)


def block_pointer_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of the 2-D tile `x` (sides powers of two, at least 16) made by a kernel written with block
    pointers; raises whatever the installed Triton raises for them."""
    out = torch.empty_like(x)
    _copy_block_ptr[(1,)](x.contiguous(), out, M=x.shape[0], N=x.shape[1])
    return out


# What to look for in the PTX: Hopper's warpgroup products, the mma.sync products every GPU since Ampere has,
# and the TMA's bulk tensor copies.
PTX_COUNTS = {"wgmma": "wgmma.mma_async", "mma.sync": "mma.sync", "TMA copies": "cp.async.bulk.tensor"}

_BF16_MID = dict(w="*bf16", u="*bf16", qg="*bf16", kd="*bf16", aqk="*bf16", gl="*fp32")


def _compile_specs(K: int = 128, V: int = 128) -> dict:
    """The four kernels of `chunk_kda_fwd` as it launches them for bfloat16 inputs with K = V = 128 (warps
    (4, 1, 4) for gram, inverse and w/u, 32 key columns per step, bfloat16 operands in the gram kernel and
    tf32 in the others, a scan of 32 value columns with two pipeline stages; no state, no cu_seqlens)."""
    i32 = "i32"
    gram = dict(
        signature=dict(
            q="*bf16",
            k="*bf16",
            g="*fp32",
            beta="*bf16",
            qg="*bf16",
            aqk="*bf16",
            lmat="*fp32",
            chunks="*i32",
            T=i32,
            H=i32,
            HV=i32,
            K=i32,
            NT=i32,
            NCH=i32,
            scale="fp32",
        ),
        constexprs=dict(BT=CHUNK, BC=SUB, BK=K, KC=32, PREC="bf16", IS_VARLEN=False),
        options=dict(num_warps=4),
    )
    inverse = dict(
        signature=dict(lmat="*fp32"),
        constexprs=dict(BT=CHUNK, BC=SUB, PREC="tf32"),
        options=dict(num_warps=1),
    )
    wu = dict(
        signature=dict(
            k="*bf16",
            v="*bf16",
            g="*fp32",
            beta="*bf16",
            xmat="*fp32",
            w="*bf16",
            u="*bf16",
            kd="*bf16",
            gl="*fp32",
            chunks="*i32",
            T=i32,
            H=i32,
            HV=i32,
            K=i32,
            V=i32,
            NT=i32,
            NCH=i32,
        ),
        constexprs=dict(BT=CHUNK, BK=K, BV=V, KC=32, VC=32, PREC="tf32", IS_VARLEN=False, KD_TOTAL=True),
        options=dict(num_warps=4),
    )
    scan = dict(
        signature={**_BF16_MID, "o": "*bf16", "h0": "*fp32", "ht": "*fp32", "cu_seqlens": "*i32",
                   "chunk_offsets": "*i32", **dict.fromkeys(["T", "HV", "K", "V", "NT", "NCH"], i32)},
        constexprs=dict(BT=CHUNK, BK=K, BVP=V, BV=32, USE_H0=False, STORE_HT=False, PREC="tf32", IS_VARLEN=False),
        options=dict(num_warps=4, num_stages=2),
    )  # fmt: skip
    return {"gram": gram, "inverse": inverse, "wu": wu, "scan": scan}


def _count_sm90(job: dict) -> dict[str, int]:
    """Compile one kernel for sm_90 (in a process where kda_edu builds compiled kernels) and count PTX_COUNTS."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kda_edu.kernels.chunk import KERNELS

    if job["kernel"] in ("tile_product", "tile_product_tma"):
        kernel = tile_product if job["kernel"] == "tile_product" else tile_product_tma
        spec = dict(
            signature=dict(a="*bf16", b="*bf16", c="*fp32"),
            constexprs=dict(M=job["M"], N=job["N"], KK=job["K"]),
            options=dict(num_warps=job["warps"]),
        )
    else:
        kernel, spec = KERNELS[job["kernel"]], _compile_specs()[job["kernel"]]
    signature = spec["signature"] | dict.fromkeys(spec["constexprs"], "constexpr")
    source = ASTSource(fn=kernel, signature=signature, constexprs=spec["constexprs"])
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=spec["options"]).asm["ptx"]
    return {name: ptx.count(pattern) for name, pattern in PTX_COUNTS.items()}


def hopper_instructions(jobs: list[dict]) -> list[dict[str, int]]:
    """Compile kernels for the H200 (sm_90) without a GPU and count, in each one's PTX, the instructions of
    `PTX_COUNTS`. A job is `{"kernel": name}` with name one of "gram", "inverse", "wu", "scan" (chunk_kda's kernels as
    `_compile_specs` launches them) or `{"kernel": "tile_product", "M": .., "N": .., "K": .., "warps": ..}` (or `"tile_product_tma"`).

    The compiler runs in a fresh Python: where there is no GPU this process builds kda_edu's kernels for the
    interpreter, which cannot be compiled; the fresh one is told to build them as on a GPU machine
    (`kda_edu.backend.INTERPRET = False` before `kda_edu.kernels` is imported). Nothing is launched.
    """
    root = str(Path(__file__).resolve().parents[2])
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    code = (
        "import json, sys; import kda_edu.backend as b; b.INTERPRET = False\n"
        "from kda_edu.chapters.ch08_chunk_kernel import _count_sm90\n"
        "print(json.dumps([_count_sm90(job) for job in json.loads(sys.argv[1])]))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, json.dumps(jobs)], env=env, capture_output=True, text=True, check=False
    )
    if run.returncode != 0:
        raise RuntimeError(f"compiling for sm_90 failed:\n{run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])
