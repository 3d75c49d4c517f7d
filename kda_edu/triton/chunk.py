"""Chunked KDA forward in Triton: one kernel parallel over chunks, one sequential over them.

This is `kda_edu.kda.kda_chunked` (read its docstring first: the notation below is the same) turned into two
kernels that keep every intermediate small.

Kernel 1, `_chunk_prepare_kernel`, one program per (chunk, batch, value head), all chunks at once:
    gate cumsum gc, the matrices A (keys against keys) and Aqk (queries against keys), the inverse
    X = (I + A)^-1 of the unit lower-triangular system (the UT transform), then
    w = X Diag(beta) (K * exp(gc)), u = X Diag(beta) V, and the two decayed copies the scan needs,
    qg = scale Q * exp(gc) and kd = K * exp(gc_C - gc). Nothing here depends on the state, so every
    chunk runs in parallel.
Kernel 2, `_chunk_scan_kernel`, one program per (value block, batch, value head), chunk after chunk:
    with the state S (K x BV, float32, in registers for the whole sequence)
        U = u - w S;   O = qg S + Aqk U;   S = Diag(exp(gc_C)) S + kd^T U
    three matrix products against S and one against U per chunk: the only sequential work left.

Between the two kernels go w, qg, kd, u, Aqk and exp(gc_C): about (3K + V + C) numbers per step and head,
stored in the input's 16-bit dtype (float32 for float32 inputs).

Overflow, and why the chunk is cut into sub-chunks of 16 rows. The decay between steps j <= i of a chunk is
exp(gc_i - gc_j) <= 1, but a matrix product needs it split into a row factor times a column factor. Split at
the chunk start, exp(gc_i) * exp(-gc_j), the column factor reaches exp(64 * 5) = exp(320) for 64 steps of
gates at -5: float32 overflows past exp(88.7). So the rows of a chunk are taken 16 at a time (block a, rows
16a .. 16a + 15) and every split is anchored where both factors stay bounded:
  * block (a, c) left of the diagonal (j in block c < a): anchor at the end boundary e_c of block c. Row
    factor exp(gc_i - e_c) <= 1 (i comes after the boundary), column factor exp(e_c - gc_j) <= 1 (j before
    it). Both exponents are <= 0 whatever the gates, and both are gate sums over a few sub-chunks computed
    from per-block cumsums, so their rounding stays small; a factor that underflows to 0 only drops a
    product that is smaller still.
  * columns inside the block (the 16 x 16 diagonal block): anchor at the block's middle row m = 16a + 8.
    Each factor's exponent is bounded by the gate sum over at most 8 steps: |exponent| <= 8 * 5 / ln 2 = 58
    (in powers of two) for gates down to -5, far inside float32's range (2^-126 .. 2^127). For gates so large
    that the half-block sum passes 96 powers of two (about -8.3 per step) the kernel switches, for that block
    only, to the exact pairwise form: one column at a time, exp(gc_i - gc_j) with the exponent clipped at 0.
    Realistic gates never take that branch; it is there so that no input produces inf or NaN.
All gates are carried in base 2 (g * log2(e)) so that every decay is one `exp2`.

The triangular inverse. L = Diag(beta) A is strictly lower triangular; its blocks go through a float32
scratch buffer so that the whole 64 x 64 matrix can be read back as one tile. Split it into the diagonal
blocks Ld and the rest Lo: I + L = (I + Ld)(I + N) with N = (I + Ld)^-1 Lo. Each 16 x 16 block of Ld is
nilpotent (Ld^16 = 0), so (I + Ld)^-1 = (I - Ld)(I + Ld^2)(I + Ld^4)(I + Ld^8); N is zero on and above the
diagonal blocks, so N^4 = 0 and (I + N)^-1 = I - N + N^2 - N^3. Ten 64 x 64 products, no loop.

Speed: correct, but about 3x slower than fla's chunk_kda on an H200 (bench/NOTES.md): the prepare kernel
needs all 255 registers and spills. Splitting it into a kernel per block row and one per chunk is next.

Precision: gates, decays, A, X and the state are float32. With 16-bit inputs the matrix products inside the
chunk use tf32 (float32 range, which the anchored factors need), the products against the state use the
16-bit dtype with float32 accumulation. With float32 inputs every product is exact float32 ("ieee").
Under Triton's interpreter everything is float32 (its 16-bit `tl.dot` is unreliable).
"""

