"""Exercises of chapter 1: softmax attention and what it costs.

Each `check_*` takes the reader's answer; `None` (the placeholder in the book) only prints what is asked.
The worked solutions are the `solution_*` functions, shown in the book's hidden cells.
"""

import torch

from kda_edu.chapters.ch01_attention_cost import LiveTensorBytes
from kda_edu.exercises import expect, not_answered, passed
from kda_edu.ops.attention import softmax_attention


# Exercise 1: grouped value heads without copying the attention weights.
def solution_grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q, k `[T, H, d]`, v `[T, HV, d_v]` with HV = G H: value head `h G + j` is mixed with the weights of
    query/key head h. The scores and softmax are computed once per query head, `[H, T, T]`; the values are
    viewed as `[T, H, G, d_v]`, so no `[HV, T, T]` tensor is ever made."""
    T, H, d = q.shape
    G = v.shape[1] // H
    scores = torch.einsum("ihd,jhd->hij", q, k) / d**0.5  # [H, T, T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    p = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    out = torch.einsum("hij,jhgv->ihgv", p, v.view(T, H, G, -1))  # [T, H, G, d_v]
    return out.reshape(T, H * G, -1)


def check_grouped_attention(fn) -> str:
    """Exercise 1: `fn(q, k, v)` with q, k `[T, H, d]`, v `[T, HV, d_v]` (HV a multiple of H) must return
    causal attention `[T, HV, d_v]` while allocating less than one `[HV, T, T]` float64 tensor at its peak."""
    g = torch.Generator().manual_seed(11)
    T, H, G, d, dv = 48, 2, 8, 8, 8
    q, k = (torch.randn(T, H, d, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(T, H * G, dv, generator=g, dtype=torch.float64)
    with LiveTensorBytes() as memory:
        out = fn(q, k, v)
    if out is None:
        return not_answered("Make your function return the [T, HV, d_v] tensor of outputs.")
    right = softmax_attention(q[None], k[None], v[None])[0]
    expect(
        isinstance(out, torch.Tensor) and out.shape == right.shape,
        f"expected a tensor of shape {tuple(right.shape)}, got {getattr(out, 'shape', type(out).__name__)}",
    )
    expect(
        torch.allclose(out, right, atol=1e-9),
        "the outputs differ from causal softmax attention. Value head h * G + j belongs to query/key head h "
        "(G = HV / H consecutive value heads per query head).",
    )
    one_copy = H * G * T * T * 8  # one [HV, T, T] float64 tensor
    expect(
        memory.peak < one_copy,
        f"right outputs, but your function allocated {memory.peak} bytes at its peak, at least one [HV, T, T] "
        f"tensor ({one_copy} bytes): the weights are copied once per value head. View v as [T, H, G, d_v] "
        "and let one [H, T, T] matrix of weights mix all G value heads of its query head.",
    )
    return passed(
        f"peak {memory.peak} bytes, under one [HV, T, T] tensor ({one_copy}): the cost of the scores follows "
        "the query heads, however many value heads share them."
    )


# Exercise 2: causal attention for one head, written with a loop over queries.
def solution_attention_one_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q, k `[T, d]`, v `[T, d_v]`: for each t, softmax over the scores of keys 0..t, then mix the values."""
    outputs = []
    for t in range(q.shape[0]):
        scores = k[: t + 1] @ q[t] / q.shape[1] ** 0.5  # [t + 1]
        outputs.append(scores.softmax(dim=0) @ v[: t + 1])
    return torch.stack(outputs)


