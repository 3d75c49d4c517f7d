"""An alternative to chunk.py's `_chunk_gram_kernel` with 64-row tiles instead of 16 x 16 blocks.

`_chunk_gram_kernel` holds the ten 16 x 16 blocks of A and of Aqk on and below the diagonal (twenty
accumulators), and multiplies 16-row blocks: on the H200 every product is an `mma.sync`, and the kernel sits at
255 registers with spills. `_chunk_gram64_kernel` computes the same outputs (qg, Aqk and L = Diag(beta) A, to
rounding) from two 64 x 64 accumulators and products of whole 64-row tiles, the shape of Hopper's
warpgroup products (`wgmma`, M = 64). Same grid (one program per (chunk, value head)), same arguments: a
drop-in for `prepare_chunks`' launch (`prepare_chunks64`, `chunk_kda_fwd64` below).

Per step of KC key columns, rows i, j = 0..63 of the chunk, blk(i) = i // 16, l the base-2 gate cumsum
WITHIN each 16-row block and s_b = l at the last row of block b (the block's gate sum, <= 0):

  * off the diagonal (blk(i) = a > c = blk(j)) the decay 2^(gc_i - gc_j) is anchored at the end of block c,
    as in chunk.py: row factor 2^(l_i + O_c(i)) with O_c(i) = sum of s_b for c < b < a (the whole blocks
    between), column factor k_j 2^(s_c - l_j) (the gates after j in block c). Both exponents are sums of
    gates, so <= 0 whatever the gates, and built from within-block cumsums (no difference of two large
    cumsums: exact enough after a reset). One product pair per column block c = 0, 1, 2, each covering every
    row block a > c at once: the masked operands (rows a <= c, columns outside block c) are exact zeros.
  * the four diagonal blocks: anchored at each block's middle row m, row factor 2^(l_i - l_m), column factor
    k_j 2^(l_m - l_j), one 64 x 64 product pair of which only the four diagonal blocks are kept (the rest mixes
    different anchors: junk, possibly inf, discarded by a select). Each exponent is bounded by the block's
    half-block gate sum; when one passes DIAG_LIMIT (96 powers of two: gates below about -8.3 per step, or a
    reset) the step's diagonal blocks come from chunk.py's `_diag_grams` instead, per 16-row block (anchored
    or exact pairwise form, as the current kernel), placed into the 64 x 64 accumulators.

Check (Triton's interpreter, float32): `python bench/experiments/gram64.py` (the `__main__` below).

Measured on the H200 (session 16, `bench/experiments/bench_gram64.py`, bench/results/h200_gram64_3540da0.json):
463 us against the current kernel's 561 at (1, 8192, 32) bf16, forward 1.082 against 1.180 ms, the same error
against float64 (5.36e-3 at (1, 1024, 4)); slower at kc 16 or 8 warps. Status: an experiment that won; it
becomes chunk.py's gram kernel together with chapter 8's stage 2, which builds and checks the 16 x 16-block
kernel (bench/NOTES.md, the plan after session 16).

Compiled offline for sm_90a (Triton 3.9 and its ptxas 13.4 on a CPU machine; bf16 inputs, K = V = 128, PREC
"bf16", KC = 32, 4 warps, default stages), against `_chunk_gram_kernel` under the same settings: both at 255
registers; spill stores / loads 624 / 748 bytes against 852 / 656; shared memory 28 KiB against 19 KiB;
PTX wgmma 16 (the eight products of the hot path, two k16 steps each) and mma.sync 32 (the fallback's
16 x 16 products only) against 0 and 80. The fallback costs registers even when it never runs: without it
the same kernel spills 180 bytes, and with KC = 16 it spills 8 bytes (none without the fallback).
"""

from unittest import mock

import torch
import triton.language as tl

from kda_edu.kernels import chunk
from kda_edu.kernels._backend import jit
from kda_edu.kernels.chunk import (
    CHUNK,
    DIAG_LIMIT,
    SUB,
    _clean,
    _diag_grams,
    _key_block,
    _mm,
    _store_block,
    base2_gates,
    chunk_layout,
    chunk_program,
    load_rows,
    pow2,
)

# How the within-block cumsum is formed: "reshape", a cumsum over the middle axis of the tile seen as
# [4, 16, KC]; "scan", one segmented associative scan down the 64 rows. Same results; compiled for sm_90 (bf16,
# K = 128, KC = 32, 4 warps) "reshape" has 255 ld.shared in its PTX against 321, and 28 KiB of shared memory
# against 32 KiB.
BLOCK_CUMSUM = tl.constexpr("reshape")


