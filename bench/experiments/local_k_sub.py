"""Issue 20 experiment: chunk_bwd.py's `_local_k_kernel` as one program per 16-row block of a chunk.

`_local_k_kernel` runs one program per (chunk, value head, block of BK key channels) and walks the chunk's four
16-row blocks one after the other, carrying [64, BK] column-side accumulators (db_all, col_x) through the walk.
On the H200 it is latency-bound: 255 registers, 12.4 % occupancy, 2.29 ms at (1, 8192, 32). Here the walk
becomes the grid: `_local_k_sub_kernel` runs one program per (chunk x 16-row block b, value head, key block),
each holding [16, 16] tiles of dA and dAqk and [16, BK] tiles of the chunk's inputs at a time, so that a
program needs fewer registers and more of them fit on a multiprocessor. (fla's `chunk_kda_bwd_kernel_intra`
cuts the work the same way; this code is written from the maths below, not from fla's.) A program owns the 16
rows of its block: it writes their dq, dk, dbeta share and dgc terms once, with no read-modify-write shared
with another program. dg, a reverse cumsum over the whole chunk, needs all four blocks done: a second small
kernel, `_dg_cumsum_kernel`, one program per (chunk, value head, key block), runs after.

The maths (chunk_bwd.py's docstring). For a gated Gram matrix M_ij = sum_c a_ic b_jc 2^(gates j+1 .. i)
(base-2 gates; A: a = beta k, dM = the sum of dA's NKB key-block shares; Aqk: a = scale q, dM = dAqk; b = k
for both),

    da_i = sum_j dM_ij b_j 2^(gates j+1 .. i),   db_j = sum_i dM_ij a_i 2^(gates j+1 .. i),   dgc = a da - b db.

For the program's block b, rows start = 16 b .. end = 16 b + 15 of the chunk:

1. Rows' side, the columns j before the block (skipped for b = 0), anchored at the block's start: the decay
   2^(gates j+1 .. i) = 2^(gates start .. i) * 2^(gates j+1 .. start-1). The row factor is the cumsum of the
   block's own gates (row start's included); the column factor the gates after j up to start - 1 (gate j+1
   read on row j, one row down). Both exponents <= 0. da_kk = (dA[block rows, :start] @ (k * colf)) * rowf,
   da_qk likewise with dAqk.
2. The diagonal block: chunk_bwd's `_diag_gram_bwd` unchanged (middle-row anchor, or the exact pairwise form
   when the half-block gate sum passes DIAG_LIMIT): its da, dq terms and the diagonal's db.
3. Columns' side, the block's keys j as columns and the rows i after the block (skipped for the last block),
   anchored at the block's end: 2^(gates j+1 .. i) = 2^(gates j+1 .. end) * 2^(gates end+1 .. i). The column
   factor is the reverse scan of the next rows' gates inside the block (`after_a` in `_local_k_block`); the
   row factor the gates from end+1 to i. db_col = (dA[end+1:, block]^T @ (beta k * rowf) + dAqk[end+1:,
   block]^T @ (scale q * rowf)) * colf.
4. The block's rows, finished: dq_out = dq + scale da_qk; dk_out = dk + beta da_kk + db_diag + db_col;
   dgc += beta k da_kk + scale q da_qk - k (db_diag + db_col); the key block's dbeta share sum_c k da_kk.
   `_local_k_kernel` writes the same sums, only the column side arrives in another order (its db_all, summed
   over the row blocks after each column, instead of db_col).
5. `_dg_cumsum_kernel`: dg = the reverse cumsum of the chunk's dgc, the chunk-end terms (`dgc_end`) added to the
   padded chunk's last row, and dg = 0 where the loaded gate is below GATE_FLOOR.

Two forms of steps 1 and 3 (constexpr TILES). The wide form (TILES=False) is one [16, 64] x [64, BK] product
per matrix and step: dM's 64-wide block row (column, transposed) against a [64, BK] tile of the chunk's k (or
beta k, scale q) times a factor that is 0 outside the rows it needs, the factors from one scan over the
chunk's 64 rows. The tiled form (TILES=True, the default) loops (a run-time loop) over the other 16-row blocks
of the chunk, nearest first, one [16, 16] x [16, BK] product per matrix and block; the gate sums of the
blocks passed are carried in a [BK] vector, so each exponent is a within-block scan plus those sums. The
wide form is what the brief asked for; compiled offline for sm_90a (Triton 3.9, bf16 inputs, K = 128) it
kept 255 registers per thread at 32 key channels and 4 warps (the [64, BK] tiles, their 64-bit addresses and
the 64-wide dM tiles, which every warp holds whole as the A operand of an M = 16 product), two programs per
multiprocessor as before. The tiled form: 164 registers, no spills (three programs), or 128 with maxnreg=128
and 8 bytes of spills (four); each of its three steps alone needs about 125 (`--sm90` prints the table).

Every exponent is a sum of consecutive gates (scans of the gates themselves, and sums of such sums), never
the difference of two cumsums: after a reset (a gate at GATE_FLOOR, -151 in base 2) such a difference keeps
~1e-5 of its value. Rows past the sequence's end (n_t, from `chunk_span`; varlen through the chunk table) load
as zeros and are never stored.

NaN and inf. A bad input value spoils the same outputs as in `_local_k_kernel`, which spreads it further than
the maths does: its column side multiplies every block's rows into every column of the chunk (the columns
outside the block zeroed by a factor, and 0 * NaN = NaN), and it runs the padded rows through dg's cumsum.
The cases of its spreading that the products above do not reproduce are flagged by hand:
* a non-finite (beta k + scale q) * 2^(the block's gate cumsum) in a row of blocks 1 .. 3 (a NaN or inf in
  beta, k, q or a gate there) makes `_local_k_kernel`'s db_all non-finite in that key channel for all 64
  columns: every dk and dg of the chunk in that channel. The block's program raises row 0 of `spoil` (an
  int8 buffer [2, HV * NCH, K padded], zeros on entry, written only where a flag is raised), and
  `_dg_cumsum_kernel` sets those dk_out and dg to NaN.
* a non-finite dA or dAqk entry in a column j past the sequence's end, on a row of blocks max(1, blk(j)) ..
  3, made that padded row of its dgc NaN, which dg's cumsum carries to every row of the chunk: row 1 of
  `spoil`, dg only. (From a NaN state, via the padded rows of U.)
* (tiled form) its rows' side multiplies k on every row of the chunk, by 0 from the block's start on: a
  non-finite k after the block makes the block's da non-finite in that channel. The columns' side loads
  those rows anyway and flags them (`k_bad`). The wide form multiplies them as `_local_k_kernel` does.
What the columns' side reads (the rows after the block) spreads no further than there, since the first flag
covers those rows. Positive gates (not allowed: g <= 0) that overflow 2^cumsum are not mirrored. End to end
(the NaN cases of the check) the kernels before local_k spread a NaN so far that the flags change nothing;
`check_kernel_nan` replays the kernel alone on one launch's arguments with a NaN or inf put in, where each
flag matters (clearing either changes the pattern).

Drop-in: `local_k_sub[grid](...)` takes exactly `chunk_kda_bwd`'s launch of `_local_k_kernel` (its grid
(NCH, HV, key blocks), arguments, constexprs and num_warps / num_stages) and launches the two kernels with
their own grids; `chunk_kda_bwd_sub` is `chunk_kda_bwd` with it patched in. `LocalKSub(warps=2)` fixes the
first kernel's warps (default: the launcher's lk_warps); `tiles`, `maxnreg`, `dg_warps` and `dg_block` the
other knobs (`LocalKSub`).

`python bench/experiments/local_k_sub.py`: the check under Triton's interpreter (float32: every gradient against
`_local_k_kernel` and against the float64 loop, NaN cases end to end and at the kernel level; a minute or
two on 2 cores). `--sm90`: registers and spills compiled offline for sm_90a beside `_local_k_kernel` (the
current kernel there: 254 registers and 8 bytes of spills at 32 channels and 4 warps). Timing on the H200:
`bench_local_k64.py --variants sub-32x2 sub-32x4 sub-64x4 sub-32x4-r128 sub-32x4-wide` (not yet run).
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
import warnings
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kda_edu.kernels import chunk_bwd, chunk_kda
from kda_edu.kernels._backend import jit
from kda_edu.kernels.chunk import KERNEL_GATE_FLOOR, base2_gates, chunk_span, load_rows
from kda_edu.kernels.chunk_bwd import _block_inputs, _diag_gram_bwd, _sum_shares
from kda_edu.ops.kda import kda_recurrent


@jit
def _load_after(ptr, rows, row_stride, cols, n_cols, end, n_t):
    """A [len(rows), len(cols)] tile of the rows after `end` (and before n_t), zeros elsewhere."""
    mask = ((rows > end) & (rows < n_t))[:, None] & (cols[None, :] < n_cols)
    return tl.load(ptr + rows[:, None] * row_stride + cols[None, :], mask=mask, other=0.0)


@jit
def _rows_side_wide(dA_c, dQ_c, k_h, g_h, ck, start, H, HV, K, n_t, a_stride,
                    BT: tl.constexpr, BC: tl.constexpr, NKB: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """Step 1 as one [16, 64] x [64, BK] product per matrix: dM's block rows against k * 2^(gates j+1 .. start-1)
    on every row of the chunk (0 from row start on, so a non-finite k anywhere spreads as in
    `_local_k_kernel`). Returns the sums before the row factor."""
    rows = tl.arange(0, BT)
    m_rows = (start + tl.arange(0, BC))[:, None] * BT + rows[None, :]
    dA_a = _sum_shares(dA_c, m_rows, a_stride, NKB)
    dQ_a = tl.load(dQ_c + m_rows).to(tl.float32)
    # gates j+1 .. start-1 for j < start: gate j+1 is loaded on row j, rows j+1 >= start as zeros
    g_next = base2_gates(load_rows(g_h, rows + 1, HV * K, ck, K, tl.minimum(n_t, start)))
    col_x = tl.cumsum(g_next, axis=0, reverse=True)
    col_f = tl.exp2(tl.where((rows < start)[:, None], col_x, float("-inf")))
    k_col = load_rows(k_h, rows, H * K, ck, K, n_t).to(tl.float32) * col_f
    return tl.dot(dA_a, k_col, input_precision=PREC), tl.dot(dQ_a, k_col, input_precision=PREC)


@jit
def _rows_side_tiles(dA_c, dQ_c, k_h, g_h, ck, b, start, H, HV, K, n_t, a_stride,
                     BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, NKB: tl.constexpr,
                     PREC: tl.constexpr):  # fmt: skip
    """Step 1 as a loop over the column blocks jb = b-1 .. 0, one [16, 16] x [16, BK] product per matrix each:
    the column factor 2^(gates j+1 .. start-1) is the block's reverse scan of the next rows' gates plus the
    gates of the blocks between (`acc`, grown block by block: sums of consecutive gates). Returns the sums
    before the row factor."""
    rc = tl.arange(0, BC)
    tile = rc[:, None] * BT + rc[None, :]  # a 16 x 16 tile of dM
    # acc: the gates loaded (one row down) on the blocks already passed, i.e. gates start_{jb+1}+1 .. start-1
    acc = tl.zeros([BK], dtype=tl.float32)
    s_kk = tl.zeros([BC, BK], dtype=tl.float32)
    s_qk = tl.zeros([BC, BK], dtype=tl.float32)
    for i in range(b):  # run-time loop over the blocks before b, nearest first
        tj = (b - 1 - i) * BC + rc
        g_next = base2_gates(load_rows(g_h, tj + 1, HV * K, ck, K, tl.minimum(n_t, start)))
        col_x = tl.cumsum(g_next, axis=0, reverse=True) + acc[None, :]
        acc += tl.sum(g_next, axis=0)
        k_col = load_rows(k_h, tj, H * K, ck, K, n_t).to(tl.float32) * tl.exp2(col_x)
        off = start * BT + (b - 1 - i) * BC + tile
        s_kk += tl.dot(_sum_shares(dA_c, off, a_stride, NKB), k_col, input_precision=PREC)
        s_qk += tl.dot(tl.load(dQ_c + off).to(tl.float32), k_col, input_precision=PREC)
    return s_kk, s_qk


@jit
def _cols_side_wide(dA_c, dQ_c, q_h, k_h, g_h, b_h, ck, start, H, HV, K, n_t, scale, a_stride,
                    BT: tl.constexpr, BC: tl.constexpr, NKB: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """Step 3 as one [16, 64] x [64, BK] product per matrix: the block's columns of dM, transposed, against
    (beta k, scale q) * 2^(gates end+1 .. i) on the rows after the block (zeros on the others). Returns the
    sum before the column factor, and zeros for the flag that `_cols_side_tiles` computes."""
    rows = tl.arange(0, BT)
    end = start + BC - 1
    m_cols = rows[None, :] * BT + (start + tl.arange(0, BC))[:, None]  # dM[i, start + x] at [x, i]
    dAT = _sum_shares(dA_c, m_cols, a_stride, NKB)
    dQT = tl.load(dQ_c + m_cols).to(tl.float32)
    g_af = base2_gates(_load_after(g_h, rows, HV * K, ck, K, end, n_t))
    row_f = tl.exp2(tl.cumsum(g_af, axis=0))  # gates end+1 .. i (1 on the rows up to end: zeros there)
    k_af = _load_after(k_h, rows, H * K, ck, K, end, n_t).to(tl.float32)
    qs_af = _load_after(q_h, rows, H * K, ck, K, end, n_t).to(tl.float32) * scale
    beta_af = tl.load(b_h + rows * HV, mask=(rows > end) & (rows < n_t), other=0.0).to(tl.float32)
    db = tl.dot(dAT, beta_af[:, None] * k_af * row_f, input_precision=PREC)
    db += tl.dot(dQT, qs_af * row_f, input_precision=PREC)
    return db, tl.zeros([k_af.shape[1]], dtype=tl.int32)


@jit
def _cols_side_tiles(dA_c, dQ_c, q_h, k_h, g_h, b_h, ck, b, start, H, HV, K, n_t, scale, a_stride,
                     BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, NKB: tl.constexpr,
                     PREC: tl.constexpr):  # fmt: skip
    """Step 3 as a loop over the row blocks ab = b+1 .. 3, one [16, 16] x [16, BK] product per matrix each: the
    row factor 2^(gates end+1 .. i) is the gates of the blocks between (`acc`) plus the block's own cumsum.
    Returns the sum before the column factor, and per key channel a flag: a non-finite k in those rows
    (which `_local_k_kernel`'s rows' side multiplies by 0 for block b and so spreads over its rows)."""
    rc = tl.arange(0, BC)
    tile_t = rc[None, :] * BT + rc[:, None]  # a 16 x 16 tile of dM, transposed: dM[y, x] at [x, y]
    acc = tl.zeros([BK], dtype=tl.float32)  # gates end+1 .. (the row block's start - 1)
    db = tl.zeros([BC, BK], dtype=tl.float32)
    k_bad = tl.zeros([BK], dtype=tl.int32)
    for ab in range(b + 1, BT // BC):  # run-time loop over the blocks after b
        tr = ab * BC + rc
        g_r = base2_gates(load_rows(g_h, tr, HV * K, ck, K, n_t))
        row_f = tl.exp2(tl.cumsum(g_r, axis=0) + acc[None, :])
        acc += tl.sum(g_r, axis=0)
        k_r = load_rows(k_h, tr, H * K, ck, K, n_t).to(tl.float32)
        qs_r = load_rows(q_h, tr, H * K, ck, K, n_t).to(tl.float32) * scale
        beta_r = tl.load(b_h + tr * HV, mask=tr < n_t, other=0.0).to(tl.float32)
        off = ab * BC * BT + start + tile_t
        db += tl.dot(
            _sum_shares(dA_c, off, a_stride, NKB), beta_r[:, None] * k_r * row_f, input_precision=PREC
        )
        db += tl.dot(tl.load(dQ_c + off).to(tl.float32), qs_r * row_f, input_precision=PREC)
        k_bad = tl.maximum(k_bad, tl.max(tl.where(tl.abs(k_r) < float("inf"), 0, 1), axis=0))
    return db, k_bad


@jit(do_not_specialize=["NT"])
def _local_k_sub_kernel(
    q, k, g, beta, dA_part, dAqk,  # inputs; dA as NKB shares, a_stride apart
    dq, dk, dgc,  # partial gradients from _local_v_kernel (dgc gets the block's terms in place)
    dq_out, dk_out,  # the finished dq, dk (the inputs' dtype when HV == H, else dq, dk again)
    dbeta_part,  # float32 [key blocks, B * T * HV]: this key block's share of dbeta
    spoil,  # int8 [2, HV * NCH, BKP], zeros on entry: the NaN flags (module docstring)
    chunks,  # varlen only: the chunk table
    T, H, HV, K, NT, NCH, scale, part_stride, a_stride,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BKP: tl.constexpr, PREC: tl.constexpr,
    IS_VARLEN: tl.constexpr, NKB: tl.constexpr, TILES: tl.constexpr = True,
):  # fmt: skip
    """Per (chunk x 16-row block, value head, block of BK key channels): steps 1-4 of the module docstring for
    the block's rows, written once. TILES: steps 1 and 3 as loops over 16 x 16 tiles of dM (default), else
    as one product of the block's 64-wide row (or column) of dM each."""
    NB: tl.constexpr = BT // BC
    i_cb = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_k = tl.program_id(2)
    i_c = i_cb // NB
    b = i_cb % NB  # the chunk's four blocks are neighbours in the grid (its tiles stay in L2)
    i_h = i_hv // (HV // H)
    t0, t_end = chunk_span(i_c, chunks, T, NT, BT, IS_VARLEN)
    n_t = (t_end - t0).to(tl.int32)
    start = b * BC
    end = start + BC - 1
    rc = tl.arange(0, BC)
    ta = start + rc
    ck = i_k * BK + tl.arange(0, BK)
    q_h = q + t0 * H * K + i_h * K
    k_h = k + t0 * H * K + i_h * K
    g_h = g + t0 * HV * K + i_hv * K
    b_h = beta + t0 * HV + i_hv
    c = (i_hv * NCH + i_c).to(tl.int64)
    dA_c = dA_part + c * BT * BT  # the chunk's dM tiles: dM[i, j] at i * BT + j (32-bit offsets)
    dQ_c = dAqk + c * BT * BT
    sp = spoil + c * BKP + ck

    k_a, qs_a, g_a, beta_a = _block_inputs(q_h, k_h, g_h, b_h, ta, ck, H, HV, K, n_t, scale)
    bk_a = beta_a[:, None] * k_a
    da_kk = tl.zeros([BC, BK], dtype=tl.float32)
    da_qk = tl.zeros([BC, BK], dtype=tl.float32)
    if b > 0:  # 1. rows' side: the columns before the block, anchored at its start
        if TILES:
            s_kk, s_qk = _rows_side_tiles(
                dA_c, dQ_c, k_h, g_h, ck, b, start, H, HV, K, n_t, a_stride, BT, BC, BK, NKB, PREC
            )
        else:
            s_kk, s_qk = _rows_side_wide(
                dA_c, dQ_c, k_h, g_h, ck, start, H, HV, K, n_t, a_stride, BT, BC, NKB, PREC
            )
        row_f = tl.exp2(tl.cumsum(g_a, axis=0))  # gates start .. i
        da_kk = s_kk * row_f
        da_qk = s_qk * row_f
        # _local_k_kernel's column side takes (beta k, scale q) * row_f of this block into every column: a
        # non-finite value there spoils its dk and dg in that channel over the whole chunk (flag row 0).
        bad = tl.max(tl.where(tl.abs((bk_a + qs_a) * row_f) < float("inf"), 0, 1), axis=0) > 0
        tl.store(sp, tl.full([BK], 1, tl.int8), mask=bad & (ck < K))

    # 2. the diagonal block
    d_tile = ta[:, None] * BT + ta[None, :]
    dA_d = _sum_shares(dA_c, d_tile, a_stride, NKB)
    dQ_d = tl.load(dQ_c + d_tile).to(tl.float32)
    da_d, dq_d, db_d = _diag_gram_bwd(dA_d, dQ_d, bk_a, qs_a, k_a, g_a, BC, PREC)
    da_kk += da_d
    da_qk += dq_d

    db_c = tl.zeros([BC, BK], dtype=tl.float32)
    if b < NB - 1:  # 3. columns' side: the block's keys against the rows after it, anchored at its end
        if TILES:
            db_c, k_bad = _cols_side_tiles(
                dA_c, dQ_c, q_h, k_h, g_h, b_h, ck, b, start, H, HV, K, n_t, scale, a_stride,
                BT, BC, BK, NKB, PREC,
            )  # fmt: skip
            if b > 0:  # the wide rows' side multiplies these k by 0: NaN in every row of the block
                da_kk = tl.where(k_bad[None, :] > 0, float("nan"), da_kk)
                da_qk = tl.where(k_bad[None, :] > 0, float("nan"), da_qk)
        else:
            db_c, k_bad = _cols_side_wide(
                dA_c, dQ_c, q_h, k_h, g_h, b_h, ck, start, H, HV, K, n_t, scale, a_stride, BT, BC, NKB, PREC
            )
        # gates j+1 .. end for j in the block: gate j+1 on row j, the row after the block's end as zero
        g_na = base2_gates(load_rows(g_h, ta + 1, HV * K, ck, K, tl.minimum(n_t, end + 1)))
        db_c *= tl.exp2(tl.cumsum(g_na, axis=0, reverse=True))
    if end >= n_t:  # rows past the sequence's end: _local_k_kernel's padded dgc rows (flag row 1)
        # Its padded row j of dgc is -0 * db_all_j: NaN when dA or dAqk has a non-finite entry in column j
        # on a row of blocks max(1, b) .. 3 (its rows' side for those blocks reads every column).
        col_bad = tl.zeros([BC], dtype=tl.int32)
        tile_t = rc[None, :] * BT + rc[:, None]
        for ab in range(tl.maximum(b, 1), NB):
            off = ab * BC * BT + start + tile_t
            p = _sum_shares(dA_c, off, a_stride, NKB) + tl.load(dQ_c + off).to(tl.float32)
            col_bad = tl.maximum(col_bad, tl.max(tl.where(tl.abs(p) < float("inf"), 0, 1), axis=1))
        pad_bad = tl.max(tl.where(ta >= n_t, col_bad, 0), axis=0) + tl.zeros([BK], dtype=tl.int32) > 0
        tl.store(sp + HV * NCH * BKP, tl.full([BK], 1, tl.int8), mask=pad_bad & (ck < K))

    # 4. the block's rows, finished
    k_off = t0 * HV * K + i_hv * K
    o_a = k_off + ta[:, None] * HV * K + ck[None, :]
    m_a = (ta[:, None] < n_t) & (ck[None, :] < K)
    dq_a = tl.load(dq + o_a, mask=m_a, other=0.0) + scale * da_qk
    tl.store(dq_out + o_a, dq_a.to(dq_out.dtype.element_ty), mask=m_a)
    dk_a = tl.load(dk + o_a, mask=m_a, other=0.0) + beta_a[:, None] * da_kk + db_d + db_c
    tl.store(dk_out + o_a, dk_a.to(dk_out.dtype.element_ty), mask=m_a)
    dg_a = tl.load(dgc + o_a, mask=m_a, other=0.0) + bk_a * da_kk + qs_a * da_qk - k_a * db_d - k_a * db_c
    tl.store(dgc + o_a, dg_a, mask=m_a)
    tl.store(
        dbeta_part + i_k * part_stride + (t0 + ta) * HV + i_hv, tl.sum(k_a * da_kk, axis=1), mask=ta < n_t
    )


