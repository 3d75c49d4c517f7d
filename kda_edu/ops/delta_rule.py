"""DeltaNet: linear attention that corrects its memory instead of only adding to it.

Linear attention writes `k_t v_t^T` whatever the state already holds for `k_t`. The delta rule first reads
the state's prediction `S^T k_t` and writes only the error, with strength beta_t in [0, 1]:

    S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale q_t)

This is KDA with no decay (g = 0). Two forms:

- `delta_rule_recurrent`: the loop above (`kda_edu.ops.recurrence.general_recurrence` with g = 0).
- `delta_rule_chunked`: the chunkwise form with the WY representation, built by the UT transform.

Layout: q, k `[B, T, H, K]`; v `[B, T, HV, V]` with HV a multiple of H; beta `[B, T, HV]`; states
`[B, HV, K, V]` in float32 (float64 for float64 inputs); outputs in q's dtype.
"""

import torch

from kda_edu.ops._checks import check_kda_inputs, resolve_scale
from kda_edu.ops._chunks import chunk_inputs, from_chunks, state_passing
from kda_edu.ops.recurrence import general_recurrence


def delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DeltaNet as a loop over time: `S += beta_t k_t (v_t - S^T k_t)^T`, then `o_t = S^T (scale q_t)`.

    This is `kda_edu.ops.recurrence.general_recurrence`, the KDA loop, with g = 0.

    Args:
        q: queries `[B, T, H, K]`, floating dtype.
        k: keys `[B, T, H, K]`, same dtype as q (usually L2-normalised, which keeps the state bounded).
        v: values `[B, T, HV, V]`, same dtype as q, HV a multiple of H.
        beta: write strength `[B, T, HV]`, any floating dtype, in [0, 1].
        scale: query scale; `K ** -0.5` when None.
        initial_state: optional `[B, HV, K, V]` in float32 (float64 for float64 inputs); zeros when None.
        output_final_state: also return the state after step T.

    Returns:
        `(o, final_state)`: o `[B, T, HV, V]` in q's dtype; final_state `[B, HV, K, V]` in float32 (float64
        for float64 inputs), or None when `output_final_state` is False.
    """
    B, T, H, HV, K, V = check_kda_inputs(q, k, v, None, beta, initial_state, gate=None)
    return general_recurrence(
        q,
        k,
        v,
        g=q.new_zeros(B, T, HV, 1),
        beta=beta,
        delta_rule=True,
        scale=resolve_scale(scale, K),
        initial_state=initial_state,
        output_final_state=output_final_state,
    )


def delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DeltaNet chunk by chunk, with the WY representation.

    In a chunk of C steps entering with state `S_0`, the values actually written,
    `U_i = beta_i (v_i - S_{i-1}^T k_i)`, satisfy one unit lower-triangular system (substitute
    `S_{i-1} = S_0 + sum_{j<i} k_j U_j^T`):

        (I + A) U = Diag(beta) (V - K S_0),    A = strictly_lower(Diag(beta) K K^T)

    `T = (I + A)^-1 Diag(beta)` is the UT transform; `u = T V` and `w = T K` do not depend on S_0 and are
    computed for all chunks at once by a triangular solve. `w` is the WY representation of the chunk's
    transition: `(I - beta_C k_C k_C^T) ... (I - beta_1 k_1 k_1^T) = I - K^T w`. Between chunks:

        U   = u - w S_0
        O   = (scale Q) S_0 + ((scale Q K^T) * M) U,    M the causal mask including the diagonal
        S_C = S_0 + K^T U

    Args:
        q: queries `[B, T, H, K]`, floating dtype.
        k: keys `[B, T, H, K]`, same dtype as q (usually L2-normalised).
        v: values `[B, T, HV, V]`, same dtype as q, HV a multiple of H.
        beta: write strength `[B, T, HV]`, any floating dtype, in [0, 1].
        scale: query scale; `K ** -0.5` when None.
        initial_state: optional `[B, HV, K, V]` in float32 (float64 for float64 inputs); zeros when None.
        output_final_state: also return the state after step T.
        chunk_size: C, the number of steps per chunk.

    Returns:
        `(o, final_state)` as `delta_rule_recurrent`.
    """
    B, T, H, HV, K, V = check_kda_inputs(q, k, v, None, beta, initial_state, gate=None)
    q, k, v_c, _, _, beta = chunk_inputs(q, k, v, None, beta, scale=scale, chunk_size=chunk_size)
    C, dtype = q.shape[3], q.dtype

    i = torch.arange(C, device=q.device)
    causal, strict = i[:, None] >= i, i[:, None] > i  # [C, C]: j <= i, j < i

    A = (beta[..., None] * (k @ k.transpose(-1, -2))).masked_fill(~strict, 0)
    L = torch.eye(C, dtype=dtype, device=q.device) + A
    u = torch.linalg.solve_triangular(L, beta[..., None] * v_c, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(L, beta[..., None] * k, upper=False, unitriangular=True)
    Aqk = (q @ k.transpose(-1, -2)).masked_fill(~causal, 0)

    o, S = state_passing(q, k, None, Aqk, w, u, initial_state)  # no decay: gc = None
    return from_chunks(o, T, v.dtype), (S if output_final_state else None)
