"""Gated DeltaNet: the delta rule with a forgetting gate, one decay per head and step.

    S'_t = exp(g_t) S_{t-1}                                   g_t <= 0, a scalar per value head
    S_t  = S'_t + beta_t k_t (v_t - S'_t^T k_t)^T
    o_t  = S_t^T (scale q_t)

This is KDA with the same decay on every key channel: its g `[B, T, HV]` is KDA's g `[B, T, HV, K]`
broadcast along K. Two forms:

- `gated_delta_recurrent`: the loop above (`kda_edu.ops.recurrence.general_recurrence` with g broadcast over K).
- `gated_delta_chunked`: the chunkwise form. Because the decay is one number per step, the within-chunk
  decays form a single `[C, C]` matrix `exp(gc_i - gc_j)` that multiplies `K K^T` elementwise; KDA's
  per-channel decay needs the `[C, C, K]` tensor instead.

Layout: q, k `[B, T, H, K]`; v `[B, T, HV, V]` with HV a multiple of H; g, beta `[B, T, HV]`; states
`[B, HV, K, V]` in float32 (float64 for float64 inputs); outputs in q's dtype.
"""

import torch

from kda_edu.ops._checks import check_kda_inputs, resolve_scale
from kda_edu.ops._chunks import chunk_inputs, from_chunks, state_passing
from kda_edu.ops.recurrence import general_recurrence


def gated_delta_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet as a loop over time: `S = exp(g_t) S`, `S += beta_t k_t (v_t - S^T k_t)^T`,
    `o_t = S^T (scale q_t)`.

    This is `kda_edu.ops.recurrence.general_recurrence`, the KDA loop, with g broadcast over the key channels.

    Args:
        q: queries `[B, T, H, K]`, floating dtype.
        k: keys `[B, T, H, K]`, same dtype as q (usually L2-normalised).
        v: values `[B, T, HV, V]`, same dtype as q, HV a multiple of H.
        g: log-space decay per head and step `[B, T, HV]`, any floating dtype, <= 0.
        beta: write strength `[B, T, HV]`, any floating dtype, in [0, 1].
        scale: query scale; `K ** -0.5` when None.
        initial_state: optional `[B, HV, K, V]` in float32 (float64 for float64 inputs); zeros when None.
        output_final_state: also return the state after step T.

    Returns:
        `(o, final_state)`: o `[B, T, HV, V]` in q's dtype; final_state `[B, HV, K, V]` in float32 (float64
        for float64 inputs), or None when `output_final_state` is False.
    """
    K = check_kda_inputs(q, k, v, g, beta, initial_state, gate="head")[4]
    return general_recurrence(
        q,
        k,
        v,
        g=g[..., None],  # [B, T, HV, 1]: the same decay on every key channel
        beta=beta,
        delta_rule=True,
        scale=resolve_scale(scale, K),
        initial_state=initial_state,
        output_final_state=output_final_state,
    )


def gated_delta_chunked(
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
    """Gated DeltaNet chunk by chunk.

    In a chunk of C steps entering with state `S_0`, with `gc_i = g_1 + ... + g_i` (local cumulative log
    decay) and `Gamma_ij = exp(gc_i - gc_j)` for j <= i (else 0):

        (I + A) U = Diag(beta) (V - Diag(exp(gc)) K S_0),    A = strictly_lower(Diag(beta) (K K^T * Gamma))
        u = (I + A)^-1 Diag(beta) V,   w = (I + A)^-1 Diag(beta) Diag(exp(gc)) K,   U = u - w S_0
        O   = Diag(exp(gc)) (scale Q) S_0 + ((scale Q K^T) * Gamma) U
        S_C = exp(gc_C) S_0 + (Diag(exp(gc_C - gc)) K)^T U

    Overflow: every exponent is <= 0. `Gamma` is computed from the differences `gc_i - gc_j`, set to -inf
    above the diagonal (where they are positive) before `exp`; `gc_i <= 0` and `gc_C - gc_i <= 0` because
    gc is non-increasing. So any gates, down to a full reset, give finite results.

    Args:
        q: queries `[B, T, H, K]`, floating dtype.
        k: keys `[B, T, H, K]`, same dtype as q (usually L2-normalised).
        v: values `[B, T, HV, V]`, same dtype as q, HV a multiple of H.
        g: log-space decay per head and step `[B, T, HV]`, any floating dtype, <= 0.
        beta: write strength `[B, T, HV]`, any floating dtype, in [0, 1].
        scale: query scale; `K ** -0.5` when None.
        initial_state: optional `[B, HV, K, V]` in float32 (float64 for float64 inputs); zeros when None.
        output_final_state: also return the state after step T.
        chunk_size: C, the number of steps per chunk.

    Returns:
        `(o, final_state)` as `gated_delta_recurrent`.
    """
    B, T, H, HV, K, V = check_kda_inputs(q, k, v, g, beta, initial_state, gate="head")
    # [B, HV, NC, C, *]; gc: within-chunk cumulative log decay [B, HV, NC, C], in [C * min(g), 0]
    q, k, v_c, _, gc, beta = chunk_inputs(q, k, v, g, beta, scale=scale, chunk_size=chunk_size)
    C, dtype = q.shape[3], q.dtype

    i = torch.arange(C, device=q.device)
    causal, strict = i[:, None] >= i, i[:, None] > i  # [C, C]: j <= i, j < i
    Gamma = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [.., C, C]

    A = (beta[..., None] * (k @ k.transpose(-1, -2)) * Gamma).masked_fill(~strict, 0)
    L = torch.eye(C, dtype=dtype, device=q.device) + A
    u = torch.linalg.solve_triangular(L, beta[..., None] * v_c, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(L, (beta * gc.exp())[..., None] * k, upper=False, unitriangular=True)
    Aqk = (q @ k.transpose(-1, -2)) * Gamma

    # one decay per step: gc `[.., C, 1]`
    o, S = state_passing(q, k, gc[..., None], Aqk, w, u, initial_state)
    return from_chunks(o, T, v.dtype), (S if output_final_state else None)
