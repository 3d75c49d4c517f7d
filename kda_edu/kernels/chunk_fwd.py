"""Chunked KDA forward in Triton: three kernels parallel over chunks, then one sequential over them.

This is `kda_edu.ops.kda.kda_chunked` (read its docstring first: the notation below is the same) turned into
kernels whose tiles stay small. The chunk's 64 rows are four blocks of 16; L = Diag(beta) A.

Kernel 1, `_chunk_gram_kernel`, one program per (chunk, value head), all chunks at once: KC key columns at a
    time, A (keys against keys) and Aqk (queries against keys) in two 64 x 64 accumulators, and
    qg = scale Q * exp(gc) (gc the gate cumsum within the chunk). Writes qg, Aqk whole (zeros above the
    diagonal, so the scan reads it without a mask) and L (float32) into the x buffer.
Kernel 2, `_chunk_inverse_kernel`, one program (one warp) per (chunk, value head): X = (I + L)^-1 over L in
    place. The diagonal blocks X_aa = (I + L_aa)^-1 by forward substitution (16 rows, element-wise float32:
    accurate when keys are nearly parallel, see `_unit_lower_inverse`), then block row a of (I + L) X = I
    gives X_ac = -X_aa sum_{c <= b < a} L_ab X_bc for c < a (16 products of 16 x 16 blocks).
Kernel 3, `_chunk_wu_kernel`, one program per (chunk, value head): the UT transform as whole-chunk products,
    w = X Diag(beta) (K * exp(gc)) and u = X Diag(beta) V (64 x 64 times 64 x KC), kd = K * exp(gc_C - gc)
    and exp(gc_C).
    Nothing in kernels 1-3 depends on the state, so every chunk runs in parallel. The backward runs the same
    three to recompute them (chunk_bwd.py), and keeps X from the x buffer.
Kernel 4, `_chunk_scan_kernel`, one program per (value block, sequence x value head), chunk after chunk
    (the value block from `scan_value_block`):
    with the state S (K x BV, float32, in registers for the whole sequence)
        U = u - w S;   O = qg S + Aqk U;   S = Diag(exp(gc_C)) S + kd^T U
    four matrix products per chunk, two against S (w S, qg S) and two against U (Aqk U, kd^T U): the only
    sequential work left.

The launcher cuts the time axis into pieces (`time_pieces`, on a GPU at sizes where it pays) and launches each
piece's scan on a second stream of higher priority as soon as that piece's prepare kernels are done: the scan,
one latency-bound program per multiprocessor, runs beside the next piece's prepare kernels instead of after
all of them, and passes its state to the next piece through the final-state buffer (`chunk_kda_fwd`).

Why three prepare kernels and not one: one kernel could do kernels 1-3's work (the A blocks, the
inverse, then w and u by block substitution), holding everything in registers: 255 registers at 4 warps, two
programs per multiprocessor, instruction-bound (an ncu profile on the H200). Split, each kernel holds
only its own work; on the H200 the prepare fell from 1.19 to 0.85 ms at (1, 8192, 32), most of it from the
bf16 products of kernel 1 and from kd's exponent in kernel 3 (docs/kernel-design.md).

Between the prepare kernels and the scan go w, qg, kd, u, Aqk and exp(gc_C): about (3K + V + C) numbers per step and head,
stored in the input's 16-bit dtype (float32 for float32 inputs). Their layout is [HV, chunk, row, column]:
chunks are numbered over all sequences, so a packed batch (`cu_seqlens`) only changes which token a chunk
starts at; a chunk never straddles two sequences.

Overflow, and why the chunk is cut into blocks of 16 rows. The decay between steps j <= i of a chunk is
exp(gc_i - gc_j) <= 1, but a matrix product needs it split into a row factor times a column factor. Split at
the chunk start, exp(gc_i) * exp(-gc_j), the column factor reaches exp(64 * 5) = exp(320) for 64 steps of
gates at -5: float32 overflows past exp(88.7). So every split is anchored where both factors stay bounded:
  * block (a, c) left of the diagonal (j in block c < a): anchor at the end boundary e_c of block c. Row
    factor exp(gc_i - e_c) <= 1 (i comes after the boundary), column factor exp(e_c - gc_j) <= 1 (j before
    it). Both exponents are <= 0 whatever the gates, and both are gate sums over a few blocks computed
    from per-block cumsums, so their rounding stays small; a factor that underflows to 0 only drops a
    product that is smaller still.
  * the 16 x 16 diagonal blocks: anchor at the block's middle row m. Each factor's exponent is bounded by
    the gate sum over at most 8 steps: |exponent| <= 8 * 5 / ln 2 = 58 (in powers of two) for gates down to
    -5, far inside float32's range (2^-126 .. 2^127). For gates so large that the half-block sum passes 96
    powers of two (about -8.3 per step) the kernel switches, for that step of key columns, to computing the
    four diagonal blocks one at a time, and a block whose own span is too large in the exact pairwise form:
    one column at a time, exp(gc_i - gc_j) with the exponent clipped at 0. Realistic gates never take that
    branch; it is there so that no input produces inf or NaN.
All gates are carried in base 2 (g * log2(e)) so that every decay is one `exp2`.

How kernel 1 multiplies: the anchors above differ from block to block, so one plain product of the whole
chunk cannot respect them, and products of 16 x 16 blocks (one per block pair, chapter 8's first version) run
as per-warp `mma.sync` on Hopper. Instead every product is a whole 64-row tile, the shape of Hopper's
warpgroup products (`wgmma`): for each column block c, one product of all the rows after block c against the
keys of block c, with every other row and column scaled by 2^-inf = 0; and one product for the four
diagonal blocks, each row and column scaled by its own block's middle anchor, of which only the diagonal
blocks are kept. That multiplies more zeros than the ten useful blocks need, and is faster all the same.
Kernel 3 has no anchor to respect (exp(gc) <= 1) and multiplies whole chunks. The designs tried and their
timings are in docs/kernel-design.md.

Precision: gates, decays, A, L, X and the state are float32. With 16-bit inputs kernel 1's products round both
operands to bfloat16 (`tile_mm`; bfloat16 has float32's exponent range, which the anchored factors need, and
its 8-bit mantissa matches the 16-bit intermediates it feeds), so do kernel 3's (X rounded to bfloat16 as well,
on the H200 0.04-0.3 ms faster at the headline shapes for a relative change of 3.3e-3 in o;
tf32 where a tile has 16 columns, see `prepare_chunks`), kernel 2 uses
tf32, and the products against the state use the 16-bit dtype, all with float32 accumulation. With float32 inputs every product is
exact float32 ("ieee"). Under Triton's interpreter everything is float32 (its 16-bit `tl.dot` is unreliable).
The diagonal inverses use no product at all: element-wise float32 forward substitution. kd's exponent
gc_C - gc_j is summed from the gates after j (a reverse cumsum) with float32 intermediates, exact after a
reset; with 16-bit intermediates it is the chunk's gate total minus the cumsum (a scan less), whose rounding
after a reset (both near -151 per reset in base 2) is ~1e-5 relative per reset, far below the 16-bit kd's
own rounding (3.9e-3 for bfloat16).

Resets and bad values. Gates are raised to GATE_FLOOR (-105, whose exp is 0 in float32) as they are loaded
(`base2_gates`): a reset of -1000 or -inf decays exactly as before, and every gate sum stays finite and small.
A NaN or inf in k, v or beta, or a NaN or +inf gate, at step t: the prepare kernels compute with zeros in
its place (so every product stays finite, and the zeros of the causal masks multiply numbers) and kernel 3
writes NaN into row t of u; the scan kernel reads U with its non-finite rows as zeros for Aqk U and sets the outputs
from the first such row on to NaN; the state update kd^T U reads the NaN rows, so the state after the chunk
is NaN, as in the loop. The outputs before t are exact.
"""

