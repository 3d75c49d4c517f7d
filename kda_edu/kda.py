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

import torch

from kda_edu._checks import check_chunk_size, check_kda_inputs, compute_dtype, resolve_scale
from kda_edu._chunks import from_chunks, to_chunks
from kda_edu.recurrence import general_recurrence


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
    `o_t = S^T (scale q_t)`. The loop itself is `kda_edu.recurrence.general_recurrence` with every part
    switched on.

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

        S_i = Diag(exp(gc_i)) S_0 + sum_{j <= i} Diag(exp(gc_i - gc_j)) k_j u_j^T

    where `u_j = beta_j (v_j - S'_j^T k_j)` is the value actually written at step j. Substituting S'_j turns
    the C definitions of u into one unit lower-triangular system (the UT transform):

        (I + A) U = Diag(beta) (V - (K * exp(gc)) S_0),
        A_ij = beta_i sum_c k_ic k_jc exp(gc_ic - gc_jc) for j < i, else 0

    so `U = u - w S_0` with `u = (I + A)^-1 Diag(beta) V` and `w = (I + A)^-1 Diag(beta) (K * exp(gc))`, both
    independent of S_0 and computed for all chunks at once by a triangular solve. Only the cheap state
    passing runs chunk after chunk:

        U       = u - w S_0
        O       = (scale Q * exp(gc)) S_0 + Aqk U
        S_C     = Diag(exp(gc_C)) S_0 + (K * exp(gc_C - gc))^T U

    with `Aqk_ij = scale sum_c q_ic k_jc exp(gc_ic - gc_jc)` for j <= i, else 0.

    Overflow: every exponent evaluated is <= 0, so every `exp` lies in [0, 1] whatever the gates. The
    within-chunk decays `exp(gc_i - gc_j)` are computed from a pairwise difference tensor `[C, C, K]` per
    chunk, never factorised as `exp(gc_i) * exp(-gc_j)` (with gates at -5 and C = 64 the second factor is
    exp(320), far beyond float32's largest, about exp(88.7)); the entries with j > i, whose differences are
    positive, are set to -inf before `exp`, so they become exact zeros with zero gradient instead of
    `inf * 0 = NaN`. The
    inter-chunk factors `exp(gc_i)` and `exp(gc_C - gc_i)` are <= 1 because gc is non-increasing. Decays that
    underflow to 0 are correct: the true value is below the dtype's smallest number.

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
        final_state `[B, HV, K, V]` in float32 (float64 for float64 inputs) or None. Memory is
        O(B HV T C K) for the pairwise decays, which is fine for a reference.
    """
    B, T, H, HV, K, V = check_kda_inputs(q, k, v, g, beta, initial_state)
    scale = resolve_scale(scale, K)
    C = check_chunk_size(chunk_size)
    dtype = compute_dtype(q.dtype)

    q = to_chunks(q.repeat_interleave(HV // H, dim=2), C, dtype) * scale  # [B, HV, NC, C, K]
    k = to_chunks(k.repeat_interleave(HV // H, dim=2), C, dtype)  # [B, HV, NC, C, K]
    v_c, g, beta = (to_chunks(x, C, dtype) for x in (v, g, beta))  # [.., C, V], [.., C, K], [.., C]
    gc = g.cumsum(dim=-2)  # within-chunk cumulative log decay, in [C * min(g), 0]

    # Pairwise decays exp(gc_i - gc_j) for j <= i, exact zeros above the diagonal: [B, HV, NC, C, C, K].
    i = torch.arange(C, device=q.device)
    causal, strict = i[:, None] >= i, i[:, None] > i  # [C, C]: j <= i, j < i
    diff = gc[..., :, None, :] - gc[..., None, :, :]
    decay = diff.masked_fill(~causal[..., None], float("-inf")).exp()

    A = (beta[..., None] * torch.einsum("...ic,...ijc,...jc->...ij", k, decay, k)).masked_fill(~strict, 0)
    Aqk = torch.einsum("...ic,...ijc,...jc->...ij", q, decay, k)

    # UT transform: solve (I + A) X = Diag(beta) [V, K * exp(gc)] for u and w.
    L = torch.eye(C, dtype=dtype, device=q.device) + A
    u = torch.linalg.solve_triangular(L, beta[..., None] * v_c, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(L, beta[..., None] * k * gc.exp(), upper=False, unitriangular=True)

    q_decayed = q * gc.exp()  # reads S_0 through exp(gc_i) <= 1
    k_decayed = k * (gc[..., -1:, :] - gc).exp()  # carries step i to the chunk end, exp(gc_C - gc_i) <= 1
    chunk_decay = gc[..., -1, :, None].exp()  # [B, HV, NC, K, 1]

    S = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.to(dtype)
    o = []
    for n in range(q.shape[2]):  # the NC chunks, in order
        U = u[:, :, n] - w[:, :, n] @ S  # values written in chunk n: [B, HV, C, V]
        o.append(q_decayed[:, :, n] @ S + Aqk[:, :, n] @ U)
        S = chunk_decay[:, :, n] * S + k_decayed[:, :, n].transpose(-1, -2) @ U
    return from_chunks(torch.stack(o, dim=2), T, v.dtype), (S if output_final_state else None)