@jit(do_not_specialize=["NT"])
def _dg_cumsum_kernel(
    g, dgc, dgc_end, dk_out, spoil, chunks,
    T, HV, K, NT, NCH,
    BT: tl.constexpr, BK: tl.constexpr, BKP: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """Per (chunk, value head, block of BK key channels): dg = the reverse cumsum of dgc within the chunk, the
    chunk-end terms on its last row (row BT - 1 of the padded chunk), 0 where the gate was below GATE_FLOOR;
    and the NaN flags of `_local_k_sub_kernel` applied to dk_out and dg."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_k = tl.program_id(2)
    t0, t_end = chunk_span(i_c, chunks, T, NT, BT, IS_VARLEN)
    n_t = (t_end - t0).to(tl.int32)
    rows = tl.arange(0, BT)
    ck = i_k * BK + tl.arange(0, BK)
    c = (i_hv * NCH + i_c).to(tl.int64)
    k_off = t0 * HV * K + i_hv * K
    kt = rows[:, None] * HV * K + ck[None, :]
    km = (rows[:, None] < n_t) & (ck[None, :] < K)
    d = tl.load(dgc + k_off + kt, mask=km, other=0.0)
    end = tl.load(dgc_end + c * BKP + ck)  # dgc_end rows are BKP (K padded) wide
    d = tl.where((rows == BT - 1)[:, None], d + end[None, :], d)
    dg = tl.cumsum(d, axis=0, reverse=True)
    all_dk = tl.load(spoil + c * BKP + ck) != 0
    dg_only = tl.load(spoil + HV * NCH * BKP + c * BKP + ck) != 0
    dg = tl.where((all_dk | dg_only)[None, :], float("nan"), dg)
    below = load_rows(g + t0 * HV * K + i_hv * K, rows, HV * K, ck, K, n_t).to(tl.float32) < KERNEL_GATE_FLOOR
    tl.store(dgc + k_off + kt, tl.where(below, 0.0, dg), mask=km)
    nan = tl.full([BT, BK], float("nan"), dk_out.dtype.element_ty)
    tl.store(dk_out + k_off + kt, nan, mask=km & all_dk[None, :])


class LocalKSub:
    """`_local_k_kernel`'s drop-in: `obj[grid](...)` with `chunk_kda_bwd`'s arguments launches
    `_local_k_sub_kernel` on (NCH * 4, HV, key blocks) and then `_dg_cumsum_kernel` on (NCH, HV, cdiv(K,
    dg_block)). `warps`: the first kernel's warps (None: the launcher's num_warps, i.e. lk_warps); `tiles`: its
    TILES; `maxnreg`: its register limit per thread (None: ptxas's choice). `dg_warps`, `dg_block`: the second
    kernel's warps and key channels per program (32 x 4 warps: 125 registers offline, 64 x 4: 251)."""

    kernels = (_local_k_sub_kernel, _dg_cumsum_kernel)

    def __init__(self, warps=None, tiles=True, maxnreg=None, dg_warps=4, dg_block=32, name="_local_k_sub"):
        self.warps, self.tiles, self.maxnreg = warps, tiles, maxnreg
        self.dg_warps, self.dg_block = dg_warps, dg_block
        self.__name__ = name

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(
        self, grid, q, k, g, beta, dA_part, dAqk, dgc_end, dq, dk, dgc, dq_out, dk_out, dbeta_part,
        chunks, T, H, HV, K, NT, NCH, scale, part_stride, a_stride,
        *, BT, BC, BK, BKP, PREC, IS_VARLEN, NKB, num_warps=4, num_stages=None,
    ):  # fmt: skip
        n_c, n_hv, n_kb = grid
        assert n_c == NCH and n_hv == HV and n_kb == triton.cdiv(K, BK), (grid, NCH, HV, K, BK)
        spoil = torch.zeros(2, HV * NCH, BKP, device=q.device, dtype=torch.int8)
        _local_k_sub_kernel[(NCH * (BT // BC), HV, n_kb)](
            q, k, g, beta, dA_part, dAqk, dq, dk, dgc, dq_out, dk_out, dbeta_part, spoil,
            chunks, T, H, HV, K, NT, NCH, scale, part_stride, a_stride,
            BT=BT, BC=BC, BK=BK, BKP=BKP, PREC=PREC, IS_VARLEN=IS_VARLEN, NKB=NKB, TILES=self.tiles,
            num_warps=self.warps or num_warps, **({} if num_stages is None else dict(num_stages=num_stages)),
            **({} if self.maxnreg is None else dict(maxnreg=self.maxnreg)),
        )  # fmt: skip
        dgb = min(BKP, self.dg_block)
        _dg_cumsum_kernel[(NCH, HV, triton.cdiv(K, dgb))](
            g, dgc, dgc_end, dk_out, spoil, chunks, T, HV, K, NT, NCH,
            BT=BT, BK=dgb, BKP=BKP, IS_VARLEN=IS_VARLEN, num_warps=self.dg_warps,
        )  # fmt: skip

    @property
    def device_caches(self):
        """Both kernels' compiled variants, {device: {(kernel name, key): CompiledKernel}} (for
        bench_local_k64.py's `_compiled`; empty under the interpreter)."""
        out = {}
        for kernel in self.kernels:
            for device, entry in getattr(kernel, "device_caches", {}).items():
                cache = entry[0] if isinstance(entry, tuple) else entry
                for key, compiled in cache.items():
                    out.setdefault(device, {})[(kernel.fn.__name__, key)] = compiled
        return out


local_k_sub = LocalKSub()
_chunk_kda_bwd = chunk_bwd.chunk_kda_bwd  # the launcher as imported, before anyone patches it


def chunk_kda_bwd_sub(*args, kernel=local_k_sub, **kwargs):
    """`chunk_bwd.chunk_kda_bwd` with `kernel` (default `local_k_sub`) in place of `_local_k_kernel`."""
    with mock.patch.object(chunk_bwd, "_local_k_kernel", kernel):
        return _chunk_kda_bwd(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# Check under Triton's interpreter (float32): every gradient against `_local_k_kernel` and the float64 loop.

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def make_inputs(B, T, H, HV, K, V, gate=-0.5, seed=0, n_states=None):
    """(q, k unit rows; v; g = gate * U(0, 1); beta U(0, 1); h0 [n_states or B, HV, K, V]) as a dict, dO, dht."""
    gen = torch.Generator().manual_seed(seed)
    n = B if n_states is None else n_states

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    x = dict(
        q=F.normalize(rnd(B, T, H, K), dim=-1),
        k=F.normalize(rnd(B, T, H, K), dim=-1),
        v=rnd(B, T, HV, V),
        g=gate * torch.rand(B, T, HV, K, generator=gen),
        beta=torch.rand(B, T, HV, generator=gen),
        h0=rnd(n, HV, K, V),
    )
    return x, rnd(B, T, HV, V), rnd(n, HV, K, V)


def gradients(fn, x, do, dht, dtype=torch.float32):
    """Gradients of sum(o dO) + sum(ht dht) for q, k, v, g, beta, h0 (None without h0), inputs in `dtype`."""
    xs = {n: t.detach().to(dtype).clone().requires_grad_() for n, t in x.items()}
    o, ht = fn(*(xs[n] for n in "q k v g beta".split()), initial_state=xs.get("h0"), output_final_state=True)
    ((o.double() * do.double()).sum() + (ht.double() * dht.double()).sum()).backward()
    return [xs[n].grad if n in xs else None for n in ("q", "k", "v", "g", "beta", "h0")]


def per_sequence_loop(cu_seqlens):
    """`kda_recurrent` on each packed sequence alone (an empty one passes its state through), as one call."""
    cu = cu_seqlens.tolist()

    def run(q, k, v, g, beta, initial_state=None, output_final_state=True):
        outs, states = [], []
        for n, (bos, eos) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
            h = None if initial_state is None else initial_state[n : n + 1]
            if eos == bos:
                states.append(h if h is not None else v.new_zeros(1, v.shape[2], k.shape[3], v.shape[3]))
                continue
            o, ht = kda_recurrent(
                *(t[:, bos:eos] for t in (q, k, v, g, beta)), initial_state=h, output_final_state=True
            )
            outs.append(o)
            states.append(ht)
        return torch.cat(outs, dim=1), torch.cat(states)

    return run


def kernel_gradients(x, do, dht, launcher, cu_seqlens=None, **knobs):
    """chunk_kda's gradients with `launcher` (with `knobs`) as its backward."""
    fn = functools.partial(chunk_kda, cu_seqlens=cu_seqlens, check_inputs=False)
    with mock.patch.object(chunk_bwd, "chunk_kda_bwd", functools.partial(launcher, **knobs)):
        return gradients(fn, x, do, dht)


def rel_max(x, ref):
    """max |x - ref| / max |ref| (float64); 0 for two empty tensors."""
    if ref.numel() == 0:
        return 0.0
    x, ref = x.double(), ref.double()
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def pairwise_blocks(g, lk_block, cu_seqlens=None, chunk=64, sub=16):
    """(16-row blocks x key blocks whose diagonal takes `_diag_gram_bwd`'s pairwise form, all of them), from the
    gates as the kernels see them: a block's half-block span (base 2, row 0's gate left out) above DIAG_LIMIT."""
    B, T, HV, K = g.shape
    kb = min(max(16, triton.next_power_of_2(K)), lk_block)
    n_kb = triton.cdiv(K, kb)
    base2 = g.reshape(B * T, HV, K).double().clamp_min(KERNEL_GATE_FLOOR.value) * math.log2(math.e)
    bounds = cu_seqlens.tolist() if cu_seqlens is not None else [b * T for b in range(B + 1)]
    taken = total = 0
    for bos, eos in zip(bounds[:-1], bounds[1:], strict=True):
        for t0 in range(bos, eos, chunk):
            gc = torch.zeros(chunk, HV, n_kb * kb, dtype=torch.float64)
            gc[: min(chunk, eos - t0), :, :K] = base2[t0 : min(t0 + chunk, eos)]
            blocks = gc.view(chunk // sub, sub, HV, n_kb, kb).clone()
            blocks[:, 0] = 0.0
            lx = blocks.cumsum(1)
            mid = lx[:, sub // 2 : sub // 2 + 1]
            span = torch.maximum((lx[:, :1] - mid).amax(dim=(1, 4)), (mid - lx[:, -1:]).amax(dim=(1, 4)))
            taken += int((span > 96.0).sum())
            total += span.numel()
    return taken, total


def check_case(name, x, do, dht, cu_seqlens=None, tol=1e-5, kernel=local_k_sub, **knobs):
    """All six gradients with `kernel` (a LocalKSub) against `_local_k_kernel` (same launcher) and the float64
    loop, as relative max errors (max |x - ref| / max |ref|).

    Tolerance against `_local_k_kernel`: 1e-5. Both sum the same float32 terms; they differ only in how: the
    exponents' scans run in another order, the column side is anchored at the column block's end instead of
    each row block's start (other rounding of the factors and products), and its products are grouped
    otherwise, so the two agree to a few float32 ulps of the largest terms (observed <= 6e-8), with dg's
    reverse cumsum adding the rows' rounding up. 1e-5 leaves two orders of magnitude for cancellation in the
    sums. Against float64: within 1e-5 or twice `_local_k_kernel`'s own error, whichever is larger."""
    started = time.time()
    new = kernel_gradients(x, do, dht, chunk_kda_bwd_sub, cu_seqlens, kernel=kernel, **knobs)
    cur = kernel_gradients(x, do, dht, _chunk_kda_bwd, cu_seqlens, **knobs)
    loop = kda_recurrent if cu_seqlens is None else per_sequence_loop(cu_seqlens)
    ref = gradients(loop, x, do, dht, torch.float64)
    taken, total = pairwise_blocks(x["g"], knobs.get("lk_block", 32), cu_seqlens)
    row = dict(
        case=name, knobs=knobs, pairwise_blocks=f"{taken}/{total}", seconds=round(time.time() - started)
    )
    for n, a, b, r in zip(NAMES, new, cur, ref, strict=True):
        if r is None:
            assert a is None and b is None
            continue
        assert torch.isfinite(a).all() and torch.isfinite(b).all(), (name, n)
        e = dict(new_cur=rel_max(a, b), new_f64=rel_max(a, r), cur_f64=rel_max(b, r))
        row[n] = e
        assert e["new_cur"] <= tol and e["new_f64"] <= max(tol, 2 * e["cur_f64"]), (name, n, e)
    return row


def print_table(rows):
    """One line per case: each gradient's relative max error new vs current / new vs f64 / current vs f64."""
    print(f"{'case':28s} {'pairwise':>9s}  " + "  ".join(f"{n:>26s}" for n in NAMES))
    print(f"{'':28s} {'':>9s}  " + "  ".join(f"{'new-cur new-f64 cur-f64':>26s}" for _ in NAMES))
    for row in rows:
        cells = []
        for n in NAMES:
            e = row.get(n)
            cells.append(
                f"{'-':>26s}" if e is None else f"{e['new_cur']:8.1e} {e['new_f64']:8.1e} {e['cur_f64']:8.1e}"
            )
        print(f"{row['case']:28s} {row['pairwise_blocks']:>9s}  " + "  ".join(cells))


def check_nan(x, do, dht, bad, **knobs):
    """A NaN at each (input, batch, step, head, channel) of `bad`: the new kernels must give non-finite values
    exactly where `_local_k_kernel` does, and the same values elsewhere."""
    x = {n: t.clone() for n, t in x.items()}
    for name, idx in bad:
        x[name][idx] = float("nan")
    new = kernel_gradients(x, do, dht, chunk_kda_bwd_sub, **knobs)
    cur = kernel_gradients(x, do, dht, _chunk_kda_bwd, **knobs)
    out = dict(bad=str(bad), knobs=knobs)
    for n, a, b in zip(NAMES, new, cur, strict=True):
        fa, fb = torch.isfinite(a), torch.isfinite(b)
        both = fa & fb
        out[n] = dict(
            nonfinite_new=int((~fa).sum()),
            nonfinite_cur=int((~fb).sum()),
            of=a.numel(),
            same_pattern=bool(torch.equal(fa, fb)),
            new_cur_where_finite=rel_max(a[both], b[both]) if both.any() else 0.0,
        )
    return out


def print_nan(res):
    print(f"NaN at {res['bad']} {res['knobs'] or ''}")
    for n in NAMES:
        e = res[n]
        print(
            f"  {n:6s} non-finite new {e['nonfinite_new']:5d} / current {e['nonfinite_cur']:5d} of {e['of']:5d}"
            f"  same pattern {e['same_pattern']}  new vs current where finite {e['new_cur_where_finite']:.1e}"
        )


_CURRENT = chunk_bwd._local_k_kernel  # the kernel as imported
_OUTPUTS = dict(dq_out=10, dk_out=11, dg=9, dbeta_part=12)  # their positions in the launch's arguments


def _clone_args(args, copies):
    """The launch's arguments with every tensor cloned once (dq_out is dq when HV != H or float32)."""
    out = []
    for a in args:
        if torch.is_tensor(a) and id(a) not in copies:
            copies[id(a)] = a.clone()
        out.append(copies[id(a)] if torch.is_tensor(a) else a)
    return out


class _Recorder:
    """Stands in for `_local_k_kernel`: records each launch (grid, cloned arguments, keywords) and runs it."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append((grid, _clone_args(args, {}), dict(kwargs)))
            return _CURRENT[grid](*args, **kwargs)

        return run


def _replay(kernel, call, edits):
    """One recorded launch again with `kernel` on fresh copies, after setting (argument, flat index) = value."""
    grid, args, kwargs = call
    args = _clone_args(args, {})
    for i, flat, value in edits:
        args[i].view(-1)[flat] = value
    kernel[grid](*args, **kwargs)
    return {n: args[i] for n, i in _OUTPUTS.items()}


def check_kernel_nan(kernel=local_k_sub):
    """The two kernels alone, on the arguments `chunk_kda_bwd` gave `_local_k_kernel` (T = 130, K = 32: three
    chunks, the last with 2 valid rows), with one NaN or inf put into an input: the non-finite outputs (dq_out,
    dk_out, dg, the dbeta shares) must be the same, and the finite ones equal. End to end (main_check) the
    kernels before them spread a NaN so far that the two kernels' differences would not show."""
    x, do, dht = make_inputs(1, 130, 1, 1, 32, 16, seed=10)
    rec = _Recorder()
    kernel_gradients(x, do, dht, chunk_kda_bwd_sub, kernel=rec)
    (call,) = rec.calls
    BT, K = 64, 32

    def tok(t, ch, HK=1):  # [B, T, heads, K] flat index of token t, head 0, channel ch
        return t * HK * K + ch

    def dm(c, i, j):  # flat index of dM[i, j] of chunk c (value head 0) in dA_part's first share / dAqk
        return (c * BT + i) * BT + j

    nan, inf = float("nan"), float("inf")
    cases = {
        "g row 37 (block 2)": [(2, tok(37, 3), nan)],
        "g row 5 (block 0)": [(2, tok(5, 3), nan)],
        "g row 48 (a block's first row)": [(2, tok(48, 0), nan)],
        "g row 0 (the chunk's first row)": [(2, tok(0, 1), nan)],
        "k row 5 (block 0)": [(1, tok(5, 2), nan)],
        "k row 100 = inf": [(1, tok(100, 2), inf)],
        "q row 3 (block 0)": [(0, tok(3, 7), nan)],
        "q row 70": [(0, tok(70, 7), nan)],
        "beta row 20": [(3, 20, nan)],
        "dA chunk 0 (40, 10)": [(4, dm(0, 40, 10), nan)],
        "dA chunk 2 padded (40, 7)": [(4, dm(2, 40, 7), nan)],
        "dA chunk 2 padded (12, 7)": [(4, dm(2, 12, 7), nan)],
        "dAqk chunk 1 (20, 20)": [(5, dm(1, 20, 20), nan)],
        "dAqk chunk 2 (1, 0) = inf": [(5, dm(2, 1, 0), inf)],
        "dgc_end chunk 1": [(6, 32 + 4, nan)],
        "dgc row 70": [(9, tok(70, 4), nan)],
    }
    print(
        f"{kernel.__name__} alone (non-finite outputs new/current, same pattern, new vs current where finite):"
    )
    out = {}
    for name, edits in cases.items():
        with warnings.catch_warnings():  # the interpreter's NumPy warns of the NaNs it makes
            warnings.simplefilter("ignore", RuntimeWarning)
            a = _replay(kernel, call, edits)
            b = _replay(_CURRENT, call, edits)
        row = {}
        for n in _OUTPUTS:
            fa, fb = torch.isfinite(a[n]), torch.isfinite(b[n])
            both = fa & fb
            row[n] = (
                int((~fa).sum()),
                int((~fb).sum()),
                bool(torch.equal(fa, fb)),
                rel_max(a[n][both], b[n][both]),
            )
        out[name] = row
        print(
            f"  {name:32s} "
            + "  ".join(
                f"{n} {e[0]}/{e[1]} {'same' if e[2] else 'DIFFERENT'} {e[3]:.0e}" for n, e in row.items()
            )
        )
    same = all(e[2] and e[3] <= 1e-5 for row in out.values() for e in row.values())
    print(f"  all the same: {same}")
    return dict(cases=out, same=same)


def main_check():
    """Every case: a table of the errors, asserting the tolerances (a few minutes on 2 cores)."""
    started = time.time()
    rows = []

    def case(name, shape, seed, gate=-0.5, edit=None, cu=None, n_states=None, no_h0=False, **knobs):
        x, do, dht = make_inputs(*shape, gate=gate, seed=seed, n_states=n_states)
        if edit is not None:
            edit(x)
        if no_h0:
            del x["h0"]
        rows.append(check_case(name, x, do, dht, cu_seqlens=cu, **knobs))
        print(json.dumps(rows[-1]), flush=True)

    def strong(x):  # about -9 per step: a half block passes DIAG_LIMIT (96 in base 2) -> pairwise diagonal
        x["g"] = -(8.0 + 2.0 * x["g"] / -0.5)

    def reset(x):  # one reset in the middle of block 2 of the first chunk, one of block 1 of the second
        x["g"][:, 40] = -1000.0
        x["g"][:, 88, :, :5] = -1000.0

    case("T100", (1, 100, 1, 1, 32, 16), 0)
    case("T1", (1, 1, 1, 1, 16, 16), 1)
    case("T16_noh0", (1, 16, 1, 1, 32, 16), 2, no_h0=True)
    case("K32_V64", (1, 80, 1, 1, 32, 64), 3)
    case("K64_V32_lk16", (1, 80, 1, 1, 64, 32), 4, lk_block=16)
    case("K64_V32_lk32_lv32", (1, 80, 1, 1, 64, 32), 4, lk_block=32, lv_block=32)
    case("H1_HV2_B2", (2, 70, 1, 2, 32, 16), 5)
    cu = torch.tensor([0, 50, 50, 59, 190], dtype=torch.int32)  # 50, an empty one, 9, 131
    case("varlen_50_0_9_131", (1, 190, 1, 2, 32, 16), 6, cu=cu, n_states=4)
    case("strong_gates", (1, 100, 1, 1, 32, 16), 7, edit=strong)
    case("reset_mid_block", (1, 130, 1, 1, 32, 16), 8, edit=reset)
    case("reset_mid_block_lk16", (1, 130, 1, 1, 32, 16), 8, edit=reset, lk_block=16)
    wide = LocalKSub(tiles=False, name="_local_k_sub_wide")  # steps 1 and 3 as 64-wide products
    case("wide: T100", (1, 100, 1, 1, 32, 16), 0, kernel=wide)
    case("wide: varlen_50_0_9_131", (1, 190, 1, 2, 32, 16), 6, cu=cu, n_states=4, kernel=wide)
    case(
        "wide: reset_lk16_lv16", (1, 130, 1, 1, 32, 16), 8, edit=reset, kernel=wide, lk_block=16, lv_block=16
    )
    print_table(rows)

    nan = []
    x, do, dht = make_inputs(2, 130, 1, 1, 32, 16, seed=9)
    for bad in (
        [("g", (0, 37, 0, 3))],  # a NaN gate mid-block (block 2 of chunk 0), batch 1 clean
        [("g", (0, 48, 0, 0))],  # on a block's first row
        [("g", (0, 129, 0, 5))],  # in the short last chunk
        [("k", (0, 5, 0, 2))],  # a key in block 0
        [("q", (0, 100, 0, 7))],  # a query
        [("beta", (0, 20, 0))],
        [("v", (0, 70, 0, 3))],
    ):
        nan.append(check_nan(x, do, dht, bad))
        print_nan(nan[-1])
    same = all(r[n]["same_pattern"] and r[n]["new_cur_where_finite"] <= 1e-5 for r in nan for n in NAMES)
    print(f"NaN cases: same non-finite pattern and values as _local_k_kernel: {same}")
    kernel_nan = check_kernel_nan()
    kernel_nan_wide = check_kernel_nan(wide)
    print(f"all checks done in {time.time() - started:.0f} s")
    assert same and kernel_nan["same"] and kernel_nan_wide["same"]
    return dict(cases=rows, nan=nan, kernel_nan=kernel_nan, kernel_nan_wide=kernel_nan_wide)


# ---------------------------------------------------------------------------------------------------------
# Offline compile for the H200 (sm_90a) on a machine without a GPU: registers and spills.

_TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
_SIGNATURES = {  # `chunk_kda_bwd`'s launch for bf16 inputs with HV == H (dq_out, dk_out bf16; dAqk the bf16 Aqk)
    "current": dict(
        q="*bf16", k="*bf16", g="*fp32", beta="*bf16", dA_part="*fp32", dAqk="*bf16", dgc_end="*fp32",
        dq="*fp32", dk="*fp32", dgc="*fp32", dq_out="*bf16", dk_out="*bf16", dbeta_part="*fp32",
        chunks="*i32", T="i32", H="i32", HV="i32", K="i32", NT="i32", NCH="i32", scale="fp32",
        part_stride="i32", a_stride="i32",
    ),
    "sub": dict(
        q="*bf16", k="*bf16", g="*fp32", beta="*bf16", dA_part="*fp32", dAqk="*bf16", dq="*fp32",
        dk="*fp32", dgc="*fp32", dq_out="*bf16", dk_out="*bf16", dbeta_part="*fp32", spoil="*i8",
        chunks="*i32", T="i32", H="i32", HV="i32", K="i32", NT="i32", NCH="i32", scale="fp32",
        part_stride="i32", a_stride="i32",
    ),
    "dg": dict(
        g="*fp32", dgc="*fp32", dgc_end="*fp32", dk_out="*bf16", spoil="*i8", chunks="*i32", T="i32",
        HV="i32", K="i32", NT="i32", NCH="i32",
    ),
}  # fmt: skip


def compile_sm90(job: dict) -> dict:
    """Compile one kernel for sm_90a as `chunk_kda_bwd` launches it for bf16 inputs at K = V = 128 (tf32
    products, NKB = 2 dA shares); registers and stack from the cubin (cuobjdump -res-usage), spill bytes
    from ptxas -v on the same PTX (Triton's bundled ptxas-blackwell: the other rejects Triton 3.9's PTX), and
    the SASS instruction count (static). Run in a process where kda_edu builds compiled kernels
    (`sm90_resources`)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if job["kernel"] == "dg":
        kernel, constexprs = _dg_cumsum_kernel, dict(BT=64, BK=job["BK"], BKP=128, IS_VARLEN=False)
    else:
        kernel = chunk_bwd._local_k_kernel if job["kernel"] == "current" else _local_k_sub_kernel
        constexprs = dict(BT=64, BC=16, BK=job["BK"], BKP=128, PREC="tf32", IS_VARLEN=False, NKB=2)
        if job["kernel"] != "current":
            constexprs["TILES"] = job["kernel"] == "sub"
    signature = _SIGNATURES[job["kernel"].split("-")[0]] | dict.fromkeys(constexprs, "constexpr")
    options = dict(num_warps=job["warps"]) | ({"maxnreg": job["maxnreg"]} if "maxnreg" in job else {})
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", 90, 32),
        options=options,
    )
    ptx, cubin = compiled.asm["ptx"], compiled.asm["cubin"]
    out = dict(job, shared_bytes=compiled.metadata.shared)
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
        ptxas = subprocess.run(
            [
                _TOOLS / "ptxas-blackwell",
                "-v",
                f"--gpu-name={arch}",
                Path(tmp, "k.ptx"),
                "-o",
                Path(tmp, "v.o"),
            ],
            capture_output=True,
            text=True,
        ).stderr
        for name, pattern in (
            ("spill_stores", r"(\d+) bytes spill stores"),
            ("spill_loads", r"(\d+) bytes spill loads"),
        ):
            found = re.search(pattern, ptxas)
            out[name] = int(found.group(1)) if found else None
        sass = subprocess.run(
            [_TOOLS / "cuobjdump", "-sass", Path(tmp, "k.cubin")], capture_output=True, text=True
        ).stdout
        out["sass_instructions"] = len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?[A-Z]", sass))
    regs = out["reg"] or 255
    out["programs_per_sm_by_regs"] = 65536 // (regs * 32 * job["warps"])  # registers alone, ignoring rounding
    return out


def sm90_resources(jobs: list[dict]) -> list[dict]:
    """`compile_sm90` for each job in a fresh Python where kda_edu builds compiled kernels (this process built
    them for the interpreter); nothing is launched."""
    root = Path(__file__).resolve().parents[2]
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    code = (
        "import json, sys; import kda_edu.backend as b; b.INTERPRET = False\n"
        "import local_k_sub\n"
        "print(json.dumps([local_k_sub.compile_sm90(job) for job in json.loads(sys.argv[1])]))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, json.dumps(jobs)], env=env, capture_output=True, text=True
    )
    if run.returncode != 0:
        raise RuntimeError(f"compiling for sm_90a failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


SM90_JOBS = (  # sub: TILES (the default); sub-wide: TILES=False (64-wide products)
    [
        dict(kernel=kern, BK=bk, warps=w)
        for kern in ("sub", "sub-wide", "current")
        for bk in (32, 64)
        for w in (2, 4)
    ]
    + [dict(kernel="current", BK=32, warps=8)]
    + [
        dict(kernel="sub", BK=bk, warps=w, maxnreg=r)
        for bk, w, r in ((32, 4, 128), (32, 2, 128), (64, 4, 128))
    ]
    + [dict(kernel="dg", BK=bk, warps=w) for bk, w in ((32, 4), (64, 4), (64, 8), (128, 4))]
)


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
            started = time.time()
            try:
                res += sm90_resources([job])
            except RuntimeError as e:
                res.append(dict(job, error=str(e)[-500:]))
            print(json.dumps(res[-1] | dict(seconds=round(time.time() - started))), flush=True)
    else:
        res = main_check()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