from contextlib import nullcontext

import torch
import triton
import triton.language as tl

from kda_edu.kernels._backend import interpreting, jit
from kda_edu.kernels.chunk_common import (
    CHUNK,
    DIAG_LIMIT,
    KEEP_MODES,
    SUB,
    base2_gates,
    chunk_layout,
    chunk_program,
    diag_span,
    load_rows,
    piece_chunk,
    pow2,
    seq_chunks,
    work_precision,
)
from kda_edu.kernels.chunk_launch import (
    device_multiprocessors,
    pass_stages,
    scan_stream,
    scan_value_block,
    time_pieces,
)


@jit
def _substitute_row(L, X, i, r):
    """Row i of forward substitution for X = (I + L)^-1: X_i = e_i - sum_{j < i} L_ij X_j."""
    l_i = tl.sum(tl.where(r[:, None] == i, L, 0.0), axis=0)  # row i of L (zeros from column i on)
    x_i = tl.sum(l_i[:, None] * X, axis=0)  # sum_j L_ij X_j; rows j >= i of X are still e_j
    return tl.where(r[:, None] == i, X - x_i[None, :], X)


@jit
def _unit_lower_inverse(L0, L1, L2, L3, BC: tl.constexpr):
    """(I + L_a)^-1 of four strictly lower-triangular 16 x 16 blocks by forward substitution, one row at a
    time and the four blocks side by side (independent chains), in float32 element-wise products (no
    tl.dot). Row i reads only rows j < i, so a NaN in a later row never reaches an earlier one, and the
    rounding stays that of the substitution: the Neumann product (I - L)(I + L^2)(I + L^4)(I + L^8) built
    L^8, whose entries reach about 1.5e3 when keys are nearly parallel and beta is 1 (relative error 3.5e-4
    in chunk_kda's float32 output, 6.5e-7 with the substitution; tests/kernels/test_numerics.py)."""
    r = tl.arange(0, BC)
    X0 = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    X1, X2, X3 = X0, X0, X0
    for i in range(1, BC):
        X0 = _substitute_row(L0, X0, i, r)
        X1 = _substitute_row(L1, X1, i, r)
        X2 = _substitute_row(L2, X2, i, r)
        X3 = _substitute_row(L3, X3, i, r)
    return X0, X1, X2, X3


@jit
def clean_nonfinite(x):
    """x with its NaN and inf entries replaced by 0, and a flag per row: 1.0 where the row had one."""
    ok = tl.abs(x) < float("inf")
    return tl.where(ok, x, 0.0), tl.max(tl.where(ok, 0.0, 1.0), axis=1)


@jit
def _spoil(x, bad):
    """x with the rows flagged in `bad` (> 0) set to NaN."""
    return tl.where(bad[:, None] > 0, float("nan"), x)


@jit
def valid_beta(b):
    """beta [R, 1] in float32 with the entries outside [0, 1] (NaN, inf included) replaced by 0, and a flag
    per row: 1.0 where the row had one."""
    b = b.to(tl.float32)
    ok = (b >= 0.0) & (b <= 1.0)
    return tl.where(ok, b, 0.0), tl.max(tl.where(ok, 0.0, 1.0), axis=1)


@jit
def _pairwise_column(k_a, gc_a, j, rc):
    """Key j of a 16-row block against every row's gates, for the exact pairwise form of a diagonal block:
    e_ic = k_jc 2^min(gc_ic - gc_jc, 0) (row i's weight for column j is then sum_c x_ic e_ic)."""
    pick = (rc == j)[:, None]
    k_j = tl.sum(tl.where(pick, k_a, 0.0), axis=0)
    gc_j = tl.sum(tl.where(pick, gc_a, 0.0), axis=0)
    return tl.exp2(tl.minimum(gc_a - gc_j[None, :], 0.0)) * k_j[None, :]


@jit
def tile_mm(a, b, PREC: tl.constexpr):
    """a @ b in float32 accumulation; PREC "bf16" rounds both operands to bfloat16 first (float32's range)."""
    if PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a, b, input_precision=PREC)