import torch
import triton
import triton.language as tl

from kda_edu._backend import interpreting
from kda_edu._checks import check_kda_inputs, resolve_scale

CHUNK = 64  # steps per chunk (C)
SUB = 16  # rows per sub-chunk: the smallest block tl.dot accepts on a GPU

# Above this many powers of two, a half sub-chunk's gate sum is too large for the anchored split of the
# diagonal block (both factors must stay normal float32 numbers, 2^-126 .. 2^127, with room for |k| < 1).
_DIAG_LIMIT = tl.constexpr(96.0)


@triton.jit
def _load_rows(ptr, t, row_stride, cols, n_cols, T):
    """Load a [len(t), len(cols)] tile whose row for step t starts at ptr + t * row_stride; zeros outside."""
    mask = (t[:, None] < T) & (cols[None, :] < n_cols)
    return tl.load(ptr + t[:, None].to(tl.int64) * row_stride + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _chunk_prepare_kernel(
    q,
    k,
    v,
    g,
    beta,  # inputs, [B, T, H, K] / [B, T, HV, V] / [B, T, HV, K] / [B, T, HV], contiguous
    w,
    u,
    qg,
    kd,
    aqk,
    gl,
    lmat,  # outputs [B*HV, NT*BT, BK|BV|BK|BK|BT] and [B*HV, NT, BK]; lmat: float32 scratch [B*HV, NT*BT, BT]
    T,
    H,
    HV,
    K,
    V,
    scale,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    NB: tl.constexpr = BT // BC
    LOG2E: tl.constexpr = 1.4426950408889634

    t0 = i_n * BT
    rows = tl.arange(0, BT)
    rc = tl.arange(0, BC)
    ck = tl.arange(0, BK)

    # Base pointers of this (batch, head): row t of q/k is at q_bh + t * H * K, and so on.
    q_bh = q + (i_b * T * H + i_h).to(tl.int64) * K
    k_bh = k + (i_b * T * H + i_h).to(tl.int64) * K
    v_bh = v + (i_b * T * HV + i_hv).to(tl.int64) * V
    g_bh = g + (i_b * T * HV + i_hv).to(tl.int64) * K
    b_bh = beta + (i_b * T * HV + i_hv).to(tl.int64)

    t_all = t0 + rows
    beta_all = tl.load(b_bh + t_all.to(tl.int64) * HV, mask=t_all < T, other=0.0).to(tl.float32)

    # X = (I + A)^-1, built block row by block row; rows not yet built are zero.
    # Phase 1: the 16 x 16 blocks of L = Diag(beta) A and of Aqk, written to the float32 scratch `lmat` and
    # to `aqk` (the blocks above the diagonal are never written: readers mask them). Every exponent is a
    # gate sum inside one or a few sub-chunks, so it is small and its rounding too.
    out_t = (i_bh * (tl.num_programs(0) * BT) + t_all).to(tl.int64)
    for a in tl.static_range(NB):
        ta = t0 + a * BC + rc
        k_a = _load_rows(k_bh, ta, H * K, ck, K, T).to(tl.float32)
        q_a = _load_rows(q_bh, ta, H * K, ck, K, T).to(tl.float32) * scale
        g_a = _load_rows(g_bh, ta, HV * K, ck, K, T).to(tl.float32) * LOG2E
        beta_a = tl.load(b_bh + ta.to(tl.int64) * HV, mask=ta < T, other=0.0).to(tl.float32)
        loc_a = tl.cumsum(g_a, axis=0)  # gc_i minus gc at the block's start boundary: <= 0
        row_off = (i_bh * (tl.num_programs(0) * BT) + t0 + a * BC + rc).to(tl.int64)[:, None] * BT

        # Blocks left of the diagonal, c = a-1 down to 0, anchored at the end boundary e_c of block c:
        # row factor exp(gc_i - e_c) = exp(loc_i + gap) <= 1 with gap the gate sum of the blocks between,
        # column factor exp(e_c - gc_j) = exp(sum of block c's gates after j) <= 1.
        gap = tl.zeros([BK], dtype=tl.float32)
        for cc in tl.static_range(a):
            c = a - 1 - cc
            tc = t0 + c * BC + rc
            k_c = _load_rows(k_bh, tc, H * K, ck, K, T).to(tl.float32)
            g_c = _load_rows(g_bh, tc, HV * K, ck, K, T).to(tl.float32) * LOG2E
            tot_c = tl.sum(g_c, axis=0)
            col = k_c * tl.exp2(tot_c[None, :] - tl.cumsum(g_c, axis=0))
            row_f = tl.exp2(loc_a + gap[None, :])
            a_ac = tl.dot(k_a * row_f, tl.trans(col), input_precision=PREC)
            aqk_ac = tl.dot(q_a * row_f, tl.trans(col), input_precision=PREC)
            tl.store(lmat + row_off + c * BC + rc[None, :], beta_a[:, None] * a_ac)
            tl.store(aqk + row_off + c * BC + rc[None, :], aqk_ac.to(aqk.dtype.element_ty))
            gap += tot_c

        # The diagonal block, anchored at its middle row m unless a half-block gate sum is too large.
        mid = tl.sum(tl.where((rc == BC // 2)[:, None], loc_a, 0.0), axis=0)
        first = tl.sum(tl.where((rc == 0)[:, None], loc_a, 0.0), axis=0)
        last = tl.sum(g_a, axis=0)
        span = tl.maximum(tl.max(first - mid, axis=0), tl.max(mid - last, axis=0))
        if span <= _DIAG_LIMIT:
            diag_row = tl.exp2(loc_a - mid[None, :])
            diag_col = k_a * tl.exp2(mid[None, :] - loc_a)
            a_dd = tl.dot(k_a * diag_row, tl.trans(diag_col), input_precision=PREC)
            aqk_dd = tl.dot(q_a * diag_row, tl.trans(diag_col), input_precision=PREC)
        else:
            a_dd = tl.zeros([BC, BC], dtype=tl.float32)
            aqk_dd = tl.zeros([BC, BC], dtype=tl.float32)
            for j in range(BC):
                pick = (rc == j)[:, None]
                k_j = tl.sum(tl.where(pick, k_a, 0.0), axis=0)
                loc_j = tl.sum(tl.where(pick, loc_a, 0.0), axis=0)
                decay = tl.exp2(tl.minimum(loc_a - loc_j[None, :], 0.0)) * k_j[None, :]  # i < j: masked below
                a_dd = tl.where(rc[None, :] == j, tl.sum(k_a * decay, axis=1)[:, None], a_dd)
                aqk_dd = tl.where(rc[None, :] == j, tl.sum(q_a * decay, axis=1)[:, None], aqk_dd)
        a_dd = tl.where(rc[:, None] > rc[None, :], beta_a[:, None] * a_dd, 0.0)
        aqk_dd = tl.where(rc[:, None] >= rc[None, :], aqk_dd, 0.0)
        tl.store(lmat + row_off + a * BC + rc[None, :], a_dd)
        tl.store(aqk + row_off + a * BC + rc[None, :], aqk_dd.to(aqk.dtype.element_ty))

    # Phase 2: X = (I + L)^-1 with whole-chunk products. Split L into its diagonal blocks Ld and the part
    # below them Lo: I + L = (I + Ld)(I + N) with N = (I + Ld)^-1 Lo. Each 16 x 16 block of Ld is nilpotent
    # of order 16, so (I + Ld)^-1 = (I - Ld)(I + Ld^2)(I + Ld^4)(I + Ld^8); N is zero on and above the
    # diagonal blocks, so N^4 = 0 and (I + N)^-1 = I - N + N^2 - N^3. Ten 64 x 64 products, no loop.
    tl.debug_barrier()  # phase 1's rows of lmat were written by other threads of this program
    lm = tl.load(lmat + out_t[:, None] * BT + rows[None, :])
    lm = tl.where(rows[:, None] > rows[None, :], lm, 0.0)  # strictly lower; the rest was never written
    same_block = (rows // BC)[:, None] == (rows // BC)[None, :]
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    P = -tl.where(same_block, lm, 0.0)
    D = eye + P
    for _ in tl.static_range(3):
        P = tl.dot(P, P, input_precision=PREC)
        D = D + tl.dot(D, P, input_precision=PREC)
    N = tl.dot(D, tl.where(same_block, 0.0, lm), input_precision=PREC)
    N2 = tl.dot(N, N, input_precision=PREC)
    X = tl.dot(eye - N + N2 - tl.dot(N, N2, input_precision=PREC), D, input_precision=PREC)

    # Phase 3, 64 key (then value) columns at a time to keep the tiles small: gc (gate cumsum over the
    # whole chunk, non-increasing), w = X Diag(beta) (K * exp(gc)), qg, kd and exp(gc_C); u = X Diag(beta) V.
    # Intermediates are padded to whole chunks and BK / BV columns: no masks needed.
    xb = X * beta_all[None, :]
    KC: tl.constexpr = 64 if BK > 64 else BK
    VC: tl.constexpr = 64 if BV > 64 else BV
    for kc in tl.static_range(BK // KC):
        cols = kc * KC + tl.arange(0, KC)
        k_c = _load_rows(k_bh, t_all, H * K, cols, K, T).to(tl.float32)
        g_c = _load_rows(g_bh, t_all, HV * K, cols, K, T).to(tl.float32) * LOG2E
        gc = tl.cumsum(g_c, axis=0)
        gc_end = tl.sum(g_c, axis=0)  # gc at the chunk's last step (padded steps have g = 0)
        w_c = tl.dot(xb, k_c * tl.exp2(gc), input_precision=PREC)
        tl.store(w + out_t[:, None] * BK + cols[None, :], w_c.to(w.dtype.element_ty))
        tl.store(
            kd + out_t[:, None] * BK + cols[None, :],
            (k_c * tl.exp2(gc_end[None, :] - gc)).to(kd.dtype.element_ty),
        )
        q_c = _load_rows(q_bh, t_all, H * K, cols, K, T).to(tl.float32) * scale
        tl.store(qg + out_t[:, None] * BK + cols[None, :], (q_c * tl.exp2(gc)).to(qg.dtype.element_ty))
        tl.store(gl + (i_bh * tl.num_programs(0) + i_n).to(tl.int64) * BK + cols, tl.exp2(gc_end))
    for vc in tl.static_range(BV // VC):
        cols = vc * VC + tl.arange(0, VC)
        u_c = tl.dot(xb, _load_rows(v_bh, t_all, HV * V, cols, V, T).to(tl.float32), input_precision=PREC)
        tl.store(u + out_t[:, None] * BV + cols[None, :], u_c.to(u.dtype.element_ty))


@triton.jit
def _chunk_scan_kernel(
    w,
    u,
    qg,
    kd,
    aqk,
    gl,  # from _chunk_prepare_kernel
    o,
    h0,
    ht,  # output [B, T, HV, V]; initial / final state [B, HV, K, V] float32
    T,
    HV,
    K,
    V,
    NT,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BVP: tl.constexpr,
    BV: tl.constexpr,
    USE_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
    PREC: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    rows = tl.arange(0, BT)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    s_mask = (ck[:, None] < K) & (cv[None, :] < V)
    s_off = i_bh.to(tl.int64) * K * V + ck[:, None] * V + cv[None, :]

    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        S += tl.load(h0 + s_off, mask=s_mask, other=0.0)

    base = i_bh.to(tl.int64) * NT * BT
    o_bh = o + (i_bh // HV).to(tl.int64) * T * HV * V + (i_bh % HV) * V
    for n in range(NT):
        t = n * BT + rows
        r = (base + t)[:, None]
        w_n = tl.load(w + r * BK + ck[None, :])
        qg_n = tl.load(qg + r * BK + ck[None, :])
        kd_n = tl.load(kd + r * BK + ck[None, :])
        u_n = tl.load(u + r * BVP + cv[None, :])
        a_n = tl.load(aqk + r * BT + rows[None, :])
        a_n = tl.where(rows[:, None] >= rows[None, :], a_n, 0.0)  # blocks above the diagonal: never written
        decay = tl.load(gl + (i_bh.to(tl.int64) * NT + n) * BK + ck)

        s_lo = S.to(w_n.dtype)
        u_n = u_n.to(tl.float32) - tl.dot(w_n, s_lo, input_precision=PREC)
        u_lo = u_n.to(w_n.dtype)
        o_n = tl.dot(qg_n, s_lo, input_precision=PREC) + tl.dot(a_n, u_lo, input_precision=PREC)
        S = S * decay[:, None] + tl.dot(tl.trans(kd_n), u_lo, input_precision=PREC)

        o_mask = (t[:, None] < T) & (cv[None, :] < V)
        tl.store(
            o_bh + t[:, None].to(tl.int64) * HV * V + cv[None, :], o_n.to(o.dtype.element_ty), mask=o_mask
        )

    if STORE_HT:
        tl.store(ht + s_off, S, mask=s_mask)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA with Triton kernels; same contract as `kda_edu.kda.kda_chunked`.

    The forward runs two kernels (below). When any input requires a gradient, the call goes through
    `kda_edu.triton.chunk_bwd.ChunkKDAFunction`, whose backward kernels give gradients for q, k, v, g,
    beta and initial_state.

    Args:
        q: queries `[B, T, H, K]`, bfloat16, float16 or float32; K <= 256.
        k: keys `[B, T, H, K]`, same dtype as q (usually L2-normalised).
        v: values `[B, T, HV, V]`, same dtype as q, HV a multiple of H; V <= 256.
        g: log-space decay per key channel `[B, T, HV, K]`, any floating dtype, <= 0.
        beta: write strength `[B, T, HV]`, any floating dtype, in [0, 1].
        scale: query scale; `K ** -0.5` when None.
        initial_state: optional `[B, HV, K, V]` float32; zeros when None.
        output_final_state: also return the state after step T.

    Returns:
        `(o, final_state)`: o `[B, T, HV, V]` in q's dtype; final_state `[B, HV, K, V]` float32, or None.
    """
    B, T, H, HV, K, V = check_kda_inputs(q, k, v, g, beta, initial_state, check_values=False)
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"q, k, v must be bfloat16, float16 or float32 for chunk_kda, got {q.dtype}")
    if K > 256 or V > 256:
        raise ValueError(
            f"chunk_kda supports K, V <= 256 (q is [B, T, H, K], v is [B, T, HV, V]), got K={K}, V={V}"
        )
    h0 = initial_state.contiguous() if initial_state is not None else None
    scale = resolve_scale(scale, K)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, g, beta, h0)):
        from kda_edu.triton.chunk_bwd import ChunkKDAFunction  # imported here: chunk_bwd imports this module

        return ChunkKDAFunction.apply(q, k, v, g, beta, scale, h0, output_final_state)
    return _chunk_kda_fwd(q, k, v, g, beta, scale, h0, output_final_state)


def _chunk_kda_fwd(
    q, k, v, g, beta, scale, h0, output_final_state,
    bv=None, warps_prepare=None, warps_scan=4, stages=2, prepare_only=False, info=None,
):  # fmt: skip
    """Launch the two kernels on validated inputs.

    The keywords are tuning knobs that bench/tune_chunk.py sweeps: `bv` value columns per scan program,
    `warps_prepare` / `warps_scan` warps per program, `stages` pipeline depth of the scan loop; `prepare_only` stops
    after the first kernel (to time it alone); `info`, a dict, receives registers / spills / shared memory
    of both kernels.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    interp = interpreting()
    BT, BK, BVP = CHUNK, _pow2(K), _pow2(V)
    NT = triton.cdiv(T, BT)
    # Intermediates: float32 for float32 inputs and under the interpreter, else the input's 16-bit dtype.
    idt = torch.float32 if (interp or q.dtype == torch.float32) else q.dtype
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))

    dev = q.device
    rows = B * HV * NT * BT
    w = torch.empty(rows, BK, device=dev, dtype=idt)
    qg = torch.empty(rows, BK, device=dev, dtype=idt)
    kd = torch.empty(rows, BK, device=dev, dtype=idt)
    u = torch.empty(rows, BVP, device=dev, dtype=idt)
    aqk = torch.empty(rows, BT, device=dev, dtype=idt)
    gl = torch.empty(B * HV * NT, BK, device=dev, dtype=torch.float32)
    lmat = torch.empty(rows, BT, device=dev, dtype=torch.float32)  # Diag(beta) A, read back by its writer
    if warps_prepare is None:
        warps_prepare = 4 if BK <= 64 else 8
    kernel = _chunk_prepare_kernel[(NT, B * HV)](
        q,
        k,
        v,
        g,
        beta,
        w,
        u,
        qg,
        kd,
        aqk,
        gl,
        lmat,
        T,
        H,
        HV,
        K,
        V,
        scale,
        BT=BT,
        BC=SUB,
        BK=BK,
        BV=BVP,
        PREC=prec,
        num_warps=warps_prepare,
    )
    if info is not None:
        info["prepare"] = _resources(kernel)
    if prepare_only:
        return None, None

    o = torch.empty(B, T, HV, V, device=dev, dtype=q.dtype)
    ht = torch.empty(B, HV, K, V, device=dev, dtype=torch.float32) if output_final_state else None
    if bv is None:
        # The scan's only parallelism is (batch, value head, value block): use narrower value blocks when
        # there are few heads, so that the programs still cover the GPU's 100+ multiprocessors.
        bv = min(BVP, 32)
        if not interp and B * HV * triton.cdiv(V, bv) < 128:
            bv = 16
    if BK * w.element_size() > 512:
        stages = 1  # float32 intermediates with K > 128: two stages of tiles exceed shared memory
    kernel = _chunk_scan_kernel[(triton.cdiv(V, bv), B * HV)](
        w,
        u,
        qg,
        kd,
        aqk,
        gl,
        o,
        h0,
        ht,
        T,
        HV,
        K,
        V,
        NT,
        BT=BT,
        BK=BK,
        BVP=BVP,
        BV=bv,
        USE_H0=h0 is not None,
        STORE_HT=output_final_state,
        PREC=prec,
        num_warps=warps_scan,
        num_stages=stages,
    )
    if info is not None:
        info["scan"] = _resources(kernel)
    return o, ht


def _resources(kernel):
    """Registers, spilled registers and shared memory of a launched kernel (empty under the interpreter)."""
    meta = getattr(kernel, "metadata", None)
    if meta is None:
        return {}
    return dict(regs=kernel.n_regs, spills=kernel.n_spills, shared=meta.shared)
