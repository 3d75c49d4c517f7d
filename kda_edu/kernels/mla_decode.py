"""MLA's absorbed (MQA-mode) attention over a pool of latent caches, split along the context.

T new tokens per sequence (T = 1: decoding; more: an append), already written into the pool. Every query
head h of token t of sequence b holds an absorbed query ``a_th = [W_uk,h^T q_th; q^R_th]`` of width
``D = r + d_r``; every cached position s of the sequence's pool row holds ``[c_s; k^R_s]`` (same width).
Token t sits at position ``L_b - T + t`` and sees the positions before it and itself; the output is the
weighted sum of the latents ``c_s`` (the first ``R = r`` numbers of each row):

    o_th = sum_{s <= L_b - T + t} softmax_s(scale a_th . row_s) row_s[:R]

Design (flash decoding, as FlashMLA does it for DeepSeek):

* The heads share the cache, so the (token, head) pairs of a sequence are the rows of one matrix, and one
  program owns a block of BM rows (all 32 heads of a decoded token) and reads each cached row once for the
  whole block: ``[BM, D] @ [D, BN]`` for the scores, ``[BM, BN] @ [BN, R]`` for the values. Reading the
  cache once per head instead would multiply the traffic by H. Each row masks the positions after its
  token.
* At batch 1 one program per head block would leave almost every SM idle while it streams a long
  context, so the context is split into NS ranges, one program each (grid ``(B, head blocks, NS)``).
  Each writes its normalised partial output and its log-sum-exp; `combine_splits` merges them
  exactly (a softmax over a union of ranges is the weighted mix of the ranges' softmaxes).
* The sequence's pool row comes from ``slots`` and its length from ``lengths``, both read on the
  device: the launch does not depend on any value on the device, so it can be captured in a CUDA graph
  and replayed as lengths grow. Programs whose range lies past ``L_b`` write an empty partial.
* Scores and the running softmax are float32; the products take the cache's dtype (bf16 on a GPU).
  Under the CPU interpreter, and for a float32 cache, the products are float32 (not TF32; the
  interpreter's bf16 ``tl.dot`` is wrong).

`kda_edu.layers.mla.mla_absorbed_reference` computes the same in PyTorch.
"""

import torch
import triton
import triton.language as tl

from kda_edu.kernels._backend import check_device, interpreting, jit
from kda_edu.ops._checks import check_absorbed_attention_inputs

__all__ = ["mla_absorbed_attention", "combine_splits", "default_splits"]


