"""MLA's absorbed (MQA-mode) decoding attention over a pool of latent caches, split along the context.

One decoded token per sequence. Every query head h of sequence b holds an absorbed query
``a_h = [W_uk,h^T q_h; q^R_h]`` of width ``D = r + d_r``; every cached position s of the sequence's pool
row holds ``[c_s; k^R_s]`` (same width). The output is the weighted sum of the latents ``c_s`` (the
first ``R = r`` numbers of each row):

    o_h = sum_{s < L_b} softmax_s(scale a_h . row_s) row_s[:R]

Design (flash decoding, as FlashMLA does it for DeepSeek):

* The heads share the cache, so one program owns a block of BH heads (all of them, up to 32) and reads
  each cached row once for the whole block: ``[BH, D] @ [D, BN]`` for the scores, ``[BH, BN] @ [BN, R]``
  for the values. Reading the cache once per head instead would multiply the traffic by H.
* At batch 1 one program per head block would leave almost every SM idle while it streams a long
  context, so the context is split into NS ranges, one program each (grid ``(B, head blocks, NS)``).
  Each writes its unnormalised partial output and its log-sum-exp; `combine_splits` merges them
  exactly (a softmax over a union of ranges is the weighted mix of the ranges' softmaxes).
* The sequence's pool row comes from ``slots`` and its length from ``lengths``, both read on the
  device: the launch does not depend on any value on the device, so it can be captured in a CUDA graph
  and replayed as lengths grow. Programs whose range lies past ``L_b`` write an empty partial.
* Scores and the running softmax are float32; the products take the cache's dtype (bf16 on a GPU).
  Under the CPU interpreter the products are float32 (its bf16 ``tl.dot`` is wrong).
"""

import torch
import triton
import triton.language as tl

from kda_edu._backend import check_device, interpreting

__all__ = ["mla_decode_attention", "mla_decode_reference", "combine_splits", "default_splits"]


@triton.jit
def _mla_decode_kernel(
    q_ptr,
    cache_ptr,
    slots_ptr,
    lengths_ptr,
    o_ptr,
    lse_ptr,
    scale,
    L_max,
    positions_per_split,
    H: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    NS: tl.constexpr,
    BH: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    BR: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_hb = tl.program_id(1)
    i_s = tl.program_id(2)

    slot = tl.load(slots_ptr + i_b).to(tl.int64)
    length = tl.load(lengths_ptr + i_b)
    start = i_s * positions_per_split
    end = tl.minimum(start + positions_per_split, length)

    offs_h = i_hb * BH + tl.arange(0, BH)
    mask_h = offs_h < H
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    offs_r = tl.arange(0, BR)
    mask_r = offs_r < R
    q_rows = (i_b * H + offs_h).to(tl.int64) * D
    row0 = slot * L_max  # first cached row of this sequence

    m = tl.full([BH], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, BR], dtype=tl.float32)
    for n0 in range(start, end, BN):
        pos = n0 + offs_n
        mask_n = pos < end
        rows = (row0 + pos) * D
        scores = tl.zeros([BH, BN], dtype=tl.float32)
        for d0 in range(0, D, BD):
            d = d0 + offs_d
            mask_d = d < D
            a = tl.load(
                q_ptr + q_rows[:, None] + d[None, :], mask=mask_h[:, None] & mask_d[None, :], other=0.0
            )
            kt = tl.load(
                cache_ptr + rows[None, :] + d[:, None], mask=mask_d[:, None] & mask_n[None, :], other=0.0
            )
            if DOT_FP32:
                scores += tl.dot(a.to(tl.float32), kt.to(tl.float32))
            else:
                scores += tl.dot(a.to(kt.dtype), kt)
        scores = tl.where(mask_n[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        vals = tl.load(
            cache_ptr + rows[:, None] + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0
        )
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, vals.to(tl.float32))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vals.dtype), vals)
        m = m_new

    # An empty range (past the sequence's end) leaves m = -inf, l = 0: a zero output, log-sum-exp -inf.
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    lse = m + tl.log(l_sum)
    part = (i_b * H + offs_h).to(tl.int64) * NS + i_s
    tl.store(o_ptr + part[:, None] * R + offs_r[None, :], out, mask=mask_h[:, None] & mask_r[None, :])
    tl.store(lse_ptr + part, lse, mask=mask_h)


