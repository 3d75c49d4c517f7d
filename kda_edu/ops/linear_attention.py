"""Linear attention: softmax attention without the softmax, in three equivalent forms.

Dropping the softmax (and its normaliser, as fla's linear attention does) leaves

    o_t = sum_{s <= t} (scale q_t . k_s) v_s = S_t^T (scale q_t),   S_t = S_{t-1} + k_t v_t^T

so the `[T, T]` score matrix can be replaced by a `[K, V]` state per value head. Three forms compute the
same outputs:

- `linear_attention_parallel`: `O = ((scale Q K^T) * M) V` with the causal mask M, like attention.
- `linear_attention_recurrent`: the state update above, one step at a time. It is the KDA-family loop of
  `kda_edu.ops.recurrence` with no decay (g = 0), full writes (beta = 1) and the delta rule switched off.
- `linear_attention_chunked`: the parallel form inside chunks of C steps, the state between them.

Layout: q, k `[B, T, H, K]`; v `[B, T, HV, V]` with HV a multiple of H; states `[B, HV, K, V]` in float32
(float64 for float64 inputs); outputs in q's dtype.
"""

import torch

from kda_edu.ops._checks import check_kda_inputs, compute_dtype, resolve_scale
from kda_edu.ops._chunks import chunk_inputs, from_chunks, state_passing
from kda_edu.ops.recurrence import general_recurrence


def linear_attention_parallel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Causal linear attention in parallel form: `O = ((scale Q K^T) * M) V`, `M_ts = [s <= t]`.

    Args:
        q: queries `[B, T, H, K]`, floating dtype.
        k: keys `[B, T, H, K]`, same dtype as q.
        v: values `[B, T, HV, V]`, same dtype as q, HV a multiple of H.
        scale: query scale; `K ** -0.5` when None.

    Returns:
        o `[B, T, HV, V]` in q's dtype, computed in float32 (float64 for float64 inputs).
    """
    B, T, H, HV, K, V = check_kda_inputs(q, k, v, None, None, gate=None, with_beta=False)
    dtype = compute_dtype(q.dtype)
    scores = resolve_scale(scale, K) * torch.einsum("bihk,bjhk->bhij", q.to(dtype), k.to(dtype))
    t = torch.arange(T, device=q.device)
    scores = scores.masked_fill(t[:, None] < t, 0).repeat_interleave(HV // H, dim=1)  # [B, HV, T, T]
    return torch.einsum("bhij,bjhv->bihv", scores, v.to(dtype)).to(q.dtype)


def linear_attention_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal linear attention as a loop over time: `S_t = S_{t-1} + k_t v_t^T`, `o_t = S_t^T (scale q_t)`.

    This is `kda_edu.ops.recurrence.general_recurrence` with g = 0, beta = 1 and `delta_rule=False`.

    Args:
        q: queries `[B, T, H, K]`, floating dtype.
        k: keys `[B, T, H, K]`, same dtype as q.
        v: values `[B, T, HV, V]`, same dtype as q, HV a multiple of H.
        scale: query scale; `K ** -0.5` when None.
        initial_state: optional `[B, HV, K, V]` in float32 (float64 for float64 inputs); zeros when None.
        output_final_state: also return the state after step T.

    Returns:
        `(o, final_state)`: o `[B, T, HV, V]` in q's dtype; final_state `[B, HV, K, V]` in float32 (float64
        for float64 inputs), or None when `output_final_state` is False.
    """
    B, T, H, HV, K, V = check_kda_inputs(q, k, v, None, None, initial_state, gate=None, with_beta=False)
    return general_recurrence(
        q,
        k,
        v,
        g=q.new_zeros(B, T, HV, 1),
        beta=q.new_ones(B, T, HV),
        delta_rule=False,
        scale=resolve_scale(scale, K),
        initial_state=initial_state,
        output_final_state=output_final_state,
    )


