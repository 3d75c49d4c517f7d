"""Causal softmax attention: the starting point of the book.

For each value head, query t attends to every key s <= t:

    o_t = sum_{s <= t} softmax_s(scale q_t . k_s) v_s

`softmax_attention` computes all T outputs at once (a `[T, T]` score matrix per head);
`softmax_attention_step` is the decoding form, which appends one key and value to a cache and attends over
everything cached. The cache grows by one entry per token, which is the cost the later chapters remove.

Layout as everywhere in kda_edu: q, k `[B, T, H, K]`; v `[B, T, HV, V]` with HV a multiple of H (value head j
uses the scores of query/key head `j // (HV // H)`); outputs `[B, T, HV, V]` in q's dtype, computed in float32
(float64 for float64 inputs).
"""

import torch

from kda_edu._checks import check_kda_inputs, compute_dtype, resolve_scale


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax attention of the last Tq positions over all Tk keys.

    q `[B, Tq, H, K]`, k `[B, Tk, H, K]`, v `[B, Tk, HV, V]`, Tq <= Tk: query i sits at position
    `Tk - Tq + i` and sees the keys up to it. Returns `[B, Tq, HV, V]` in q's dtype.
    """
    Tq, Tk, H, HV = q.shape[1], k.shape[1], q.shape[2], v.shape[2]
    dtype = compute_dtype(q.dtype)
    scores = scale * torch.einsum("bihk,bjhk->bhij", q.to(dtype), k.to(dtype))  # [B, H, Tq, Tk]
    query_pos = torch.arange(Tk - Tq, Tk, device=q.device)
    visible = torch.arange(Tk, device=q.device) <= query_pos[:, None]  # [Tq, Tk]
    scores = scores.masked_fill(~visible, float("-inf"))
    p = scores.softmax(dim=-1)  # [B, H, Tq, Tk]
    if HV != H:  # value heads share a query/key head: copy its weights once per value head, [B, HV, Tq, Tk]
        p = p.repeat_interleave(HV // H, dim=1)
    return torch.einsum("bhij,bjhv->bihv", p, v.to(dtype)).to(q.dtype)


def softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Causal softmax attention, all positions at once.

    `o_t = sum_{s <= t} softmax_s(scale q_t . k_s) v_s`, masking the scores above the diagonal to -inf
    before the softmax (every row keeps its diagonal, so no row is all -inf).

    Args:
        q: queries `[B, T, H, K]`, floating dtype.
        k: keys `[B, T, H, K]`, same dtype as q.
        v: values `[B, T, HV, V]`, same dtype as q, HV a multiple of H.
        scale: score scale; `K ** -0.5` when None.

    Returns:
        o `[B, T, HV, V]` in q's dtype.
    """
    K = check_kda_inputs(q, k, v, None, None, gate=None, with_beta=False)[4]
    return _attend(q, k, v, resolve_scale(scale, K))


def softmax_attention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One decoding step of causal softmax attention with a growing key/value cache.

    Appends k and v to the cache, then lets q attend over every cached position (all are in its past).

    Args:
        q, k: the new token's query and key `[B, 1, H, K]`.
        v: its value `[B, 1, HV, V]`.
        kv_cache: `(k_cache, v_cache)` of the t earlier tokens, `[B, t, H, K]` and `[B, t, HV, V]` in q's
            dtype and device; None before the first token. Not modified.
        scale: score scale; `K ** -0.5` when None.

    Returns:
        `(o, kv_cache)`: o `[B, 1, HV, V]` in q's dtype, and the new cache `[B, t + 1, H, K]`,
        `[B, t + 1, HV, V]`.
    """
    B, T, H, HV, K, V = check_kda_inputs(q, k, v, None, None, gate=None, with_beta=False)
    if T != 1:
        raise ValueError(f"q, k and v must have T = 1 for one decoding step, got T = {T}")
    if kv_cache is not None:
        if not (isinstance(kv_cache, tuple) and len(kv_cache) == 2):
            raise TypeError("kv_cache must be a tuple (k_cache [B, t, H, K], v_cache [B, t, HV, V]) or None")
        k_cache, v_cache = kv_cache
        for name, x, expected, tail in (
            ("k_cache", k_cache, "[B, t, H, K]", (H, K)),
            ("v_cache", v_cache, "[B, t, HV, V]", (HV, V)),
        ):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor of shape {expected}, got {type(x).__name__}")
            if x.dim() != 4 or x.shape[0] != B or tuple(x.shape[2:]) != tail:
                raise ValueError(
                    f"{name} must have shape {expected} = ({B}, t, {tail[0]}, {tail[1]}), "
                    f"got {tuple(x.shape)}"
                )
            if x.dtype != q.dtype or x.device != q.device:
                raise TypeError(
                    f"{name} of shape {expected} must have q's dtype and device ({q.dtype}, {q.device}), "
                    f"got ({x.dtype}, {x.device})"
                )
        if k_cache.shape[1] != v_cache.shape[1]:
            raise ValueError(
                f"k_cache and v_cache must hold the same number of tokens t, got {k_cache.shape[1]} and "
                f"{v_cache.shape[1]}"
            )
        k, v = torch.cat([k_cache, k], dim=1), torch.cat([v_cache, v], dim=1)
    return _attend(q, k, v, resolve_scale(scale, K)), (k, v)
