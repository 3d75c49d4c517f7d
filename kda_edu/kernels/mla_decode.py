"""MLA's absorbed (MQA-mode) attention over a paged cache of latent rows, split along the context.

T new tokens per sequence (T = 1: decoding; more: an append), already written into the cache. Every query
head h of token t of sequence b holds an absorbed query ``a_th = [W_uk,h^T q_th; q^R_th]`` of width
``D = R + d_r``; every cached position s of the sequence holds a row ``[c_s; k^R_s]`` (same width). Token t
sits at position ``L_b - T + t`` and sees the positions before it and itself; the output is the weighted sum
of the latents ``c_s`` (the first ``R`` numbers of each row):

    o_th = sum_{s <= L_b - T + t} softmax_s(scale a_th . row_s) row_s[:R]

The rows live in a pool of blocks ``[N, block_size, D]``; sequence b's position s is row ``s % block_size``
of block ``block_table[b, s // block_size]`` (`kda_edu.models.serving.paged_mla`). A contiguous pool
``[P, L_max, D]`` with one row per sequence is the special case ``block_size = L_max``, table ``slots[:, None]``
(`mla_absorbed_attention`).

Design (flash decoding, as FlashMLA does it for DeepSeek):

* The heads share the cache, so the (token, head) pairs of a sequence are the rows of one matrix, and one
  program owns a block of BM rows (all 32 heads of a decoded token) and reads each cached row once for the
  whole block: ``[BM, D] @ [D, BN]`` for the scores, ``[BM, BN] @ [BN, R]`` for the values. Reading the
  cache once per head instead would multiply the traffic by H. The latent part of a tile of BN positions
  is loaded once and used twice, for the scores and for the values. Each row masks the positions after
  its token.
* At small batch one program per head block would leave almost every SM idle while it streams a long
  context, so the context is split into NS ranges, one program each (grid ``(B, head blocks, NS)``).
  Each writes its normalised partial output and its log-sum-exp; a second kernel merges them exactly (a
  softmax over a union of ranges is the weighted mix of the ranges' softmaxes, `combine_splits`).
* The table, the lengths and the block ids are read on the device: the launch depends only on shapes, so
  it can be captured in a CUDA graph and replayed as lengths grow. Programs whose range lies past ``L_b``
  write an empty partial.
* A non-finite cached value gives NaN in the output of every row that sees it and reaches no other row: a
  score of -inf alone would weight it zero, and with several new tokens (an append) a later token's value
  would reach earlier tokens as 0 * inf in the value product, so both are checked.
* Scores and the running softmax are float32; the products take the cache's dtype (bf16 on a GPU).
  Under the CPU interpreter, and for a float32 cache, the products are float32 (not TF32; the
  interpreter's bf16 ``tl.dot`` is wrong).

`kda_edu.layers.mla.mla_absorbed_reference` computes the same in PyTorch.
"""

import torch
import triton
import triton.language as tl

from kda_edu.kernels._backend import check_device, interpreting, jit
from kda_edu.ops._checks import check_absorbed_attention_inputs, check_block_table

__all__ = ["mla_absorbed_attention", "paged_mla_absorbed_attention", "combine_splits", "default_splits"]


