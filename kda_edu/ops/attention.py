"""Causal softmax attention: the starting point of the book.

For each value head, query t attends to every key s <= t:

    o_t = sum_{s <= t} softmax_s(scale q_t . k_s) v_s

`softmax_attention` computes all T outputs at once (a `[T, T]` score matrix per head) with `causal_attention`,
which MLA (`kda_edu.layers.mla`) uses too;
`softmax_attention_step` is the decoding form, which appends one key and value to a cache and attends over
everything cached. The cache grows by one entry per token, which is the cost the later chapters remove.

Layout as everywhere in kda_edu: q, k `[B, T, H, K]`; v `[B, T, HV, V]` with HV a multiple of H (value head j
uses the scores of query/key head `j // (HV // H)`); outputs `[B, T, HV, V]` in q's dtype, computed in float32
(float64 for float64 inputs).
"""

import torch

from kda_edu.ops._checks import check_kda_inputs, compute_dtype, resolve_scale

# With one key/value head shared by all query heads, the keys and values are converted to float32 at most this
# many numbers at a time (256 MiB), so an MLA decoding step never holds a float32 copy of a whole (bf16) cache.
MQA_SLICE_NUMBERS = 2**26


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Causal softmax attention of the last Tq positions over all Tk keys, the one softmax attention of kda_edu.

    q `[B, Tq, H, K]`, k `[B, Tk, Hk, K]`, v `[B, Tk, HV, V]`, Tq <= Tk: query i sits at position
    `Tk - Tq + i` and sees the keys up to it. Two head layouts:

    - Hk = H and HV a multiple of H: value head j uses the weights of query/key head `j // (HV // H)`;
      returns `[B, Tq, HV, V]`.
    - Hk = HV = 1 < H (multi-query attention, MLA's decoding form): the one key/value head is shared by all H
      query heads; returns `[B, Tq, H, V]`. The query heads are folded into the query rows, `[B, Tq H, K] @
      [B, K, Tk]`, so the shared head is read as it is (a broadcasting matmul would copy it once per query
      head), in two passes (scores, then the weighted sum) over slices of at most `MQA_SLICE_NUMBERS` numbers,
      each converted to float32 on its own.

    Computed in float32 (float64 for float64 inputs); returned in `out_dtype`, q's dtype when None.
    """
    B, Tq, H, _ = q.shape
    Tk, Hk, HV = k.shape[1], k.shape[2], v.shape[2]
    dtype = compute_dtype(q.dtype)
    query_pos = torch.arange(Tk - Tq, Tk, device=q.device)
    visible = torch.arange(Tk, device=q.device) <= query_pos[:, None]  # [Tq, Tk]
    if Hk == 1 and H > 1:  # one key/value head shared by all query heads
        keys, values = k[:, :, 0], v[:, :, 0]  # [B, Tk, K], [B, Tk, V]
        rows = q.to(dtype).reshape(B, Tq * H, -1) * scale  # [B, Tq H, K]: query heads as rows
        width = max(1, MQA_SLICE_NUMBERS // (B * max(keys.shape[-1], values.shape[-1])))  # positions a slice
        slices = [slice(s, min(s + width, Tk)) for s in range(0, Tk, width)]
        scores = rows.new_empty(B, Tq * H, Tk)
        for part in slices:
            scores[:, :, part] = torch.bmm(rows, keys[:, part].to(dtype).transpose(1, 2))
        scores = scores.view(B, Tq, H, Tk).masked_fill_(~visible[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(B, Tq * H, Tk)
        del scores
        out = sum(torch.bmm(probs[:, :, part], values[:, part].to(dtype)) for part in slices)
        return out.view(B, Tq, H, -1).to(out_dtype or q.dtype)
    scores = scale * torch.einsum("bihk,bjhk->bhij", q.to(dtype), k.to(dtype))  # [B, H, Tq, Tk]
    scores = scores.masked_fill(~visible, float("-inf"))
    p = scores.softmax(dim=-1)  # [B, H, Tq, Tk]
    if HV != H:  # value heads share a query/key head: copy its weights once per value head, [B, HV, Tq, Tk]
        p = p.repeat_interleave(HV // H, dim=1)
    return torch.einsum("bhij,bjhv->bihv", p, v.to(dtype)).to(out_dtype or q.dtype)


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
    return causal_attention(q, k, v, resolve_scale(scale, K))


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
    return causal_attention(q, k, v, resolve_scale(scale, K)), (k, v)
