"""The chunkwise algorithm, piece by piece (chapter 6).

`kda_edu.ops.kda.kda_chunked` is the reference chunked KDA. This module holds what the chapter builds around it:

- why the plain recurrence is slow: the FLOP counts `recurrent_flops`, `chunked_flops`;
- why a parallel scan is the wrong fix: `parallel_scan`, `compose_affine`, `kda_scan`, `scan_flops`;
- the WY representation and the UT transform: `transition_product`, `forward_substitution`, `ut_transform`;
- the chunkwise KDA in matrix-product form, stage by stage, with sub-chunk anchors that keep every exponent
  bounded: `intra_chunk_matrices`, then `kda_chunked_matmul` (with `sub_chunk=chunk_size` it is the naive
  factorisation that overflows); its stage 4 is the state pass that every chunked form shares,
  `kda_edu.ops._chunks.state_passing`;
- the numerics: `largest_exponent` (chapter 6's figure of it: `kda_edu.chapters.ch06_chunkwise`).

Layout as everywhere in kda_edu: q, k `[B, T, H, K]`; v `[B, T, HV, V]`; g `[B, T, HV, K]` (log decay, <= 0);
beta `[B, T, HV]`; states `[B, HV, K, V]`. Inside a chunk, tensors are `[..., C, K]` with any batch dims first.
"""

import math

import torch
import torch.nn.functional as F

from kda_edu.ops._checks import (
    GATE_FLOOR,
    check_chunk_size,
    check_kda_inputs,
    compute_dtype,
    resolve_scale,
)
from kda_edu.ops._chunks import chunk_inputs, from_chunks, state_passing

# ---------------------------------------------------------------------------------------------------------
# Inputs