def check_attention_one_head(fn) -> str:
    """Exercise 2: `fn(q, k, v)` with q, k `[T, d]` and v `[T, d_v]` must return causal attention `[T, d_v]`."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(7, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out = fn(q, k, v)
    if out is None:
        return not_answered("Make your function return the [T, d_v] tensor of outputs.")
    right = softmax_attention(q[None, :, None], k[None, :, None], v[None, :, None])[0, :, 0]
    expect(
        isinstance(out, torch.Tensor) and out.shape == right.shape,
        f"expected a tensor of shape {tuple(right.shape)}, got {getattr(out, 'shape', type(out).__name__)}",
    )
    expect(
        torch.allclose(out[0], v[0], atol=1e-9),
        "the first output must equal the first value: token 0 sees only itself. Check the causal mask.",
    )
    expect(
        torch.allclose(out, right, atol=1e-9),
        "the outputs differ from causal softmax attention. Did you scale the scores by 1/sqrt(d) and take the "
        "softmax over the keys s <= t only?",
    )
    return passed()


# Exercise 3: attention one block of keys at a time (the online softmax).
def solution_attention_in_blocks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int
) -> torch.Tensor:
    """Causal attention for one head, q, k `[T, d]`, v `[T, d_v]`, reading the keys `block` at a time.

    Each query keeps a running maximum m of its scores, the running sum l of `exp(score - m)` and the running
    weighted sum acc of values; a new block with a larger maximum rescales both by `exp(m_old - m_new)`. No
    `[T, T]` matrix is formed: at most `[T, block]` scores exist at once.
    """
    T, d = q.shape
    m = torch.full((T, 1), float("-inf"), dtype=q.dtype)
    l = torch.zeros(T, 1, dtype=q.dtype)
    acc = torch.zeros(T, v.shape[1], dtype=q.dtype)
    rows = torch.arange(T)[:, None]
    for start in range(0, T, block):
        cols = torch.arange(start, min(start + block, T))
        scores = (q @ k[cols].T / d**0.5).masked_fill(cols[None, :] > rows, float("-inf"))  # [T, block]
        m_new = torch.maximum(m, scores.max(dim=1, keepdim=True).values)
        shrink = torch.exp(m - m_new)  # rescales what was accumulated under the old maximum
        p = torch.exp(scores - m_new)
        l = l * shrink + p.sum(dim=1, keepdim=True)
        acc = acc * shrink + p @ v[cols]
        m = m_new
    return acc / l


def check_attention_in_blocks(fn) -> str:
    """Exercise 3: `fn(q, k, v, block)` must equal causal softmax attention for every block size, including
    scores too large for a plain `exp`, and hold less than a quarter of a `[T, T]` score matrix at its peak
    (measured with `LiveTensorBytes` at T = 512, block = 16)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(13, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out = fn(q, k, v, 4)
    if out is None:
        return not_answered("Make your function return the [T, d_v] tensor of outputs.")
    for scale, block in ((1.0, 4), (1.0, 1), (1.0, 5), (1.0, 13), (1000.0, 4)):  # scores up to a few thousand
        right = softmax_attention((scale * q)[None, :, None], k[None, :, None], v[None, :, None])[0, :, 0]
        out = fn(scale * q, k, v, block)
        expect(
            isinstance(out, torch.Tensor) and out.shape == right.shape,
            f"expected a tensor of shape {tuple(right.shape)}, got {getattr(out, 'shape', type(out).__name__)}",
        )
        expect(
            bool(torch.isfinite(out).all()),
            "with scores in the thousands your output is not finite: subtract the running maximum before exp.",
        )
        expect(
            torch.allclose(out, right, atol=1e-9, rtol=1e-9),
            f"block = {block}: the outputs differ from causal softmax attention by up to "
            f"{(out - right).abs().max():.2g}. When a block raises a query's maximum, rescale its running sum "
            "and its accumulated values by exp(old max - new max).",
        )
    # The constraint the exercise states: at most [T, block] scores at once, measured as the peak of live tensors.
    T, block = 512, 16
    q, k, v = (torch.randn(T, 8, generator=g, dtype=torch.float64) for _ in range(3))
    with LiveTensorBytes() as memory:
        fn(q, k, v, block)
    quarter = T * T * 8 // 4  # a quarter of one [T, T] float64 score matrix
    expect(
        memory.peak < quarter,
        f"right outputs, but at T = {T}, block = {block} your function held {memory.peak} bytes at its peak, "
        f"more than a quarter of one [T, T] score matrix ({quarter}): keep only [T, block] scores at a time.",
    )
    return passed(
        f"equal to the full softmax, peak {memory.peak} bytes at T = {T} (a [T, T] matrix is {4 * quarter}): "
        "FlashAttention's recurrence."
    )


# Exercise 4: decoding into a preallocated cache.
def solution_decode_step(q_t, k_t, v_t, k_cache, v_cache, t: int) -> torch.Tensor:
    """One decoding step for one head: write k_t, v_t `[d]`, `[d_v]` into row t of the preallocated caches
    `[T_max, d]`, `[T_max, d_v]` (in place), then let q_t attend over rows 0..t only. Returns o_t `[d_v]`."""
    k_cache[t] = k_t
    v_cache[t] = v_t
    scores = k_cache[: t + 1] @ q_t / q_t.shape[0] ** 0.5  # [t + 1]: the rows written so far, nothing after
    return scores.softmax(dim=0) @ v_cache[: t + 1]


def check_decode_step(fn) -> str:
    """Exercise 4: `fn(q_t, k_t, v_t, k_cache, v_cache, t)` must write token t into the caches it is given
    (rows beyond t hold NaN, unwritten) and return causal attention's output for position t."""
    g = torch.Generator().manual_seed(4)
    T, d, dv = 12, 8, 6
    q, k = (torch.randn(T, d, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(T, dv, generator=g, dtype=torch.float64)
    k_cache = torch.full((T, d), float("nan"), dtype=torch.float64)  # a row not yet written is NaN
    v_cache = torch.full((T, dv), float("nan"), dtype=torch.float64)
    right = softmax_attention(q[None, :, None], k[None, :, None], v[None, :, None])[0, :, 0]
    for t in range(T):
        o_t = fn(q[t], k[t], v[t], k_cache, v_cache, t)
        if o_t is None:
            return not_answered("Make your function return o_t, a [d_v] tensor.")
        expect(
            torch.equal(k_cache[t], k[t]) and torch.equal(v_cache[t], v[t]),
            f"after step {t} row {t} of the caches does not hold k_t and v_t: write them in place "
            "(k_cache[t] = k_t), into the tensors you are given, instead of building new ones.",
        )
        expect(
            isinstance(o_t, torch.Tensor) and bool(torch.isfinite(o_t).all()),
            f"step {t} returned a non-finite output: it read rows beyond t, which are not written yet. "
            "Attend over k_cache[: t + 1] only.",
        )
        expect(
            torch.allclose(o_t, right[t], atol=1e-9),
            f"step {t}: the output differs from causal softmax attention at position {t}. Scale the scores "
            "by 1/sqrt(d) and take the softmax over rows 0..t.",
        )
    return passed("The cache is allocated once and written in place: no copy per token, unlike torch.cat.")
