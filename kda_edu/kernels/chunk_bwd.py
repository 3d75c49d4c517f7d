"""Chunked KDA backward in Triton, and the `torch.autograd.Function` that makes `chunk_kda` differentiable.

Read `kda_edu.ops.kda.kda_chunked` and `kda_edu.kernels.chunk` first: the notation is theirs. Per chunk (C = 64
steps, gc the within-chunk gate cumsum, S0 the state entering the chunk, X = (I + A)^-1 with A the strictly
lower gated key Gram matrix with beta inside, as in `kda_chunked` and chapter 6; chunk_fwd.py keeps beta apart and
calls this matrix L = Diag(beta) A):

    U   = u - w S0                          u = X Diag(beta) V,  w = X Diag(beta) (K * exp(gc))
    O   = qg S0 + Aqk U                     qg = scale Q * exp(gc)
    S_C = Diag(exp(gc_C)) S0 + kd^T U       kd = K * exp(gc_C - gc)

Differentiating these three lines, with dO given and dS = dL/dS_C arriving from the next chunk:

    dU  = Aqk^T dO + kd dS                            (the values written, seen from the loss)
    dS0 = qg^T dO + Diag(exp(gc_C)) dS - w^T dU        (passed on to the previous chunk)
    dqg = dO S0^T,  dkd = U dS^T,  dw = -dU S0^T,  dAqk = dO U^T,  d exp(gc_C) = rowsum(S0 * dS)

Only dS0 couples the chunks: it runs backwards through time, the mirror image of the forward state pass.
Everything else is local to a chunk once S0, dS, U and dU are known. Then through the UT transform: with
du' = X^T dU and dw' = X^T dw, the gradient of (I + A) is -X^T dX X^T, which collapses to

    dV = Diag(beta) du',   dA = -(du' u^T + dw' w^T) (strictly lower part),   d(K exp(gc)) = Diag(beta) dw'

(no product with X twice). Finally the gated Gram matrices A_ij = sum_c (beta_i k_ic) k_jc exp(gc_ic - gc_jc)
and Aqk_ij = sum_c (scale q_ic) k_jc exp(gc_ic - gc_jc): for M_ij = sum_c a_ic b_jc exp(gc_ic - gc_jc),

    da_i = sum_j dM_ij b_j exp(gc_i - gc_j),   db_j = sum_i dM_ij a_i exp(gc_i - gc_j),
    dgc  = a * da - b * db

and every term `x * exp(f(gc))` adds `x * dx` to dgc. The gate g enters only through gc = cumsum(g), so
dg is the reverse cumulative sum of dgc within the chunk (the chunk-end terms land on its last row).

The kernels, in order (all but the two passes are parallel over chunks):

    1-2. chunk_fwd.py's three prepare kernels again (`_chunk_gram_kernel`, `_chunk_inverse_kernel`,
       `_chunk_wu_kernel`), through the forward's own launcher `prepare_chunks` with store_x=True: the forward's
       intermediates (w, u, qg, kd, Aqk, exp(gc_C)) and X = (I + A)^-1. X costs nothing extra: the inverse
       kernel forms it in every forward (the w/u kernel multiplies by it); store_x only keeps its buffer.
    3. `_states_kernel`: the forward state pass again, storing each chunk's S0 and U.
    4. `_dstates_kernel`: the backward state pass, storing each chunk's dS and dU; gives dS for h0.
    5. `_local_v_kernel`: everything that sums over the value dimension (products against S0, dS, U, dU, V):
       dv, the element-wise parts of dq, dk, dgc, dbeta, and the C x C matrices dA and dAqk.
    6. `_local_k_kernel`: the gated Gram backward for dA and dAqk, one program per 16-row block of a chunk
       (its rows through the columns before the block, the diagonal block, and its keys through the rows
       after it, as loops over 16 x 16 tiles), writing the block's rows of dq, dk and dgc once.
    7. `_local_dg_kernel`: dg = the reverse cumsum of dgc within each chunk.
    5 and 6 each run one program per (chunk, value head, block of key channels), 6 per 16-row block of the
    chunk too: every term is per key channel except dbeta and dA, sums over the channels, which each block
    writes as its share. The launcher adds the dbeta shares; 6 adds 5's dA shares as it loads them. The terms
    without a key channel (dv, dAqk) come from the first block only, a launch of its own (FIRST). With one
    value head per key head and 16-bit inputs, 6 writes the finished dq and dk in the inputs' dtype.

Variable-length batches (`cu_seqlens`, N sequences packed along T with B = 1) use the forward's layout
(chunk_common.py's `chunk_layout`): every chunk lies inside one sequence, the last chunk of a sequence may be short,
and the intermediates are indexed by chunk, [HV, NCH, ...]. The parallel kernels (1-2, 5-7) run one program
per chunk and value head (and key block) and read the chunk's first token and its sequence's end from the chunk table, so they
never see a step of another sequence. The two passes (3, 4) run one program per (value block, sequence x value
head) over that sequence's chunks only (per-sequence chunk offsets), starting from its h0 (3) or dht (4);
pass 4 ends with that sequence's dh0, [N, HV, K, V]. An empty sequence has no chunks: its dh0 is its dht.
Without cu_seqlens, chunk i_c is chunk i_c % NT of batch row i_c // NT, with no table (IS_VARLEN = False).

What the forward keeps besides q, k, v, g, beta, h0 and cu_seqlens (`keep_intermediates`, chunk_common.py's
`KEEP_MODES`): by default ("matrices") the two C x C matrices of each chunk, X and Aqk, and qg, which its
gram and inverse kernels made; the backward then runs only the w/u kernel of 1-2 (w, u, kd and gl from X and
the inputs). With "all" it keeps every output of its prepare kernels and X (its `prepare_chunks` call with
store_x=True, the same kernels and launches as the backward's) and the backward skips 1-2; with "none" the
backward runs all of 1-2 again. The gradients are the same bit for bit in the three modes. Recomputing 1-2
costs O(T C K) parallel work, exactly a forward's prepare; storing all of it costs (3K + V + 2C) numbers per
step and head, the matrices and qg (K + 2C), held from the forward to the backward. The per-chunk states
S0 (kernel 3) are the one thing that cannot be recomputed locally: they are stored for the duration of the
backward only, in the 16-bit input dtype (float32 for float32 inputs), the precision the forward itself
multiplies them in.

Rounding of dg: dg_t is the sum over the rows i >= t of dgc_i, and most of that sum cancels. For M_ij =
sum_c a_ic b_jc exp(gc_ic - gc_jc) the term T_ij = dM_ij a_i b_j exp(gc_i - gc_j) enters dgc_i (through
a * da) and dgc_j (through -b * db), so it leaves dg_t only for the pairs j < t <= i that straddle t, each
with the decay of gate t inside; kd's term x_i = k_i exp(gc_C - gc_i) dkd_i enters row i with - and the
chunk's end with +, so it leaves dg_t only for t > i, with the gates after i inside. The true dg is
therefore small when the decay is strong (every remaining term carries exp(g_t) or smaller), and the terms
that cancel are harmless only while they are small too: rounding leaves about 1e-7 of each. Two of them are
not small, decay 1: Aqk's diagonal pair (i = j: q_i dAqk_ii k_i, added and subtracted in the same row) and kd's
term for the chunk's last row (exp(0)). Both cancel exactly in exact arithmetic, so `_local_k_kernel` leaves
the diagonal out of the products (adding dAqk_ii k_i to dq and dAqk_ii q_i to dk alone) and
`_local_v_kernel` leaves the last row's kd term out of dgc and of the end term. What remains of dg's
rounding is then relative to dg itself: with every gate at -5, -12 or -20 its relative error against the
float64 loop is about 1e-6, 6e-7 and 4e-7 (it was 7e-5, 5e-2 and 1e2: an absolute floor near 1e-7 of the
other gradients).

Bad values: the backward is as causal as the forward. A NaN or inf in q, k, v or beta, or a NaN or +inf gate, at
step t spoils the forward from t on (chunk_fwd.py runs that step as a zero step and writes its row of u as NaN, so
U's row, the outputs from t on and the state after the chunk are NaN), and for a loss on the outputs before
t every gradient of an earlier step must be that of the clean prefix. Such a loss sends exact zeros back from
t on (dO, dS from the later chunks, and so dU, du', dw' and the C x C gradients in rows t and after), but a
zero times NaN is NaN, and dg, a reverse cumsum over the chunk, would carry a NaN of row t to every row before
it. So every kernel here reads the inputs, U and u, and the forward's qg and Aqk (a bad query's row is NaN
there) with their non-finite entries replaced by 0, by a select (`_finite`, `_gates`), as the prepare kernels
read the inputs: the products then multiply exact zeros by finite numbers. The gradients of step t and after
are not meaningful (the forward is not finite there); the chunks after t's see a NaN state S0.

Overflow: as in the forward, every exponent evaluated is <= 0 or anchored inside a 16-row sub-chunk. Columns
before a sub-chunk use the anchor at its start boundary, rows after it the anchor at its end boundary (both
factors <= 1 either way). The 16 x 16 diagonal blocks use
the middle-row anchor when the gates allow it and the exact pairwise form otherwise (see chunk_fwd.py).
Rounding: kernels 5 and 6 take each exponent as a sum of consecutive gates (the gates before a row, after it
up to the chunk's end or a block boundary, between two rows of a block), never as the difference of two
cumsums: after a reset (a gate at GATE_FLOOR, -151 in base 2) two cumsums are both large and their difference
keeps only ~1e-5 of its value, a relative error of that size in every decay after the reset.
"""