@jit
def _mla_absorbed_kernel(
    q,
    pool,
    table,
    lengths,
    o,
    lse,
    scale,
    block_size,
    table_stride,
    positions_per_split,
    T,
    NS,
    H: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BR: tl.constexpr,
    BP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    APPEND: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_m = tl.program_id(1)
    i_s = tl.program_id(2)

    length = tl.load(lengths + i_b)
    start = i_s * positions_per_split
    end = tl.minimum(start + positions_per_split, length)

    rows = i_m * BM + tl.arange(0, BM)  # token rows // H, head rows % H
    row_mask = rows < T * H
    visible = length - (T - 1 - rows // H)  # positions each row sees
    cr = tl.arange(0, BR)  # the latent part of a row
    r_mask = cr < R
    cp = tl.arange(0, BP)  # the rope part
    p_mask = cp < D - R
    q_row = (i_b * T * H + rows).to(tl.int64) * D
    q_c = tl.load(q + q_row[:, None] + cr[None, :], mask=row_mask[:, None] & r_mask[None, :], other=0.0)
    q_p = tl.load(q + q_row[:, None] + R + cp[None, :], mask=row_mask[:, None] & p_mask[None, :], other=0.0)
    if DOT_FP32:
        q_c, q_p = q_c.to(tl.float32), q_p.to(tl.float32)
    else:
        q_c, q_p = q_c.to(pool.dtype.element_ty), q_p.to(pool.dtype.element_ty)
    table_row = table + i_b.to(tl.int64) * table_stride

    m = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BM], dtype=tl.float32)
    sees_bad = tl.zeros([BM], dtype=tl.int32)  # a row saw a non-finite cached value
    o_sum = tl.zeros([BM, BR], dtype=tl.float32)
    for n0 in range(start, end, BN):
        pos = n0 + tl.arange(0, BN)
        pos_mask = pos < end
        block = tl.load(table_row + pos // block_size, mask=pos_mask, other=0).to(tl.int64)
        row_off = (block * block_size + pos % block_size) * D
        c = tl.load(
            pool + row_off[:, None] + cr[None, :], mask=pos_mask[:, None] & r_mask[None, :], other=0.0
        )
        k_p = tl.load(
            pool + row_off[:, None] + R + cp[None, :], mask=pos_mask[:, None] & p_mask[None, :], other=0.0
        )
        if DOT_FP32:
            c, k_p = c.to(tl.float32), k_p.to(tl.float32)
            scores = tl.dot(q_c, tl.trans(c), input_precision="ieee")
            scores += tl.dot(q_p, tl.trans(k_p), input_precision="ieee")
        else:
            scores = tl.dot(q_c, tl.trans(c)) + tl.dot(q_p, tl.trans(k_p))
        seen = pos_mask[None, :] & (pos[None, :] < visible[:, None])
        # A non-finite cached value makes the scores at its position non-finite: every row that sees it
        # outputs NaN (a score of -inf alone would be weighted zero, silently).
        bad = (scores != scores) | (tl.abs(scores) == float("inf"))
        sees_bad = tl.maximum(sees_bad, tl.max((seen & bad).to(tl.int32), axis=1))
        scores = tl.where(seen, scores * scale, float("-inf"))
        if APPEND:
            # Several new tokens: a tile holds positions some rows see and others must not. A non-finite
            # value there would reach the rows that do not see it as 0 * inf in the value product.
            c = tl.where((c != c) | (tl.abs(c.to(tl.float32)) == float("inf")), tl.zeros_like(c), c)
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at 0
        alpha = tl.exp(m - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        if DOT_FP32:
            o_sum = o_sum * alpha[:, None] + tl.dot(p, c, input_precision="ieee")
        else:
            o_sum = o_sum * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        m = m_new

    # A range that a row does not reach leaves m = -inf, l = 0: a zero output, log-sum-exp -inf.
    o_all = o_sum / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    o_all = tl.where(sees_bad[:, None] > 0, float("nan"), o_all)
    lse_all = tl.where(l_sum > 0, m + tl.log(tl.where(l_sum > 0, l_sum, 1.0)), float("-inf"))
    part = (i_b * T * H + rows).to(tl.int64) * NS + i_s
    tl.store(o + part[:, None] * R + cr[None, :], o_all, mask=row_mask[:, None] & r_mask[None, :])
    tl.store(lse + part, lse_all, mask=row_mask)


@jit
def _combine_kernel(partial, lse, out, NS, R: tl.constexpr, BS: tl.constexpr, BR: tl.constexpr):
    """One program per (token, head) row: out = sum_j softmax_j(lse_j) partial_j over its NS ranges."""
    i_row = tl.program_id(0).to(tl.int64)
    i_r = tl.program_id(1)
    cs = tl.arange(0, BS)
    cr = i_r * BR + tl.arange(0, BR)
    lse_row = tl.load(lse + i_row * NS + cs, mask=cs < NS, other=float("-inf"))
    m = tl.max(lse_row, axis=0)  # finite: every row sees its own position in some range
    total = tl.sum(tl.exp(lse_row - m), axis=0)
    acc = tl.zeros([BR], dtype=tl.float32)
    for j in range(0, NS):
        w_j = tl.exp(tl.load(lse + i_row * NS + j) - m) / total  # 0 for an empty range
        acc += w_j * tl.load(partial + (i_row * NS + j) * R + cr, mask=cr < R, other=0.0)
    tl.store(out + i_row * R + cr, acc, mask=cr < R)


def combine_splits(partial: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Merge per-range softmax outputs `[..., NS, R]` with their log-sum-exps `[..., NS]` into `[..., R]`.

    Range j's output is its own softmax's weighted sum; over the union the weights are `exp(lse_j - lse)`,
    with `lse = logsumexp_j lse_j`. Empty ranges have `lse_j = -inf` and weight 0. (The PyTorch statement
    of what `_combine_kernel` does in one pass.)"""
    weights = torch.softmax(lse, dim=-1)  # exp(lse_j - logsumexp(lse))
    return (weights.unsqueeze(-1) * partial).sum(dim=-2)


def _block_rows(rows: int) -> int:
    return max(16, min(32, triton.next_power_of_2(rows)))


def default_splits(batch: int, rows: int, max_len: int, device: torch.device) -> int:
    """Context ranges per sequence for `rows` (token, head) rows each and at most `max_len` positions: as
    many as fill the GPU's multiprocessors once (a program's pipelined tiles take most of an SM's shared
    memory, so a second wave would run on a few SMs while the rest idle), each range at least 64 positions
    (one tile).

    Tuned on an H100 at batch 1 (`bench/kernels/mla_decode.py`'s grid of tiles, warps, stages and split
    counts): a 4K context took 15 us in 64 ranges against 39 us in 8 ranges of 512 positions, a 32K one 42 us
    in 128 ranges against 48 us in 64 and 51 us in 256."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    programs = batch * triton.cdiv(rows, _block_rows(rows))
    return max(1, min(sms // programs, triton.cdiv(max_len, 64)))


def paged_mla_absorbed_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    value_dim: int,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA attention of the last T tokens of each sequence over its cached rows, read through a
    block table.

    Args:
        q: absorbed queries `[B, T, H, D]` (D = R + d_r), any float dtype.
        pool: the blocks `[N, block_size, D]`, contiguous.
        block_table: int32/int64 `[B, max_blocks]`: sequence b's position s is row `s % block_size` of block
            `block_table[b, s // block_size]`. Entries past a sequence's length are not read; block ids
            are not checked against N (that would cost a host sync).
        lengths: int32/int64 `[B]`, cached positions of each sequence (T new ones included),
            `T <= L <= max_blocks * block_size` (not checked, for the same reason).
        scale: multiplies the scores.
        value_dim: R, the values are the first R numbers of each cached row.
        num_splits: context ranges per sequence; None picks `default_splits`.

    Returns:
        `[B, T, H, R]` float32.

    Raises:
        TypeError: q or pool is not a floating tensor, block_table or lengths not a tensor.
        ValueError: an argument has the wrong rank, shape, integer dtype or device, q an empty dimension,
            pool is not contiguous, or num_splits is below 1; the message names the argument and the shape
            it must have.
    """
    check_block_table(q, pool, block_table, lengths, value_dim)
    if not pool.is_contiguous():
        raise ValueError(
            "pool [N, block_size, D] must be contiguous (the kernel addresses its rows directly)"
        )
    if num_splits is not None and (
        isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1
    ):
        raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")
    check_device(q)
    B, T, H, _ = q.shape
    if num_splits is None:
        num_splits = default_splits(B, T * H, block_table.shape[1] * pool.shape[1], q.device)
    key = (pool.device, pool.dtype, tuple(pool.shape[1:]), value_dim, T * H)
    if key in _WORKING:
        return _launch(q, pool, block_table, lengths, scale, value_dim, num_splits, *_WORKING[key])
    candidates = _fallbacks(default_config(pool))
    for i, config in enumerate(candidates):
        try:
            out = _launch(q, pool, block_table, lengths, scale, value_dim, num_splits, *config)
        except triton.runtime.errors.OutOfResources:
            if i == len(candidates) - 1:
                raise
            continue
        _WORKING[key] = config
        return out


def mla_absorbed_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    value_dim: int,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA attention of the last T tokens of each sequence over its row of a contiguous pool.

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
        `[B, T, H, R]` float32: `paged_mla_absorbed_attention` with one block of `L_max` positions per
        sequence.

    Raises:
        TypeError: q or cache is not a floating tensor, slots or lengths not a tensor.
        ValueError: an argument has the wrong rank, shape, integer dtype or device, q an empty dimension, or
            num_splits is below 1; the message names the argument and the shape it must have.
    """
    check_absorbed_attention_inputs(q, cache, slots, lengths, value_dim)
    if not cache.is_contiguous():
        raise ValueError("cache must be contiguous (the kernel addresses its rows directly)")
    return paged_mla_absorbed_attention(q, cache, slots[:, None], lengths, scale, value_dim, num_splits)


def default_config(pool: torch.Tensor) -> tuple[int, int, int]:
    """(positions per tile BN, warps, pipeline stages) for a pool: tiles of 64 positions and as many stages
    (at most 3) as the device's shared memory per block holds, each stage a tile of rows `[BN, D]`; under
    the interpreter one warp, one stage, tiles of 32."""
    if interpreting():
        return 32, 1, 1
    smem = torch.cuda.get_device_properties(pool.device).shared_memory_per_block_optin
    for bn in (64, 32, 16):
        tile = bn * pool.shape[2] * pool.element_size()
        stages = min(3, smem // (tile + tile // 4))  # a quarter more for the softmax tiles and the queries
        if stages >= 1:
            return bn, 8, max(1, stages)
    return 16, 4, 1


_WORKING: dict[
    tuple, tuple[int, int, int]
] = {}  # per device, dtype and shape: the configuration that compiled


def _fallbacks(config: tuple[int, int, int]) -> list[tuple[int, int, int]]:
    """`config`, then fewer pipeline stages, then smaller tiles: what to try when a compiled kernel needs more
    shared memory than the device has (Triton's estimate before compiling is not exact)."""
    bn, warps, stages = config
    out = [(bn, warps, s) for s in range(stages, 0, -1)]
    out += [(b, warps, 1) for b in (32, 16) if b < bn]
    return out


def _launch(q, pool, block_table, lengths, scale, value_dim, NS, BN, num_warps, num_stages) -> torch.Tensor:
    """The split kernel and the merge with a given split count and tile configuration (checked arguments)."""
    B, T, H, D = q.shape
    block_size = pool.shape[1]
    capacity = block_table.shape[1] * block_size  # the most positions a sequence can have
    rows = T * H
    BM = _block_rows(rows)
    BR = max(16, triton.next_power_of_2(value_dim))
    per_split = triton.cdiv(triton.cdiv(capacity, NS), BN) * BN
    partial = torch.empty(B, rows, NS, value_dim, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, rows, NS, device=q.device, dtype=torch.float32)
    _mla_absorbed_kernel[(B, triton.cdiv(rows, BM), NS)](
        q.contiguous(),
        pool,
        block_table.contiguous(),
        lengths.contiguous(),
        partial,
        lse,
        scale,
        block_size,
        block_table.shape[1],
        per_split,
        T,
        NS,
        H=H,
        D=D,
        R=value_dim,
        BM=BM,
        BN=BN,
        BR=BR,
        BP=max(16, triton.next_power_of_2(D - value_dim)),
        DOT_FP32=interpreting() or pool.dtype == torch.float32,
        APPEND=T > 1,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if NS == 1:
        return partial.view(B, T, H, value_dim)
    out = torch.empty(B, T, H, value_dim, device=q.device, dtype=torch.float32)
    BRC = min(BR, 128)
    _combine_kernel[(B * rows, triton.cdiv(value_dim, BRC))](
        partial,
        lse,
        out,
        NS,
        R=value_dim,
        BS=max(2, triton.next_power_of_2(NS)),
        BR=BRC,
        num_warps=1 if interpreting() else 4,
    )
    return out