def random_inputs(
    B: int,
    T: int,
    H: int,
    K: int,
    V: int,
    *,
    HV: int | None = None,
    lower_bound: float = -1.0,
    at_bound: float = 0.0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Random KDA inputs: q ~ N(0, 1), unit-length k, v ~ N(0, 1), g uniform in [lower_bound, 0], beta in (0, 1).

    Args:
        B, T, H, K, V: sizes; HV (value heads) defaults to H.
        lower_bound: the most negative log decay, < 0.
        at_bound: the fraction of key channels whose gate is pinned at `lower_bound` at every step (the
            hardest case for the numerics: their cumulative decay falls as fast as the bound allows).
        dtype, device, seed: where and how the tensors are made (drawn in float64 on the CPU, then cast).

    Returns:
        `{"q", "k", "v", "g", "beta"}` in the layout of kda_edu.
    """
    HV = H if HV is None else HV
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(generator=gen, dtype=torch.float64)
    g = lower_bound * torch.rand(B, T, HV, K, **f64)
    g[..., : round(at_bound * K)] = lower_bound
    out = dict(
        q=torch.randn(B, T, H, K, **f64),
        k=F.normalize(torch.randn(B, T, H, K, **f64), dim=-1),
        v=torch.randn(B, T, HV, V, **f64),
        g=g,
        beta=torch.rand(B, T, HV, **f64),
    )
    return {name: x.to(device=device, dtype=dtype) for name, x in out.items()}


# ---------------------------------------------------------------------------------------------------------
# FLOP counts, per head (one value head; K and V are d_k and d_v)


def recurrent_flops(T: int, K: int, V: int) -> int:
    """FLOPs of T steps of the KDA loop for one head.

    Per step: decay `Diag(alpha) S` (K V), prediction `S^T k` (2 K V), error and beta (2 V), write
    `S + k u^T` (2 K V), read `S^T q` (2 K V): `7 K V + 2 V`.
    """
    return T * (7 * K * V + 2 * V)


def chunked_flops(T: int, C: int, K: int, V: int) -> dict[str, int]:
    """FLOPs of the chunkwise algorithm for one head and T steps (T a multiple of C), stage by stage.

    Only the entries the algorithm needs are counted: the C x C matrices are lower triangular, so a
    product that fills one costs about `C^2 / 2` entries times 2 FLOPs per term. A unit lower-triangular
    solve with N right-hand columns costs `C (C - 1) N`. Leading terms, with d_k = d_v = d:
    `6 T d^2 + 5 T C d`.
    """
    n = T // C  # chunks
    tri = C * (C + 1) // 2  # entries on and below the diagonal
    return {
        "gate cumsum": T * K,
        "A = strictly lower (beta K) Gamma K^T": n * (tri - C) * 2 * K,
        "Aqk = lower Q Gamma K^T": n * tri * 2 * K,
        "UT transform: solve for w and u": n * C * (C - 1) * (K + V),
        "U = u - w S": n * 2 * C * K * V,
        "O = Q S + Aqk U": n * (2 * C * K * V + tri * 2 * V),
        "S = Diag S + K^T U": n * (2 * C * K * V + K * V),
    }


def scan_compositions(T: int) -> int:
    """How many pairs `parallel_scan` composes for a sequence of T elements."""
    if T <= 1:
        return 0
    return T // 2 + scan_compositions(T // 2) + (T - 1) // 2


def scan_flops(T: int, K: int, V: int) -> int:
    """FLOPs of `kda_scan` for one head: every composition multiplies a K x K by a K x K and a K x V matrix
    (`2 K^3 + 2 K^2 V + K V`), and every step reads its state (`2 K V`)."""
    return scan_compositions(T) * (2 * K**3 + 2 * K**2 * V + K * V) + T * 2 * K * V


# ---------------------------------------------------------------------------------------------------------
# The parallel scan over the affine maps S -> A S + X


def compose_affine(later, earlier):
    """Compose two affine maps of the state: apply `earlier = (M1, X1)`, then `later = (M2, X2)`.

    `S -> M2 (M1 S + X1) + X2 = (M2 M1) S + (M2 X1 + X2)`. M (the transition) is `[..., K, K]`, X is
    `[..., K, V]`.
    """
    (M2, X2), (M1, X1) = later, earlier
    return M2 @ M1, M2 @ X1 + X2


def parallel_scan(elements, compose):
    """Inclusive scan of `elements` (a tuple of tensors, time along dim 0) under an associative `compose`.

    Returns a tuple like `elements` whose entry t is `e_t o ... o e_1` (`compose(later, earlier)`). The
    work-efficient recursion: compose neighbours (2i, 2i + 1) in one batched call, scan those T/2 pairs
    recursively, then fix the remaining even positions with one more batched call. About 2 T compositions
    in all (`scan_compositions`), but only about 2 log2(T) rounds that depend on each other.
    """
    T = elements[0].shape[0]
    if T == 1:
        return elements
    pairs = compose(tuple(x[1::2] for x in elements), tuple(x[0 : 2 * (T // 2) : 2] for x in elements))
    odd = parallel_scan(pairs, compose)  # odd[i] = prefix up to position 2i + 1
    even = compose(tuple(x[2::2] for x in elements), tuple(x[: (T - 1) // 2] for x in odd))
    out = []
    for x, o, e in zip(elements, odd, even, strict=True):
        y = torch.empty_like(x)
        y[0], y[1::2], y[2::2] = x[0], o, e
        out.append(y)
    return tuple(out)


def kda_scan(q, k, v, g, beta, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA from a zero state by a parallel scan over the per-step affine maps `S -> M_t S + X_t`.

    `M_t = (I - beta_t k_t k_t^T) Diag(exp(g_t))` is K x K and `X_t = beta_t k_t v_t^T` is K x V. The scan
    holds T of each, `T K (K + V)` numbers per head, and every composition multiplies K x K matrices.

    Returns:
        `(o, final_state)`: o `[B, T, HV, V]` in q's dtype, final_state `[B, HV, K, V]` (float32, or
        float64 for float64 inputs).
    """
    B, T, H, HV, K, V = check_kda_inputs(q, k, v, g, beta)
    scale = resolve_scale(scale, K)
    dtype = compute_dtype(q.dtype)
    # time first, one entry per (step, batch, value head)
    q_t, k_t = (x.to(dtype).repeat_interleave(HV // H, dim=2).transpose(0, 1) for x in (q, k))
    v_t, alpha, b = (
        v.to(dtype).transpose(0, 1),
        g.to(dtype).exp().transpose(0, 1),
        beta.to(dtype).transpose(0, 1),
    )
    eye = torch.eye(K, dtype=dtype, device=q.device)
    M = eye * alpha[..., None, :] - b[..., None, None] * k_t[..., :, None] * (k_t * alpha)[..., None, :]
    X = b[..., None, None] * k_t[..., :, None] * v_t[..., None, :]
    _, states = parallel_scan((M, X), compose_affine)  # states[t] = S_t: [T, B, HV, K, V]
    o = torch.einsum("tbhk,tbhkv->tbhv", q_t * scale, states)
    return o.transpose(0, 1).to(q.dtype), states[-1]


# ---------------------------------------------------------------------------------------------------------
# The WY representation and the UT transform (one head, one chunk: k, g `[n, K]`, beta `[n]`)


def transition_product(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """`M_n ... M_2 M_1` with `M_i = (I - beta_i k_i k_i^T) Diag(exp(g_i))`, multiplied out as K x K matrices."""
    P = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
    for k_i, g_i, b_i in zip(k, g, beta, strict=True):
        P = g_i.exp()[:, None] * P - b_i * torch.outer(k_i, k_i * g_i.exp()) @ P
    return P


def forward_substitution(A: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """Solve `(I + A) X = rhs` for strictly lower-triangular A `[..., C, C]`, one row at a time.

    Row i of the system reads `X_i + sum_{j<i} A_ij X_j = rhs_i`: every row needs only the rows above it.
    """
    X = rhs.clone()
    for i in range(1, A.shape[-1]):
        X[..., i, :] -= (A[..., i, :i, None] * X[..., :i, :]).sum(dim=-2)
    return X


def ut_transform(A: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """Solve `(I + A) X = rhs` for strictly lower-triangular A `[..., C, C]` with one triangular solve."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    return torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)


# ---------------------------------------------------------------------------------------------------------
# Chunkwise KDA in matrix-product form, stage by stage


def anchored_exponents(gc: torch.Tensor, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The exponents that split `exp(gc_i - gc_j)` for rows i in [start, stop) and columns j < stop.

    The anchor is `b = gc_{start-1}`, the cumulative log decay just before the row block (0 for the first
    block): `exp(gc_i - gc_j) = exp(gc_i - b) * exp(b - gc_j)`. The row exponent `gc_i - b` is <= 0 (i is
    after the anchor). The column exponent `b - gc_j` is <= 0 for columns before the block and at most the
    gate sum over the block's own rows, `(stop - start) |g_min|`, inside it.

    Returns:
        `(row_exponent [..., stop - start, K], column_exponent [..., stop, K])`.
    """
    anchor = gc[..., start - 1 : start, :] if start > 0 else torch.zeros_like(gc[..., :1, :])
    return gc[..., start:stop, :] - anchor, anchor - gc[..., :stop, :]


def intra_chunk_matrices(
    q: torch.Tensor,
    k: torch.Tensor,
    gc: torch.Tensor,
    beta: torch.Tensor,
    sub_chunk: int,
    resets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two C x C matrices of a chunk, as matrix products over row blocks of `sub_chunk` steps.

        A_ij   = beta_i sum_c k_ic k_jc exp(gc_ic - gc_jc)   for j < i, else 0
        Aqk_ij =        sum_c q_ic k_jc exp(gc_ic - gc_jc)   for j <= i, else 0

    Each decay is split at the row block's anchor (`anchored_exponents`), so a block of rows is one product
    `(k_rows * exp(row)) @ (k_cols * exp(col))^T`. With `sub_chunk >= C` there is one block anchored at the
    chunk start: the naive factorisation `exp(gc_i) * exp(-gc_j)`, whose second factor overflows.

    Resets: a step whose decay is exactly 0 (a gate at or below `kda_edu.ops._checks.GATE_FLOOR`) inside a row
    block would need a column factor of at least exp(105), an overflow. With `resets` given, each stretch
    of a block between two resets (per channel) is its own product, anchored at the reset that starts it;
    a decay across a reset is 0, so the stretches add up to the block. The exponents are computed in gc's
    dtype and rounded to k's only after `exp`.

    Args:
        q, k: `[..., C, K]` (q already scaled). gc: within-chunk cumulative log decay `[..., C, K]`.
        beta: `[..., C]`. sub_chunk: rows per block. resets: optional bool `[..., C, K]`, the reset steps.

    Returns:
        `(A, Aqk)`, each `[..., C, C]`.
    """
    C = k.shape[-2]
    A = k.new_zeros(*k.shape[:-1], C)
    Aqk = torch.zeros_like(A)
    for start in range(0, C, sub_chunk):
        stop = min(start + sub_chunk, C)
        gc_rows = gc[..., start:stop, :]
        stretch = torch.zeros_like(gc_rows) if resets is None else resets[..., start:stop, :].cumsum(dim=-2)
        for s in range(int(stretch.max()) + 1):  # stretch 0 is the whole block when it holds no reset
            row, col = anchored_exponents(gc, start, stop)
            if s > 0:  # anchor at the s-th reset of the block: gc there is the largest of its stretch
                at = gc_rows.masked_fill(stretch != s, -math.inf).amax(dim=-2, keepdim=True)
                at = at.nan_to_num(neginf=0.0)  # channels with fewer resets: every entry is masked below
                row, col = gc_rows - at, at - gc[..., :stop, :]
                col[..., :start, :] = -math.inf  # columns before the block: across the reset, decay 0
            row = row.masked_fill(stretch != s, -math.inf)
            col[..., start:, :] = col[..., start:, :].masked_fill(stretch != s, -math.inf)
            keys_t = (k[..., :stop, :] * col.exp().to(k.dtype)).transpose(-1, -2)
            A[..., start:stop, :stop] += (k[..., start:stop, :] * row.exp().to(k.dtype)) @ keys_t
            Aqk[..., start:stop, :stop] += (q[..., start:stop, :] * row.exp().to(q.dtype)) @ keys_t
    return beta[..., None] * A.tril(-1), Aqk.tril()


def kda_chunked_matmul(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    sub_chunk: int = 16,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA chunk by chunk in matrix-product form, the way the Triton kernels organise it.

    Stages: (1) within-chunk cumulative log decay gc; (2) the matrices A and Aqk as anchored matrix
    products (`intra_chunk_matrices`); (3) the UT transform, one triangular solve for
    `[w, u] = (I + A)^-1 Diag(beta) [K * exp(gc), V]`; (4) `state_passing` over the chunks.

    The decays inside a chunk are split into two factors at an anchor every `sub_chunk` rows, so the
    largest exponent evaluated is about `sub_chunk * |min g|` over the gates above `GATE_FLOOR`: gates at or
    below it (down to -inf) are resets, raised to the floor, with a stretch of their own in
    `intra_chunk_matrices`; gc and its differences are float64 until `exp`. `sub_chunk = chunk_size` is the naive
    split at the chunk start: with gates near -5 and 64-step chunks it overflows float32 and returns
    inf/NaN. `kda_edu.ops.kda.kda_chunked` never evaluates a positive exponent.

    Args and returns as `kda_edu.ops.kda.kda_chunked`, plus `sub_chunk` (rows per anchored block, >= 1).
    """
    B, T, H, HV, K, V = check_kda_inputs(q, k, v, g, beta, initial_state)
    c = check_chunk_size(sub_chunk)
    # (1) [B, HV, NC, C, *]; resets (down to -inf) at GATE_FLOOR, gc in float64: the sums of resets must not round
    q_c, k_c, v_c, g_c, gc, beta_c = chunk_inputs(
        q, k, v, g, beta, scale=scale, chunk_size=chunk_size, resets=True
    )
    dtype = q_c.dtype
    A, Aqk = intra_chunk_matrices(q_c, k_c, gc, beta_c, c, resets=g_c <= GATE_FLOOR[dtype])  # (2)
    w, u = ut_transform(A, beta_c[..., None] * torch.cat([k_c * gc.exp().to(dtype), v_c], dim=-1)).split(
        [K, V], -1
    )  # (3)
    o, state = state_passing(q_c, k_c, gc, Aqk, w, u, initial_state)  # (4)
    return from_chunks(o, T, q.dtype), (state if output_final_state else None)


# ---------------------------------------------------------------------------------------------------------
# Numerics: the exponents the split evaluates


def largest_exponent(gc: torch.Tensor, sub_chunk: int) -> float:
    """The largest exponent `intra_chunk_matrices` passes to `exp` for cumulative decays gc `[..., C, K]`."""
    C = gc.shape[-2]
    largest = -math.inf
    for start in range(0, C, sub_chunk):
        row, col = anchored_exponents(gc, start, min(start + sub_chunk, C))
        largest = max(largest, row.max().item(), col.max().item())
    return largest