import torch
import triton
import triton.language as tl

from kda_edu.kernels._backend import jit
from kda_edu.kernels.chunk_common import (  # the chunk size too: keep_intermediates hands the forward's buffers over
    CHUNK,
    DIAG_LIMIT,
    KEEP_MODES,
    KERNEL_GATE_FLOOR,
    SUB,
    base2_gates,
    chunk_layout,
    chunk_span,
    diag_span,
    load_rows,
    pow2,
    seq_chunks,
    work_precision,
)
from kda_edu.kernels.chunk_fwd import prepare_chunks
from kda_edu.kernels.chunk_launch import pass_stages, scan_value_block


@jit
def _finite(x):
    """x with its NaN and inf entries replaced by 0, in x's dtype (a select: 0 * NaN would be NaN)."""
    return tl.where(tl.abs(x) < float("inf"), x, tl.zeros_like(x))


@jit
def _gates(x):
    """Base-2 gates as the prepare kernels take them (`base2_gates`), with a NaN or +inf gate as 0."""
    x = x.to(tl.float32)
    return tl.where(x < float("inf"), base2_gates(x), 0.0)


@jit
def _diag_gram_bwd(dA, dQ, bk_a, qs_a, k_a, g_a, BC: tl.constexpr, PREC: tl.constexpr):
    """Backward of the diagonal blocks of both Gram matrices (A: rows beta k; Aqk: rows scale q; columns k),
    for masked dA and dQ: returns d(beta k), d(scale q) and the column-side dk of the two together.

    g_a: the block's base-2 gates. The decay of pair (i, j) is 2^(gates j+1 .. i); the anchored form takes it
    as a difference of the cumsum of gates 1 .. i (row 0's gate, a reset there included, never enters a pair),
    the pairwise form as a sum of the gates themselves, so that a reset inside the block costs no precision."""
    rc = tl.arange(0, BC)
    lx = tl.cumsum(tl.where((rc > 0)[:, None], g_a, 0.0), axis=0)
    mid, span = diag_span(lx, BC)
    if span <= DIAG_LIMIT:
        row_f = tl.exp2(lx - mid[None, :])
        k_col = k_a * tl.exp2(mid[None, :] - lx)
        da_kk = tl.dot(dA, k_col, input_precision=PREC) * row_f
        da_qk = tl.dot(dQ, k_col, input_precision=PREC) * row_f
        db = tl.dot(tl.trans(dA), bk_a * row_f, input_precision=PREC)
        db = (db + tl.dot(tl.trans(dQ), qs_a * row_f, input_precision=PREC)) * tl.exp2(mid[None, :] - lx)
    else:  # exact pairwise form, one column j at a time: e_ij = 2^(gates j+1 .. i), 1 for i <= j
        da_kk = tl.zeros(k_a.shape, dtype=tl.float32)
        da_qk = tl.zeros(k_a.shape, dtype=tl.float32)
        db = tl.zeros(k_a.shape, dtype=tl.float32)
        for j in range(BC):
            pick = (rc == j)[:, None]
            kj = tl.sum(tl.where(pick, k_a, 0.0), axis=0)[None, :]
            e = tl.exp2(tl.cumsum(tl.where((rc > j)[:, None], g_a, 0.0), axis=0))
            ea = e * tl.sum(tl.where(rc[None, :] == j, dA, 0.0), axis=1)[:, None]  # column j of dA
            eq = e * tl.sum(tl.where(rc[None, :] == j, dQ, 0.0), axis=1)[:, None]
            da_kk += ea * kj
            da_qk += eq * kj
            db = tl.where(pick, tl.sum(ea * bk_a + eq * qs_a, axis=0)[None, :], db)
    return da_kk, da_qk, db