@jit
def diag_grams(k_a, q_a, gc_a, BC: tl.constexpr, PREC: tl.constexpr):
    """The 16 x 16 diagonal blocks of the two gated Gram matrices of one block of rows, together:
    Mk_ij = sum_c k_ic k_jc 2^(gc_ic - gc_jc) and Mq_ij = sum_c q_ic k_jc 2^(gc_ic - gc_jc) (entries j > i are
    junk). Anchored at the block's middle row when its half-block gate sums allow it (`diag_span`), else the
    exact pairwise form."""
    mid, span = diag_span(gc_a, BC)
    if span <= DIAG_LIMIT:
        col = tl.trans(k_a * tl.exp2(mid[None, :] - gc_a))
        row_f = tl.exp2(gc_a - mid[None, :])
        Mk = tile_mm(k_a * row_f, col, PREC)
        Mq = tile_mm(q_a * row_f, col, PREC)
    else:  # exact pairwise form, one column at a time, exponent clipped at 0 (only rows i < j clip)
        rc = tl.arange(0, BC)
        Mk = tl.zeros([BC, BC], dtype=tl.float32)
        Mq = tl.zeros([BC, BC], dtype=tl.float32)
        for j in range(BC):
            e = _pairwise_column(k_a, gc_a, j, rc)
            Mk = tl.where(rc[None, :] == j, tl.sum(k_a * e, axis=1)[:, None], Mk)
            Mq = tl.where(rc[None, :] == j, tl.sum(q_a * e, axis=1)[:, None], Mq)
    return Mk, Mq


@jit
def store_block(ptr, row0, a, BC: tl.constexpr, n_cols, cols, x):
    """Store a [BC, len(cols)] tile as rows row0 + a * BC ... of a buffer with n_cols columns."""
    r = (row0 + a * BC + tl.arange(0, BC)).to(tl.int64)
    tl.store(ptr + r[:, None] * n_cols + cols[None, :], x.to(ptr.dtype.element_ty))


@jit
def key_block(k_h, g_h, t, cols, H, HV, K, n_t):
    """Rows t of the keys and the base-2 gate cumsum over them in key columns `cols` (gates through `base2_gates`),
    with NaN / inf keys and gates that are not <= 0 (NaN, +inf, growth) replaced by 0, and a flag per row: 1.0
    where it had one."""
    k, bad = clean_nonfinite(load_rows(k_h, t, H * K, cols, K, n_t).to(tl.float32))
    g = load_rows(g_h, t, HV * K, cols, K, n_t).to(tl.float32)
    ok = g <= 0.0  # False for NaN, +inf and any growth
    bad = tl.maximum(bad, tl.max(tl.where(ok, 0.0, 1.0), axis=1))
    return k, tl.cumsum(tl.where(ok, base2_gates(g), 0.0), axis=0), bad