@jit
def _mla_absorbed_kernel(
    q,
    cache,
    slots,
    lengths,
    o,
    lse,
    scale,
    L_max,
    positions_per_split,
    T,
    NS,
    H: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    BR: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_m = tl.program_id(1)
    i_s = tl.program_id(2)

    slot = tl.load(slots + i_b).to(tl.int64)
    length = tl.load(lengths + i_b)
    start = i_s * positions_per_split
    end = tl.minimum(start + positions_per_split, length)

    rows = i_m * BM + tl.arange(0, BM)  # token rows // H, head rows % H
    row_mask = rows < T * H
    visible = length - (T - 1 - rows // H)  # positions each row sees
    cr = tl.arange(0, BR)
    r_mask = cr < R
    q_off = (i_b * T * H + rows).to(tl.int64) * D
    row0 = slot * L_max  # first cached row of this sequence

    m = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BM], dtype=tl.float32)
    o_sum = tl.zeros([BM, BR], dtype=tl.float32)
    for n0 in range(start, end, BN):
        pos = n0 + tl.arange(0, BN)
        pos_mask = pos < end
        cache_off = (row0 + pos) * D
        scores = tl.zeros([BM, BN], dtype=tl.float32)
        for d0 in range(0, D, BD):
            cd = d0 + tl.arange(0, BD)
            d_mask = cd < D
            q_c = tl.load(
                q + q_off[:, None] + cd[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0
            )
            kt_c = tl.load(
                cache + cache_off[None, :] + cd[:, None], mask=d_mask[:, None] & pos_mask[None, :], other=0.0
            )
            if DOT_FP32:
                scores += tl.dot(q_c.to(tl.float32), kt_c.to(tl.float32), input_precision="ieee")
            else:
                scores += tl.dot(q_c.to(kt_c.dtype), kt_c)
        seen = pos_mask[None, :] & (pos[None, :] < visible[:, None])
        scores = tl.where(seen, scores * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at 0
        alpha = tl.exp(m - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        v_n = tl.load(
            cache + cache_off[:, None] + cr[None, :], mask=pos_mask[:, None] & r_mask[None, :], other=0.0
        )
        if DOT_FP32:
            o_sum = o_sum * alpha[:, None] + tl.dot(p, v_n.to(tl.float32), input_precision="ieee")
        else:
            o_sum = o_sum * alpha[:, None] + tl.dot(p.to(v_n.dtype), v_n)
        m = m_new

    # A range that a row does not reach leaves m = -inf, l = 0: a zero output, log-sum-exp -inf.
    o_all = o_sum / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    lse_all = m + tl.log(l_sum)
    part = (i_b * T * H + rows).to(tl.int64) * NS + i_s
    tl.store(o + part[:, None] * R + cr[None, :], o_all, mask=row_mask[:, None] & r_mask[None, :])
    tl.store(lse + part, lse_all, mask=row_mask)


def combine_splits(partial: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Merge per-range softmax outputs `[..., NS, R]` with their log-sum-exps `[..., NS]` into `[..., R]`.

    Range j's output is its own softmax's weighted sum; over the union the weights are `exp(lse_j - lse)`,
    with `lse = logsumexp_j lse_j`. Empty ranges have `lse_j = -inf` and weight 0."""
    weights = torch.softmax(lse, dim=-1)  # exp(lse_j - logsumexp(lse))
    return (weights.unsqueeze(-1) * partial).sum(dim=-2)


def _block_rows(rows: int) -> int:
    return max(16, min(32, triton.next_power_of_2(rows)))


def default_splits(batch: int, rows: int, max_len: int, device: torch.device) -> int:
    """Context ranges per sequence for `rows` (token, head) rows each: enough programs for about four per
    SM, each range at least 256 positions."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    wanted = triton.cdiv(4 * sms, batch * triton.cdiv(rows, _block_rows(rows)))
    return max(1, min(wanted, triton.cdiv(max_len, 256)))


def mla_absorbed_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    value_dim: int,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA attention of the last T tokens of each sequence over its pool row of cached rows.

    Args:
        q: absorbed queries `[B, T, H, D]` (D = r + d_r), any float dtype.
        cache: the pool `[P, L_max, D]`, contiguous; row `slots[b]` holds sequence b's cached positions,
            the T new ones included.
        slots: int32/int64 `[B]`, pool rows (not checked against P: that would cost a host sync).
        lengths: int32/int64 `[B]`, cached positions of each sequence (T new ones included), `T <= L <= L_max`.
        scale: multiplies the scores.
        value_dim: R, the values are the first R numbers of each cached row.
        num_splits: context ranges per sequence; None picks `default_splits`.

    Returns:
        `[B, T, H, R]` float32.

    Raises:
        TypeError: q or cache is not a floating tensor, slots or lengths not a tensor.
        ValueError: an argument has the wrong rank, shape, integer dtype or device, q an empty dimension, or
            num_splits is below 1; the message names the argument and the shape it must have.
    """
    check_absorbed_attention_inputs(q, cache, slots, lengths, value_dim)
    B, T, H, D = q.shape
    P, L_max, _ = cache.shape
    if not cache.is_contiguous():
        raise ValueError("cache must be contiguous (the kernel addresses its rows directly)")
    if num_splits is not None and (
        isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1
    ):
        raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")
    check_device(q)
    rows = T * H
    NS = default_splits(B, rows, L_max, q.device) if num_splits is None else num_splits
    BM, BN = _block_rows(rows), 32
    per_split = triton.cdiv(triton.cdiv(L_max, NS), BN) * BN
    partial = torch.empty(B, rows, NS, value_dim, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, rows, NS, device=q.device, dtype=torch.float32)
    grid = (B, triton.cdiv(rows, BM), NS)
    _mla_absorbed_kernel[grid](
        q.contiguous(),
        cache,
        slots.contiguous(),
        lengths.contiguous(),
        partial,
        lse,
        scale,
        L_max,
        per_split,
        T,
        NS,
        H=H,
        D=D,
        R=value_dim,
        BM=BM,
        BN=BN,
        BD=64,
        BR=triton.next_power_of_2(value_dim),
        DOT_FP32=interpreting() or cache.dtype == torch.float32,
        num_warps=1 if interpreting() else BM // 4,
    )
    return combine_splits(partial, lse).view(B, T, H, value_dim)