def combine_splits(partial: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Merge per-range softmax outputs `[B, H, NS, R]` with their log-sum-exps `[B, H, NS]` into `[B, H, R]`.

    Range j's output is its own softmax's weighted sum; over the union the weights are `exp(lse_j - lse)`,
    with `lse = logsumexp_j lse_j`. Empty ranges have `lse_j = -inf` and weight 0."""
    weights = torch.softmax(lse, dim=-1)  # exp(lse_j - logsumexp(lse))
    return (weights.unsqueeze(-1) * partial).sum(dim=2)


def default_splits(batch: int, num_heads: int, max_len: int, device: torch.device) -> int:
    """Context ranges per sequence: enough programs for about four per SM, each range >= 256 positions."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    head_blocks = triton.cdiv(num_heads, _block_heads(num_heads))
    wanted = triton.cdiv(4 * sms, batch * head_blocks)
    return max(1, min(wanted, triton.cdiv(max_len, 256)))


def _block_heads(num_heads: int) -> int:
    return max(16, min(32, triton.next_power_of_2(num_heads)))


def mla_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    value_dim: int,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA attention of one token per sequence over its pool row of cached latents.

    Args:
        q: absorbed queries `[B, H, D]` (D = r + d_r), any float dtype.
        cache: the pool `[P, L_max, D]`, contiguous; row `slots[b]` holds sequence b's cached positions.
        slots: int32/int64 `[B]`, pool rows (not checked against P: that would cost a host sync).
        lengths: int32 `[B]`, positions visible to each sequence (the new token's included), `<= L_max`.
        scale: multiplies the scores.
        value_dim: R, the values are the first R numbers of each cached row.
        num_splits: context ranges per sequence; None picks `default_splits`.

    Returns:
        `[B, H, R]` float32.
    """
    B, H, D = q.shape
    P, L_max, Dc = cache.shape
    if Dc != D or not 1 <= value_dim <= D:
        raise ValueError(
            f"cache must be [P, L_max, D] with q's D = {D} and 1 <= value_dim <= D, got {tuple(cache.shape)}, {value_dim}"
        )
    if not cache.is_contiguous():
        raise ValueError("cache must be contiguous (the kernel addresses its rows directly)")
    for name, t in (("slots", slots), ("lengths", lengths)):
        if t.dtype not in (torch.int32, torch.int64) or tuple(t.shape) != (B,) or t.device != q.device:
            raise ValueError(
                f"{name} must be int32/int64 [B] = [{B}] on {q.device}, got {tuple(t.shape)} {t.dtype} {t.device}"
            )
    check_device(q)
    NS = default_splits(B, H, L_max, q.device) if num_splits is None else num_splits
    BH = _block_heads(H)
    BN = 32
    per_split = triton.cdiv(triton.cdiv(L_max, NS), BN) * BN
    partial = torch.empty(B, H, NS, value_dim, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, H, NS, device=q.device, dtype=torch.float32)
    grid = (B, triton.cdiv(H, BH), NS)
    _mla_decode_kernel[grid](
        q.contiguous(),
        cache,
        slots.contiguous(),
        lengths.contiguous(),
        partial,
        lse,
        scale,
        L_max,
        per_split,
        H=H,
        D=D,
        R=value_dim,
        NS=NS,
        BH=BH,
        BN=BN,
        BD=64,
        BR=triton.next_power_of_2(value_dim),
        DOT_FP32=interpreting() or cache.dtype == torch.float32,
        num_warps=1 if interpreting() else BH // 4,
    )
    return combine_splits(partial, lse)


def mla_decode_reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    value_dim: int,
) -> torch.Tensor:
    """`mla_decode_attention` in PyTorch: gathers the sequences' rows (a copy) and masks past each length.

    Float32 (float64 for float64 inputs) `[B, H, R]`; runs on any device."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    rows = cache[slots.long()].to(dtype)  # [B, L_max, D]
    scores = torch.einsum("bhd,bld->bhl", q.to(dtype), rows) * scale
    visible = torch.arange(cache.shape[1], device=q.device)[None, :] < lengths[:, None]  # [B, L_max]
    probs = torch.softmax(scores.masked_fill(~visible[:, None, :], float("-inf")), dim=-1)
    return torch.einsum("bhl,blr->bhr", probs, rows[..., :value_dim])