def linear_attention_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal linear attention chunk by chunk.

    With chunks of C steps (the last zero-padded) and `S_0` the state entering a chunk:

        O   = (scale Q) S_0 + ((scale Q K^T) * M) V      inter-chunk read + intra-chunk parallel form
        S_C = S_0 + K^T V

    Args:
        q: queries `[B, T, H, K]`, floating dtype.
        k: keys `[B, T, H, K]`, same dtype as q.
        v: values `[B, T, HV, V]`, same dtype as q, HV a multiple of H.
        scale: query scale; `K ** -0.5` when None.
        initial_state: optional `[B, HV, K, V]` in float32 (float64 for float64 inputs); zeros when None.
        output_final_state: also return the state after step T.
        chunk_size: C, the number of steps per chunk.

    Returns:
        `(o, final_state)` as `linear_attention_recurrent`.
    """
    B, T, H, HV, K, V = check_kda_inputs(q, k, v, None, None, initial_state, gate=None, with_beta=False)
    # [B, HV, NC, C, *]
    q, k, v_c, _, _, _ = chunk_inputs(q, k, v, None, None, scale=scale, chunk_size=chunk_size)
    i = torch.arange(q.shape[3], device=q.device)
    scores = (q @ k.transpose(-1, -2)).masked_fill(i[:, None] < i, 0)  # parallel form in every chunk

    # no decay (gc = None) and no delta rule (w = None): the chunk writes its values V
    o, S = state_passing(q, k, None, scores, None, v_c, initial_state)
    return from_chunks(o, T, v.dtype), (S if output_final_state else None)


def decayed_linear_attention_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Linear attention with a decay and no delta rule (RetNet, Mamba-2): `S = exp(g_t) S + k_t v_t^T`,
    `o_t = S^T (scale q_t)`, as a loop over time (`general_recurrence` with `delta_rule=False`).

    Args:
        q: queries `[B, T, H, K]`, floating dtype.
        k: keys `[B, T, H, K]`, same dtype as q.
        v: values `[B, T, HV, V]`, same dtype as q, HV a multiple of H.
        g: log-space decay per value head and step `[B, T, HV]`, values <= 0.
        scale: query scale; `K ** -0.5` when None.
        initial_state: optional `[B, HV, K, V]` in float32 (float64 for float64 inputs); zeros when None.
        output_final_state: also return the state after step T.

    Returns:
        `(o, final_state)` as `linear_attention_recurrent`.
    """
    B, T, H, HV, K, V = check_kda_inputs(q, k, v, g, None, initial_state, gate="head", with_beta=False)
    return general_recurrence(
        q,
        k,
        v,
        g=g[..., None],
        beta=torch.ones(B, T, HV, dtype=q.dtype, device=q.device),
        delta_rule=False,
        scale=resolve_scale(scale, K),
        initial_state=initial_state,
        output_final_state=output_final_state,
    )


def decayed_linear_attention_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`decayed_linear_attention_recurrent` chunk by chunk.

    With `gc_i` the cumulative log decay from the chunk start to step i (inclusive), `S_0` the state entering
    the chunk and the mask `M_ij = exp(gc_i - gc_j)` for j <= i (0 above the diagonal; every exponent <= 0):

        O   = diag(exp(gc)) (scale Q) S_0 + ((scale Q K^T) * M) V
        S_C = exp(gc_C) S_0 + (K * exp(gc_C - gc))^T V

    Args and returns as `decayed_linear_attention_recurrent`, plus `chunk_size`, C.
    """
    B, T, H, HV, K, V = check_kda_inputs(q, k, v, g, None, initial_state, gate="head", with_beta=False)
    # [B, HV, NC, C, *]; gc `[B, HV, NC, C]`, padded steps have g = 0
    q, k, v_c, _, gc, _ = chunk_inputs(q, k, v, g, None, scale=scale, chunk_size=chunk_size)
    i = torch.arange(q.shape[3], device=q.device)
    diff = (gc[..., :, None] - gc[..., None, :]).masked_fill(i[:, None] < i, float("-inf"))  # [.., C, C]
    scores = (q @ k.transpose(-1, -2)) * diff.exp()

    # one decay per step (gc `[.., C, 1]`), no delta rule (w = None): the chunk writes its values V
    o, S = state_passing(q, k, gc[..., None], scores, None, v_c, initial_state)
    return from_chunks(o, T, v.dtype), (S if output_final_state else None)
