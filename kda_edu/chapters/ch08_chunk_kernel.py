"""Chapter 8's tools for taking `kda_edu.kernels.chunk_fwd` apart: stage by stage, byte by byte, and its benchmark.

- `prepare` runs only the three prepare kernels (`_chunk_gram_kernel`, `_chunk_inverse_kernel`,
  `_chunk_wu_kernel`, through `prepare_chunks`) and returns their intermediates (w, u, qg, kd, Aqk, exp(gc_C),
  and on request X = (I + L)^-1) as `[B, HV, NT, C, *]` tensors; `scan` runs the scan kernel on them; `gram`
  runs one gram kernel alone and returns qg, Aqk and L.
- `reference_intermediates` computes the same intermediates in float64 PyTorch, from the chunkwise pieces of
  chapter 6 (`kda_edu.ops.chunkwise`).
- `gram16_kernel` is the gram kernel's first version, one product per 16 x 16 block (twenty accumulators),
  with the arguments of `chunk_fwd._chunk_gram_kernel`; the launchers take it as their `gram_kernel`, and
  `blocks16_forward` is the forward with it (a rung of `LADDER`).
- `left_of_diagonal`, `diagonal_product` and `gram64` are the 64-row gram kernel's products written in
  PyTorch: the masked products left of the diagonal, the anchored product whose diagonal blocks it keeps;
  `diagonal_spans` finds the steps of key columns whose gates send the kernel to its per-block path.
- `diagonal_block_inverse`, `block_inverse` and `block_forward_substitution` are the inverse kernel's
  arithmetic written in PyTorch so that they can be checked against `torch.linalg.inv` / `torch.linalg.solve`:
  the 16 x 16 diagonal blocks of I + L inverted by forward substitution, row by row; the blocks of
  X = (I + L)^-1 left of the diagonal, block row by block row, as the kernel forms them; and (I + L)^-1 B
  16 rows at a time (with B = I it gives X). `neumann_block_inverse` is the product form an earlier kernel
  used for the diagonal blocks, kept to show why it was dropped.
- `design_traffic` and `design_flops` count what the four kernels move and compute per token and head;
  `gram_block_flops` counts the useful part of the gram kernel's products (the ten blocks on and below the
  diagonal); `counted_design_flops` runs PyTorch's FLOP counter on the PyTorch forms of the products.
- `crossover` finds where one method's times overtake another's; `plot_rates` draws a committed forward
  benchmark (read with `kda_edu.book.bench_result`).
- `hopper_instructions` compiles kernels for the H200 (sm_90) without a GPU and counts the tensor-core
  instructions, TMA copies and the fences before warpgroup products in their PTX: chunk_kda's four, `gram16_kernel`, and `tile_product` (one
  product) and `tile_product_tma` (the same through tensor descriptors). `block_pointer_copy` runs a kernel
  written with block pointers, to see whether the installed Triton still accepts them.
- `LADDER` lists the versions of the forward the chapter builds, from `ch08_chunk_v0` to the kernels of
  `kda_edu.kernels.chunk`, each with its launcher and what it changed; bench/kernels/bench_ch08_ladder.py
  checks and times every entry.
"""

import math
import re
import sys

import torch
import triton
import triton.language as tl

from kda_edu.chapters.ch07_primer import H100
from kda_edu.chapters.ch08_chunk_v0 import v0_forward
from kda_edu.kernels import chunk_fwd
from kda_edu.kernels._backend import jit

# With chunk_fwd.py's public names, the building blocks `gram16_kernel` shares with its gram kernel (private
# to chunk_fwd.py, which this chapter takes apart; imported, not copied, so that each exists once)
from kda_edu.kernels.chunk_common import CHUNK, SUB, chunk_layout, chunk_program, load_rows, pow2
from kda_edu.kernels.chunk_fwd import (
    KERNELS,
    chunk_kda_fwd,
    clean_nonfinite,
    diag_grams,
    key_block,
    prepare_chunks,
    store_block,
    tile_mm,
)
from kda_edu.kernels.chunk_launch import pass_stages
from kda_edu.kernels.offline import compile_source, in_fresh_python
from kda_edu.ops._checks import GATE_FLOOR
from kda_edu.ops._chunks import chunk_inputs, to_chunks
from kda_edu.ops.chunkwise import intra_chunk_matrices, ut_transform
from kda_edu.plotting import COLORS

# ---------------------------------------------------------------------------------------------------------
# The kernels, one stage at a time


