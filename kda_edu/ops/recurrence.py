"""The one recurrence behind every linear-attention model in the book.

Kimi Delta Attention keeps a state `S` of shape `[K, V]` per value head and, at every step t,

    S'_t = Diag(exp(g_t)) S_{t-1}                decay: key channel c keeps exp(g_t[c]) of its row
    U_t  = beta_t (v_t - S'_t^T k_t)             delta rule: write only what S'_t mispredicts for k_t
    S_t  = S'_t + k_t U_t^T                      write
    o_t  = S_t^T (scale q_t)                     read

The earlier chapters are this loop with some parts switched off:

    model             g (log decay)           beta     delta_rule
    linear attention  0                       1        False (write v_t, erase nothing)
    DeltaNet          0                       beta_t   True
    Gated DeltaNet    one value per head      beta_t   True
    KDA               one value per channel   beta_t   True

Linear attention is the one model that is not KDA with special inputs: it writes `v_t` without first
erasing the prediction `S^T k_t`, so the loop has a single switch, `delta_rule`.

`recurrence_loop` is these four lines and nothing else; `general_recurrence` wraps it with what a library
needs around the equations: grouped heads, the compute dtype, the query scale, and non-finite inputs.
"""

import math

import torch

from kda_edu.ops._checks import compute_dtype


def recurrence_loop(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    S: torch.Tensor,
    delta_rule: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence above, step by step: one head per row, nothing checked, converted or scaled.

    Args:
        q, k: `[B, T, H, K]` (the query already scaled); v: `[B, T, H, V]`; g: log decay `[B, T, H, K]` or
            `[B, T, H, 1]`; beta: `[B, T, H]`; S: the state entering step 0, `[B, H, K, V]`; all one dtype.
        delta_rule: erase the prediction `S'^T k_t` before writing.

    Returns:
        `(o, S)`: the reads `[B, T, H, V]` and the state after the last step.
    """
    T = q.shape[1]
    o = []
    for t in range(T):
        q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]  # [B, H, K], [B, H, K], [B, H, V]
        S = g[:, t, :, :, None].exp() * S  # decay
        if delta_rule:
            v_t = v_t - torch.einsum("bhk,bhkv->bhv", k_t, S)  # erase what S reads at k_t
        U_t = beta[:, t, :, None] * v_t
        S = S + k_t[..., :, None] * U_t[..., None, :]  # write
        o.append(torch.einsum("bhk,bhkv->bhv", q_t, S))  # read
    return torch.stack(o, dim=1), S


def general_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    delta_rule: bool,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the KDA-family recurrence above with a plain loop over time (`recurrence_loop`), for grouped heads, in
    the compute dtype, with non-finite inputs kept causal.

    The public functions of each chapter validate their inputs and call this; it does not check them again.

    Args:
        q: queries `[B, T, H, K]`.
        k: keys `[B, T, H, K]`.
        v: values `[B, T, HV, V]`, HV a multiple of H; value head j reads query/key head `j // (HV // H)`.
        g: log-space decay `[B, T, HV, K]`, or `[B, T, HV, 1]` for one decay per head, values <= 0.
        beta: write strength `[B, T, HV]`.
        delta_rule: erase the prediction `S'^T k_t` before writing (True for all but linear attention).
        scale: query scale.
        initial_state: optional `[B, HV, K, V]`; zeros when None.
        output_final_state: return the state after the last step.

    Returns:
        `(o, final_state)`: o `[B, T, HV, V]` in v's dtype; final_state `[B, HV, K, V]` in float32 (float64
        for float64 inputs), or None when `output_final_state` is False.

    Non-finite inputs stay causal, forward and backward: a NaN or inf in the key of step t makes the state NaN
    from t on; one in the value spoils (NaN or inf) that value column of the state and the outputs from t on;
    one in the query makes o_t alone NaN. A bad key or query enters the products as zero and what it spoils is set to NaN by a select:
    multiplied in, its NaN would reach the earlier steps' gradients (a loss on o[:t] sends back zeros from t
    on, and zero times NaN is NaN).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dtype = compute_dtype(q.dtype)
    q = q.to(dtype).repeat_interleave(HV // H, dim=2) * scale
    k = k.to(dtype).repeat_interleave(HV // H, dim=2)
    bad_q, bad_k = (~torch.isfinite(x).all(dim=-1, keepdim=True) for x in (q, k))  # [B, T, HV, 1]
    q, k = torch.where(bad_q, 0.0, q), torch.where(bad_k, 0.0, k)  # in the products as zero (docstring)
    S = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.to(dtype)
    o, S = recurrence_loop(q, k, v.to(dtype), g.to(dtype), beta.to(dtype), S, delta_rule)
    spoiled = bad_k.cummax(dim=1).values  # a bad key at this step or before: the state is spoiled
    o = torch.where(bad_q | spoiled, math.nan, o)
    S = torch.where(bad_k.any(dim=1)[..., None], math.nan, S)
    return o.to(v.dtype), (S if output_final_state else None)
