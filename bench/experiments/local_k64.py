"""Issue 20 experiment: chunk_bwd.py's `_local_k_kernel` with 64-row tile products instead of 16-row ones.

`_local_k_kernel` (one program per (chunk, value head, block of BK key channels)) walks the chunk's four 16-row
blocks and multiplies 16-row tiles: on Hopper every such product is a per-warp `mma.sync`, and the kernel was
measured bound by the number of instructions it issues. `_local_k64_kernel` computes the same outputs from
products of whole 64-row tiles (M = 64: the shape of Hopper's warpgroup `wgmma`), as chunk.py's
`_chunk_gram_kernel` does for the forward. Same arguments, grid and outputs: it is swapped in with
`mock.patch.object(chunk_bwd, "_local_k_kernel", _local_k64_kernel)` (`chunk_kda_bwd64` below).

The maths (chunk_bwd.py's docstring): for a gated Gram matrix M_ij = sum_c a_ic b_jc 2^(gates j+1 .. i) (base-2
gates; A: a = beta k, Aqk: a = scale q; b = k for both),

    da_i = sum_j dM_ij b_j 2^(gates j+1 .. i),   db_j = sum_i dM_ij a_i 2^(gates j+1 .. i),   dgc = a da - b db,

with dA (strictly lower; `_local_v_kernel`'s NKB key-block shares) and dAqk (lower, diagonal included). With
blk(i) = i // 16, l_i the gates from the first row of i's block to i, after_j the gates after j to the end of
j's block and s_b the gate sum of block b, every product is (a masked 64 x 64 tile of dM) @ (64 x BK):

* rows' side, left of the diagonal: row block a anchored at its first row. The pair (i, j), blk(j) < a = blk(i),
  decays by 2^l_i 2^colx_j, colx_j = after_j + s_{blk(j)+1} + ... + s_{a-1} (both <= 0). da = 2^l * sum over
  a = 1, 2, 3 of (dM's rows of block a) @ (k 2^colx, zero from block a on): one accumulator through three
  products (per matrix; dA's shares each a product of their own).
* columns' side, left of the diagonal: column block c anchored at its end. The pair decays by 2^after_j
  2^rowx_i, rowx_i = s_{c+1} + ... + s_{blk(i)-1} + l_i. db = 2^after * sum over c = 2, 1, 0 of (dM's columns
  of block c)^T @ (a 2^rowx, zero up to block c): one accumulator through the products of both matrices.
* the four diagonal blocks at once, each anchored at its block's middle row as `_diag_gram_bwd`'s anchored
  branch (d_i = the gates 1 .. i of i's block, row 0's left out, minus the same at row 8; |d| <= the
  half-block gate sum): da += 2^d * (dM's diagonal blocks) @ (k 2^-d), db += 2^-d * (...)^T @ (a 2^d). The
  entries across two blocks would pair two anchors: they are zeroed in dM, never formed.

Anchoring the rows' side at the row block and the columns' side at the column block puts the factor that
differs from product to product on the operand (k 2^colx, a 2^rowx) and the one they share on the result
(2^l, 2^after), so each side accumulates in one tile through its chain of products: separate products, each
scaled before the sum, keep several wgmma accumulators (and their register operands) alive at once. For the
same reason
each dM tile is loaded straight into its product, masked by the load (wgmma then reads it from shared memory;
a tile summed or converted in registers is a register operand, alive while its product runs): dA's shares are
separate products, and dAqk, in the inputs' 16-bit dtype on a GPU, multiplies in that dtype against the other
operand split into two 16-bit parts (`_mm_dM`, SPLIT16: about 16 mantissa bits against tf32's 11, and exact
on dAqk's side). dA and float32 dAqk multiply in PREC (the launcher's: tf32 for 16-bit inputs, "ieee" for
float32), all accumulation float32. Per program that is 3 (rows) + 3 (columns) + 2 (diagonal) products per
dM tile: 24 with NKB = 2 shares (8 of them 16-bit pairs with SPLIT16), against `_local_k_kernel`'s 12 of
16 x 64 x BK or 64 x 16 x BK (the dA shares summed first) and 16 of 16 x 16 x BK. The loops over a and c are
run-time loops: unrolled, the compiler hoists every load of dM to the top (each a 64 x 64 tile in registers).

Every exponent is a sum of consecutive gates (within-block scans of the gates, block sums added as the loops
go), never the difference of two cumsums: after a reset (a gate at GATE_FLOOR, -151 in base 2) such a
difference keeps ~1e-5 of its value. after_j is a reverse scan of the next rows' gates (a second load of the
gate tile, one row down), as `_local_k_block` builds it.

Two other paths, per program: when some block's half-block span passes DIAG_LIMIT (strong gates, a reset
inside a block), the diagonal blocks come from `_diag_gram_bwd` one block at a time (anchored or exact pairwise,
as `_local_k_kernel`), added to memory before the products above (which then skip theirs). When a gate, key,
query or beta of the program is NaN or inf, the program runs `_local_k_kernel`'s own per-block code
(`_local_k_block`), so that a bad value spreads exactly as it does there (a product over a masked tile turns a
NaN anywhere in the other operand into NaN in every row). A NaN in dM alone (from v) stays in its own rows
and columns in the products above, as in `_local_k_kernel`.

Outputs: dq_out = dq + scale da_q, dk_out = dk + beta da_k + db, dbeta's share sum_c k da_k, and dg = the reverse
cumsum of dgc + beta k da_k + scale q da_q - k db with the chunk-end terms on the last row, 0 where the gate was
below GATE_FLOOR.

`python bench/experiments/local_k64.py`: the check under Triton's interpreter (float32: every gradient against
`_local_k_kernel` and against the float64 loop). `--sm90`: registers, spills and instruction counts compiled
offline for sm_90a, beside `_local_k_kernel`. Timing on the H200: `bench/experiments/bench_local_k64.py`.

Status (session 17): the interpreter checks pass; compiled offline for sm_90a it spills heavily (1.5 KB at
32 key channels and 4 warps, against 8 bytes for `_local_k_kernel`), and it has not run on a GPU yet (no
device time was left). bench/NOTES.md has the offline numbers and the plan.
"""

