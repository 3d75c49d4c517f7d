"""Exercises of chapter 1: softmax attention and what it costs.

Each `check_*` takes the reader's answer; `None` (the placeholder in the book) only prints what is asked.
The worked solutions are the `solution_*` functions, shown in the book's hidden cells.
"""

import math

import torch

from kda_edu.chapters.ch01_attention_cost import LLAMA3_8B, CacheConfig
from kda_edu.exercises import expect, not_answered, passed
from kda_edu.ops.attention import softmax_attention

LLAMA3_70B = CacheConfig("Llama-3-70B", layers=80, q_heads=64, kv_heads=8, head_dim=128, bytes_per_value=2)
H200_BYTES = 141e9  # the H200's memory, in bytes
LLAMA3_8B_WEIGHT_BYTES = 8.03e9 * 2  # 8.03 billion parameters in bf16


# Exercise 1: the KV cache of a larger model.
def solution_kv_cache_gib() -> float:
    """Bytes per token `2 L H_kv d b`, times 128K tokens, in GiB (2**30 bytes)."""
    per_token = 2 * 80 * 8 * 128 * 2  # K and V, layers, KV heads, head dim, bytes of bf16
    return per_token * 131072 / 2**30


def check_kv_cache_gib(answer) -> str:
    """Exercise 1: the KV cache of one 131072-token sequence in Llama-3-70B (LLAMA3_70B), in GiB."""
    if answer is None:
        return not_answered("Give the KV cache of one 131072-token sequence of LLAMA3_70B in GiB.")
    right = LLAMA3_70B.kv_cache_bytes(131072) / 2**30
    expect(
        isinstance(answer, (int, float)) and math.isclose(answer, right, rel_tol=0.01),
        f"{answer!r} is not it. Count the bytes per token first: a key and a value vector per layer and KV "
        "head (not per query head), 2 bytes per number in bf16; then multiply by the tokens and divide by 2**30.",
    )
    return passed(f"{right:.0f} GiB for one sequence: nearly a third of an H200's 141 GB.")


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
    scores too large for a plain `exp`."""
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
    return passed("Attention one block at a time equals the full softmax: FlashAttention's recurrence.")


# Exercise 4: how many long sequences fit on one GPU.
def solution_sequences_per_gpu() -> int:
    """Memory left after the weights, divided by one 131072-token cache (131072 bytes per token), rounded down."""
    cache = 2 * 32 * 8 * 128 * 2 * 131072
    return int((141e9 - 8.03e9 * 2) // cache)


def check_sequences_per_gpu(answer) -> str:
    """Exercise 4: how many 131072-token sequences of Llama-3-8B fit in an H200 beside the bf16 weights."""
    if answer is None:
        return not_answered(
            "Give the number of 131072-token Llama-3-8B caches that fit in 141e9 bytes beside 16.06e9 bytes "
            "of weights."
        )
    cache = LLAMA3_8B.kv_cache_bytes(131072)
    right = int((H200_BYTES - LLAMA3_8B_WEIGHT_BYTES) // cache)
    expect(
        answer == right,
        f"{answer!r} is not it. One sequence's cache is 2 x 32 layers x 8 KV heads x 128 x 2 bytes per token; "
        "subtract the weights from the GPU's memory and round down.",
    )
    return passed(f"{right} sequences: a batch of {right} is the most one GPU can decode at this length.")