@jit
def _block_inputs(q_h, k_h, g_h, beta_h, ta, ck, H, HV, K, n_t, scale):
    """Rows ta of the chunk in key columns ck: k, scale * q, the gates in base 2, beta (zeros past n_t), each
    non-finite input as 0 (`_finite`, `_gates`; the module docstring, "Bad values")."""
    k_a = _finite(load_rows(k_h, ta, H * K, ck, K, n_t).to(tl.float32))
    qs_a = _finite(load_rows(q_h, ta, H * K, ck, K, n_t).to(tl.float32)) * scale
    g_a = _gates(load_rows(g_h, ta, HV * K, ck, K, n_t))
    beta_a = _finite(tl.load(beta_h + ta * HV, mask=ta < n_t, other=0.0).to(tl.float32))
    return k_a, qs_a, g_a, beta_a


@jit
def _decay_row(gl, c, ck, BK: tl.constexpr, count):
    """exp(gc_C) of chunk c (row c of `gl`, BK numbers) when count > 0, else zeros: `_states_kernel` loads it
    one chunk ahead, since Triton's pipeliner stages only the operands of products and this is an
    element-wise factor. (Measured on the H200: the states pass 10-12 % faster; the
    same made the forward's scan slower, by up to 27 %, and `_dstates_kernel` by 3 %.) The mask
    compares ck with a scalar: Triton's interpreter rejects a scalar condition and-ed with a tensor one."""
    return tl.load(gl + c * BK + ck, mask=ck < tl.minimum(count, 1) * BK, other=0.0)


