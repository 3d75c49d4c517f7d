"""Kimi Delta Attention (KDA): reference implementations in plain PyTorch.

KDA is the gated delta rule with one decay per key channel. Per value head, with state `S` of shape `[K, V]`:

    S'_t = Diag(exp(g_t)) S_{t-1}
    S_t  = S'_t + beta_t k_t (v_t - S'_t^T k_t)^T
    o_t  = S_t^T (scale q_t)

Three forms of the same function:

- `kda_recurrent`: the loop above, one step at a time (the ground truth).
- `kda_chunked`: the chunkwise algorithm, the one the Triton kernels implement.
- `kda_step`: one decoding step from a given state.

Layout (as in fla): q, k `[B, T, H, K]`; v `[B, T, HV, V]` with HV a multiple of H (value head j reads
query/key head `j // (HV // H)`); g `[B, T, HV, K]` in log space, <= 0; beta `[B, T, HV]` in [0, 1]; states
`[B, HV, K, V]` in float32 (float64 for float64 inputs); outputs in the input dtype.
"""

import math

import torch
import torch.nn.functional as F

from kda_edu.ops._checks import check_kda_inputs, resolve_scale
from kda_edu.ops._chunks import chunk_inputs, from_chunks, state_passing
from kda_edu.ops.recurrence import general_recurrence