@jit
def _block_cumsum(x, BC: tl.constexpr):
    """Cumsum of x [4 * BC, KC] down each BC-row block separately (restarting at rows 0, BC, 2 BC, 3 BC)."""
    return tl.reshape(tl.cumsum(tl.reshape(x, [x.shape[0] // BC, BC, x.shape[1]]), axis=1), x.shape)


@jit
def _row(x, i):
    """Row i of the tile x [R, KC], as a [1, KC] row."""
    r = tl.arange(0, x.shape[0])
    return tl.sum(tl.where((r == i)[:, None], x, 0.0), axis=0)[None, :]


@jit
def _per_block(blk, x0, x1, x2, x3):
    """[R, KC] tile whose rows in 16-row block b (blk == b, a [R, 1] column) are the [1, KC] row x_b."""
    return tl.where(blk == 0, x0, tl.where(blk == 1, x1, tl.where(blk == 2, x2, x3)))


@jit
def _left_of_diagonal(k, q, l, blk, row_exp, s_c, c: tl.constexpr, PREC: tl.constexpr):
    """Blocks (a, c) of A and Aqk for every row block a > c, from one 64-row product each: the rows i of the
    blocks after c scaled by 2^row_exp (row_exp = the gates from the end of block c to i, <= 0) against the
    keys j of block c scaled by 2^(s_c - l_j) (the gates after j within block c, <= 0). Every other row and
    column is an exact 0 (exponent -inf), so the product is 0 outside those blocks."""
    col = tl.trans(k * tl.exp2(tl.where(blk == c, s_c - l, float("-inf"))))
    row_f = tl.exp2(tl.where(blk > c, row_exp, float("-inf")))
    return tile_mm(k * row_f, col, PREC), tile_mm(q * row_f, col, PREC)


@jit
def _exact_diagonal(q_h, k_h, g_h, cols, H, HV, K, n_t, scale, BC: tl.constexpr, PREC: tl.constexpr):
    """The four diagonal 16 x 16 blocks of A and Aqk for one step of key columns, each from `diag_grams` on
    its block reloaded by `key_block` (anchored at its middle row, or the exact pairwise form when its
    half-block gate sum is too large), placed into [4 BC, 4 BC] tiles with zeros off the diagonal blocks.
    The gram kernel takes this path only for steps with gates below about -8.3 per step, or a reset."""
    rc = tl.arange(0, BC)
    a_id = tl.arange(0, 4)[
        :, None, None, None
    ]  # the 64 x 64 tiles seen as [row block, row, column block, column]
    c_id = tl.arange(0, 4)[None, None, :, None]
    Dk = tl.zeros([4, BC, 4, BC], dtype=tl.float32)
    Dq = tl.zeros([4, BC, 4, BC], dtype=tl.float32)
    for a in tl.static_range(4):
        k_a, l_a, _ = key_block(k_h, g_h, a * BC + rc, cols, H, HV, K, n_t)
        q_a = load_rows(q_h, a * BC + rc, H * K, cols, K, n_t).to(tl.float32) * scale
        Mk, Mq = diag_grams(k_a, q_a, l_a, BC, PREC)
        here = (a_id == a) & (c_id == a)
        Dk = tl.where(here, Mk[None, :, None, :], Dk)
        Dq = tl.where(here, Mq[None, :, None, :], Dq)
    return tl.reshape(Dk, [4 * BC, 4 * BC]), tl.reshape(Dq, [4 * BC, 4 * BC])


@jit(do_not_specialize=["NT", "N0", "CS", "CN"])
def _chunk_gram_kernel(
    q, k, g, beta, qg, aqk, lmat, chunks, T, H, HV, K, NT, NCH, scale, N0, CS, CN,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr, PREC: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """One program per (chunk, value head): A and Aqk in two 64 x 64 float32 accumulators, KC key columns at
    a time, and qg. Writes qg, Aqk whole (zeros above the diagonal) and L = Diag(beta) A (zeros on and above
    it) into lmat. Each step makes eight products of whole 64-row tiles (Hopper's warpgroup shape):

    * left of the diagonal, one pair per column block c = 0, 1, 2 (`_left_of_diagonal`), covering every row
      block after c at once, anchored at the end of block c (both exponents <= 0 whatever the gates);
    * the four diagonal blocks from one pair anchored at each block's middle row, of which only those blocks
      are kept: the rest mixes different anchors (possibly inf) and is discarded by a select. Each exponent
      there is bounded by its block's half-block gate sum; when one passes DIAG_LIMIT the step takes
      `_exact_diagonal` instead.

    l is the base-2 gate cumsum within each 16-row block and s_b its value at block b's last row (the block's
    gate sum), so every exponent is a sum of a few gates, never the difference of two long cumsums."""
    tl.static_assert(BT == 4 * BC)
    i_hv, i_h, t0, n_t, row0 = chunk_program(chunks, T, NT, H, HV, NCH, N0, CS, CN, BT, IS_VARLEN)
    q_h = q + t0 * H * K + i_h * K
    k_h = k + t0 * H * K + i_h * K
    g_h = g + t0 * HV * K + i_hv * K
    beta_h = beta + t0 * HV + i_hv
    rows = tl.arange(0, BT)
    blk = (rows // BC)[:, None]  # each row's 16-row block, [BT, 1]
    on_diag = blk == (rows // BC)[None, :]  # the four diagonal blocks of a [BT, BT] tile
    A = tl.zeros([BT, BT], dtype=tl.float32)
    Aq = tl.zeros([BT, BT], dtype=tl.float32)
    for kc in range(0, BK, KC):
        ck = kc + tl.arange(0, KC)
        k_c, _ = clean_nonfinite(load_rows(k_h, rows, H * K, ck, K, n_t).to(tl.float32))
        q_c = load_rows(q_h, rows, H * K, ck, K, n_t).to(tl.float32) * scale
        g_c = load_rows(g_h, rows, HV * K, ck, K, n_t).to(tl.float32)
        l = _block_cumsum(tl.where(g_c <= 0.0, base2_gates(g_c), 0.0), BC)
        s0, s1, s2 = _row(l, BC - 1), _row(l, 2 * BC - 1), _row(l, 3 * BC - 1)  # block gate sums, <= 0

        # Left of the diagonal, by column block c; row exponent l_i + the sums of the blocks between c and blk(i).
        x, y = _left_of_diagonal(k_c, q_c, l, blk, l + _per_block(blk, 0.0, 0.0, s1, s1 + s2), s0, 0, PREC)
        A, Aq = A + x, Aq + y
        x, y = _left_of_diagonal(k_c, q_c, l, blk, l + tl.where(blk == 3, s2, 0.0), s1, 1, PREC)
        A, Aq = A + x, Aq + y
        x, y = _left_of_diagonal(k_c, q_c, l, blk, l, s2, 2, PREC)
        A, Aq = A + x, Aq + y

        # The diagonal blocks, anchored at each block's middle row.
        d = l - _per_block(blk, _row(l, BC // 2), _row(l, BC + BC // 2), _row(l, 2 * BC + BC // 2),
                           _row(l, 3 * BC + BC // 2))  # fmt: skip
        if tl.max(tl.max(tl.abs(d), axis=1), axis=0) <= DIAG_LIMIT:
            col = tl.trans(k_c * tl.exp2(-d))
            row_f = tl.exp2(d)
            A += tl.where(on_diag, tile_mm(k_c * row_f, col, PREC), 0.0)
            Aq += tl.where(on_diag, tile_mm(q_c * row_f, col, PREC), 0.0)
        else:
            x, y = _exact_diagonal(q_h, k_h, g_h, ck, H, HV, K, n_t, scale, BC, PREC)
            A, Aq = A + x, Aq + y

        # qg = q 2^(gc), gc the cumsum from the chunk start: l plus the sums of the blocks before (<= 0).
        gc = l + _per_block(blk, 0.0, s0, s0 + s1, s0 + s1 + s2)
        store_block(qg, row0, 0, BT, BK, ck, q_c * tl.exp2(gc))

    beta_all, _ = valid_beta(tl.load(beta_h + rows * HV, mask=rows < n_t, other=0.0)[:, None])
    store_block(lmat, row0, 0, BT, BT, rows, tl.where(rows[:, None] > rows[None, :], beta_all * A, 0.0))
    store_block(aqk, row0, 0, BT, BT, rows, tl.where(rows[:, None] >= rows[None, :], Aq, 0.0))


@jit
def _load_block(ptr, row0, a, c, BC: tl.constexpr, BT: tl.constexpr):
    """Block (a, c) of a chunk's C x C matrix stored as rows row0 .. row0 + C - 1 of a [*, C] buffer."""
    r = (row0 + a * BC + tl.arange(0, BC)).to(tl.int64)
    return tl.load(ptr + r[:, None] * BT + c * BC + tl.arange(0, BC)[None, :])


@jit
def _neg_times(x_a, acc, PREC: tl.constexpr):
    """-x_a acc: one block of X = (I + L)^-1 left of the diagonal, from acc = sum_b L_ab X_bc."""
    return -tl.dot(x_a, acc, input_precision=PREC)


@jit(do_not_specialize=["NT", "N0", "CS", "CN"])
def _chunk_inverse_kernel(
    lmat,  # in: L = Diag(beta) A, out: X = (I + L)^-1, float32 [HV, NCH * BT, BT], in place
    NT,
    NCH,
    N0,
    CS,
    CN,  # the chunks of this launch (`piece_chunk`)
    BT: tl.constexpr,
    BC: tl.constexpr,
    PREC: tl.constexpr,
):
    """One program per (chunk, value head): X = (I + L)^-1 of the chunk, written over L.

    The diagonal blocks X_aa = (I + L_aa)^-1 by forward substitution (`_unit_lower_inverse`); then block row
    a of (I + L) X = I gives the blocks left of the diagonal, X_ac = -X_aa sum_{c <= b < a} L_ab X_bc, block
    column after block column (16 products of 16 x 16 blocks). X is lower triangular: zeros above."""
    tl.static_assert(BT == 4 * BC)
    row0 = (tl.program_id(1) * NCH + piece_chunk(NT, N0, CS, CN)).to(tl.int64) * BT
    l10, l20, l21 = (
        _load_block(lmat, row0, 1, 0, BC, BT),
        _load_block(lmat, row0, 2, 0, BC, BT),
        _load_block(lmat, row0, 2, 1, BC, BT),
    )
    l30, l31, l32 = (
        _load_block(lmat, row0, 3, 0, BC, BT),
        _load_block(lmat, row0, 3, 1, BC, BT),
        _load_block(lmat, row0, 3, 2, BC, BT),
    )
    x0, x1, x2, x3 = _unit_lower_inverse(
        _load_block(lmat, row0, 0, 0, BC, BT),
        _load_block(lmat, row0, 1, 1, BC, BT),
        _load_block(lmat, row0, 2, 2, BC, BT),
        _load_block(lmat, row0, 3, 3, BC, BT),
        BC,
    )
    x10 = _neg_times(x1, tl.dot(l10, x0, input_precision=PREC), PREC)
    x21 = _neg_times(x2, tl.dot(l21, x1, input_precision=PREC), PREC)
    x20 = _neg_times(x2, tl.dot(l20, x0, input_precision=PREC) + tl.dot(l21, x10, input_precision=PREC), PREC)
    x32 = _neg_times(x3, tl.dot(l32, x2, input_precision=PREC), PREC)
    x31 = _neg_times(x3, tl.dot(l31, x1, input_precision=PREC) + tl.dot(l32, x21, input_precision=PREC), PREC)
    acc = tl.dot(l30, x0, input_precision=PREC) + tl.dot(l31, x10, input_precision=PREC)
    x30 = _neg_times(x3, acc + tl.dot(l32, x20, input_precision=PREC), PREC)
    tl.debug_barrier()  # every thread has read L before any overwrites it
    rc = tl.arange(0, BC)
    z = tl.zeros([BC, BC], dtype=tl.float32)
    store_block(lmat, row0, 0, BC, BT, rc, x0)
    store_block(lmat, row0, 1, BC, BT, rc, x10)
    store_block(lmat, row0, 2, BC, BT, rc, x20)
    store_block(lmat, row0, 3, BC, BT, rc, x30)
    store_block(lmat, row0, 0, BC, BT, BC + rc, z)
    store_block(lmat, row0, 1, BC, BT, BC + rc, x1)
    store_block(lmat, row0, 2, BC, BT, BC + rc, x21)
    store_block(lmat, row0, 3, BC, BT, BC + rc, x31)
    store_block(lmat, row0, 0, BC, BT, 2 * BC + rc, z)
    store_block(lmat, row0, 1, BC, BT, 2 * BC + rc, z)
    store_block(lmat, row0, 2, BC, BT, 2 * BC + rc, x2)
    store_block(lmat, row0, 3, BC, BT, 2 * BC + rc, x32)
    store_block(lmat, row0, 0, BC, BT, 3 * BC + rc, z)
    store_block(lmat, row0, 1, BC, BT, 3 * BC + rc, z)
    store_block(lmat, row0, 2, BC, BT, 3 * BC + rc, z)
    store_block(lmat, row0, 3, BC, BT, 3 * BC + rc, x3)


@jit(do_not_specialize=["NT", "N0", "CS", "CN"])
def _chunk_wu_kernel(
    k,
    v,
    g,
    beta,  # inputs, contiguous
    xmat,  # X = (I + L)^-1 of every chunk, float32 [HV, NCH * BT, BT]
    w,
    u,
    kd,
    gl,  # outputs [HV, NCH * BT, BK | BV | BK] and [HV, NCH, BK]
    flags,  # int32 [1] (read only with CHECK): bit 0 set when a gate is not <= 0, bit 1 when a beta is outside [0, 1]
    chunks,
    T,
    H,
    HV,
    K,
    V,
    NT,
    NCH,
    N0,
    CS,
    CN,  # the chunks of this launch (`piece_chunk`)
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    KC: tl.constexpr,
    VC: tl.constexpr,
    PREC: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    KD_TOTAL: tl.constexpr = False,
    U_PREC: tl.constexpr = "tf32",
    CHECK: tl.constexpr = False,  # write `flags`
):
    """One program per (chunk, value head): the UT transform as whole-chunk products against X.

    w = X Diag(beta) (K * 2^gc), u = X Diag(beta) V (64 x 64 times 64 x KC each), kd = K * 2^(gc_C - gc) and
    2^gc_C. gc is the gate cumsum from the chunk's start; gc_C - gc_j is summed from the gates after j (a
    reverse cumsum: after a reset, gc_C and gc_j are both near -151 and their difference keeps ~1e-5 of its
    value), except with KD_TOTAL (16-bit intermediates, whose own rounding is far larger), which takes that
    difference and saves a second gate load and scan. Rows with a NaN or inf in k or v, a beta outside [0, 1]
    or a gate that is not <= 0 (NaN, +inf, growth) run with zeros there and are written into u as NaN (the
    scan spoils the outputs from the first such row on). With CHECK, a program that meets an invalid gate or
    beta also sets its bit in `flags`: `chunk_kda`'s value check, at the cost of two compares per value."""
    i_hv, i_h, t0, n_t, row0 = chunk_program(chunks, T, NT, H, HV, NCH, N0, CS, CN, BT, IS_VARLEN)
    k_h = k + t0 * H * K + i_h * K
    g_h = g + t0 * HV * K + i_hv * K
    v_h = v + t0 * HV * V + i_hv * V
    rows = tl.arange(0, BT)
    r = (row0 + rows).to(tl.int64)[:, None]
    X = tl.load(xmat + r * BT + rows[None, :])
    beta_all, bad_b = valid_beta(
        tl.load(beta + t0 * HV + i_hv + rows * HV, mask=rows < n_t, other=0.0)[:, None]
    )
    bad = bad_b
    bad_g = tl.zeros_like(bad)
    for kc in range(0, BK, KC):
        ck = kc + tl.arange(0, KC)
        k_c, bad_k = clean_nonfinite(load_rows(k_h, rows, H * K, ck, K, n_t).to(tl.float32))
        g_c = load_rows(g_h, rows, HV * K, ck, K, n_t).to(tl.float32)
        ok = g_c <= 0.0  # False for NaN, +inf and any growth
        g_c = tl.where(ok, base2_gates(g_c), 0.0)
        if not KD_TOTAL:
            g_next = load_rows(g_h, rows + 1, HV * K, ck, K, tl.minimum(n_t, BT)).to(tl.float32)  # gate j + 1
            g_next = tl.where(g_next <= 0.0, base2_gates(g_next), 0.0)
        bad_g = tl.maximum(bad_g, tl.max(tl.where(ok, 0.0, 1.0), axis=1))
        bad = tl.maximum(bad, tl.maximum(bad_k, bad_g))
        gc = tl.cumsum(g_c, axis=0)
        if KD_TOTAL:
            after = tl.sum(g_c, axis=0)[None, :] - gc
        else:
            after = tl.cumsum(g_next, axis=0, reverse=True)  # gc_C - gc_j: the gates after j
        w_c = tile_mm(X, beta_all * k_c * tl.exp2(gc), PREC)
        tl.store(w + r * BK + ck[None, :], w_c.to(w.dtype.element_ty))
        tl.store(kd + r * BK + ck[None, :], (k_c * tl.exp2(after)).to(kd.dtype.element_ty))
        tl.store(gl + row0 // BT * BK + ck, tl.exp2(tl.sum(g_c, axis=0)))
    for vc in range(0, BV, VC):
        cv = vc + tl.arange(0, VC)
        v_c, bad_v = clean_nonfinite(load_rows(v_h, rows, HV * V, cv, V, n_t).to(tl.float32))
        u_c = _spoil(tile_mm(X, beta_all * v_c, U_PREC), bad + bad_v)
        tl.store(u + r * BV + cv[None, :], u_c.to(u.dtype.element_ty))
    if CHECK:
        found = (tl.max(bad_g, axis=0) > 0).to(tl.int32) + 2 * (tl.max(bad_b, axis=0) > 0).to(tl.int32)
        if found > 0:
            tl.atomic_or(flags, found)


@jit(do_not_specialize=["NT", "N0", "CS", "CN"])
def _chunk_scan_kernel(
    w,
    u,
    qg,
    kd,
    aqk,
    gl,  # from the prepare kernels above
    o,
    h0,
    ht,  # output [B, T, HV, V]; initial / final state [N, HV, K, V] float32
    cu_seqlens,
    offsets,  # varlen only: int [N + 1] token and chunk offsets of each sequence
    T,
    HV,
    K,
    V,
    NT,
    NCH,
    N0,
    CS,
    CN,  # this launch: chunks CS .. CS + CN - 1 of sequences N0, N0 + 1, ... (`time_pieces`)
    BT: tl.constexpr,
    BK: tl.constexpr,
    BVP: tl.constexpr,
    BV: tl.constexpr,
    USE_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
    PREC: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """One program per (value block, sequence x value head): the state pass and the output, chunk after chunk,
    from h0 (when USE_H0) to ht (when STORE_HT). A launch on one piece of the time axis runs only that
    piece's chunks; the launcher chains the pieces through ht (`chunk_kda_fwd`)."""
    i_v = tl.program_id(0)
    i_nh = N0 * HV + tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    c0, n_chunks = seq_chunks(i_n, offsets, NT, IS_VARLEN)
    c0 += CS
    n_chunks = tl.minimum(n_chunks - CS, CN)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    rows = tl.arange(0, BT)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    s_mask = (ck[:, None] < K) & (cv[None, :] < V)
    s_off = i_nh.to(tl.int64) * K * V + ck[:, None] * V + cv[None, :]

    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        S += tl.load(h0 + s_off, mask=s_mask, other=0.0)

    o_h = o + i_hv * V
    for n in range(n_chunks):
        c = (i_hv * NCH + c0 + n).to(tl.int64)  # the chunk's index in the intermediates
        r = (c * BT + rows)[:, None]
        w_n = tl.load(w + r * BK + ck[None, :])
        qg_n = tl.load(qg + r * BK + ck[None, :])
        kd_n = tl.load(kd + r * BK + ck[None, :])
        u_n = tl.load(u + r * BVP + cv[None, :])
        aqk_n = tl.load(aqk + r * BT + rows[None, :])
        decay = tl.load(gl + c * BK + ck)  # not a product's operand: not staged (loading it ahead was slower)

        s_lo = S.to(w_n.dtype)
        u_n = u_n.to(tl.float32) - tl.dot(w_n, s_lo, input_precision=PREC)
        u_lo = u_n.to(w_n.dtype)
        # A row of U that is not finite (a bad input at that step, marked by the prepare kernel) spoils the
        # outputs from it on and the state; Aqk U reads the rows with it replaced by 0 (Aqk's zeros above the
        # diagonal times a NaN would spoil the earlier outputs too), and the later outputs are set to NaN.
        u_ok, bad = clean_nonfinite(u_n)
        o_n = tl.dot(qg_n, s_lo, input_precision=PREC) + tl.dot(
            aqk_n, u_ok.to(w_n.dtype), input_precision=PREC
        )
        o_n = _spoil(o_n, tl.cumsum(bad, axis=0))
        S = S * decay[:, None] + tl.dot(tl.trans(kd_n), u_lo, input_precision=PREC)

        t = bos + (CS + n) * BT + rows
        o_mask = (t[:, None] < eos) & (cv[None, :] < V)
        tl.store(o_h + t[:, None] * HV * V + cv[None, :], o_n.to(o.dtype.element_ty), mask=o_mask)

    if STORE_HT:
        tl.store(ht + s_off, S, mask=s_mask)


def prepare_chunks(
    q,
    k,
    v,
    g,
    beta,
    scale,
    layout,
    store_x=False,
    kc=None,
    warps=(4, 1, 4),
    wu_prec=None,
    pieces=None,
    after_piece=None,
    reuse=None,
    flags=None,
    gram_kernel=None,
):
    """Allocate the prepare kernels' outputs and launch the three of them on contiguous inputs; forward and
    backward share this launch. `layout` is `chunk_layout`'s `(NT, NCH, chunks, offsets)`.

    `reuse`: a dict holding x (X, float32), aqk and qg from an earlier call on the same inputs (the forward's,
    kept for the backward by `keep_intermediates="matrices"`). Then only the w/u kernel runs: it reads X and
    writes w, u, kd and gl; the gram and inverse kernels, which make X, Aqk and qg, are skipped.

    `pieces`: `time_pieces`' list of (first sequence, sequences, first chunk, chunks), launched one after the
    other (all chunks at once when None); `after_piece(buffers, piece)` is called after each piece's three
    launches (the forward launches that piece's scan there).

    `gram_kernel`: a kernel with `_chunk_gram_kernel`'s arguments to launch in its place (chapter 8's earlier
    versions of it), or None.

    `flags`: an int32 `[1]` tensor of zeros, or None: the w/u kernel sets bit 0 where it meets a gate that is
    not <= 0 and bit 1 where it meets a beta outside [0, 1] (`chunk_kda`'s value check, `ValueCheck`).

    Returns `(buffers, kernels)`: buffers holds w, u, qg, kd, aqk (one padded chunk of CHUNK rows per chunk
    and value head, in `work_precision`'s dtype), gl (exp of each chunk's last cumulative gate, float32) and
    x (X = (I + L)^-1 in float32 when `store_x`, else None: the kernels always form it, and the buffer is
    dropped here); kernels maps "gram", "inverse" and "wu" to the launched kernels (empty when there is no
    chunk). `kc` key (and value) columns per step of the gram and w/u kernels' column loops, `warps` warps per
    program of the three kernels.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    NT, NCH, chunks, _ = layout
    BT, BK, BVP = CHUNK, pow2(K), pow2(V)
    idt, prec = work_precision(q.dtype)
    rows, lo = HV * NCH * BT, dict(device=q.device, dtype=idt)
    f32 = dict(device=q.device, dtype=torch.float32)
    shapes = dict(  # name: (shape, dtype); x holds L, then X = (I + L)^-1 in its place
        w=((rows, BK), lo),
        u=((rows, BVP), lo),
        qg=((rows, BK), lo),
        kd=((rows, BK), lo),
        aqk=((rows, BT), lo),
        gl=((HV * NCH, BK), f32),
        x=((rows, BT), f32),
    )
    reuse = reuse or {}
    if reuse and set(reuse) != set(KEEP_MODES["matrices"]):
        raise ValueError(f"reuse must hold exactly {KEEP_MODES['matrices']}, got {sorted(reuse)}")
    buffers = {n: reuse[n] if n in reuse else torch.empty(*shape, **kw) for n, (shape, kw) in shapes.items()}
    if NCH == 0:
        buffers["x"] = buffers["x"] if store_x else None
        return buffers, {}
    w, u, qg, kd, aqk, gl, x = buffers.values()
    varlen = chunks is not None
    low = "bf16" if idt != torch.float32 else prec  # the gram kernel's products (see the module docstring)
    kc = min(kc or 32, BK)
    vc = min(kc, BVP)
    # The w/u kernel's products: with 16-bit inputs X and the right-hand tile are rounded to bfloat16 (the
    # default, or `wu_prec="bf16"`; `wu_prec="tf32"` keeps tf32), each product only where its tile has >= 32
    # columns: Triton 3.6's bfloat16 product of 64 x 64 by 64 x 16 hits an illegal address on the H200
    # (docs/kernel-design.md, open questions).
    w_prec = u_prec = prec
    if wu_prec in (None, "bf16") and idt != torch.float32:
        w_prec = "bf16" if kc >= 32 else prec
        u_prec = "bf16" if vc >= 32 else prec
    nt = NCH if varlen else NT  # chunks per sequence as `piece_chunk` counts them
    for piece in pieces or [(0, NCH // nt, 0, nt)]:
        n0, nn, cs, cn = piece
        grid = (NCH if varlen else nn * cn, HV)  # with cu_seqlens one piece: every chunk
        kernels = {}
        if not reuse:
            kernels["gram"] = (gram_kernel or _chunk_gram_kernel)[grid](
                q, k, g, beta, qg, aqk, x, chunks, T, H, HV, K, NT, NCH, scale, n0, cs, cn,
                BT=BT, BC=SUB, BK=BK, KC=kc, PREC=low, IS_VARLEN=varlen, num_warps=warps[0],
            )  # fmt: skip
            kernels["inverse"] = _chunk_inverse_kernel[grid](
                x, nt, NCH, n0, cs, cn, BT=BT, BC=SUB, PREC=prec, num_warps=warps[1]
            )
        kernels.update(
            wu=_chunk_wu_kernel[grid](
                k, v, g, beta, x, w, u, kd, gl, gl if flags is None else flags, chunks, T, H, HV, K, V, NT, NCH, n0, cs, cn,
                BT=BT, BK=BK, BV=BVP, KC=kc, VC=vc, PREC=w_prec, U_PREC=u_prec, KD_TOTAL=idt != torch.float32,
                IS_VARLEN=varlen, num_warps=warps[2], CHECK=flags is not None,
            ),
        )  # fmt: skip
        if after_piece is not None:
            after_piece(buffers, piece)
    if not store_x:
        buffers["x"] = None
    return buffers, kernels


# The kernels by stage, for tools that launch one of them alone (chapter 8's `scan`). The functions keep
# their names: profilers report a kernel by its function's name, and the committed timings are keyed by it.
KERNELS = {
    "gram": _chunk_gram_kernel,
    "inverse": _chunk_inverse_kernel,
    "wu": _chunk_wu_kernel,
    "scan": _chunk_scan_kernel,
}


def chunk_kda_fwd(
    q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens=None,
    bv=None, kc=None, warps_prepare=(4, 1, 4), warps_scan=4, stages=None, stop_after=None, info=None, keep=None,
    wu_prec=None, pieces=None, flags=None, gram_kernel=None,
):  # fmt: skip
    """Launch the four kernels on validated inputs.

    The time axis is cut into `time_pieces` (without cu_seqlens, on a GPU, at sizes where it pays): the
    prepare kernels of each piece run on the current stream, and each piece's scan on a second stream of higher
    priority (`scan_stream`) as soon as that piece is prepared, carrying the state to the next piece through
    the final-state buffer. The scan, one latency-bound program per multiprocessor, then runs beside the next
    piece's prepare kernels instead of after all of them. The results are those of one piece: every chunk is
    computed the same way, and the state passes between pieces in float32, as it stays in the registers.

    The keywords after cu_seqlens are tuning knobs that bench/kernels/tune_chunk.py sweeps: `bv` value columns per
    scan program, `kc` key (and value) columns per step of the gram and w/u kernels' column loops,
    `warps_prepare` warps per program of the three prepare kernels (gram, inverse, w/u), `warps_scan` of the
    scan, `stages` pipeline depth of the scan loop (`pass_stages` when None); `wu_prec` "bf16" for bfloat16 operands in the w/u kernel's
    products (`prepare_chunks`); `pieces` how many pieces to cut the time axis into, or an explicit
    list of pieces (`time_pieces`' choice when None, one piece under the interpreter, where pieces asked for run
    one after the other on one stream). `stop_after="prepare"` stops after
    the three prepare kernels (to time them alone); `info`, a dict, receives registers / spills / shared memory
    of each kernel, by `KERNELS`' names. `keep`, a dict, receives the prepare kernels' outputs (w, u, qg, kd,
    aqk, gl) and X = (I + L)^-1: everything the backward would otherwise recompute first. `flags` (the value check)
    and `gram_kernel` go to `prepare_chunks`.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT, BK, BVP = CHUNK, pow2(K), pow2(V)
    layout = chunk_layout(T, B, cu_seqlens)
    NT, NCH, _, offsets = layout
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    idt, prec = work_precision(q.dtype)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))

    dev = q.device
    o = torch.empty(B, T, HV, V, device=dev, dtype=q.dtype)
    varlen = cu_seqlens is not None
    if pieces is None and interpreting():
        pieces = 1  # nothing runs side by side there
    sms = device_multiprocessors(dev)
    cut = time_pieces(N, NCH if varlen else NT, HV, V, BVP, idt.itemsize, varlen, sms, pieces)
    # The state between pieces of the time axis goes through ht (a program reads and writes only its own block).
    chained = any(cs > 0 for _, _, cs, _ in cut)
    ht = torch.empty(N, HV, K, V, device=dev, dtype=torch.float32) if output_final_state or chained else None
    scan_on = scan_stream(dev) if len(cut) > 1 and q.is_cuda else None
    launched = {}

    def scan_piece(buffers, piece):
        n0, nn, cs, cn = piece
        if stop_after is not None or nn * HV == 0 or V == 0:
            return
        args = (buffers[n] for n in ("w", "u", "qg", "kd", "aqk", "gl"))
        block = bv or scan_value_block(nn * HV, V, BVP, idt.itemsize)
        depth = stages or pass_stages(BK, idt.itemsize, block, alone=len(cut) == 1)
        if scan_on is not None:  # after this piece's prepare kernels (and all before them)
            scan_on.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(scan_on) if scan_on is not None else nullcontext():
            launched["scan"] = _chunk_scan_kernel[(triton.cdiv(V, block), nn * HV)](
                *args, o, h0 if cs == 0 else ht, ht, cu_seqlens, offsets, T, HV, K, V, NT, NCH, n0, cs, cn,
                BT=BT, BK=BK, BVP=BVP, BV=block, USE_H0=h0 is not None or cs > 0, STORE_HT=ht is not None,
                PREC=prec, IS_VARLEN=varlen, num_warps=warps_scan, num_stages=depth,
            )  # fmt: skip

    made, kernels = prepare_chunks(
        q, k, v, g, beta, scale, layout, store_x=keep is not None, kc=kc, warps=warps_prepare, wu_prec=wu_prec,
        pieces=cut, after_piece=scan_piece, flags=flags, gram_kernel=gram_kernel,
    )  # fmt: skip
    if NCH == 0:  # no chunk, no prepare launch: the scan still writes the final state (h0, or zeros)
        scan_piece(made, (0, N, 0, 0))
    if scan_on is not None:
        torch.cuda.current_stream(dev).wait_stream(scan_on)  # o, ht and the buffers are done with
    if keep is not None:
        keep.update(made)
    if info is not None:
        info.update((name, _resources(kernel)) for name, kernel in {**kernels, **launched}.items())
    if kernels and stop_after is not None:
        return None, None
    return o, ht if output_final_state else None


def _resources(kernel):
    """Registers, spilled registers and shared memory of a launched kernel (empty under the interpreter)."""
    meta = getattr(kernel, "metadata", None)
    if meta is None:
        return {}
    return dict(regs=kernel.n_regs, spills=kernel.n_spills, shared=meta.shared)