@jit(do_not_specialize=["NT"])
def _states_kernel(
    w, u, kd, gl, h0, h, vn,  # prepare outputs; h0 [N, HV, K, V] f32; out: S0 per chunk, U per chunk
    offsets,  # varlen only: int32 [N + 1] first chunk of each sequence
    HV, K, V, NT, NCH,
    BT: tl.constexpr, BK: tl.constexpr, BVP: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """Per (value block, sequence x value head): the forward state pass again, from that sequence's h0,
    storing the state entering each of its chunks and the values U each writes."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    c0, n_chunks = seq_chunks(i_n, offsets, NT, IS_VARLEN)
    rows = tl.arange(0, BT)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        S += tl.load(h0 + i_nh.to(tl.int64) * K * V + ck[:, None] * V + cv[None, :],
                     mask=(ck[:, None] < K) & (cv[None, :] < V), other=0.0)  # fmt: skip
    c_first = (i_hv * NCH + c0).to(tl.int64)
    decay_next = _decay_row(gl, c_first, ck, BK, n_chunks)
    for n in range(n_chunks):
        c = c_first + n  # chunk's index in the intermediates
        r = (c * BT + rows)[:, None]
        s_lo = S.to(h.dtype.element_ty)
        tl.store(h + (c * BK + ck[:, None]) * BVP + cv[None, :], s_lo)
        w_n = tl.load(w + r * BK + ck[None, :])
        kd_n = tl.load(kd + r * BK + ck[None, :])
        decay = decay_next  # loaded a chunk ahead (`_decay_row`)
        decay_next = _decay_row(gl, c + 1, ck, BK, n_chunks - 1 - n)
        U = tl.load(u + r * BVP + cv[None, :]).to(tl.float32) - tl.dot(
            w_n, s_lo.to(w_n.dtype), input_precision=PREC
        )
        u_lo = U.to(vn.dtype.element_ty)
        tl.store(vn + r * BVP + cv[None, :], u_lo)
        S = S * decay[:, None] + tl.dot(tl.trans(kd_n), u_lo.to(kd_n.dtype), input_precision=PREC)


@jit(do_not_specialize=["NT"])
def _dstates_kernel(
    qg, kd, w, aqk, gl, do, dht, dh, dvn, dh0,  # dh: dS per chunk; dvn: dU per chunk (float32)
    chunks, offsets,  # varlen only: the chunk table and first chunk of each sequence
    T, HV, K, V, NT, NCH,
    BT: tl.constexpr, BK: tl.constexpr, BVP: tl.constexpr, BV: tl.constexpr,
    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """The backward state pass of one sequence, its last chunk first, from that sequence's dht:
    dU = Aqk^T dO + kd dS; dS <- qg^T dO + exp(gc_C) dS - w^T dU. What is left is that sequence's dh0."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    c0, n_chunks = seq_chunks(i_n, offsets, NT, IS_VARLEN)
    rows = tl.arange(0, BT)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    s_mask = (ck[:, None] < K) & (cv[None, :] < V)
    s_off = i_nh.to(tl.int64) * K * V + ck[:, None] * V + cv[None, :]
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        dS += tl.load(dht + s_off, mask=s_mask, other=0.0)
    do_h = do + i_hv * V
    for i in range(n_chunks):
        i_c = c0 + n_chunks - 1 - i
        t0, t_end = chunk_span(i_c, chunks, T, NT, BT, IS_VARLEN)
        n_t = (t_end - t0).to(tl.int32)
        c = (i_hv * NCH + i_c).to(tl.int64)
        r = (c * BT + rows)[:, None]
        qg_n = _finite(tl.load(qg + r * BK + ck[None, :]))  # a bad query's row: 0
        kd_n = tl.load(kd + r * BK + ck[None, :])
        w_n = tl.load(w + r * BK + ck[None, :])
        aqk_n = _finite(tl.load(aqk + r * BT + rows[None, :]))
        decay = tl.load(gl + c * BK + ck)  # here, loading it a chunk ahead (as _states_kernel) was slower
        do_n = tl.load(do_h + t0 * HV * V + rows[:, None] * HV * V + cv[None, :],
                       mask=(rows[:, None] < n_t) & (cv[None, :] < V), other=0.0).to(w_n.dtype)  # fmt: skip
        ds_lo = dS.to(dh.dtype.element_ty)
        tl.store(dh + (c * BK + ck[:, None]) * BVP + cv[None, :], ds_lo)
        dU = tl.dot(tl.trans(aqk_n), do_n, input_precision=PREC) + tl.dot(
            kd_n, ds_lo.to(kd_n.dtype), input_precision=PREC
        )
        tl.store(dvn + r * BVP + cv[None, :], dU)
        dS = dS * decay[:, None] + tl.dot(tl.trans(qg_n), do_n, input_precision=PREC)
        dS -= tl.dot(tl.trans(w_n), dU.to(w_n.dtype), input_precision=PREC)
    if STORE_DH0:
        tl.store(dh0 + s_off, dS, mask=s_mask)


@jit(do_not_specialize=["NT"])
def _local_v_kernel(
    q, k, v, g, beta, do,  # inputs and dO
    u, w, x, h, vn, dh, dvn,  # recomputed intermediates
    dv, dq, dk, dgc, dgc_end, db_part, dA_part, dAqk,  # outputs (dq, dk, dgc partial; dA, dAqk for kernel 6)
    chunks,  # varlen only: the chunk table
    T, H, HV, K, V, NT, NCH, scale, part_stride, a_stride,  # strides of db_part / dA_part between key blocks
    BT: tl.constexpr, BK: tl.constexpr, BKP: tl.constexpr, BVP: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr, IS_VARLEN: tl.constexpr, FIRST: tl.constexpr,
):  # fmt: skip
    """Per (chunk, value head, block of BK key channels): all sums over the value dimension, then the
    element-wise gate terms. See the module doc. The key-side terms are per channel; dA and dbeta also sum
    over the channels, so each key block writes its share (dA_part, db_part) and the launcher adds them. The
    terms with no key channel in them (dv, dAqk and the value-side parts of dA and dbeta) are computed by the
    first key block only.

    The first key block is its own launch (FIRST = True, grid z = 1; the other blocks: FIRST = False, grid
    z = K / BK - 1). A branch on the program id inside the value loop (`if i_k == 0`) compiled to wrong code
    on the H200 with Triton 3.6 (dv, dA and dbeta wrong in bf16, dAqk in float32; right under the
    interpreter); as a constexpr the branch is resolved when the kernel is compiled."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_k = tl.program_id(2)
    if not FIRST:
        i_k += 1
    i_h = i_hv // (HV // H)
    t0, t_end = chunk_span(i_c, chunks, T, NT, BT, IS_VARLEN)
    n_t = (t_end - t0).to(tl.int32)
    rows = tl.arange(0, BT)
    ck = i_k * BK + tl.arange(0, BK)
    c = (i_hv * NCH + i_c).to(tl.int64)
    r = (c * BT + rows)[:, None]  # row of the padded intermediates
    hb = c * BKP  # first row of this chunk's state tiles (BKP = K padded)
    v_off = t0 * HV * V + i_hv * V  # [B, T, HV, V] tensors: row t of the chunk at + t * HV * V
    tv_off = rows[:, None] * HV * V
    beta_h = beta + t0 * HV + i_hv
    beta_all = _finite(tl.load(beta_h + rows * HV, mask=rows < n_t, other=0.0).to(tl.float32))
    X = tl.load(x + r * BT + rows[None, :])

    dqg = tl.zeros([BT, BK], dtype=tl.float32)
    dkd = tl.zeros([BT, BK], dtype=tl.float32)
    dw = tl.zeros([BT, BK], dtype=tl.float32)
    dM_qk = tl.zeros([BT, BT], dtype=tl.float32)
    dM_kk = tl.zeros([BT, BT], dtype=tl.float32)  # -dA, before masking
    dgl = tl.zeros([BK], dtype=tl.float32)
    db = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        v_mask = cv[None, :] < V
        tv_mask = (rows[:, None] < n_t) & v_mask
        s_off = (hb + ck[:, None]) * BVP + cv[None, :]
        S0 = tl.load(h + s_off, mask=v_mask, other=0.0)
        dS = tl.load(dh + s_off, mask=v_mask, other=0.0)
        U = _finite(tl.load(vn + r * BVP + cv[None, :], mask=v_mask, other=0.0))
        dU = tl.load(dvn + r * BVP + cv[None, :], mask=v_mask, other=0.0)
        do_c = tl.load(do + v_off + tv_off + cv[None, :], mask=tv_mask, other=0.0)
        do_c = do_c.to(S0.dtype)
        dqg += tl.dot(do_c, tl.trans(S0), input_precision=PREC)
        dkd += tl.dot(U, tl.trans(dS), input_precision=PREC)
        dw -= tl.dot(dU.to(S0.dtype), tl.trans(S0), input_precision=PREC)
        dgl += tl.sum(S0.to(tl.float32) * dS.to(tl.float32), axis=1)
        if FIRST:  # the value-side terms, once per chunk
            u_c = _finite(tl.load(u + r * BVP + cv[None, :], mask=v_mask, other=0.0).to(tl.float32))
            v_c = tl.load(v + v_off + tv_off + cv[None, :], mask=tv_mask, other=0.0)
            dM_qk += tl.dot(do_c, tl.trans(U), input_precision=PREC)
            dup = tl.dot(tl.trans(X), dU, input_precision=PREC)  # du' = X^T dU
            dv_c = (beta_all[:, None] * dup).to(dv.dtype.element_ty)
            tl.store(dv + v_off + tv_off + cv[None, :], dv_c, mask=tv_mask)
            db += tl.sum(dup * v_c.to(tl.float32), axis=1)
            dM_kk += tl.dot(dup, tl.trans(u_c), input_precision=PREC)

    # Key side: the UT transform's w, then the element-wise exp(gc) factors of qg, w and kd.
    k_all = _finite(load_rows(k + t0 * H * K + i_h * K, rows, H * K, ck, K, n_t).to(tl.float32))
    qs = _finite(load_rows(q + t0 * H * K + i_h * K, rows, H * K, ck, K, n_t).to(tl.float32)) * scale
    g_h = g + t0 * HV * K + i_hv * K
    g_c = _gates(load_rows(g_h, rows, HV * K, ck, K, n_t))
    gc = tl.cumsum(g_c, axis=0)
    gc_end = tl.sum(g_c, axis=0)
    # gc_end - gc_i, the gates after row i, as a reverse cumsum of the next rows' gates: as a difference of
    # two cumsums it would carry their rounding (~1e-4 of an exponent once a reset of -1000 is in both).
    # (n_t counts to the sequence's end: row BT of the chunk is the next chunk's first.)
    g_next = _gates(load_rows(g_h, rows + 1, HV * K, ck, K, n_t))
    after = tl.cumsum(tl.where((rows < BT - 1)[:, None], g_next, 0.0), axis=0, reverse=True)
    w_c = tl.load(w + r * BKP + ck[None, :]).to(tl.float32)
    dwp = tl.dot(tl.trans(X), dw, input_precision=PREC)  # dw' = X^T dw
    dM_kk += tl.dot(dwp, tl.trans(w_c), input_precision=PREC)
    eg = tl.exp2(gc)
    ed = tl.exp2(after)
    kg = k_all * eg
    db += tl.sum(dwp * kg, axis=1)
    dkg = beta_all[:, None] * dwp
    # kd's term, -x_i on row i and +x_i at the chunk's end, adds x_i to dg_t for t > i only: the chunk's last
    # row (ed = 1, the largest) adds nothing to a row of the chunk and is left out of both (module docstring,
    # "Rounding of dg"), so that `end` carries no rounding of it.
    x_kd = tl.where((rows == tl.minimum(n_t, BT) - 1)[:, None], 0.0, k_all * ed * dkd)
    dgc_c = qs * eg * dqg + kg * dkg - x_kd
    end = tl.sum(x_kd, axis=0) + tl.exp2(gc_end) * dgl

    k_off = t0 * HV * K + i_hv * K  # [B, T, HV, K] gradients: row t of the chunk at + t * HV * K
    tk_off = rows[:, None] * HV * K + ck[None, :]
    tk_mask = (rows[:, None] < n_t) & (ck[None, :] < K)
    tl.store(dq + k_off + tk_off, scale * eg * dqg, mask=tk_mask)
    tl.store(dk + k_off + tk_off, eg * dkg + ed * dkd, mask=tk_mask)
    tl.store(dgc + k_off + tk_off, dgc_c, mask=tk_mask)
    tl.store(dgc_end + hb + ck, end)
    tl.store(db_part + i_k * part_stride + t0 * HV + i_hv + rows * HV, db, mask=rows < n_t)
    m_off = r * BT + rows[None, :]
    tl.store(dA_part + i_k * a_stride + m_off, tl.where(rows[:, None] > rows[None, :], -dM_kk, 0.0))
    if FIRST:
        tl.store(dAqk + m_off, tl.where(rows[:, None] >= rows[None, :], dM_qk, 0.0))


@jit
def _sum_shares(ptr, off, stride, N: tl.constexpr):
    """The sum of N float32 shares of one tile, `stride` elements apart (the key blocks' shares of dA)."""
    x = tl.load(ptr + off)
    for i in tl.static_range(1, N):
        x += tl.load(ptr + i * stride + off)
    return x


@jit
def _gram_rows_before(dA_c, dQ_c, k_h, g_h, ck, i_a, start, H, HV, K, n_t, a_stride,
                      BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, NKB: tl.constexpr,
                      PREC: tl.constexpr):  # fmt: skip
    """The rows' side of block i_a's rows i through the columns j before the block, before the row factor:
    sum_j dM_ij k_j 2^(gates j+1 .. start-1), for dM = dA (the sum of its NKB shares) and dAqk. One 16 x 16
    tile of each per block before i_a, nearest first: the column factor is that block's reverse scan of the
    next rows' gates plus the gates of the blocks between (`between`, grown block by block), so each
    exponent is a sum of consecutive gates, <= 0."""
    rc = tl.arange(0, BC)
    tile = rc[:, None] * BT + rc[None, :]  # a 16 x 16 tile of dM: dM[i, j] at i * BT + j
    between = tl.zeros([BK], dtype=tl.float32)
    s_kk = tl.zeros([BC, BK], dtype=tl.float32)
    s_qk = tl.zeros([BC, BK], dtype=tl.float32)
    for i in range(i_a):
        jb = i_a - 1 - i
        tj = jb * BC + rc
        # gate j+1 on row j; the gates from row start on are not this pair's (loaded as zeros)
        g_next = _gates(load_rows(g_h, tj + 1, HV * K, ck, K, tl.minimum(n_t, start)))
        col_x = tl.cumsum(g_next, axis=0, reverse=True) + between[None, :]
        between += tl.sum(g_next, axis=0)
        k_col = _finite(load_rows(k_h, tj, H * K, ck, K, n_t).to(tl.float32)) * tl.exp2(col_x)
        off = start * BT + jb * BC + tile
        s_kk += tl.dot(_sum_shares(dA_c, off, a_stride, NKB), k_col, input_precision=PREC)
        s_qk += tl.dot(tl.load(dQ_c + off).to(tl.float32), k_col, input_precision=PREC)
    return s_kk, s_qk


@jit
def _gram_cols_after(dA_c, dQ_c, q_h, k_h, g_h, beta_h, ck, i_a, start, H, HV, K, n_t, scale, a_stride,
                     BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, NKB: tl.constexpr,
                     PREC: tl.constexpr):  # fmt: skip
    """The columns' side of block i_a's keys j through the rows i after the block, before the column factor:
    sum_i dM_ij a_i 2^(gates end+1 .. i), a = beta k for dA and scale q for dAqk. One transposed 16 x 16
    tile of each per block after i_a, nearest first: the row factor is that block's own gate cumsum plus the
    gates of the blocks between."""
    rc = tl.arange(0, BC)
    tile_t = rc[None, :] * BT + rc[:, None]  # transposed: dM[i, j] at [j, i]
    between = tl.zeros([BK], dtype=tl.float32)
    db = tl.zeros([BC, BK], dtype=tl.float32)
    for ab in range(i_a + 1, BT // BC):
        k_r, qs_r, g_r, beta_r = _block_inputs(q_h, k_h, g_h, beta_h, ab * BC + rc, ck, H, HV, K, n_t, scale)
        row_f = tl.exp2(tl.cumsum(g_r, axis=0) + between[None, :])
        between += tl.sum(g_r, axis=0)
        off = ab * BC * BT + start + tile_t
        db += tl.dot(
            _sum_shares(dA_c, off, a_stride, NKB), beta_r[:, None] * k_r * row_f, input_precision=PREC
        )
        db += tl.dot(tl.load(dQ_c + off).to(tl.float32), qs_r * row_f, input_precision=PREC)
    return db


@jit(do_not_specialize=["NT"])
def _local_k_kernel(
    q, k, g, beta, dA_part, dAqk,  # inputs; dA as _local_v_kernel's NKB key-block shares, a_stride apart
    dq, dk, dgc,  # partial gradients from _local_v_kernel (dgc gets the block's terms in place)
    dq_out, dk_out,  # the finished dq, dk: the inputs' dtype when HV == H (no cast left), else dq, dk again
    dbeta_part,  # float32 [cdiv(K, BK), B * T * HV]: this key block's share of dbeta
    floor_hit,  # int32 [HV * NCH], zeros: set to 1 for a chunk with a gate at or below GATE_FLOOR
    chunks,  # varlen only: the chunk table
    T, H, HV, K, NT, NCH, scale, part_stride, a_stride,  # part_stride = B * T * HV
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr,
    NKB: tl.constexpr,
):  # fmt: skip
    """Per (chunk x 16-row block i_a, value head, block of BK key channels): the gradients of the block's rows
    through the gated Gram matrices A and Aqk, written once (no other program writes these rows):

    1. rows' side: the columns before the block, anchored at its start (`_gram_rows_before`, then the row
       factor 2^(gates start .. i));
    2. the diagonal block (`_diag_gram_bwd`: middle-row anchor, or the exact pairwise form);
    3. columns' side: the block's keys against the rows after it, anchored at its end (`_gram_cols_after`,
       then the column factor 2^(gates j+1 .. end));
    4. dq finished, dk finished, dgc += the block's Gram terms, the key block's share of dbeta.

    dg, a reverse cumsum over the whole chunk, needs all four blocks: `_local_dg_kernel` runs after. It
    zeroes dg where a gate was raised to GATE_FLOOR, and reads the gates for that only in the chunks this
    kernel marks in `floor_hit` (a gate at or below the floor among the block's rows). dA
    arrives as _local_v_kernel's NKB key-block shares, added here as they are loaded (`_sum_shares`)."""
    NB: tl.constexpr = BT // BC
    i_cb = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_k = tl.program_id(2)
    i_c = i_cb // NB  # a chunk's four blocks are neighbours in the grid: its dA tiles stay in L2
    i_a = i_cb % NB
    i_h = i_hv // (HV // H)
    t0, t_end = chunk_span(i_c, chunks, T, NT, BT, IS_VARLEN)
    n_t = (t_end - t0).to(tl.int32)
    start = i_a * BC
    end = start + BC - 1
    rc = tl.arange(0, BC)
    ta = start + rc
    ck = i_k * BK + tl.arange(0, BK)
    q_h = q + t0 * H * K + i_h * K
    k_h = k + t0 * H * K + i_h * K
    g_h = g + t0 * HV * K + i_hv * K
    beta_h = beta + t0 * HV + i_hv
    c = (i_hv * NCH + i_c).to(tl.int64)
    dA_c = dA_part + c * BT * BT  # the chunk's C x C tiles of dA (share 0) and dAqk
    dQ_c = dAqk + c * BT * BT

    k_a, qs_a, g_a, beta_a = _block_inputs(q_h, k_h, g_h, beta_h, ta, ck, H, HV, K, n_t, scale)
    # Gates base2_gates raised to the floor, and any within a power of two of it (a margin for rounding):
    # _local_dg_kernel checks that chunk's gates exactly.
    floor_rows = tl.max(tl.where(g_a < KERNEL_GATE_FLOOR * 1.4426950408889634 + 1.0, 1, 0))
    tl.store(floor_hit + c, 1, mask=floor_rows > 0)  # every writer writes the same 1
    bk_a = beta_a[:, None] * k_a
    da_kk = tl.zeros([BC, BK], dtype=tl.float32)
    da_qk = tl.zeros([BC, BK], dtype=tl.float32)
    if i_a > 0:  # 1.
        s_kk, s_qk = _gram_rows_before(dA_c, dQ_c, k_h, g_h, ck, i_a, start, H, HV, K, n_t, a_stride, BT, BC, BK,
                                       NKB, PREC)  # fmt: skip
        row_f = tl.exp2(tl.cumsum(g_a, axis=0))  # the block's gates up to row i, its first row's included
        da_kk = s_kk * row_f
        da_qk = s_qk * row_f
    d_tile = ta[:, None] * BT + ta[None, :]  # 2.
    dA_d = _sum_shares(dA_c, d_tile, a_stride, NKB)
    # Aqk's diagonal (decay 1) adds the same q_i dAqk_ii k_i to dgc twice, with opposite signs: it is taken
    # out of the products and added to dq and dk alone (module docstring, "Rounding of dg").
    dQ_d = tl.load(dQ_c + d_tile).to(tl.float32)
    on_diag = rc[:, None] == rc[None, :]
    dQ_ii = tl.sum(tl.where(on_diag, dQ_d, 0.0), axis=1)[:, None]
    da_d, dq_d, db_a = _diag_gram_bwd(dA_d, tl.where(on_diag, 0.0, dQ_d), bk_a, qs_a, k_a, g_a, BC, PREC)
    da_kk += da_d
    da_qk += dq_d
    if i_a < NB - 1:  # 3.
        db_c = _gram_cols_after(dA_c, dQ_c, q_h, k_h, g_h, beta_h, ck, i_a, start, H, HV, K, n_t, scale, a_stride,
                                BT, BC, BK, NKB, PREC)  # fmt: skip
        # gates j+1 .. end for j in the block: gate j+1 on row j, the row after the block's end as zero
        g_na = _gates(load_rows(g_h, ta + 1, HV * K, ck, K, tl.minimum(n_t, end + 1)))
        db_a += db_c * tl.exp2(tl.cumsum(g_na, axis=0, reverse=True))

    a_off = t0 * HV * K + i_hv * K + ta[:, None] * HV * K + ck[None, :]  # 4.
    a_mask = (ta[:, None] < n_t) & (ck[None, :] < K)
    dq_a = tl.load(dq + a_off, mask=a_mask, other=0.0) + scale * (da_qk + dQ_ii * k_a)
    tl.store(dq_out + a_off, dq_a.to(dq_out.dtype.element_ty), mask=a_mask)
    dk_a = tl.load(dk + a_off, mask=a_mask, other=0.0) + beta_a[:, None] * da_kk + db_a + dQ_ii * qs_a
    tl.store(dk_out + a_off, dk_a.to(dk_out.dtype.element_ty), mask=a_mask)
    dg_a = tl.load(dgc + a_off, mask=a_mask, other=0.0) + bk_a * da_kk + qs_a * da_qk - k_a * db_a
    tl.store(dgc + a_off, dg_a, mask=a_mask)
    tl.store(
        dbeta_part + i_k * part_stride + (t0 + ta) * HV + i_hv, tl.sum(k_a * da_kk, axis=1), mask=ta < n_t
    )


@jit(do_not_specialize=["NT"])
def _local_dg_kernel(
    g, dgc, dgc_end,  # dgc: every term of every row, from kernels 5 and 6; becomes dg in place
    floor_hit,  # int32 [HV * NCH]: 1 where _local_k_kernel saw a gate at or below GATE_FLOOR
    chunks, T, HV, K, NT, NCH,
    BT: tl.constexpr, BK: tl.constexpr, BKP: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """Per (chunk, value head, block of BK key channels): dg = the reverse cumsum of dgc within the chunk,
    gc_i = g_1 + ... + g_i giving dg_t = sum_{i >= t} dgc_i, with the chunk-end terms on the padded chunk's last
    row (rows past the sequence's end carry zeros: their gates were loaded as 0, so they add nothing)."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_k = tl.program_id(2)
    t0, t_end = chunk_span(i_c, chunks, T, NT, BT, IS_VARLEN)
    n_t = (t_end - t0).to(tl.int32)
    rows = tl.arange(0, BT)
    ck = i_k * BK + tl.arange(0, BK)
    c = (i_hv * NCH + i_c).to(tl.int64)
    tk_off = t0 * HV * K + i_hv * K + rows[:, None] * HV * K + ck[None, :]
    tk_mask = (rows[:, None] < n_t) & (ck[None, :] < K)
    d = tl.load(dgc + tk_off, mask=tk_mask, other=0.0)
    end = tl.load(dgc_end + c * BKP + ck, mask=ck < K, other=0.0)  # dgc_end rows are BKP (K padded) wide
    d = tl.where((rows == BT - 1)[:, None], d + end[None, :], d)
    dg = tl.cumsum(d, axis=0, reverse=True)
    # A gate below GATE_FLOOR was raised to it (`base2_gates`): the output does not depend on it, dg = 0.
    # The gates are read only in chunks where _local_k_kernel saw one at the floor (a third of the bytes).
    if tl.load(floor_hit + c) != 0:
        g_c = load_rows(g + t0 * HV * K + i_hv * K, rows, HV * K, ck, K, n_t).to(tl.float32)
        dg = tl.where(g_c < KERNEL_GATE_FLOOR, 0.0, dg)
    tl.store(dgc + tk_off, dg, mask=tk_mask)


def chunk_kda_bwd(
    q, k, v, g, beta, scale, h0, do, dht, cu_seqlens=None, lk_block=32, lk_warps=2, lv_block=64, lv_warps=8,
    lk_stages=None, kept=None, bv=None, wu_prec=None, pass_depth=None,
):  # fmt: skip
    """Launch the kernels (up to eight; the module docstring numbers them 1-7) on contiguous inputs; returns
    dq, dk, dv, dg, dbeta, dh0 (dh0 None without h0).

    `kept`: the forward's intermediates (`chunk_kda_fwd`'s `keep` dict, cut to a `KEEP_MODES` entry), used
    instead of running kernels 1-2 again: all of them, or X, Aqk and qg, and then only the w/u kernel runs.
    The dict is emptied, so that each buffer is freed here as soon as it is no longer needed.

    `lk_block` / `lv_block` key channels and `lk_warps` / `lv_warps` warps per program of `_local_k_kernel` /
    `_local_v_kernel` are tuning knobs, and so is `lk_stages`, the pipeline depth of `_local_k_kernel`'s loops
    (None: Triton's default). The defaults are the fastest of bench/kernels/tune_bwd.py's sweep on the H200
    (docs/kernel-design.md has the sweep's outcome). `pass_depth`: the pipeline depth of the two state passes
    (3-4), `pass_stages`' choice when None; `bv` their value columns per program, `scan_value_block`'s when
    None.

    With cu_seqlens (N sequences packed along T, B = 1), h0, dht and dh0 are per sequence, [N, HV, K, V]."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT, BK, BVP = CHUNK, pow2(K), pow2(V)
    varlen = cu_seqlens is not None
    layout = chunk_layout(T, B, cu_seqlens, BT)
    NT, NCH, chunks, offsets = layout
    N = cu_seqlens.numel() - 1 if varlen else B
    idt, prec = work_precision(q.dtype)
    dev = q.device
    rows = HV * NCH * BT
    f32 = dict(device=dev, dtype=torch.float32)
    lo = dict(device=dev, dtype=idt)

    # Every token lies in exactly one chunk, so the kernels write every entry of the gradients.
    new = torch.empty if NCH * HV * K * V > 0 else torch.zeros  # else nothing runs: all gradients zero
    dv = new(v.shape, device=dev, dtype=v.dtype)
    dq, dk, dg = (new(B, T, HV, K, **f32) for _ in range(3))
    dbeta = new(B, T, HV, **f32)
    dh0 = torch.empty(N, HV, K, V, **f32) if h0 is not None else None
    if new is torch.zeros:
        if dh0 is not None:  # no steps: the final state is h0
            dh0.copy_(dht if dht is not None else torch.zeros_like(dh0))
        return _finish(q, k, g, beta, dq, dk, dv, dg, dbeta, dh0, H)

    # 1-2. Recompute the chunk-local intermediates and the UT inverse (or take the forward's: all of them, or
    # its matrices X and Aqk and qg, and then remake the rest with the w/u kernel alone).
    if kept is None or set(kept) != set(KEEP_MODES["all"]):
        reuse = {name: kept.pop(name) for name in list(kept)} if kept else None  # emptied, as below
        kept = prepare_chunks(q, k, v, g, beta, scale, layout, store_x=True, wu_prec=wu_prec, reuse=reuse)[0]
        del reuse
    w, u, qg, kd, aqk, gl, x = (kept.pop(name) for name in ("w", "u", "qg", "kd", "aqk", "gl", "x"))

    # 3-4. The two passes over the chunks of each sequence: states forward, state gradients backward.
    bv = bv or scan_value_block(N * HV, V, BVP, idt.itemsize)
    stages = pass_stages(BK, w.element_size(), bv) if pass_depth is None else pass_depth
    h = torch.empty(HV * NCH, BK, BVP, **lo)
    vn = torch.empty(rows, BVP, **lo)
    _states_kernel[(triton.cdiv(V, bv), N * HV)](
        w, u, kd, gl, h0, h, vn, offsets, HV, K, V, NT, NCH,
        BT=BT, BK=BK, BVP=BVP, BV=bv, USE_H0=h0 is not None, PREC=prec, IS_VARLEN=varlen,
        num_warps=4, num_stages=stages,
    )  # fmt: skip
    dh = torch.empty(HV * NCH, BK, BVP, **lo)
    dvn = torch.empty(rows, BVP, **f32)
    _dstates_kernel[(triton.cdiv(V, bv), N * HV)](
        qg, kd, w, aqk, gl, do, dht, dh, dvn, dh0, chunks, offsets, T, HV, K, V, NT, NCH,
        BT=BT, BK=BK, BVP=BVP, BV=bv, USE_DHT=dht is not None, STORE_DH0=h0 is not None, PREC=prec,
        IS_VARLEN=varlen, num_warps=4, num_stages=stages,
    )  # fmt: skip
    del qg, kd

    # 5-6. Chunk-local gradients.
    dgc_end = torch.empty(HV * NCH, BK, **f32)
    dAqk = aqk  # Aqk is no longer needed after kernel 4: its buffer takes dAqk
    kbv = min(BK, lv_block)  # key channels per program of _local_v_kernel
    nkb = triton.cdiv(K, kbv)
    dA_part = torch.empty(nkb, *x.shape, **f32)  # each key block's share of dA (X is still being read)
    x_numel = x.numel()
    db_part = torch.empty(nkb, B * T * HV, **f32)
    for first, grid in ((True, (NCH, HV, 1)), (False, (NCH, HV, nkb - 1))):  # key block 0, then the rest
        if grid[2] == 0:
            continue
        _local_v_kernel[grid](
            q, k, v, g, beta, do, u, w, x, h, vn, dh, dvn, dv, dq, dk, dg, dgc_end, db_part, dA_part, dAqk,
            chunks, T, H, HV, K, V, NT, NCH, scale, B * T * HV, x_numel,
            BT=BT, BK=kbv, BKP=BK, BVP=BVP, BV=min(BVP, 64), PREC=prec, IS_VARLEN=varlen, FIRST=first,
            num_warps=lv_warps, **_local_v_stages(BK, w.element_size()),
        )  # fmt: skip
    del x  # dA stays as its nkb shares: _local_k_kernel adds them as it loads them
    dbeta.copy_(db_part.sum(0).view(dbeta.shape))
    del db_part
    kb = min(BK, lk_block)  # key channels per program: [16, kb] tiles instead of [16, K] ones
    dbeta_part = torch.zeros(triton.cdiv(K, kb), B * T * HV, **f32)
    # With one value head per key head, local_k writes dq and dk in the inputs' dtype: no cast kernels after.
    dq_out, dk_out = dq, dk
    if HV == H and q.dtype != torch.float32:
        dq_out, dk_out = (
            torch.empty(q.shape, device=dev, dtype=q.dtype),
            torch.empty(k.shape, device=dev, dtype=k.dtype),
        )
    floor_hit = torch.zeros(HV * NCH, device=dev, dtype=torch.int32)
    _local_k_kernel[(NCH * (BT // SUB), HV, triton.cdiv(K, kb))](
        q, k, g, beta, dA_part, dAqk, dq, dk, dg, dq_out, dk_out, dbeta_part, floor_hit,
        chunks, T, H, HV, K, NT, NCH, scale, B * T * HV, x_numel,
        BT=BT, BC=SUB, BK=kb, PREC=prec, IS_VARLEN=varlen, NKB=nkb, num_warps=lk_warps,
        **({} if lk_stages is None else dict(num_stages=lk_stages)),
    )  # fmt: skip
    dgb = min(BK, 32)  # key channels per program of the reverse cumsum
    _local_dg_kernel[(NCH, HV, triton.cdiv(K, dgb))](
        g, dg, dgc_end, floor_hit, chunks, T, HV, K, NT, NCH, BT=BT, BK=dgb, BKP=BK, IS_VARLEN=varlen, num_warps=4
    )  # fmt: skip
    del dq, dk, dA_part
    dbeta += dbeta_part.sum(0).view(dbeta.shape)
    del dbeta_part  # the shares are gone before the casts
    return _finish(q, k, g, beta, dq_out, dk_out, dv, dg, dbeta, dh0, H)


def _finish(q, k, g, beta, dq, dk, dv, dg, dbeta, dh0, H):
    """Sum dq, dk over the value heads that share a query/key head; cast to the inputs' dtypes."""
    B, T, HV, K = dq.shape
    if HV != H:  # a query/key head serves HV // H value heads: add their gradients
        dq = dq.view(B, T, H, HV // H, K).sum(3)
        dk = dk.view(B, T, H, HV // H, K).sum(3)
    return dq.to(q.dtype), dk.to(k.dtype), dv, dg.to(g.dtype), dbeta.to(beta.dtype), dh0


def _local_v_stages(BK: int, itemsize: int) -> dict:
    """Pipeline depth of `_local_v_kernel`, from BK = K padded (not the program's key block). With float32
    intermediates Triton's default (3 stages) asked for more shared memory than a Hopper SM has when a program
    held all K key channels (311 kB at K = 128, V = 64 on the H200; limit 227 kB): two stages fit up to
    K = 128 (164 kB), one beyond (197 kB at K = V = 256; sizes from compiling for sm_90). A program now holds
    lv_block channels, which needs less, so the rule errs on the safe side. Offline sm_90 compile of the split
    kernel (Triton 3.9, float32, first key block, blocks of 64): 112 kB at 2 stages (208 kB at 3) for
    K = V = 128, and 112 kB at 2 stages for K = V = 256, where this rule takes 1 (80 kB)."""
    if itemsize < 4:
        return {}
    return dict(num_stages=2 if BK <= 128 else 1)


def refuse_double_backward(name: str) -> None:
    """Raise a RuntimeError inside a backward taken with create_graph=True (grad mode is on there only then).

    The kernels' gradients are plain tensors with no graph of their own, so a second derivative through them
    (a gradient penalty, a Hessian-vector product) would silently miss every term that passes through them."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{name}'s backward (Triton kernels) is not differentiable: second derivatives "
            "(torch.autograd.grad or backward with create_graph=True, e.g. a gradient penalty) are not "
            "supported through it; use kda_edu.ops.kda.kda_chunked, whose backward is differentiable"
        )