SUB_BLOCK = 16  # rows per sub-block inside a chunk, see _decayed_scores


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA as a loop over time: the ground truth every other form is checked against.

    For t = 1..T: `S = Diag(exp(g_t)) S`, then `S += beta_t k_t (v_t - S^T k_t)^T`, then
    `o_t = S^T (scale q_t)`. The loop itself is `kda_edu.ops.recurrence.general_recurrence` with every part
    switched on; its docstring says what a NaN or inf in q, k or v spoils (never a step before it, forward or
    backward).

    Args:
        q: queries `[B, T, H, K]`, floating dtype.
        k: keys `[B, T, H, K]`, same dtype as q (usually L2-normalised).
        v: values `[B, T, HV, V]`, same dtype as q, HV a multiple of H.
        g: log-space decay per key channel `[B, T, HV, K]`, any floating dtype, <= 0.
        beta: write strength `[B, T, HV]`, any floating dtype, in [0, 1].
        scale: query scale; `K ** -0.5` when None.
        initial_state: optional `[B, HV, K, V]` in float32 (float64 for float64 inputs); zeros when None.
        output_final_state: also return the state after step T.

    Returns:
        `(o, final_state)`: o `[B, T, HV, V]` in q's dtype; final_state `[B, HV, K, V]` in float32 (float64
        for float64 inputs), or None when `output_final_state` is False. Computed in float32 (float64 for
        float64 inputs).
    """
    K = check_kda_inputs(q, k, v, g, beta, initial_state)[4]
    return general_recurrence(
        q,
        k,
        v,
        g,
        beta,
        delta_rule=True,
        scale=resolve_scale(scale, K),
        initial_state=initial_state,
        output_final_state=output_final_state,
    )


def kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One KDA decoding step: the body of the `kda_recurrent` loop, applied to a given state.

    Args:
        q, k: `[B, 1, H, K]`.
        v: `[B, 1, HV, V]`.
        g: `[B, 1, HV, K]`, <= 0.
        beta: `[B, 1, HV]`, in [0, 1].
        state: `[B, HV, K, V]` in float32 (float64 for float64 inputs); not modified.
        scale: query scale; `K ** -0.5` when None.

    Returns:
        `(o, new_state)`: o `[B, 1, HV, V]` in q's dtype, new_state `[B, HV, K, V]` in state's dtype.
    """
    if not isinstance(state, torch.Tensor):
        raise TypeError(f"state must be a torch.Tensor of shape [B, HV, K, V], got {type(state).__name__}")
    B, T, H, HV, K, V = check_kda_inputs(q, k, v, g, beta, state, state_name="state")
    if T != 1:
        raise ValueError(f"q, k, v, g and beta must have T = 1 for one decoding step, got T = {T}")
    return general_recurrence(
        q,
        k,
        v,
        g,
        beta,
        delta_rule=True,
        scale=resolve_scale(scale, K),
        initial_state=state,
        output_final_state=True,
    )


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA computed chunk by chunk: matrix products inside a chunk, the recurrence only between chunks.

    Split time into chunks of C = `chunk_size` steps (the last one zero-padded: a padded step has k = v = 0,
    g = 0 and beta = 0, so it leaves the state alone). Inside a chunk, with local positions i, j = 1..C and
    `gc_i = g_1 + ... + g_i` the cumulative log decay from the chunk start (per key channel), the state
    entering the chunk `S_0` and the state after step i is

        S_i = Diag(exp(gc_i)) S_0 + sum_{j <= i} Diag(exp(gc_i - gc_j)) k_j U_j^T

    where `U_j = beta_j (v_j - S'_j^T k_j)` is the value actually written at step j. Substituting S'_j turns
    the C definitions of U_j into one unit lower-triangular system (the UT transform):

        (I + A) U = Diag(beta) (V - (K * exp(gc)) S_0),
        A_ij = beta_i sum_c k_ic k_jc exp(gc_ic - gc_jc) for j < i, else 0

    so `U = u - w S_0` with `u = (I + A)^-1 Diag(beta) V` and `w = (I + A)^-1 Diag(beta) (K * exp(gc))`, both
    independent of S_0 (one triangular solve each; a kernel computes them for all chunks in parallel). Only
    the state passing depends on the previous chunk:

        U       = u - w S_0
        O       = (scale Q * exp(gc)) S_0 + Aqk U
        S_C     = Diag(exp(gc_C)) S_0 + (K * exp(gc_C - gc))^T U

    with `Aqk_ij = scale sum_c q_ic k_jc exp(gc_ic - gc_jc)` for j <= i, else 0.

    Overflow: every exponent evaluated is <= 0, so every `exp` lies in [0, 1] whatever the gates, down to a
    -1000 reset. gc is non-increasing, so the inter-chunk factors `exp(gc_i)` and `exp(gc_C - gc_i)` are
    <= 1. The within-chunk decays `exp(gc_i - gc_j)`, j <= i, are never factorised as `exp(gc_i) *
    exp(-gc_j)` (with gates at -5 and C = 64 the second factor is exp(320), far beyond float32's largest,
    about exp(88.7)); `_decayed_scores` either takes the difference first or splits it at an anchor that
    lies between i and j, so both factors are <= 1. Entries with j > i are set to -inf before `exp`, so
    they become exact zeros with zero gradient instead of `inf * 0 = NaN`. Decays that underflow to 0 are
    correct: the true value is below the dtype's smallest number.

    Resets and rounding: each step's gate is first raised to `kda_edu.ops._checks.GATE_FLOOR` (-105 for float32,
    whose exp is already exactly 0), so a reset of -1000 or -inf decays exactly as before but gc stays finite
    (-inf - (-inf) would be NaN). gc is summed and differenced in float64 and only the decays, numbers in
    [0, 1], are rounded to the compute dtype: a float32 sum that reaches ~1000 after a few resets carries a
    rounding of ~1e-4, which the decays between the steps after the reset would inherit.

    Non-finite q, k, v: a NaN or inf in the key or value of step t makes every output of that head from t
    on NaN, in all V columns, and the final state NaN. The loop spoils less for a bad value: there only
    that value column is non-finite from t on, the other columns of the outputs and state stay finite (for
    a bad key the loop's state is NaN from t on too). A non-finite query makes its own output NaN and
    nothing else, in both forms. In every case the outputs before t are exactly those of the clean prefix,
    and so, for a loss on them, are the gradients of every step before t (and of the initial state): the
    bad step runs as a zero step (its key and value, or its query, as zeros) and the outputs it spoils are
    set to NaN by a select afterwards. Multiplied in, the NaN would reach the earlier steps, forward through
    the zeros of the causal masks and backward through any product with a zero gradient (0 * NaN = NaN).
    Non-finite g or beta are rejected by the input check.

    Args:
        q: queries `[B, T, H, K]`, floating dtype; any T >= 1.
        k: keys `[B, T, H, K]`, same dtype as q (usually L2-normalised).
        v: values `[B, T, HV, V]`, same dtype as q, HV a multiple of H.
        g: log-space decay per key channel `[B, T, HV, K]`, any floating dtype, <= 0.
        beta: write strength `[B, T, HV]`, any floating dtype, in [0, 1].
        scale: query scale; `K ** -0.5` when None.
        initial_state: optional `[B, HV, K, V]` in float32 (float64 for float64 inputs); zeros when None.
        output_final_state: also return the state after step T.
        chunk_size: C, the number of steps per chunk.

    Returns:
        `(o, final_state)` exactly as `kda_recurrent` (up to rounding): o `[B, T, HV, V]` in q's dtype;
        final_state `[B, HV, K, V]` in float32 (float64 for float64 inputs) or None.
    """
    B, T, H, HV, K, V = check_kda_inputs(q, k, v, g, beta, initial_state)
    # [B, HV, NC, C, *]; gates raised to GATE_FLOOR and gc summed in float64 within each chunk (docstring)
    q, k, v_c, _, gc, beta = chunk_inputs(q, k, v, g, beta, scale=scale, chunk_size=chunk_size, resets=True)
    # A step with a non-finite key or value runs as a zero step; the outputs from it on are set to NaN
    # afterwards, and so is the final state. A non-finite query reads as zero and its own output is set to
    # NaN. Multiplying by the zeros of the causal masks would instead spread a NaN to the earlier steps of
    # its chunk, and the backward's products with zero gradients to every earlier step (0 * NaN = NaN).
    bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v_c).all(-1))  # [B, HV, NC, C]
    bad_q = ~torch.isfinite(q).all(-1)
    k, v_c = (torch.where(bad[..., None], 0.0, x) for x in (k, v_c))
    q = torch.where(bad_q[..., None], 0.0, q)
    spoilt = bad.flatten(-2).cumsum(dim=-1).unflatten(-1, bad.shape[-2:]) > 0  # from the first bad step on
    Aqk, w, u = kda_intra_chunk(q, k, v_c, gc, beta)  # independent of the state, every chunk at once

    # Sequential: the values written given the incoming state, the outputs, the outgoing state.
    o, S = state_passing(q, k, gc, Aqk, w, u, initial_state)
    o = torch.where((spoilt | bad_q)[..., None], math.nan, o)
    S = torch.where(spoilt[:, :, -1, -1, None, None], math.nan, S)
    return from_chunks(o, T, v.dtype), (S if output_final_state else None)


def kda_intra_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gc: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The part of every chunk that does not depend on the state entering it: `Aqk`, `w` and `u`.

    With the chunk's (I + A) of `kda_chunked`'s docstring, `u = (I + A)^-1 Diag(beta) V`,
    `w = (I + A)^-1 Diag(beta) (K * exp(gc))` (one triangular solve each) and the causal scores
    `Aqk_ij = sum_c q_ic k_jc exp(gc_ic - gc_jc)` for j <= i. The chunks are independent of each other; here
    they run one at a time, which bounds the memory of the decayed scores.

    Args:
        q: scaled queries `[B, HV, NC, C, K]`; k `[B, HV, NC, C, K]`; v `[B, HV, NC, C, V]`; gc the gates
            summed from each chunk's start `[B, HV, NC, C, K]`; beta `[B, HV, NC, C]` (`chunk_inputs`).

    Returns:
        `(Aqk [B, HV, NC, C, C], w [B, HV, NC, C, K], u [B, HV, NC, C, V])` in q's dtype.
    """
    C, dtype = q.shape[3], q.dtype
    i = torch.arange(C, device=q.device)
    eye, not_below = torch.eye(C, dtype=dtype, device=q.device), i[:, None] <= i  # [C, C]
    Aqk, w, u = [], [], []
    for n in range(q.shape[2]):  # the NC chunks
        q_n, k_n, v_n, beta_n, gc_n = q[:, :, n], k[:, :, n], v[:, :, n], beta[:, :, n, :, None], gc[:, :, n]
        Akk, Aqk_n = _decayed_scores(torch.stack([k_n, q_n]), k_n, gc_n)  # x = k for A, x = q for Aqk
        L = eye + beta_n * Akk.masked_fill(not_below, 0)  # I + A, A strictly lower triangular
        decay_in = gc_n.exp().to(dtype)  # from the chunk start, <= 1
        Aqk.append(Aqk_n)
        u.append(torch.linalg.solve_triangular(L, beta_n * v_n, upper=False, unitriangular=True))
        w.append(torch.linalg.solve_triangular(L, beta_n * k_n * decay_in, upper=False, unitriangular=True))
    return tuple(torch.stack(x, dim=2) for x in (Aqk, w, u))


def _decayed_scores(x: torch.Tensor, k: torch.Tensor, gc: torch.Tensor) -> torch.Tensor:
    """`P_ij = sum_c x_ic k_jc exp(gc_ic - gc_jc)` for j <= i, and 0 for j > i, in every chunk.

    Args:
        x: `[..., C, K]`, broadcast against k (a stack of several x shares the work on k).
        k, gc: `[..., C, K]`; gc non-increasing along C.

    Returns:
        `[..., C, C]`.

    Taking every difference `gc_i - gc_j` would cost a `[C, C, K]` tensor per chunk. Instead the C rows are
    split into sub-blocks of b = gcd(C, 16). For row i in sub-block I and a column j in an earlier sub-block,
    the anchor `a_I` (gc just before sub-block I; 0 for the first) lies between them, `gc_i <= a_I <= gc_j`,
    so `exp(gc_i - gc_j) = exp(gc_i - a_I) * exp(a_I - gc_j)` is a product of two factors <= 1 and those
    columns become one matrix product per sub-block. Only the columns inside sub-block I use the pairwise
    differences, `[b, b, K]` per sub-block. Every exponent is <= 0; the columns a factorisation must not
    reach (j > i, or j not before sub-block I) are set to -inf before `exp`.
    """
    C = k.shape[-2]
    b = math.gcd(C, SUB_BLOCK)
    nb = C // b
    pos = torch.arange(C, device=k.device)
    anchor = F.pad(gc[..., b - 1 :: b, :], (0, 0, 1, 0))[..., :nb, :]  # [..., nb, K]: gc before sub-block I

    # Columns before the row's sub-block: exp(gc_i - a_I) on the rows, exp(a_I - gc_j) on the columns.
    x_rows = x.unflatten(-2, (nb, b)) * (gc.unflatten(-2, (nb, b)) - anchor[..., None, :]).exp().to(x.dtype)
    earlier = pos < pos[::b, None]  # [nb, C]: column j lies before sub-block I
    to_anchor = anchor[..., :, None, :] - gc[..., None, :, :]  # [..., nb, C, K]
    to_anchor = to_anchor.masked_fill(~earlier[..., None], float("-inf"))
    k_cols = k[..., None, :, :] * to_anchor.exp().to(k.dtype)  # [..., nb, C, K]
    scores = x_rows @ k_cols.transpose(-1, -2)  # [..., nb, b, C], zero from column I * b on

    # Columns inside the row's sub-block: pairwise differences.
    xb, kb, gb = (t.unflatten(-2, (nb, b)) for t in (x, k, gc))
    causal = pos[:b, None] >= pos[:b]  # [b, b]: j <= i
    decay = (gb[..., :, None, :] - gb[..., None, :, :]).masked_fill(~causal[..., None], float("-inf"))
    decay = decay.exp().to(k.dtype)
    k_decayed = kb[..., None, :, :] * decay  # [..., nb, b, b, K]: key j decayed to row i
    within = (k_decayed @ xb[..., :, :, None]).squeeze(-1)  # [..., nb, b, b]: sum over c of x_ic * that
    # Place sub-block I's own scores at column block I.
    diagonal = torch.eye(nb, dtype=within.dtype, device=k.device)
    scores = scores.unflatten(-1, (nb, b)) + torch.einsum("...Iij,IJ->...IiJj", within, diagonal)
    return scores.flatten(-2).flatten(-3, -2)