@jit
def _segmented_add(a, a_first, b, b_first):
    """Combine of a segmented sum: b's partial sum alone when b's span starts a segment, else a + b."""
    return tl.where(b_first > 0, b, a + b), tl.maximum(a_first, b_first)


@jit
def _block_cumsum(x, BC: tl.constexpr):
    """Cumsum of x [4 * BC, KC] down each BC-row block separately (restarting at rows 0, BC, 2 BC, 3 BC)."""
    if BLOCK_CUMSUM == "scan":
        r = tl.arange(0, x.shape[0])
        first = tl.broadcast_to(((r % BC) == 0).to(tl.int32)[:, None], x.shape)
        out, _ = tl.associative_scan((x, first), 0, _segmented_add)
    else:
        out = tl.reshape(tl.cumsum(tl.reshape(x, [x.shape[0] // BC, BC, x.shape[1]]), axis=1), x.shape)
    return out


@jit
def _row(x, i):
    """Row i of the tile x [R, KC], as a [1, KC] row."""
    r = tl.arange(0, x.shape[0])
    return tl.sum(tl.where((r == i)[:, None], x, 0.0), axis=0)[None, :]


@jit
def _per_block(blk, x0, x1, x2, x3):
    """[R, KC] tile whose rows in block b (blk == b, a [R, 1] column) are the [1, KC] row x_b."""
    return tl.where(blk == 0, x0, tl.where(blk == 1, x1, tl.where(blk == 2, x2, x3)))


@jit
def _left_of_diagonal(k, q, l, blk, row_exp, s_c, c: tl.constexpr, PREC: tl.constexpr):
    """Blocks (a, c) of A and Aqk for every row block a > c, from one product each: rows i in blocks after c
    scaled by 2^row_exp (row_exp = l_i + the block sums between c and blk(i): the gates from the end of block
    c to i, <= 0), against the keys j of block c scaled by 2^(s_c - l_j) (the gates after j in block c, <= 0).
    Every other row and column is an exact 0 (exponent -inf), so the product is 0 outside those blocks."""
    col = tl.trans(k * tl.exp2(tl.where(blk == c, s_c - l, float("-inf"))))
    row_f = tl.exp2(tl.where(blk > c, row_exp, float("-inf")))
    return _mm(k * row_f, col, PREC), _mm(q * row_f, col, PREC)


@jit
def _exact_diagonal(q_h, k_h, g_h, cols, H, HV, K, n_t, scale, BC: tl.constexpr, PREC: tl.constexpr):
    """The four diagonal 16 x 16 blocks of A and Aqk in one step as chunk.py computes them (`_diag_grams` on
    each block reloaded by `_key_block`: anchored at its middle row, or the exact pairwise form when its
    half-block gate sum is too large), placed into [4 BC, 4 BC] tiles, zeros off the diagonal blocks.
    Runs only for steps whose gates are below about -8.3 per step, or which hold a reset."""
    rc = tl.arange(0, BC)
    # The 64 x 64 tiles seen as [4, BC, 4, BC]: (row block, row, column block, column).
    a_id = tl.arange(0, 4)[:, None, None, None]
    c_id = tl.arange(0, 4)[None, None, :, None]
    Dk = tl.zeros([4, BC, 4, BC], dtype=tl.float32)
    Dq = tl.zeros([4, BC, 4, BC], dtype=tl.float32)
    for a in tl.static_range(4):
        k_a, l_a, _ = _key_block(k_h, g_h, a * BC + rc, cols, H, HV, K, n_t)
        q_a = load_rows(q_h, a * BC + rc, H * K, cols, K, n_t).to(tl.float32) * scale
        Mk, Mq = _diag_grams(k_a, q_a, l_a, BC, PREC)
        here = (a_id == a) & (c_id == a)
        Dk = tl.where(here, Mk[None, :, None, :], Dk)
        Dq = tl.where(here, Mq[None, :, None, :], Dq)
    return tl.reshape(Dk, [4 * BC, 4 * BC]), tl.reshape(Dq, [4 * BC, 4 * BC])


@jit(do_not_specialize=["NT"])
def _chunk_gram64_kernel(
    q, k, g, beta, qg, aqk, lmat, chunks, T, H, HV, K, NT, NCH, scale,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr, PREC: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """One program per (chunk, value head), `_chunk_gram_kernel`'s arguments and outputs: qg, Aqk whole (zeros
    above the diagonal) and L = Diag(beta) A (zeros on and above the diagonal) into lmat, from two 64 x 64
    accumulators, KC key columns at a time, eight 64 x KC x 64 products per step (module docstring)."""
    tl.static_assert(BT == 4 * BC)
    i_hv, i_h, t0, n_t, row0 = chunk_program(chunks, T, NT, H, HV, NCH, BT, IS_VARLEN)
    q_h = q + t0 * H * K + i_h * K
    k_h = k + t0 * H * K + i_h * K
    g_h = g + t0 * HV * K + i_hv * K
    b_h = beta + t0 * HV + i_hv
    r = tl.arange(0, BT)
    blk = (r // BC)[:, None]  # each row's 16-row block, [BT, 1]
    on_diag = blk == (r // BC)[None, :]  # the four diagonal blocks of a [BT, BT] tile
    A = tl.zeros([BT, BT], dtype=tl.float32)
    Aq = tl.zeros([BT, BT], dtype=tl.float32)
    for kc in range(0, BK, KC):
        cols = kc + tl.arange(0, KC)
        k_c, _ = _clean(load_rows(k_h, r, H * K, cols, K, n_t).to(tl.float32))
        q_c = load_rows(q_h, r, H * K, cols, K, n_t).to(tl.float32) * scale
        g_c = load_rows(g_h, r, HV * K, cols, K, n_t).to(tl.float32)
        l = _block_cumsum(tl.where(g_c < float("inf"), base2_gates(g_c), 0.0), BC)
        s0, s1, s2 = _row(l, BC - 1), _row(l, 2 * BC - 1), _row(l, 3 * BC - 1)  # block gate sums, <= 0

        # Left of the diagonal, by column block c; row exponent l_i + the sums of the blocks between c and blk(i).
        x, y = _left_of_diagonal(k_c, q_c, l, blk, l + _per_block(blk, 0.0, 0.0, s1, s1 + s2), s0, 0, PREC)
        A, Aq = A + x, Aq + y
        x, y = _left_of_diagonal(k_c, q_c, l, blk, l + tl.where(blk == 3, s2, 0.0), s1, 1, PREC)
        A, Aq = A + x, Aq + y
        x, y = _left_of_diagonal(k_c, q_c, l, blk, l, s2, 2, PREC)
        A, Aq = A + x, Aq + y

        # The diagonal blocks, anchored at each block's middle row: |l_i - l_m| is at most the block's
        # half-block gate sum, so both factors stay inside float32's range while that is <= DIAG_LIMIT.
        d = l - _per_block(blk, _row(l, BC // 2), _row(l, BC + BC // 2), _row(l, 2 * BC + BC // 2),
                           _row(l, 3 * BC + BC // 2))  # fmt: skip
        if tl.max(tl.max(tl.abs(d), axis=1), axis=0) <= DIAG_LIMIT:
            col = tl.trans(k_c * tl.exp2(-d))
            row_f = tl.exp2(d)
            A += tl.where(on_diag, _mm(k_c * row_f, col, PREC), 0.0)
            Aq += tl.where(on_diag, _mm(q_c * row_f, col, PREC), 0.0)
        else:
            x, y = _exact_diagonal(q_h, k_h, g_h, cols, H, HV, K, n_t, scale, BC, PREC)
            A, Aq = A + x, Aq + y

        # qg = q 2^(gc), gc the cumsum from the chunk start: l plus the sums of the blocks before (<= 0).
        gc = l + _per_block(blk, 0.0, s0, s0 + s1, s0 + s1 + s2)
        _store_block(qg, row0, 0, BT, BK, cols, q_c * tl.exp2(gc))

    b, _ = _clean(tl.load(b_h + r * HV, mask=r < n_t, other=0.0).to(tl.float32)[:, None])
    _store_block(lmat, row0, 0, BT, BT, r, tl.where(r[:, None] > r[None, :], b * A, 0.0))
    _store_block(aqk, row0, 0, BT, BT, r, tl.where(r[:, None] >= r[None, :], Aq, 0.0))


def prepare_chunks64(*args, **kwargs):
    """`kda_edu.kernels.chunk.prepare_chunks` (same arguments, buffers and return value) with
    `_chunk_gram64_kernel` launched in place of `_chunk_gram_kernel` (the same arguments); the inverse and
    w/u kernels unchanged."""
    with mock.patch.object(chunk, "_chunk_gram_kernel", _chunk_gram64_kernel):
        return chunk.prepare_chunks(*args, **kwargs)


def chunk_kda_fwd64(*args, **kwargs):
    """`kda_edu.kernels.chunk.chunk_kda_fwd` (same arguments and knobs: stop_after="prepare", info, keep) with
    the prepare kernels of `prepare_chunks64`; the scan kernel is chunk.py's."""
    with mock.patch.object(chunk, "_chunk_gram_kernel", _chunk_gram64_kernel):
        return chunk.chunk_kda_fwd(*args, **kwargs)


def _inputs(B, T, H, HV, K, V, gate, seed=0):
    """Float32 CPU inputs: L2-normalised keys, beta = rand, g = gate * rand (natural log)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = gate * torch.rand(B, T, HV, K, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    return q, k, v, g, beta


def _rel(x, ref):
    """Largest absolute difference over the largest reference entry."""
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def _check(name, inputs, cu_seqlens=None, loop=True, nan_at=None, tol=1e-5):
    """Run both forwards (and their prepare buffers) on `inputs`; print and assert the differences."""
    from kda_edu.kernels.chunk import _chunk_gram_kernel, chunk_kda_fwd, prepare_chunks
    from kda_edu.ops.kda import kda_recurrent

    q, k, v, g, beta = inputs
    B, T, H, K = q.shape
    scale = K**-0.5
    o64, s64 = chunk_kda_fwd64(q, k, v, g, beta, scale, None, True, cu_seqlens)
    o, s = chunk_kda_fwd(q, k, v, g, beta, scale, None, True, cu_seqlens)
    line = f"{name:34s}"
    if cu_seqlens is None:
        n_exact, n_steps = _fallback_steps(g)
        line += f" [exact diagonal in {n_exact}/{n_steps} steps]"
    if nan_at is None:
        assert torch.isfinite(o64).all() and torch.isfinite(s64).all(), name
        line += f" vs chunk_kda_fwd: o {_rel(o64, o):.2e} state {_rel(s64, s):.2e}"
        errs = [_rel(o64, o), _rel(s64, s)]
    else:  # outputs before the bad step finite and equal to chunk_kda_fwd's; from it on NaN like it
        before, after = o64[:, :nan_at], o64[:, nan_at:]
        assert torch.isfinite(before).all() and torch.isnan(after).all() and torch.isnan(o[:, nan_at:]).all()
        errs = [_rel(before, o[:, :nan_at])]
        line += f" vs chunk_kda_fwd, o before step {nan_at}: {errs[0]:.2e} (NaN from it on, both)"
    if loop:
        ref_o, ref_s = kda_recurrent(q.double(), k.double(), v.double(), g.double(), beta.double(), scale,
                                     output_final_state=True)  # fmt: skip
        errs += [_rel(o64, ref_o), _rel(s64, ref_s)]
        line += f" | vs float64 loop: o {errs[-2]:.2e} state {errs[-1]:.2e}"
        line += f" (chunk_kda_fwd {_rel(o, ref_o):.2e})"
    # The raw prepare buffers over the rows of real steps: qg, Aqk, X = (I + L)^-1 (store_x), w and u; and L
    # itself from the two gram kernels launched alone (below the diagonal; the new one writes zeros elsewhere).
    layout = chunk_layout(T, B, cu_seqlens)
    cont = [x.contiguous() for x in (q, k, v, g, beta)]
    b64, _ = prepare_chunks64(*cont, scale, layout, store_x=True)
    b, _ = prepare_chunks(*cont, scale, layout, store_x=True)
    valid = _valid_rows(T, B, v.shape[2], layout, cu_seqlens)
    below = torch.arange(CHUNK)[None, :] < (torch.arange(valid.numel()) % CHUNK)[:, None]
    b64["L"] = _gram_alone(_chunk_gram64_kernel, *cont, scale, layout)
    b["L"] = _gram_alone(_chunk_gram_kernel, *cont, scale, layout)
    assert not b64["L"][~below].any(), name
    b64["L"], b["L"] = b64["L"] * below, b["L"] * below
    for key in ("qg", "aqk", "L", "x", "w", "u"):
        x64, x = b64[key][valid], b[key][valid]
        ok = torch.isfinite(x)
        assert torch.equal(ok, torch.isfinite(x64)), (name, key)
        e = _rel(x64[ok], x[ok]) if ok.any() else 0.0
        errs.append(e)
        line += f" | {key} {e:.1e}"
    print(line)
    assert max(errs) < tol, (name, errs)


def _gram_alone(kernel, q, k, v, g, beta, scale, layout, kc=32):
    """L = Diag(beta) A as `kernel` (a gram kernel, launched as `prepare_chunks` launches it) writes it into a
    zeroed float32 buffer [HV * NCH * CHUNK, CHUNK]."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    NT, NCH, chunks, _ = layout
    BK, rows = pow2(K), HV * NCH * CHUNK
    qg, aqk, lmat = torch.zeros(rows, BK), torch.zeros(rows, CHUNK), torch.zeros(rows, CHUNK)
    kernel[(NCH, HV)](
        q, k, g, beta, qg, aqk, lmat, chunks, T, H, HV, K, NT, NCH, scale,
        BT=CHUNK, BC=SUB, BK=BK, KC=min(kc, BK), PREC="ieee", IS_VARLEN=chunks is not None, num_warps=4,
    )  # fmt: skip
    return lmat


def _fallback_steps(g, kc=32):
    """(steps taking the exact diagonal path, all steps): the (chunk, head, KC-column) steps in which some
    16-row block's largest |l_i - l_middle| passes DIAG_LIMIT (computed here in float64, from the gates the
    kernel loads: floored at GATE_FLOOR, NaN and +inf as 0, base 2)."""
    from kda_edu.ops._checks import GATE_FLOOR

    B, T, HV, K = g.shape
    NT, BK = -(-T // CHUNK), pow2(K)
    x = g.double().clamp(min=GATE_FLOOR[torch.float32]) * 1.4426950408889634
    x = torch.where(g < float("inf"), x, 0.0)
    x = torch.nn.functional.pad(x, (0, BK - K, 0, 0, 0, NT * CHUNK - T))
    l = x.reshape(B, NT, 4, SUB, HV, BK).cumsum(3)
    span = (l - l[:, :, :, SUB // 2 : SUB // 2 + 1]).abs()
    span = span.reshape(B, NT, 4 * SUB, HV, BK // min(kc, BK), min(kc, BK)).amax(dim=(2, 5))
    return int((span > DIAG_LIMIT.value).sum()), span.numel()


def _valid_rows(T, B, HV, layout, cu_seqlens):
    """Mask of the buffers' rows [HV * NCH * CHUNK] that hold a real step (not the padding of a last chunk)."""
    NT, NCH, chunks, _ = layout
    if cu_seqlens is None:
        n_t = torch.tensor([min(CHUNK, T - (c % NT) * CHUNK) for c in range(NCH)])
    else:
        n_t = (chunks[:, 1] - chunks[:, 0]).clamp(max=CHUNK)
    rows = torch.arange(CHUNK)[None, :] < n_t[:, None]
    return rows.reshape(-1).repeat(HV)


def main():
    """The checks of the brief (module docstring), under Triton's interpreter in float32."""
    import numpy

    # The anchored diagonal products overflow to inf in their discarded entries (above the diagonal within a
    # block, and the off-diagonal blocks of the 64 x 64 product), in chunk.py's kernel too: numpy would warn.
    numpy.seterr(over="ignore", invalid="ignore")
    _check("mild gates (1,130,2,2,32,16)", _inputs(1, 130, 2, 2, 32, 16, -0.5))
    _check("strong gates (1,130,2,4,32,48)", _inputs(1, 130, 2, 4, 32, 48, -12.0, seed=1))
    q, k, v, g, beta = _inputs(2, 100, 1, 1, 64, 32, -1.0, seed=2)
    g[:, ::7] = float("-inf")
    _check("resets every 7 (2,100,1,1,64,32)", (q, k, v, g, beta))
    q, k, v, g, beta = _inputs(1, 150, 1, 2, 64, 32, -0.5, seed=8)
    g[..., 32:] *= 24.0  # columns 32..63 at -12 * rand: the second KC step of a chunk takes the exact path
    _check("mixed steps (1,150,1,2,64,32)", (q, k, v, g, beta))
    _check("T = 1 (1,1,2,2,32,16)", _inputs(1, 1, 2, 2, 32, 16, -0.5, seed=3))
    _check("K = 256 (1,70,1,2,256,32)", _inputs(1, 70, 1, 2, 256, 32, -0.5, seed=4))
    _check("K = 48, BK 64 (1,70,1,1,48,24)", _inputs(1, 70, 1, 1, 48, 24, -3.0, seed=5))
    cu = torch.tensor([0, 50, 51, 190], dtype=torch.int32)
    _check("varlen [0,50,51,190]", _inputs(1, 190, 2, 2, 32, 16, -1.0, seed=6), cu_seqlens=cu, loop=False)
    q, k, v, g, beta = _inputs(1, 130, 2, 2, 32, 16, -0.5, seed=7)
    g[0, 77, :, 5] = float("nan")
    _check("NaN gate at step 77", (q, k, v, g, beta), loop=False, nan_at=77)
    print("all checks pass")


if __name__ == "__main__":
    main()