import argparse
import functools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kda_edu.kernels import chunk_bwd, chunk_kda
from kda_edu.kernels._backend import jit
from kda_edu.kernels.chunk import (
    DIAG_LIMIT,
    KERNEL_GATE_FLOOR,
    _block_cumsum,
    _per_block,
    _row,
    base2_gates,
    chunk_span,
    load_rows,
)
from kda_edu.kernels.chunk_bwd import (
    _block_inputs,
    _diag_gram_bwd,
    _local_k_block,
    _rows_of_block,
    _sum_shares,
)
from kda_edu.ops.kda import kda_recurrent


@jit
def _block_cumsum_rev(x, BC: tl.constexpr):
    """Reverse cumsum of x [4 * BC, BK] up each BC-row block separately (from each block's last row)."""
    blocks = tl.reshape(x, [x.shape[0] // BC, BC, x.shape[1]])
    return tl.reshape(tl.cumsum(blocks, axis=1, reverse=True), x.shape)


@jit
def _mm_dM(dM, offs, mask, b, acc, N: tl.constexpr, stride, PREC: tl.constexpr, SPLIT16: tl.constexpr):
    """acc + (the sum of N tiles at dM + offs + i * stride, zero outside mask) @ b, in float32 accumulation.

    Each tile is loaded straight into its product, so that Hopper's wgmma reads it from shared memory: a tile
    computed in registers (a sum of shares, a conversion) becomes a register operand of wgmma, alive while
    its product runs. A float32 tile (dA's shares; dAqk for float32 inputs) multiplies b in PREC, as in
    `_local_k_kernel`. A 16-bit tile (dAqk for 16-bit inputs, exact in its dtype) with SPLIT16 multiplies b
    split into two parts of its dtype, b = hi + lo, which keep about 16 of b's 24 mantissa bits (tf32: 11);
    without SPLIT16 it is converted to float32 (a register operand) and multiplies b in PREC."""
    for i in tl.static_range(N):
        x = tl.load(dM + i * stride + offs, mask=mask, other=0.0)
        if x.dtype == tl.float32 or not SPLIT16:
            acc = tl.dot(x.to(tl.float32), b, acc=acc, input_precision=PREC)
        else:
            hi = b.to(x.dtype)
            acc = tl.dot(x, hi, acc=acc)
            acc = tl.dot(x, (b - hi.to(tl.float32)).to(x.dtype), acc=acc)
    return acc


@jit
def _chunk_tiles(q_h, k_h, g_h, b_h, ck, H, HV, K, n_t, scale, BT: tl.constexpr, BC: tl.constexpr):
    """The chunk's rows in key columns ck: k, scale q, beta ([BT, 1]) and the gate exponents, each a sum of
    consecutive base-2 gates: l, the gates from the first row of i's block to i (on a block's last row, the
    block's gate sum); after, the gates after j to the end of its block (the next rows' gates, scanned up); d,
    the gates 1 .. i of i's block minus the same at its middle row (row 0's gate left out, so that a reset
    there costs no precision). Zeros past n_t (the gates there are 0). Also `finite`:
    False where a gate, key, query or beta is NaN or inf (a gate of -inf is a reset, raised to GATE_FLOOR)."""
    rows = tl.arange(0, BT)
    blk = (rows // BC)[:, None]
    k_t = load_rows(k_h, rows, H * K, ck, K, n_t).to(tl.float32)
    qs = load_rows(q_h, rows, H * K, ck, K, n_t).to(tl.float32) * scale
    beta_t = tl.load(b_h + rows * HV, mask=rows < n_t, other=0.0).to(tl.float32)[:, None]
    g2 = base2_gates(load_rows(g_h, rows, HV * K, ck, K, n_t))
    l = _block_cumsum(g2, BC)
    g_next = base2_gates(load_rows(g_h, rows + 1, HV * K, ck, K, n_t))
    after = _block_cumsum_rev(tl.where((rows % BC == BC - 1)[:, None], 0.0, g_next), BC)
    lx = _block_cumsum(tl.where((rows % BC == 0)[:, None], 0.0, g2), BC)
    d = lx - _per_block(blk, _row(lx, BC // 2), _row(lx, BC + BC // 2), _row(lx, 2 * BC + BC // 2),
                        _row(lx, 3 * BC + BC // 2))  # fmt: skip
    finite = (tl.abs(g2) < float("inf")) & (tl.abs(beta_t * k_t) < float("inf")) & (tl.abs(qs) < float("inf"))
    return k_t, qs, beta_t, l, after, d, finite


@jit
def _exact_diagonal_bwd(
    dA_part, dAqk, q_h, k_h, g_h, b_h, c, ck, H, HV, K, n_t, scale, a_stride,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, NKB: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """The diagonal blocks one at a time, by `_diag_gram_bwd` (anchored or exact pairwise per block, as
    `_local_k_kernel`) on each block reloaded, its [BC, BK] results placed into [BT, BK] tiles."""
    NB: tl.constexpr = BT // BC
    rc = tl.arange(0, BC)
    da_k = tl.zeros([BT, BK], dtype=tl.float32)
    da_q = tl.zeros([BT, BK], dtype=tl.float32)
    db = tl.zeros([BT, BK], dtype=tl.float32)
    for a in range(NB):
        ta = a * BC + rc
        k_a, qs_a, g_a, beta_a = _block_inputs(q_h, k_h, g_h, b_h, ta, ck, H, HV, K, n_t, scale)
        m_a = (c * BT + ta)[:, None] * BT + ta[None, :]
        dA_a = _sum_shares(dA_part, m_a, a_stride, NKB)
        dQ_a = tl.load(dAqk + m_a).to(tl.float32)
        x, y, z = _diag_gram_bwd(dA_a, dQ_a, beta_a[:, None] * k_a, qs_a, k_a, g_a, BC, PREC)
        da_k += _rows_of_block(x, a, NB, BC, BK)
        da_q += _rows_of_block(y, a, NB, BC, BK)
        db += _rows_of_block(z, a, NB, BC, BK)
    return da_k, da_q, db


@jit
def _add_to(ptr, mask, x):
    """*ptr += x where mask (read-modify-write of a tile this program owns)."""
    tl.store(ptr, tl.load(ptr, mask=mask, other=0.0) + x, mask=mask)


@jit
def _finish(dk_c, dk_out_c, dgc_c, g_h, kt, km, end, k_t, db, dk_add, dgc_add, BT: tl.constexpr):
    """The last writes: dk_out = dk + dk_add + db, and dg = the reverse cumsum of dgc + dgc_add - k db with the
    chunk-end terms on the last row (0 where the gate was below GATE_FLOOR: raised to it, it has no effect)."""
    dk_new = tl.load(dk_c + kt, mask=km, other=0.0) + dk_add + db
    tl.store(dk_out_c + kt, dk_new.to(dk_out_c.dtype.element_ty), mask=km)
    dgc_t = tl.load(dgc_c + kt, mask=km, other=0.0) + dgc_add - k_t * db
    dgc_t = tl.where((tl.arange(0, BT) == BT - 1)[:, None], dgc_t + end[None, :], dgc_t)
    dg = tl.cumsum(dgc_t, axis=0, reverse=True)
    below = tl.load(g_h + kt, mask=km, other=0.0).to(tl.float32) < KERNEL_GATE_FLOOR
    tl.store(dgc_c + kt, tl.where(below, 0.0, dg), mask=km)


@jit(do_not_specialize=["NT"])
def _local_k64_kernel(
    q, k, g, beta, dA_part, dAqk, dgc_end,  # inputs from _local_v_kernel; dA as NKB shares, a_stride apart
    dq, dk, dgc,  # partial gradients (dgc is completed in place and becomes dg)
    dq_out, dk_out,  # the finished dq, dk: the inputs' dtype when HV == H, else dq, dk again
    dbeta_part,  # float32 [cdiv(K, BK), B * T * HV]: this key block's share of dbeta (zeros on entry)
    chunks,  # varlen only: the chunk table
    T, H, HV, K, NT, NCH, scale, part_stride, a_stride,  # part_stride = B * T * HV
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BKP: tl.constexpr, PREC: tl.constexpr,
    IS_VARLEN: tl.constexpr, NKB: tl.constexpr, SPLIT16: tl.constexpr = True,
):  # fmt: skip
    """Per (chunk, value head, block of BK key channels): `_local_k_kernel`'s outputs from 64-row products
    (module docstring): the gradients through the gated Gram matrices A and Aqk, then dg."""
    tl.static_assert(BT == 4 * BC)
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_k = tl.program_id(2)
    i_h = i_hv // (HV // H)
    t0, t_end = chunk_span(i_c, chunks, T, NT, BT, IS_VARLEN)
    n_t = (t_end - t0).to(tl.int32)
    rows = tl.arange(0, BT)
    blk = (rows // BC)[:, None]  # each row's 16-row block, [BT, 1]
    ck = i_k * BK + tl.arange(0, BK)
    q_h = q + t0 * H * K + i_h * K
    k_h = k + t0 * H * K + i_h * K
    g_h = g + t0 * HV * K + i_hv * K
    b_h = beta + t0 * HV + i_hv
    c = (i_hv * NCH + i_c).to(tl.int64)
    # Pointers moved to the chunk's first element, so that the per-element offsets stay 32-bit: the [B, T, HV, K]
    # gradients (dq_out and dk_out alike when HV == H) at + kt, this chunk's dA shares and dAqk at + m_off.
    k_off = t0 * HV * K + i_hv * K
    kt = rows[:, None] * HV * K + ck[None, :]
    km = (rows[:, None] < n_t) & (ck[None, :] < K)
    dq_c, dk_c, dgc_c = dq + k_off, dk + k_off, dgc + k_off
    db_p = dbeta_part + i_k * part_stride + (t0 + rows) * HV + i_hv
    end = tl.load(dgc_end + c * BKP + ck)

    k_t, qs, beta_t, l, after, d, finite = _chunk_tiles(q_h, k_h, g_h, b_h, ck, H, HV, K, n_t, scale, BT, BC)
    if tl.max(tl.max(tl.where(finite, 0.0, 1.0), axis=1), axis=0) > 0.0:
        # A NaN or inf input: `_local_k_kernel`'s own per-block code, so that it spreads exactly as there.
        db_all = tl.zeros([BT, BK], dtype=tl.float32)
        col_x = tl.zeros([BT, BK], dtype=tl.float32)
        for a in range(BT // BC):
            db_all, col_x = _local_k_block(
                a, q_h, k_h, g_h, b_h, dA_part, dAqk, dq, dk, dgc, dq_out, dbeta_part, k_t, db_all, col_x,
                c, t0, k_off, ck, H, HV, K, n_t, scale, i_k, i_hv, part_stride, a_stride,
                BT, BC, BK, NKB, PREC,
            )  # fmt: skip
        tl.debug_barrier()  # the blocks' stores into dk and dgc are seen by every thread below
        zero = tl.zeros([BT, BK], dtype=tl.float32)
        _finish(dk_c, dk_out + k_off, dgc_c, g_h, kt, km, end, k_t, db_all, zero, zero, BT)
    else:
        # The diagonal blocks: anchored in the products below, unless some block's half-block span passes
        # DIAG_LIMIT; then one block at a time first, their terms added to memory.
        too_large = tl.max(tl.max(tl.where(tl.abs(d) <= DIAG_LIMIT, 0.0, 1.0), axis=1), axis=0)
        diag_ok = too_large == 0.0
        if too_large > 0.0:
            x, y, z = _exact_diagonal_bwd(
                dA_part, dAqk, q_h, k_h, g_h, b_h, c, ck, H, HV, K, n_t, scale, a_stride, BT, BC, BK, NKB, PREC
            )  # fmt: skip
            _add_to(dq_c + kt, km, scale * y)
            _add_to(dk_c + kt, km, beta_t * x + z)
            _add_to(dgc_c + kt, km, beta_t * k_t * x + qs * y - k_t * z)
            tl.store(db_p, tl.sum(k_t * x, axis=1), mask=rows < n_t)
            tl.debug_barrier()
        d = tl.where(diag_ok, d, 0.0)
        dA_c, dQ_c = dA_part + c * BT * BT, dAqk + c * BT * BT
        m_off = rows[:, None] * BT + rows[None, :]  # dM_ij at m_off[i, j]
        t_off = rows[None, :] * BT + rows[:, None]  # dM_ij at t_off[j, i]: dM^T
        on_diag = blk == (rows // BC)[None, :]  # the diagonal blocks of a [BT, BT] tile
        zero = tl.zeros([BT, BK], dtype=tl.float32)

        # Rows' side. Row block a, anchored at its first row: row factor 2^l_i; the keys j before the block
        # scaled by 2^colx_j, colx_j = the gates j+1 .. end of block a - 1 (after_j plus the sums of the whole
        # blocks between, added as a grows): one chain over a = 1, 2, 3, each product of dM's rows of block a.
        # A loop (not unrolled), so that each step's loads of dM stay in it.
        acc_k, acc_q, colx = zero, zero, after
        for a in range(1, BT // BC):
            b_a = tl.where(blk < a, k_t * tl.exp2(colx), 0.0)
            acc_k = _mm_dM(dA_c, m_off, blk == a, b_a, acc_k, NKB, a_stride, PREC, SPLIT16)
            acc_q = _mm_dM(dQ_c, m_off, blk == a, b_a, acc_q, 1, 0, PREC, SPLIT16)
            colx = tl.where(blk < a, colx + _row(l, a * BC + BC - 1), colx)
        kd = k_t * tl.exp2(-d)
        ed = tl.exp2(d)
        da_k = tl.exp2(l) * acc_k + tl.where(
            diag_ok, ed * _mm_dM(dA_c, m_off, on_diag, kd, zero, NKB, a_stride, PREC, SPLIT16), 0.0
        )
        da_q = tl.exp2(l) * acc_q + tl.where(
            diag_ok, ed * _mm_dM(dQ_c, m_off, on_diag, kd, zero, 1, 0, PREC, SPLIT16), 0.0
        )
        tl.store(
            db_p, tl.load(db_p, mask=rows < n_t, other=0.0) + tl.sum(k_t * da_k, axis=1), mask=rows < n_t
        )
        dq_new = tl.load(dq_c + kt, mask=km, other=0.0) + scale * da_q
        tl.store(dq_out + k_off + kt, dq_new.to(dq_out.dtype.element_ty), mask=km)

        # Columns' side. Column block c, anchored at its end: column factor 2^after_j; the rows i after the
        # block scaled by 2^rowx_i, rowx_i = the gates from the end of block c to i (l_i plus the sums of the
        # whole blocks between, added as c falls): one chain over c = 2, 1, 0 and both matrices, each product
        # of dM's columns of block c (rows of dM^T).
        bk = beta_t * k_t
        acc_b, rowx = zero, l
        for cc in range(BT // BC - 1):
            cb = BT // BC - 2 - cc
            x_c = tl.where(blk > cb, tl.exp2(rowx), 0.0)
            acc_b = _mm_dM(dA_c, t_off, blk == cb, bk * x_c, acc_b, NKB, a_stride, PREC, SPLIT16)
            acc_b = _mm_dM(dQ_c, t_off, blk == cb, qs * x_c, acc_b, 1, 0, PREC, SPLIT16)
            rowx = tl.where(blk > cb, rowx + _row(l, cb * BC + BC - 1), rowx)
        dd_b = _mm_dM(dA_c, t_off, on_diag, bk * ed, zero, NKB, a_stride, PREC, SPLIT16)
        dd_b = _mm_dM(dQ_c, t_off, on_diag, qs * ed, dd_b, 1, 0, PREC, SPLIT16)
        db = tl.exp2(after) * acc_b + tl.where(diag_ok, tl.exp2(-d) * dd_b, 0.0)
        _finish(
            dk_c, dk_out + k_off, dgc_c, g_h, kt, km, end, k_t, db, beta_t * da_k, bk * da_k + qs * da_q, BT
        )


_chunk_kda_bwd = chunk_bwd.chunk_kda_bwd  # the launcher as imported, before anyone patches it


def chunk_kda_bwd64(*args, **kwargs):
    """`chunk_bwd.chunk_kda_bwd` with `_local_k64_kernel` in place of `_local_k_kernel` (same arguments)."""
    with mock.patch.object(chunk_bwd, "_local_k_kernel", _local_k64_kernel):
        return _chunk_kda_bwd(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# Check under Triton's interpreter (float32): every gradient against `_local_k_kernel` and the float64 loop.

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def make_inputs(B, T, H, HV, K, V, gate=-0.5, seed=0, n_states=None):
    """q, k (unit rows), v, g = gate * U(0, 1), beta, h0 ([n_states or B, HV, K, V]) as a dict; dO and dht."""
    gen = torch.Generator().manual_seed(seed)
    S = B if n_states is None else n_states
    x = dict(
        q=F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
        k=F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
        v=torch.randn(B, T, HV, V, generator=gen),
        g=gate * torch.rand(B, T, HV, K, generator=gen),
        beta=torch.rand(B, T, HV, generator=gen),
        h0=torch.randn(S, HV, K, V, generator=gen),
    )
    return x, torch.randn(B, T, HV, V, generator=gen), torch.randn(S, HV, K, V, generator=gen)


def gradients(fn, x, do, dht, dtype=torch.float32):
    """Gradients of sum(o * dO) + sum(ht * dht) with respect to q, k, v, g, beta, h0 (every input in `dtype`)."""
    xs = {n: t.detach().to(dtype).clone().requires_grad_() for n, t in x.items()}
    o, ht = fn(
        xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], initial_state=xs["h0"], output_final_state=True
    )
    ((o.double() * do.double()).sum() + (ht.double() * dht.double()).sum()).backward()
    return [xs[n].grad for n in ("q", "k", "v", "g", "beta", "h0")]


def loop_per_sequence(cu_seqlens):
    """`kda_recurrent` run on each sequence of a packed row alone (final states stacked), as one call."""
    bounds = cu_seqlens.tolist()

    def run(q, k, v, g, beta, initial_state, output_final_state):
        outs, states = [], []
        for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            part = (t[:, bos:eos] for t in (q, k, v, g, beta))
            o, ht = kda_recurrent(*part, initial_state=initial_state[n : n + 1], output_final_state=True)
            outs.append(o)
            states.append(ht)
        return torch.cat(outs, dim=1), torch.cat(states)

    return run


def kernel_gradients(x, do, dht, launcher, cu_seqlens=None, **knobs):
    """chunk_kda's gradients with `launcher` (chunk_kda_bwd or chunk_kda_bwd64, with `knobs`) as its backward."""
    fn = functools.partial(chunk_kda, cu_seqlens=cu_seqlens, check_inputs=False)
    with mock.patch.object(chunk_bwd, "chunk_kda_bwd", functools.partial(launcher, **knobs)):
        return gradients(fn, x, do, dht)


def rel(x, ref):
    """Relative norm error |x - ref| / |ref| (float64)."""
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def fallback_programs(g, lk_block, cu_seqlens=None, chunk=64, sub=16):
    """(programs of `_local_k64_kernel` that take the per-block diagonal path, all programs), from the gates as
    the kernel sees them: a program falls back when some 16-row block's gates 1 .. i, minus the same at its
    middle row, pass DIAG_LIMIT (in base 2) or are not finite. float32, the kernel's summation order aside."""
    B, T, HV, K = g.shape
    kb = min(max(16, triton.next_power_of_2(K)), lk_block)
    n_kb = triton.cdiv(K, kb)
    flat = g.reshape(B * T, HV, K).float()
    bounds = cu_seqlens.tolist() if cu_seqlens is not None else [b * T for b in range(B + 1)]
    base2 = flat.clamp_min(KERNEL_GATE_FLOOR.value) * math.log2(math.e)
    taken = total = 0
    for bos, eos in zip(bounds[:-1], bounds[1:], strict=True):
        for t0 in range(bos, eos, chunk):
            gc = torch.zeros(chunk, HV, n_kb * kb)
            gc[: min(chunk, eos - t0), :, :K] = base2[t0 : min(t0 + chunk, eos)]
            blocks = gc.view(chunk // sub, sub, HV, n_kb, kb).clone()
            blocks[:, 0] = 0.0  # row 0's gate never enters a pair of its block
            lx = blocks.cumsum(1)
            d = lx - lx[:, sub // 2 : sub // 2 + 1]
            unsafe = ~(d.abs() <= DIAG_LIMIT.value)
            per_program = unsafe.any(dim=(0, 1, 4))  # [HV, n_kb]
            taken += int(per_program.sum())
            total += per_program.numel()
    return taken, total


def _check_case(name, x, do, dht, cu_seqlens=None, tol_current=2e-6, **knobs):
    """All six gradients with `_local_k64_kernel` against `_local_k_kernel` and the float64 loop."""
    start = time.time()
    new = kernel_gradients(x, do, dht, chunk_kda_bwd64, cu_seqlens, **knobs)
    cur = kernel_gradients(x, do, dht, _chunk_kda_bwd, cu_seqlens, **knobs)
    loop = kda_recurrent if cu_seqlens is None else loop_per_sequence(cu_seqlens)
    ref = gradients(loop, x, do, dht, torch.float64)
    taken, total = fallback_programs(x["g"], knobs.get("lk_block", 32), cu_seqlens)
    print(
        f"{name}: {knobs or 'default knobs'}, per-block diagonal in {taken} of {total} programs ({time.time() - start:.0f} s)"
    )
    rows = {}
    for n, a, b, r in zip(NAMES, new, cur, ref, strict=True):
        assert torch.isfinite(a).all() and torch.isfinite(b).all(), (name, n)
        rows[n] = dict(new_vs_current=rel(a, b), new_vs_f64=rel(a, r), current_vs_f64=rel(b, r))
        e = rows[n]
        print(
            f"  {n:6s} new vs current {e['new_vs_current']:.2e}   new vs f64 {e['new_vs_f64']:.2e}   current vs f64 {e['current_vs_f64']:.2e}"
        )
        assert e["new_vs_current"] <= tol_current, (name, n, e)
        assert e["new_vs_f64"] <= max(1e-5, 1.5 * e["current_vs_f64"]), (name, n, e)
    return dict(rows=rows, fallback_programs=taken, programs=total)


def _check_nan(x, do, dht, bad, **knobs):
    """NaNs in batch 0 at the (input, step, channel) of `bad`; batch 1 is clean. The new kernel must be non-finite
    exactly where `_local_k_kernel` is and equal to it elsewhere. In exact arithmetic batch 1's gradients are
    finite, and so is batch 0's dq before the first NaN step t (dq_s = scale S_s dO_s needs only the steps up to
    s); both kernels give dq from the first row of t's 16-row block on as NaN (with a NaN gate, `_diag_gram_bwd`,
    which both run on that block, multiplies a NaN factor by the zeros above the diagonal). So batch 1 is held to
    the float64 loop on batch 1 alone, and batch 0's dq before t's block to the loop on batch 0's steps before t
    alone."""
    x = {n: t.clone() for n, t in x.items()}
    for name, t, ch in bad:
        x[name][0, t, 0, ch] = float("nan")
    new = kernel_gradients(x, do, dht, chunk_kda_bwd64, **knobs)
    cur = kernel_gradients(x, do, dht, _chunk_kda_bwd, **knobs)
    t_bad = min(t for _, t, _ in bad)
    clean = {n: t[1:] for n, t in x.items()}
    ref1 = gradients(kda_recurrent, clean, do[1:], dht[1:], torch.float64)
    before = {n: (t[:1, :t_bad] if n != "h0" else t[:1]) for n, t in x.items()}
    ref0_dq = gradients(kda_recurrent, before, do[:1, :t_bad], torch.zeros_like(dht[:1]), torch.float64)[0]
    print(f"NaN at (input, step, channel) {bad} of batch 0, batch 1 clean: {knobs or 'default knobs'}")
    out = {}
    for n, a, b, r in zip(NAMES, new, cur, ref1, strict=True):
        fa, fb = torch.isfinite(a), torch.isfinite(b)
        diff = ((a - b).double()[fb].norm() / b.double()[fb].norm().clamp_min(1e-30)).item()
        out[n] = dict(
            nonfinite_new=int((~fa).sum()),
            nonfinite_current=int((~fb).sum()),
            same_pattern=bool(torch.equal(fa, fb)),
            new_vs_current_where_finite=diff,
            batch1_new_vs_f64=rel(a[1], r[0]),
        )
        print(
            f"  {n:6s} "
            + "  ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}" for k, v in out[n].items())
        )
        assert out[n]["same_pattern"] and diff <= 2e-6, (n, out[n])
        assert torch.isfinite(a[1]).all() and out[n]["batch1_new_vs_f64"] <= 1e-5, (n, out[n])
    t_block = (
        t_bad // 16 * 16
    )  # bad steps in batch 0's first chunk: its 16-row blocks start at multiples of 16
    dq_new = new[0][0, :t_block]
    out["dq_before_nan_block"] = dict(
        steps=t_block,
        first_nonfinite_step=int(
            (~torch.isfinite(new[0][0])).reshape(x["g"].shape[1], -1).any(1).int().argmax()
        ),
        new_vs_f64=rel(dq_new, ref0_dq[0, :t_block]) if torch.isfinite(dq_new).all() else math.inf,
    )
    print(f"  dq of batch 0 before the NaN's 16-row block: {out['dq_before_nan_block']}")
    assert out["dq_before_nan_block"]["new_vs_f64"] <= 1e-5
    return out


@jit
def _split_product_kernel(dM, b, out, SPLIT16: tl.constexpr):
    """out = (dM's rows 16 .. 31) @ b by `_mm_dM`, for `_check_split_product`."""
    rows = tl.arange(0, 64)
    cols = tl.arange(0, 32)
    offs = rows[:, None] * 64 + rows[None, :]
    b_t = tl.load(b + rows[:, None] * 32 + cols[None, :])
    acc = tl.zeros([64, 32], dtype=tl.float32)
    acc = _mm_dM(dM, offs, (rows // 16 == 1)[:, None], b_t, acc, 1, 0, "ieee", SPLIT16)
    tl.store(out + rows[:, None] * 32 + cols[None, :], acc)


def _check_split_product():
    """`_mm_dM`'s 16-bit path (dAqk for 16-bit inputs on a GPU), which the kernel checks above never reach:
    the interpreter keeps every intermediate in float32. float16 here (the interpreter's bfloat16 products are
    unreliable, TOOLCHAIN.md; the code is the same): a 16-bit tile against b split into two 16-bit parts is
    within float32 rounding of the float64 product, where b rounded to float16 once is ~1e-4 off."""
    gen = torch.Generator().manual_seed(11)
    dM = torch.randn(64, 64, generator=gen).half()
    b = torch.randn(64, 32, generator=gen) * torch.rand(64, 32, generator=gen)
    ref = torch.zeros(64, 32, dtype=torch.float64)
    ref[16:32] = dM[16:32].double() @ b.double()
    out = {}
    for split in (True, False):
        got = torch.empty(64, 32)
        _split_product_kernel[(1,)](dM, b, got, SPLIT16=split)
        out[f"split16={split}"] = rel(got, ref)
    once = torch.zeros(64, 32, dtype=torch.float64)
    once[16:32] = dM[16:32].double() @ b.half().double()
    out["b rounded to float16 once"] = rel(once, ref)
    print(
        "16-bit dM products, relative error against float64: "
        + ", ".join(f"{k} {v:.1e}" for k, v in out.items())
    )
    assert out["split16=True"] <= 1e-6 and out["split16=False"] <= 1e-6 < out["b rounded to float16 once"]
    return out


def main_check():
    """Every case; prints each gradient's errors and asserts the tolerances (about 3 minutes on 2 cores)."""
    start = time.time()
    res = {"split_product": _check_split_product()}
    x, do, dht = make_inputs(1, 130, 1, 1, 32, 16, gate=-0.5)
    res["mild_T130"] = _check_case("mild_T130", x, do, dht)
    x, do, dht = make_inputs(1, 130, 1, 1, 32, 16, gate=-0.5, seed=1)
    x["g"][..., 16:] *= 24.0  # -12 U(0, 1) on the second half of the key channels
    res["strong_half_lk16"] = _check_case("strong_half_lk16", x, do, dht, lk_block=16)
    res["strong_half_lk32"] = _check_case("strong_half_lk32", x, do, dht)
    x, do, dht = make_inputs(1, 130, 1, 1, 32, 16, gate=-60.0, seed=8)
    res["gates_to_-60"] = _check_case("gates_to_-60", x, do, dht)
    x, do, dht = make_inputs(1, 130, 1, 1, 32, 16, gate=-0.5, seed=2)
    x["g"][:, [16, 48, 64, 112]] = -1000.0  # resets on the first row of a block: the anchored path stays
    res["resets_first_rows"] = _check_case("resets_first_rows", x, do, dht)
    x, do, dht = make_inputs(1, 130, 1, 1, 32, 16, gate=-0.1, seed=3)
    x["g"][:, 6::7] = -1000.0  # every 7 steps, over a chunk boundary
    x["g"][:, 16, 0, :5] = -1000.0
    x["g"][:, 90, 0, 3] = -math.inf
    res["resets_every_7_lk16"] = _check_case("resets_every_7_lk16", x, do, dht, lk_block=16)
    x, do, dht = make_inputs(1, 1, 1, 1, 16, 16, gate=-0.5, seed=4)
    res["T1"] = _check_case("T1", x, do, dht)
    x, do, dht = make_inputs(1, 70, 1, 2, 48, 40, gate=-0.5, seed=5)
    res["K48_V40_HV2_lk64"] = _check_case("K48_V40_HV2_lk64", x, do, dht, lk_block=64)
    res["K48_V40_HV2_lk16"] = _check_case("K48_V40_HV2_lk16", x, do, dht, lk_block=16)
    cu = torch.tensor([0, 50, 51, 190], dtype=torch.int32)
    x, do, dht = make_inputs(1, 190, 1, 2, 32, 16, gate=-0.5, seed=6, n_states=3)
    res["varlen_50_1_139"] = _check_case("varlen_50_1_139", x, do, dht, cu_seqlens=cu)
    x, do, dht = make_inputs(2, 130, 1, 1, 32, 16, gate=-0.5, seed=7)
    res["nan_gates"] = _check_nan(x, do, dht, bad=[("g", 37, 3), ("g", 92, 5)])
    res["nan_gate_first_row_lk16"] = _check_nan(x, do, dht, bad=[("g", 48, 0)], lk_block=16)
    res["nan_value"] = _check_nan(x, do, dht, bad=[("v", 37, 3)])
    print(f"all checks passed in {time.time() - start:.0f} s")
    return res


# ---------------------------------------------------------------------------------------------------------
# Offline compile for the H200 (sm_90a) on a machine without a GPU: registers, spills, PTX products.

_BF16_LAUNCH = dict(  # `chunk_kda_bwd`'s launch of the local_k kernel for bf16 inputs (dAqk: the bf16 Aqk buffer)
    q="*bf16", k="*bf16", g="*fp32", beta="*bf16", dA_part="*fp32", dAqk="*bf16", dgc_end="*fp32",
    dq="*fp32", dk="*fp32", dgc="*fp32", dq_out="*bf16", dk_out="*bf16", dbeta_part="*fp32", chunks="*i32",
    T="i32", H="i32", HV="i32", K="i32", NT="i32", NCH="i32", scale="fp32", part_stride="i32", a_stride="i32",
)  # fmt: skip
_TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _compile_sm90(job: dict) -> dict:
    """Compile one local_k kernel for sm_90a as `chunk_kda_bwd` launches it for bf16 inputs at K = V = 128
    (tf32 products, NKB = 2 dA shares), in a process whose kda_edu kernels are built compiled; count the PTX's
    wgmma and mma.sync, read registers and stack from the cubin (cuobjdump -res-usage) and the spill bytes from
    ptxas -v on the same PTX (Triton's bundled ptxas-blackwell: the other one rejects Triton 3.9's PTX 9.4),
    and count the SASS instructions (static: a loop body once). Triton 3.6 and its ptxas on the H200 allocate
    differently (bench/NOTES.md, session 14: offline spill bytes did not match the GPU's), so these compare
    kernels compiled alike, not what the GPU will run."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = {"current": chunk_bwd._local_k_kernel, "k64": _local_k64_kernel}[job["kernel"]]
    constexprs = dict(BT=64, BC=16, BK=job["BK"], BKP=128, PREC="tf32", IS_VARLEN=False, NKB=2)
    if job["kernel"] == "k64":
        constexprs["SPLIT16"] = job.get("split16", True)
    source = ASTSource(
        fn=kernel, signature=_BF16_LAUNCH | dict.fromkeys(constexprs, "constexpr"), constexprs=constexprs
    )
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=job["warps"], **({"num_stages": job["stages"]} if "stages" in job else {})),
    )
    ptx, cubin = compiled.asm["ptx"], compiled.asm["cubin"]
    out = dict(
        job,
        wgmma=ptx.count("wgmma.mma_async"),
        mma_sync=ptx.count("mma.sync"),
        shared_bytes=compiled.metadata.shared,
    )
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "k.cubin").write_bytes(cubin)
        Path(tmp, "k.ptx").write_text(ptx)
        usage = subprocess.run(
            [_TOOLS / "cuobjdump", "-res-usage", Path(tmp, "k.cubin")], capture_output=True, text=True
        ).stdout
        for key in ("REG", "STACK"):
            found = re.search(rf"{key}:(\d+)", usage)
            out[key.lower()] = int(found.group(1)) if found else None
        arch = re.search(r"\.target\s+(\S+)", ptx).group(1)
        ptxas = subprocess.run([_TOOLS / "ptxas-blackwell", "-v", f"--gpu-name={arch}", Path(tmp, "k.ptx"), "-o", Path(tmp, "v.cubin")], capture_output=True, text=True).stderr  # fmt: skip
        for name, pattern in (
            ("spill_store_bytes", r"(\d+) bytes spill stores"),
            ("spill_load_bytes", r"(\d+) bytes spill loads"),
        ):
            found = re.search(pattern, ptxas)
            out[name] = int(found.group(1)) if found else None
        sass = subprocess.run(
            [_TOOLS / "cuobjdump", "-sass", Path(tmp, "k.cubin")], capture_output=True, text=True
        ).stdout
        instructions = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
        out["sass_instructions"] = len(instructions)
        for op in ("HGMMA", "HMMA", "LDS", "STS", "LDL", "STL", "LDG", "STG", "BAR", "MUFU.EX2", "SHFL"):
            out[f"sass_{op}"] = sum(1 for i in instructions if i == op or i.startswith(op + "."))
    return out


def sm90_resources(jobs: list[dict]) -> list[dict]:
    """`_compile_sm90` for each job in a fresh Python where kda_edu builds compiled kernels (here they are built
    for the interpreter, which cannot be compiled); nothing is launched."""
    root = Path(__file__).resolve().parents[2]
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    code = (
        "import json, sys; import kda_edu.backend as b; b.INTERPRET = False\n"
        "import local_k64\n"
        "print(json.dumps([local_k64._compile_sm90(job) for job in json.loads(sys.argv[1])]))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, json.dumps(jobs)], env=env, capture_output=True, text=True
    )
    if run.returncode != 0:
        raise RuntimeError(f"compiling for sm_90a failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


SM90_JOBS = [
    dict(kernel=kern, BK=bk, warps=w)
    for bk, w in ((32, 4), (32, 8), (64, 4), (64, 8))
    for kern in ("current", "k64")
] + [dict(kernel="k64", BK=32, warps=4, split16=False), dict(kernel="k64", BK=32, warps=4, stages=1)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--sm90", action="store_true", help="compile offline for sm_90a and print resources instead"
    )
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    if args.sm90:
        res = []
        for job in SM90_JOBS:  # one process per kernel: a failed compile costs only its own row
            start = time.time()
            try:
                res += sm90_resources([job])
            except RuntimeError as e:
                res.append(dict(job, error=str(e)[-500:]))
            print(json.dumps(res[-1] | dict(seconds=round(time.time() - start))), flush=True)
    else:
        res = main_check()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