def prepare(
    q,
    k,
    v,
    g,
    beta,
    scale: float | None = None,
    kc: int | None = None,
    store_x: bool = False,
    gram_kernel=None,
) -> dict:
    """Run the three prepare kernels alone (float32 inputs) and return their outputs, chunk by chunk.

    Returns a dict of `[B, HV, NT, C, *]` tensors, trimmed to K / V columns: `w`, `u`, `qg`, `kd` (`[.., K]` or
    `[.., V]`), `aqk` (`[.., C, C]`, lower triangle, zeros above), `gl`
    (`[B, HV, NT, K]`, exp(gc_C)), with `store_x` also `x` (`[.., C, C]`, X = (I + L)^-1 as the inverse kernel
    wrote it, float32), and `flat`: the padded buffers as the scan kernel reads them (layout
    `[HV, B * NT * C, cols]`: value head first, then the global chunk index, then the row). `kc` key columns
    per step of the kernels' column loops (the launcher's default when None). `gram_kernel`: launched in place
    of chunk_fwd.py's gram kernel when given (`gram16_kernel`).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    BT = CHUNK
    NT, NCH, _, _ = layout = chunk_layout(T, B)  # chunk i_c is chunk i_c % NT of sequence i_c // NT
    q, k, v, g, beta = (x.contiguous().float() for x in (q, k, v, g, beta))
    flat = prepare_chunks(q, k, v, g, beta, scale, layout, store_x=store_x, kc=kc, gram_kernel=gram_kernel)[0]
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
        *flat.values(), o, h0, ht, None, None, s["T"], s["HV"], s["K"], s["V"], s["NT"], s["NCH"], 0, 0, s["NT"],
        BT=CHUNK, BK=BK, BVP=pow2(s["V"]), BV=bv, USE_H0=h0 is not None, STORE_HT=True, PREC="ieee",
        IS_VARLEN=False, num_warps=4,
        num_stages=pass_stages(BK, 4),  # as the launcher, for float32 tiles
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


def gram(q, k, g, beta, scale: float | None = None, kc: int | None = None, kernel=None) -> dict:
    """Run one gram kernel alone (float32 inputs, launched as `prepare_chunks` launches it) and return its
    outputs chunk by chunk: `qg` `[B, HV, NT, C, K]`, `aqk` and `L` = Diag(beta) A `[B, HV, NT, C, C]` (L as
    written into the x buffer, whose entries the kernel leaves unwritten read as 0).

    `kernel`: chunk_fwd.py's `_chunk_gram_kernel` when None, or another with its arguments (`gram16_kernel`); `kc`
    key columns per step (`prepare_chunks`' default of 32, at most K rounded up to a power of two, when None).
    """
    B, T, H, K = q.shape
    HV = g.shape[2]
    scale = K**-0.5 if scale is None else scale
    NT, NCH, chunks, _ = chunk_layout(T, B)
    BK = pow2(K)
    q, k, g, beta = (x.contiguous().float() for x in (q, k, g, beta))
    rows = HV * NCH * CHUNK
    qg = torch.zeros(rows, BK, device=q.device)
    aqk = torch.zeros(rows, CHUNK, device=q.device)
    lmat = torch.zeros(rows, CHUNK, device=q.device)
    (kernel or chunk_fwd._chunk_gram_kernel)[(NCH, HV)](
        q, k, g, beta, qg, aqk, lmat, chunks, T, H, HV, K, NT, NCH, scale, 0, 0, NT,
        BT=CHUNK, BC=SUB, BK=BK, KC=min(kc or 32, BK), PREC="ieee", IS_VARLEN=False, num_warps=4,
    )  # fmt: skip

    def view(x, cols):  # [HV, B, NT, C, cols] -> [B, HV, NT, C, cols]
        return x.view(HV, B, NT, CHUNK, -1).permute(1, 0, 2, 3, 4)[..., :cols]

    return dict(qg=view(qg, K), aqk=view(aqk, CHUNK), L=view(lmat, CHUNK))


# ---------------------------------------------------------------------------------------------------------
# The gram kernel's first version: one anchored product per 16 x 16 block


@jit
def _pair(k_a, q_a, exponent, col, PREC: tl.constexpr):
    """One block pair left of the diagonal: (k_a, q_a) rows scaled by 2^exponent (<= 0) against col^T."""
    row_f = tl.exp2(exponent)
    return tile_mm(k_a * row_f, tl.trans(col), PREC), tile_mm(q_a * row_f, tl.trans(col), PREC)


@jit
def _key_blocks(k_h, g_h, cols, H, HV, K, n_t, BC: tl.constexpr):
    """The chunk's four 16-row blocks of keys in key columns `cols` (`key_block`), the within-block gate
    cumsums l_a, the column factors c_a = k_a * 2^(s_a - l_a) of blocks 0..2 (s_a the block's gate sum) and
    the block gate sums s_0..s_2 ([1, len(cols)])."""
    rc = tl.arange(0, BC)
    last = (rc == BC - 1)[:, None]
    k0, l0, _ = key_block(k_h, g_h, rc, cols, H, HV, K, n_t)
    k1, l1, _ = key_block(k_h, g_h, BC + rc, cols, H, HV, K, n_t)
    k2, l2, _ = key_block(k_h, g_h, 2 * BC + rc, cols, H, HV, K, n_t)
    k3, l3, _ = key_block(k_h, g_h, 3 * BC + rc, cols, H, HV, K, n_t)
    s0 = tl.sum(tl.where(last, l0, 0.0), axis=0)[None, :]
    s1 = tl.sum(tl.where(last, l1, 0.0), axis=0)[None, :]
    s2 = tl.sum(tl.where(last, l2, 0.0), axis=0)[None, :]
    c0, c1, c2 = k0 * tl.exp2(s0 - l0), k1 * tl.exp2(s1 - l1), k2 * tl.exp2(s2 - l2)
    return k0, k1, k2, k3, l0, l1, l2, l3, s0, s1, s2, c0, c1, c2


@jit
def _store_l_aqk(lmat, aqk, beta_h, row0, n_t, HV, ad, a1, a2, a3, qd, q1, q2, q3, A_ROW: tl.constexpr,
                 BT: tl.constexpr, BC: tl.constexpr):  # fmt: skip
    """Row block A_ROW of L = Diag(beta) A and of Aqk: ad / qd the diagonal block, a1.. / q1.. the blocks
    1, 2, 3 left of it. The blocks of L above the diagonal are not written (the inverse kernel never reads
    them); those of Aqk are written as zeros (the scan reads whole rows)."""
    rc = tl.arange(0, BC)
    ta = A_ROW * BC + rc
    b_a, _ = clean_nonfinite(tl.load(beta_h + ta * HV, mask=ta < n_t, other=0.0).to(tl.float32)[:, None])
    store_block(
        lmat, row0, A_ROW, BC, BT, A_ROW * BC + rc, tl.where(rc[:, None] > rc[None, :], b_a * ad, 0.0)
    )
    store_block(aqk, row0, A_ROW, BC, BT, A_ROW * BC + rc, tl.where(rc[:, None] >= rc[None, :], qd, 0.0))
    if A_ROW >= 1:
        store_block(lmat, row0, A_ROW, BC, BT, (A_ROW - 1) * BC + rc, b_a * a1)
        store_block(aqk, row0, A_ROW, BC, BT, (A_ROW - 1) * BC + rc, q1)
    if A_ROW >= 2:
        store_block(lmat, row0, A_ROW, BC, BT, (A_ROW - 2) * BC + rc, b_a * a2)
        store_block(aqk, row0, A_ROW, BC, BT, (A_ROW - 2) * BC + rc, q2)
    if A_ROW >= 3:
        store_block(lmat, row0, A_ROW, BC, BT, (A_ROW - 3) * BC + rc, b_a * a3)
        store_block(aqk, row0, A_ROW, BC, BT, (A_ROW - 3) * BC + rc, q3)
    for c in range(A_ROW + 1, BT // BC):  # the blocks right of the diagonal
        store_block(aqk, row0, A_ROW, BC, BT, c * BC + rc, tl.zeros([BC, BC], dtype=tl.float32))


@jit(do_not_specialize=["NT", "N0", "CS", "CN"])
def gram16_kernel(
    q, k, g, beta, qg, aqk, lmat, chunks, T, H, HV, K, NT, NCH, scale, N0, CS, CN,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr, PREC: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """One program per (chunk, value head): the chunk's ten 16 x 16 blocks of A and Aqk on and below the
    diagonal (twenty accumulators), KC key columns at a time, each key block loaded once per step, and qg.
    Writes qg, Aqk whole and L = Diag(beta) A into lmat (`_store_l_aqk`). Block (a, c < a) is anchored at the
    end boundary of block c (`_pair`, both exponents <= 0), the diagonal blocks at their middle row or in
    the exact pairwise form (`diag_grams`). The arguments are those of chunk_fwd.py's `_chunk_gram_kernel`."""
    tl.static_assert(BT == 4 * BC)
    i_hv, i_h, t0, n_t, row0 = chunk_program(chunks, T, NT, H, HV, NCH, N0, CS, CN, BT, IS_VARLEN)
    q_h = q + t0 * H * K + i_h * K
    k_h = k + t0 * H * K + i_h * K
    g_h = g + t0 * HV * K + i_hv * K
    beta_h = beta + t0 * HV + i_hv
    rc = tl.arange(0, BC)
    t_0, t_1, t_2, t_3 = rc, BC + rc, 2 * BC + rc, 3 * BC + rc
    z = tl.zeros([BC, BC], dtype=tl.float32)
    a10, a20, a21, a30, a31, a32 = z, z, z, z, z, z
    q10, q20, q21, q30, q31, q32 = z, z, z, z, z, z
    a00, a11, a22, a33, q00, q11, q22, q33 = z, z, z, z, z, z, z, z
    for kc in range(0, BK, KC):
        ck = kc + tl.arange(0, KC)
        k0, k1, k2, k3, l0, l1, l2, l3, s0, s1, s2, c0, c1, c2 = _key_blocks(k_h, g_h, ck, H, HV, K, n_t, BC)
        q0 = load_rows(q_h, t_0, H * K, ck, K, n_t).to(tl.float32) * scale
        q1 = load_rows(q_h, t_1, H * K, ck, K, n_t).to(tl.float32) * scale
        x, y = _pair(k1, q1, l1, c0, PREC)
        a10, q10 = a10 + x, q10 + y
        q2 = load_rows(q_h, t_2, H * K, ck, K, n_t).to(tl.float32) * scale
        x, y = _pair(k2, q2, l2 + s1, c0, PREC)
        a20, q20 = a20 + x, q20 + y
        x, y = _pair(k2, q2, l2, c1, PREC)
        a21, q21 = a21 + x, q21 + y
        q3 = load_rows(q_h, t_3, H * K, ck, K, n_t).to(tl.float32) * scale
        x, y = _pair(k3, q3, l3 + s1 + s2, c0, PREC)
        a30, q30 = a30 + x, q30 + y
        x, y = _pair(k3, q3, l3 + s2, c1, PREC)
        a31, q31 = a31 + x, q31 + y
        x, y = _pair(k3, q3, l3, c2, PREC)
        a32, q32 = a32 + x, q32 + y
        x, y = diag_grams(k0, q0, l0, BC, PREC)
        a00, q00 = a00 + x, q00 + y
        x, y = diag_grams(k1, q1, l1, BC, PREC)
        a11, q11 = a11 + x, q11 + y
        x, y = diag_grams(k2, q2, l2, BC, PREC)
        a22, q22 = a22 + x, q22 + y
        x, y = diag_grams(k3, q3, l3, BC, PREC)
        a33, q33 = a33 + x, q33 + y
        store_block(qg, row0, 0, BC, BK, ck, q0 * tl.exp2(l0))
        store_block(qg, row0, 1, BC, BK, ck, q1 * tl.exp2(l1 + s0))
        store_block(qg, row0, 2, BC, BK, ck, q2 * tl.exp2(l2 + s0 + s1))
        store_block(qg, row0, 3, BC, BK, ck, q3 * tl.exp2(l3 + s0 + s1 + s2))
    _store_l_aqk(lmat, aqk, beta_h, row0, n_t, HV, a00, z, z, z, q00, z, z, z, 0, BT, BC)
    _store_l_aqk(lmat, aqk, beta_h, row0, n_t, HV, a11, a10, z, z, q11, q10, z, z, 1, BT, BC)
    _store_l_aqk(lmat, aqk, beta_h, row0, n_t, HV, a22, a21, a20, z, q22, q21, q20, z, 2, BT, BC)
    _store_l_aqk(lmat, aqk, beta_h, row0, n_t, HV, a33, a32, a31, a30, q33, q32, q31, q30, 3, BT, BC)


def blocks16_forward(q, k, v, g, beta, scale, initial_state, output_final_state, **knobs):
    """`chunk_kda_fwd` with `gram16_kernel` as its gram kernel: the forward before the gram kernel multiplied
    64-row tiles. Same arguments (and tuning knobs, `info` among them) and result as `chunk_kda_fwd`."""
    return chunk_kda_fwd(
        q, k, v, g, beta, scale, initial_state, output_final_state, gram_kernel=gram16_kernel, **knobs
    )


# ---------------------------------------------------------------------------------------------------------
# The ladder: every version of the forward, in the order the chapter builds them

# name -> (launcher, what this version changed). Every launcher takes validated inputs
# (q, k, v, g, beta, scale, initial_state, output_final_state) and `info=` (a dict that receives the compiled
# kernels' registers), and returns (o, final_state).
LADDER = {
    "v0": (
        v0_forward,
        "one program per chunk holds all 64 rows; A and Aqk one key channel at a time with whole pairwise "
        "decays; (I + L)^-1 by 64-row forward substitution; one program per head carries the whole state",
    ),
    "blocks16": (
        blocks16_forward,
        "three prepare kernels and a scan: A and Aqk as one anchored tensor-core product per 16 x 16 block "
        "(gram16_kernel, twenty accumulators), (I + L)^-1 from 16 x 16 blocks, w and u as whole-chunk "
        "products, 16-bit intermediates, the state split over blocks of value columns",
    ),
    "chunk_kda": (
        chunk_kda_fwd,
        "kda_edu.kernels.chunk: as blocks16, but the gram kernel multiplies whole 64-row tiles (two 64 x 64 "
        "accumulators): three masked products left of the diagonal and one anchored product kept on the "
        "diagonal blocks, per step of key columns",
    ),
}


# ---------------------------------------------------------------------------------------------------------
# The 64-row gram kernel's products, in PyTorch

LOG2E = 1 / math.log(2)


def _block_gates(g: torch.Tensor, sub: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Base-2 gate cumsums within each block of `sub` rows (l, `[..., C, K]`) and the gate sum of each
    block (s, `[..., C / sub, K]`), from natural-log gates `[..., C, K]`."""
    lb = (g * LOG2E).unflatten(-2, (-1, sub)).cumsum(-2)
    return lb.flatten(-3, -2), lb[..., -1, :]


def left_of_diagonal(q, k, g, c: int, sub: int = SUB) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks (a, c) of A and Aqk for every row block a > c, as `_left_of_diagonal` forms them: one product of
    all C rows against all C columns, every row outside the blocks after c and every column outside block c
    scaled by 2^-inf = 0.

    q (scaled), k: `[..., C, K]`; g: the chunk's natural-log gates `[..., C, K]`. Row i (in block a > c) is
    scaled by 2^(the gates from the end of block c to i), column j (in block c) by 2^(the gates after j within
    block c): both exponents <= 0. Returns `(A_c, Aqk_c)`, `[..., C, C]`, zero outside blocks (a > c, c).
    """
    l, s = _block_gates(g, sub)
    blk = (torch.arange(k.shape[-2], device=k.device) // sub)[:, None]  # each row's block, [C, 1]
    between = torch.cat([torch.zeros_like(s[..., :1, :]), s.cumsum(-2)], -2)  # gates of the blocks before b
    row_exp = l + between[..., blk[:, 0], :] - between[..., c + 1 : c + 2, :]
    col = k * torch.exp2(torch.where(blk == c, s[..., c : c + 1, :] - l, -math.inf))
    row_f = torch.exp2(torch.where(blk > c, row_exp, -math.inf))
    return (k * row_f) @ col.mT, (q * row_f) @ col.mT


def diagonal_product(q, k, g, sub: int = SUB) -> tuple[torch.Tensor, torch.Tensor]:
    """The anchored product the gram kernel keeps on the diagonal blocks, whole: every row and column scaled by
    2^(its gate cumsum from its own block's middle row), `(Mk, Mq)`, `[..., C, C]` (shapes as in
    `left_of_diagonal`). Inside a diagonal block, on and below the diagonal, both factors share one anchor and
    the entries are A's and Aqk's. Elsewhere they share none: entry (i, j) is the wanted decay times
    2^(m_c - m_a), m_a and m_c the cumsums at the middle rows of i's and j's blocks, or (above the diagonal) a
    decay that grows instead of shrinking; the kernel discards them."""
    l, _ = _block_gates(g, sub)
    mid = l[..., sub // 2 :: sub, :].repeat_interleave(sub, dim=-2)  # each row's block middle
    d = l - mid
    col = k * torch.exp2(-d)
    return (k * torch.exp2(d)) @ col.mT, (q * torch.exp2(d)) @ col.mT


def diagonal_spans(g: torch.Tensor, kc: int = 32, sub: int = SUB) -> torch.Tensor:
    """The largest |exponent| of the gram kernel's anchored diagonal product, in powers of two, per chunk and
    step of `kc` key columns: the largest gate sum from a row to its block's middle row, with the gates
    raised to GATE_FLOOR as the kernels load them. A step above `chunk_common.DIAG_LIMIT` takes the per-block path.

    g: natural-log gates `[B, T, HV, K]`. Returns `[B, HV, NT, ceil(K / kc)]`.
    """
    g = to_chunks(g.clamp(min=GATE_FLOOR[torch.float32]), CHUNK, torch.float64)  # [B, HV, NT, C, K]
    l, _ = _block_gates(g, sub)
    mid = l[..., sub // 2 :: sub, :].repeat_interleave(sub, dim=-2)
    span = (l - mid).abs().amax(dim=-2)  # [B, HV, NT, K]
    return torch.nn.functional.pad(span, (0, -span.shape[-1] % kc)).unflatten(-1, (-1, kc)).amax(dim=-1)


def gram64(q, k, g, sub: int = SUB) -> tuple[torch.Tensor, torch.Tensor]:
    """A (without beta; strictly lower triangular) and Aqk (lower triangular) as the 64-row gram kernel forms
    them on its hot path: the three `left_of_diagonal` products summed, plus the diagonal blocks of
    `diagonal_product` (selected, so that its other entries, however large, never enter)."""
    C = k.shape[-2]
    blk = torch.arange(C, device=k.device) // sub
    on_diag = blk[:, None] == blk[None, :]
    A, Aqk = 0, 0
    for c in range(C // sub - 1):
        x, y = left_of_diagonal(q, k, g, c, sub)
        A, Aqk = A + x, Aqk + y
    Mk, Mq = diagonal_product(q, k, g, sub)
    A, Aqk = A + torch.where(on_diag, Mk, 0.0), Aqk + torch.where(on_diag, Mq, 0.0)
    r = torch.arange(C, device=k.device)
    return torch.where(r[:, None] > r[None, :], A, 0.0), torch.where(r[:, None] >= r[None, :], Aqk, 0.0)


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

    (A single prepare kernel can solve for w and u this way; with B = I it gives X.)

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
    L and X are float32 and go through the x buffer: the gram kernel writes L whole (its 64 x 64 accumulator,
    zeros on and above the diagonal), the inverse kernel reads the blocks on and below the diagonal (on
    average (C / 16 + 1) / 2 blocks of 16 columns per row) and writes X whole (zeros above), the w/u kernel
    reads X whole. The w/u kernel reads k, g and beta again: a
    separate launch, long after the gram kernel read them (at the benchmark's shapes k and g alone are
    larger than the H200's 50 MB L2 cache), so the second read is counted as memory traffic.
    """
    between = mid_bytes * (3 * K + V + C) + 4 * K / C
    l_cols = (C // SUB + 1) * SUB / 2  # columns of L on and below the diagonal, per row on average
    return {
        "gram reads q, k, g, beta": in_bytes * (2 * K + 1) + 4 * K,
        "gram writes qg, Aqk, L": mid_bytes * (K + C) + 4 * C,
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


def gram_block_flops(K: int, C: int = CHUNK, sub: int = SUB) -> float:
    """FLOPs per token and head of the gram kernel's useful products: the blocks (a, c <= a) of A and Aqk,
    sub x sub each, over K key channels (what `gram16_kernel` multiplies; 2 FLOPs per multiply-add)."""
    nb = C // sub  # blocks of rows per chunk
    pairs = nb * (nb + 1) // 2  # blocks (a, c) with c <= a: A and Aqk each, [sub, K] x [K, sub]
    return pairs * 2 * 2 * sub * sub * K / C


def design_flops(K: int, V: int, C: int = CHUNK, sub: int = SUB) -> dict[str, float]:
    """FLOPs per token and value head of the four kernels, by phase, as they execute them (2 FLOPs per
    multiply-add; products of whole tiles counted whole, their zeros included).

    The gram kernel's hot path: per step of key columns, for each column block c < C / sub - 1 a pair of
    C x C products (A and Aqk) whose rows and columns outside blocks (a > c, c) are zeros, and one anchored
    pair of which only the diagonal blocks are kept (`left_of_diagonal`, `diagonal_product`); its per-block
    path for very strong gates is not counted. `gram_block_flops` is the useful part.
    """
    nb = C // sub  # blocks of rows per chunk
    return {
        "gram: A, Aqk left of the diagonal (masked)": (nb - 1) * 2 * 2 * C * C * K / C,
        "gram: A, Aqk diagonal blocks (anchored)": 2 * 2 * C * C * K / C,
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


def counted_flops(fn) -> float:
    """FLOPs of the matrix products `fn()` runs, as PyTorch's counter (`FlopCounterMode`) finds them: two per
    multiply-add, element-wise work not counted."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def counted_design_flops(K: int = 128, V: int = 128, C: int = CHUNK, sub: int = SUB) -> dict[str, float]:
    """Per token and head, the FLOPs of the PyTorch forms of the design's matrix products as `counted_flops`
    finds them on four chunks of random float64 inputs: the entries of `design_flops` that are products (the
    scan's two as one, "scan"), and three forms the design does not use: the useful blocks of the gram
    products (chapter 6's `intra_chunk_matrices`), the whole-chunk inverse by the product form
    (`neumann_block_inverse` at n = C), and w and u by block forward substitution instead of the product with
    the whole X. The diagonal block inverses are element-wise: the counter does not see them."""
    from kda_edu.ops.chunkwise import random_inputs, state_passing

    n = 4 * C
    x = random_inputs(1, n, 1, K, V, dtype=torch.float64)
    c = chunk_inputs(**x, scale=None, chunk_size=C)
    A, Aqk = intra_chunk_matrices(c.q, c.k, c.gc, c.beta, sub)
    X = block_inverse(A, sub)
    rhs = c.beta[..., None] * torch.cat([c.k * c.gc.exp(), c.v], -1)
    w, u = (X @ rhs).split(K, -1)

    def count(fn):
        return counted_flops(fn) / n

    return {
        "gram: A, Aqk left of the diagonal (masked)": count(
            lambda: [left_of_diagonal(c.q, c.k, c.g, j, sub) for j in range(C // sub - 1)]
        ),
        "gram: A, Aqk diagonal blocks (anchored)": count(lambda: diagonal_product(c.q, c.k, c.g, sub)),
        "inverse: blocks of X left of the diagonal": count(lambda: block_inverse(A, sub)),
        "wu: X times [K * 2^gc, V]": count(lambda: X @ rhs),
        "scan": count(lambda: state_passing(c.q, c.k, c.gc, Aqk, w, u, c.q.new_zeros(1, 1, K, V))),
        "useful gram blocks": count(lambda: intra_chunk_matrices(c.q, c.k, c.gc, c.beta, sub)),
        "whole inverse by products": count(lambda: neumann_block_inverse(A)),
        "w, u by block substitution": count(lambda: block_forward_substitution(A, rhs, sub)),
    }


# ---------------------------------------------------------------------------------------------------------
# The committed benchmark


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
    "kda_edu chunk_kda": dict(marker="o", color=COLORS["kda_edu"]),
    "fla chunk_kda": dict(marker="s", color=COLORS["fla"]),
    "fla chunk_gated_delta_rule": dict(marker="^", color=COLORS["fla gated delta"]),
    "torch sdpa flash causal": dict(marker="x", color=COLORS["softmax"]),
    "kda_edu kda_chunked (PyTorch)": dict(marker="d", color=COLORS["reference"]),
}


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


# ---------------------------------------------------------------------------------------------------------
# The H200: which instructions the compiler picks

# At most 227 kB of shared memory per program (block) on every sm_90 GPU (H100, H200): chapter 7's limits.
SM90_SHARED_PER_BLOCK = H100.shared_per_block


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
# the TMA's bulk tensor copies, and the fences that make a store to shared memory visible to the tensor cores
# (a wgmma reads its B operand from shared memory only).
PTX_COUNTS = {
    "wgmma": "wgmma.mma_async",
    "mma.sync": "mma.sync",
    "TMA copies": "cp.async.bulk.tensor",
    "fences": "fence.proxy.async",
}

_BF16_MID = dict(w="*bf16", u="*bf16", qg="*bf16", kd="*bf16", aqk="*bf16", gl="*fp32")


def _compile_specs(K: int = 128, V: int = 128) -> dict:
    """The four kernels of `chunk_kda_fwd` as it launches them for bfloat16 inputs with K = V = 128 (warps
    (4, 1, 4) for gram, inverse and w/u, 32 key columns per step, bfloat16 operands in the gram and w/u
    kernels and tf32 in the inverse, a scan of 32 value columns with two pipeline stages; no state, no
    cu_seqlens, one piece of the time axis)."""
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
            N0=i32,
            CS=i32,
            CN=i32,
        ),
        constexprs=dict(BT=CHUNK, BC=SUB, BK=K, KC=32, PREC="bf16", IS_VARLEN=False),
        options=dict(num_warps=4),
    )
    inverse = dict(
        signature=dict(lmat="*fp32", NT=i32, NCH=i32, N0=i32, CS=i32, CN=i32),
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
            flags="*i32",
            chunks="*i32",
            T=i32,
            H=i32,
            HV=i32,
            K=i32,
            V=i32,
            NT=i32,
            NCH=i32,
            N0=i32,
            CS=i32,
            CN=i32,
        ),
        constexprs=dict(
            BT=CHUNK,
            BK=K,
            BV=V,
            KC=32,
            VC=32,
            PREC="bf16",
            U_PREC="bf16",
            IS_VARLEN=False,
            KD_TOTAL=True,
            CHECK=True,
        ),
        options=dict(num_warps=4),
    )
    scan = dict(
        signature={**_BF16_MID, "o": "*bf16", "h0": "*fp32", "ht": "*fp32", "cu_seqlens": "*i32",
                   "offsets": "*i32", **dict.fromkeys(["T", "HV", "K", "V", "NT", "NCH", "N0", "CS", "CN"], i32)},
        constexprs=dict(BT=CHUNK, BK=K, BVP=V, BV=32, USE_H0=False, STORE_HT=False, PREC="tf32", IS_VARLEN=False),
        options=dict(num_warps=4, num_stages=2),
    )  # fmt: skip
    return {"gram": gram, "inverse": inverse, "wu": wu, "scan": scan}


def _count_sm90(job: dict) -> dict[str, int]:
    """Compile one kernel for sm_90 (in a process where kda_edu builds compiled kernels) and count PTX_COUNTS."""
    if job["kernel"] in ("tile_product", "tile_product_tma"):
        kernel = tile_product if job["kernel"] == "tile_product" else tile_product_tma
        spec = dict(
            signature=dict(a="*bf16", b="*bf16", c="*fp32"),
            constexprs=dict(M=job["M"], N=job["N"], KK=job["K"]),
            options=dict(num_warps=job["warps"]),
        )
    elif job["kernel"] == "gram16":  # launched in the gram kernel's place, with its arguments
        kernel, spec = gram16_kernel, _compile_specs()["gram"]
    else:
        kernel, spec = KERNELS[job["kernel"]], _compile_specs()[job["kernel"]]
    signature = spec["signature"] | dict.fromkeys(spec["constexprs"], "constexpr")
    ptx = compile_source(kernel, signature, spec["constexprs"], spec["options"], (9, 0)).asm["ptx"]
    return {name: ptx.count(pattern) for name, pattern in PTX_COUNTS.items()}


def hopper_instructions(jobs: list[dict]) -> list[dict[str, int]]:
    """Compile kernels for the H200 (sm_90) without a GPU and count, in each one's PTX, the instructions of
    `PTX_COUNTS`. A job is `{"kernel": name}` with name one of "gram", "inverse", "wu", "scan" (chunk_kda's kernels as
    `_compile_specs` launches them) or "gram16" (`gram16_kernel`, launched as "gram"), or
    `{"kernel": "tile_product", "M": .., "N": .., "K": .., "warps": ..}` (or `"tile_product_tma"`).

    The compiler runs in a fresh Python (`kda_edu.kernels.offline.in_fresh_python`): where there is no GPU this
    process builds kda_edu's kernels for the interpreter, which cannot be compiled. Nothing is launched.
    """
    return in_fresh_python(__name__, "_count_sm90", jobs)


def _scan_pipeline_sm90(job: dict) -> dict:
    """Compile the scan as `chunk_kda_fwd` launches it for bfloat16, K = V = 128, with job["bv"] value columns
    and job["stages"] pipeline stages, for sm_90, with the 16-byte alignment a launch specialises its pointers
    and sizes on (without it the pipeliner cannot use asynchronous copies). Returns its shared memory in
    bytes and the `cp.async.wait_group` counts in its PTX, in order."""
    spec = _compile_specs()["scan"]
    constexprs = {**spec["constexprs"], "BV": job["bv"]}
    kernel = KERNELS["scan"]
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(kernel.arg_names)
        if name in spec["signature"] and (spec["signature"][name].startswith("*") or name in ("HV", "K", "V"))
    }
    signature = spec["signature"] | dict.fromkeys(constexprs, "constexpr")
    options = {**spec["options"], "num_stages": job["stages"]}
    compiled = compile_source(kernel, signature, constexprs, options, (9, 0), attrs=aligned)
    waits = [int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+);", compiled.asm["ptx"])]
    return {"shared": compiled.metadata.shared, "waits": waits}


def scan_pipeline(stages: list[int], bv: int = 32) -> list[dict]:
    """For each pipeline depth in `stages`: the scan compiled for the H200 (sm_90) without a GPU, as
    `_scan_pipeline_sm90` describes, in a fresh Python as `hopper_instructions` does."""
    return in_fresh_python(__name__, "_scan_pipeline_sm90", [dict(stages=s, bv=bv) for s in stages])


def chapter_launches(capability: tuple[int, int]) -> list[tuple]:
    """The launches of the chapters' own kernels (chapter 7's primer, chapter 8's first kernels and tile
    experiments; not the library's kernels they launch too), in float32 and in the 16-bit dtype the chapters use on that GPU (`kda_edu.device`);
    chapter 8's tile product through the TMA only for 9.0, the only GPU the chapter builds it for."""
    from kda_edu.chapters import ch07_primer as ch07
    from kda_edu.device import choose_dtype
    from kda_edu.kernels.offline import meta_kda_inputs, recorded_launches

    ch08 = sys.modules[__name__]

    low = choose_dtype(None, True, tuple(capability), tuple(capability) >= (8, 0))
    with recorded_launches(capability) as launches:
        for dtype in (torch.float32, low):
            meta = dict(dtype=dtype, device="meta")
            x = torch.empty(4096, **meta)
            ch07.vector_add(x, x)
            ch07.row_softmax(torch.empty(8, 100, **meta))
            ch07.chunk_cumsum(torch.empty(1, 256, 2, 64, **meta))
            a = torch.empty(2, 64, 64, **meta)
            for precision in (None, "ieee") if dtype == torch.float32 else (None,):
                ch07.batched_matmul(a, a, input_precision=precision)
                ch07.chunked_linear_attention(*(torch.empty(1, 128, 2, 64, **meta) for _ in range(3)))
            q, k, v, g, beta, state = meta_kda_inputs(dtype, T=128, K=64, V=64)
            v0_forward(q, k, v, g, beta, 0.125, state, True)
            ch08.blocks16_forward(q, k, v, g, beta, 0.125, state, True)
            # (not `block_pointer_copy`: the chapter shows that Triton no longer builds block pointers)
            tile = torch.empty(64, 64, dtype=low, device="meta")
            kernels = [ch08.tile_product] + ([ch08.tile_product_tma] if tuple(capability) >= (9, 0) else [])
            for kernel in kernels:
                kernel[(1,)](tile, tile, torch.empty(64, 64, device="meta"), M=64, N=64, KK=64)
    return [launch for launch in launches if launch[0].fn.__module__.startswith("kda_edu.chapters.")]
