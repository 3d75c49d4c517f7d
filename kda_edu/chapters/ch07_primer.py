"""Warm-up Triton kernels for chapter 7, each one step closer to the chunked KDA kernel.

Every kernel comes with a thin launcher (the grid is computed in the open) and, where PyTorch has no
one-liner for it, a PyTorch reference with the same contract:

1. `vector_add`: one program per block of elements, a mask for the ragged end.
2. `row_softmax`: one program per row, reductions (`tl.max`, `tl.sum`) over a block of columns.
3. `chunk_cumsum`: the gates' cumulative sum inside each chunk (`tl.cumsum`), one program per (chunk, head);
   reference `chunk_cumsum_reference`.
4. `batched_matmul`: tiles, a loop over the inner dimension, `tl.dot` with a float32 accumulator.
5. `chunked_linear_attention`: a loop over chunks that carries a `K x V` state in registers, the shape of
   KDA's sequential kernel; reference `kda_edu.ops.linear_attention.linear_attention_parallel`.

6. The GPU underneath: `occupancy` models how many programs of a compiled kernel one multiprocessor holds at
   once (the minimum of its register, shared-memory, warp and block limits), for limits read from the running
   GPU (`device_limits`) or the documented ones of an H100 and a T4 (`H100`, `T4`); `compiled_resources`
   compiles `batched_matmul_kernel` for an H100 without a GPU and reports its registers and shared memory.

The two kernels with `tl.dot` take its `input_precision` ("tf32", "tf32x3" or "ieee"): how a GPU multiplies
float32 blocks. `dot_error_bound` says how far from the exact product each choice may land.

Layout as everywhere in kda_edu: q, k `[B, T, H, K]`, v `[B, T, H, V]`, g `[B, T, H, K]`. Importing this module
goes through `kda_edu.kernels`, which switches Triton's interpreter on when there is no GPU.

The interpreter runs every program as numpy code on the CPU. Two of its habits matter here: its `tl.dot` on
bfloat16 operands returns wrong numbers (float16 and float32 are right), so `batched_matmul` casts its
operands to float32 when interpreting; and it accepts `tl.dot` on blocks smaller than 16, which a GPU rejects,
so the launchers refuse them everywhere.
"""

import inspect
import math
import re
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kda_edu.kernels._backend import interpreting, jit

MIN_DOT = 16  # the smallest block a GPU's tl.dot accepts along each dimension

# How tl.dot on float32 blocks treats its operands on an NVIDIA GPU, as a relative error per operand:
# "ieee" multiplies the float32 numbers themselves (no tensor cores); "tf32" rounds each operand to TF32,
# 10 explicit mantissa bits (the conversion may truncate, so up to one unit in the last place: 2^-10);
# "tf32x3" splits each operand into two TF32 numbers, hi + lo, and adds hi*hi + hi*lo + lo*hi: what it
# drops (the rounding of lo and the product lo*lo) is about 2^-20 of each term; 2^-19 bounds it.
OPERAND_ERROR = {"ieee": 0.0, "tf32x3": 2.0**-19, "tf32": 2.0**-10}
FP32_UNIT = 2.0**-24  # unit roundoff of a float32 addition (23 explicit mantissa bits)


def dot_error_bound(precision: str, depth: int, roundings: int = 2) -> float:
    """Bound on |computed - exact| / (|A| |B|) for products through tl.dot at `input_precision=precision`.

    The classical bound for a sum of products: each term carries the relative error of its rounded operands
    (`roundings` of them, `OPERAND_ERROR[precision]` each), and `depth` float32 additions add at most
    `depth` units of roundoff each to what they sum; the factor 2 leaves room for a float32 reference.
    The bound is elementwise and scales with `|A| |B|` (the product of the absolute values), so it holds
    whatever the signs; random signs typically land about sqrt(depth) times lower on the accumulation part.
    """
    if precision not in OPERAND_ERROR:
        raise ValueError(f"precision must be one of {sorted(OPERAND_ERROR)}, got {precision!r}")
    return roundings * OPERAND_ERROR[precision] + 2 * depth * FP32_UNIT


def _check_precision(input_precision: str | None) -> None:
    if input_precision is not None and input_precision not in OPERAND_ERROR:
        raise ValueError(f"input_precision must be one of {sorted(OPERAND_ERROR)}, got {input_precision!r}")


# ---------------------------------------------------------------------------------------------------------
# 1. Vector add: programs, blocks, masks


@jit
def add_kernel(x, y, out, n, BLOCK: tl.constexpr):
    """out[i] = x[i] + y[i]; program p owns elements p * BLOCK .. p * BLOCK + BLOCK - 1."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n  # the last program's block runs past the end
    tl.store(out + offs, tl.load(x + offs, mask=mask) + tl.load(y + offs, mask=mask), mask=mask)


def vector_add(x: torch.Tensor, y: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """x + y for two contiguous 1-D tensors of the same length, `block` elements per program."""
    if x.shape != y.shape or x.dim() != 1:
        raise ValueError(
            f"x and y must be 1-D tensors of one length, got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    out = torch.empty_like(x)
    n = x.numel()
    add_kernel[(triton.cdiv(n, block),)](x, y, out, n, BLOCK=block)
    return out


# ---------------------------------------------------------------------------------------------------------
# 2. Row-wise softmax: one program per row, reductions


@jit
def softmax_kernel(x, out, n_cols, row_stride, BLOCK: tl.constexpr):
    """Softmax of row `program_id(0)`; the whole row fits in one block of BLOCK >= n_cols columns."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # Padding columns read -inf: they add exp(-inf) = 0 to the sum and never win the max.
    x_row = tl.load(x + row * row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    z = x_row - tl.max(x_row, axis=0)  # subtract the max: every exponent <= 0, no overflow
    e = tl.exp(z)
    tl.store(out + row * row_stride + cols, (e / tl.sum(e, axis=0)).to(out.dtype.element_ty), mask=mask)


def row_softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension of a contiguous 2-D tensor `[rows, cols]`, one program per row."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, cols], got shape {tuple(x.shape)}")
    x = x.contiguous()
    out = torch.empty_like(x)
    softmax_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), BLOCK=triton.next_power_of_2(x.shape[1]))
    return out


# ---------------------------------------------------------------------------------------------------------
# 3. Chunked cumulative sum of the gates: a 2-D tile per program, tl.cumsum


@jit
def chunk_cumsum_kernel(g, out, T, H, K, C: tl.constexpr, BK: tl.constexpr):
    """Cumulative sum over time inside chunk `program_id(0)` of head `program_id(1)` (= b * H + h).

    Row t of head (b, h) starts at g + ((b * T + t) * H + h) * K: time steps are H * K numbers apart.
    """
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    t = i_n * C + tl.arange(0, C)
    c = tl.arange(0, BK)
    offs = ((i_b * T + t[:, None]) * H + i_h) * K + c[None, :]
    mask = (t[:, None] < T) & (c[None, :] < K)
    tile = tl.load(g + offs, mask=mask, other=0.0).to(tl.float32)  # [C, BK]
    tl.store(out + offs, tl.cumsum(tile, axis=0), mask=mask)


def chunk_cumsum(g: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """`gc[b, t, h] = g[b, n C, h] + ... + g[b, t, h]` with n C the start of t's chunk; g `[B, T, H, K]`.

    Returns float32 `[B, T, H, K]`. `chunk` must be a power of two (a block size).
    """
    if g.dim() != 4:
        raise ValueError(f"g must be [B, T, H, K], got shape {tuple(g.shape)}")
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two, got {chunk}")
    B, T, H, K = g.shape
    g = g.contiguous()
    out = torch.empty(B, T, H, K, dtype=torch.float32, device=g.device)
    chunk_cumsum_kernel[(triton.cdiv(T, chunk), B * H)](
        g, out, T, H, K, C=chunk, BK=triton.next_power_of_2(K)
    )
    return out


def chunk_cumsum_reference(g: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """`chunk_cumsum` in PyTorch: pad T to whole chunks, cumsum inside each, drop the padding (float32)."""
    B, T, H, K = g.shape
    pad = -T % chunk
    x = torch.nn.functional.pad(g.float(), (0, 0, 0, 0, 0, pad))
    return x.unflatten(1, (-1, chunk)).cumsum(dim=2).flatten(1, 2)[:, :T]


# ---------------------------------------------------------------------------------------------------------
# 4. Batched matrix product: tiles, a loop over the inner dimension, tl.dot


@jit
def batched_matmul_kernel(
    a,
    b,
    c,
    M,
    N,
    K,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Tile (program_id(0), program_id(1)) of c[z] = a[z] @ b[z] for batch z = program_id(2).

    a `[Z, M, K]`, b `[Z, K, N]`, c `[Z, M, N]`, all contiguous. The BM x BN accumulator stays in registers
    while BK-wide slices of a and b stream through. UPCAST casts the operands to float32 before tl.dot;
    PRECISION is tl.dot's input_precision for float32 operands.
    """
    i_m, i_n, z = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = i_m * BM + tl.arange(0, BM)
    rn = i_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_z = a + z.to(tl.int64) * M * K
    b_z = b + z.to(tl.int64) * K * N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a_t = tl.load(
            a_z + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0
        )
        b_t = tl.load(
            b_z + kk[:, None] * N + rn[None, :], mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0
        )
        if UPCAST:
            a_t, b_t = a_t.to(tl.float32), b_t.to(tl.float32)
        acc += tl.dot(
            a_t, b_t, input_precision=PRECISION
        )  # float32 accumulation whatever the operands' dtype
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(
        c + z.to(tl.int64) * M * N + rm[:, None] * N + rn[None, :], acc.to(c.dtype.element_ty), mask=mask
    )


def batched_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    block: tuple[int, int, int] = (32, 32, 32),
    upcast: bool | None = None,
    input_precision: str | None = None,
) -> torch.Tensor:
    """`a @ b` for a `[Z, M, K]` and b `[Z, K, N]`; one program per (BM x BN tile, batch element).

    Args:
        block: (BM, BN, BK), powers of two >= 16 (a GPU's tl.dot needs at least 16 along each dimension).
        upcast: cast the operands to float32 before tl.dot. None: only when interpreting (the interpreter's
            bfloat16 tl.dot is wrong); on a GPU the 16-bit operands go to the tensor cores as they are.
        input_precision: how a GPU multiplies float32 blocks: "tf32" (tensor cores, operands rounded to 10
            mantissa bits), "tf32x3" (three TF32 products, near float32), "ieee" (exact float32 products, no
            tensor cores), or None for Triton's default (TF32 on NVIDIA GPUs). 16-bit operands are multiplied
            exactly whatever it says; the interpreter ignores it (its products are always exact float32).
    """
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"a must be [Z, M, K] and b [Z, K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    _check_precision(input_precision)
    if min(block) < MIN_DOT:
        raise ValueError(f"every block size must be >= {MIN_DOT} for tl.dot on a GPU, got {block}")
    upcast = interpreting() if upcast is None else upcast
    Z, M, K = a.shape
    N = b.shape[2]
    BM, BN, BK = block
    c = torch.empty(Z, M, N, dtype=a.dtype, device=a.device)
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN), Z)
    batched_matmul_kernel[grid](
        a.contiguous(),
        b.contiguous(),
        c,
        M,
        N,
        K,
        BM=BM,
        BN=BN,
        BK=BK,
        UPCAST=upcast,
        PRECISION=input_precision,
    )
    return c


# ---------------------------------------------------------------------------------------------------------
# 5. Chunked linear attention: a loop over chunks with the state in registers


@jit
def chunked_linear_attention_kernel(
    q,
    k,
    v,
    o,
    T,
    H,
    K,
    V,
    scale,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Causal linear attention for head program_id(0) (= b * H + h), chunk after chunk.

    With S the state entering chunk n (the sum of k_s v_s^T over all earlier steps):
        O_n = scale (Q_n S + tril(Q_n K_n^T) V_n),    S <- S + K_n^T V_n
    S (BK x BV, float32) never leaves the program's registers.
    """
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    rows = tl.arange(0, C)
    ck = tl.arange(0, BK)
    cv = tl.arange(0, BV)
    causal = rows[:, None] >= rows[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    for n in range(0, tl.cdiv(T, C)):
        t = n * C + rows
        row_k = ((i_b * T + t[:, None]) * H + i_h).to(tl.int64) * K
        row_v = ((i_b * T + t[:, None]) * H + i_h).to(tl.int64) * V
        mk = (t[:, None] < T) & (ck[None, :] < K)
        mv = (t[:, None] < T) & (cv[None, :] < V)
        q_n = tl.load(q + row_k + ck[None, :], mask=mk, other=0.0).to(tl.float32)
        k_n = tl.load(k + row_k + ck[None, :], mask=mk, other=0.0).to(tl.float32)
        v_n = tl.load(v + row_v + cv[None, :], mask=mv, other=0.0).to(tl.float32)
        scores = tl.where(causal, tl.dot(q_n, tl.trans(k_n), input_precision=PRECISION), 0.0)  # [C, C]
        o_n = (
            tl.dot(q_n, S, input_precision=PRECISION) + tl.dot(scores, v_n, input_precision=PRECISION)
        ) * scale
        tl.store(o + row_v + cv[None, :], o_n.to(o.dtype.element_ty), mask=mv)
        # after the outputs: the chunk's own steps were counted by `scores`
        S += tl.dot(tl.trans(k_n), v_n, input_precision=PRECISION)


def chunked_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    chunk: int = 16,
    input_precision: str | None = None,
) -> torch.Tensor:
    """Causal linear attention `o_t = scale sum_{s <= t} (q_t . k_s) v_s`; q, k `[B, T, H, K]`, v `[B, T, H, V]`.

    One program per (batch, head); `chunk` (a power of two >= 16) steps per loop iteration. Computed in
    float32 (every tl.dot at `input_precision`, as in `batched_matmul`), returned in v's dtype.
    """
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"q, k must be [B, T, H, K] and v [B, T, H, V], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if chunk < MIN_DOT or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= {MIN_DOT}, got {chunk}")
    _check_precision(input_precision)
    B, T, H, K = q.shape
    V = v.shape[3]
    scale = K**-0.5 if scale is None else scale
    o = torch.empty_like(v)
    BK, BV = max(MIN_DOT, triton.next_power_of_2(K)), max(MIN_DOT, triton.next_power_of_2(V))
    q, k, v = (x.contiguous() for x in (q, k, v))
    chunked_linear_attention_kernel[(B * H,)](
        q, k, v, o, T, H, K, V, scale, C=chunk, BK=BK, BV=BV, PRECISION=input_precision
    )
    return o


# ---------------------------------------------------------------------------------------------------------
# What a kernel was declared with


def unspecialised(kernel) -> set[str]:
    """The arguments a `@triton.jit` kernel was told never to specialise on (`do_not_specialize`).

    Works on compiled kernels (`triton.JITFunction`, which records it per parameter) and on the
    interpreter's kernels (which keep the decorator's arguments).
    """
    if hasattr(kernel, "params"):
        return {p.name for p in kernel.params if p.do_not_specialize}
    names = kernel.kwargs.get("do_not_specialize") or []
    params = list(inspect.signature(kernel.fn).parameters)
    return {params[n] if isinstance(n, int) else n for n in names}


# ---------------------------------------------------------------------------------------------------------
# Pictures


def program_ids(shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """For a 2-D output of `shape` cut into `block` tiles: the linear id of the program that owns each element.

    The grid is padded to whole tiles; elements of the padding (which the masks switch off) get -1.
    Programs are numbered along the first grid axis fastest, the way a launch enumerates (pid_0, pid_1).
    """
    (R, Cc), (br, bc) = shape, block
    gr, gc = triton.cdiv(R, br), triton.cdiv(Cc, bc)
    r = torch.arange(gr * br)[:, None]
    c = torch.arange(gc * bc)[None, :]
    ids = (r // br) + gr * (c // bc)
    return torch.where((r < R) & (c < Cc), ids, -1)


def plot_ownership(ax, shape: tuple[int, int], block: tuple[int, int]) -> None:
    """Draw which program owns which element of a 2-D output (padding in white, tile borders in black)."""
    import matplotlib.pyplot as plt

    ids = program_ids(shape, block).float()
    shown = torch.where(ids < 0, torch.nan, ids % 10)  # ten colours, repeated
    ax.imshow(shown.numpy(), cmap=plt.get_cmap("tab10"), vmin=0, vmax=10, interpolation="nearest")
    (R, Cc), (br, bc) = shape, block
    for r in range(0, ids.shape[0] + 1, br):
        ax.axhline(r - 0.5, color="black", lw=0.8)
    for c in range(0, ids.shape[1] + 1, bc):
        ax.axvline(c - 0.5, color="black", lw=0.8)
    ax.add_patch(plt.Rectangle((-0.5, -0.5), Cc, R, fill=False, ec="red", lw=2))
    for r0 in range(0, R, br):
        for c0 in range(0, Cc, bc):
            r_mid, c_mid = (r0 + min(r0 + br, R)) / 2 - 0.5, (c0 + min(c0 + bc, Cc)) / 2 - 0.5
            ax.text(c_mid, r_mid, f"({r0 // br},{c0 // bc})", ha="center", va="center", fontsize=8)
    ax.grid(False)


# ---------------------------------------------------------------------------------------------------------
# Speed on a GPU


def gpu_bandwidth(sizes: list[int]) -> dict[str, list[float]]:
    """Achieved GB/s of `vector_add` and `row_softmax` beside PyTorch's own ops, on the current CUDA device.

    For each n in `sizes`: vector add of n float32 numbers (12 n bytes: two reads, one write) and a softmax
    of n / 1024 rows of 1024 float32 numbers (8 n bytes). Times are `triton.testing.do_bench` medians.
    """
    from triton.testing import do_bench

    out = {"triton add": [], "torch add": [], "triton softmax": [], "torch softmax": []}
    for n in sizes:
        x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
        m = x.view(-1, 1024)
        for name, fn, nbytes in (
            ("triton add", lambda x=x, y=y: vector_add(x, y), 12 * n),
            ("torch add", lambda x=x, y=y: x + y, 12 * n),
            ("triton softmax", lambda m=m: row_softmax(m), 8 * n),
            ("torch softmax", lambda m=m: m.softmax(-1), 8 * n),
        ):
            ms = do_bench(fn, return_mode="median")
            out[name].append(nbytes / (ms * 1e-3) / 1e9)
    return out


# ---------------------------------------------------------------------------------------------------------
# 6. The GPU underneath: how many programs fit on one multiprocessor


class DeviceLimits(NamedTuple):
    """What one streaming multiprocessor (SM) of a GPU offers the programs resident on it at once."""

    name: str
    sms: int  # multiprocessors on the chip
    registers_per_sm: int  # 32-bit registers in one SM's register file
    max_registers_per_thread: int
    shared_per_sm: int  # bytes of shared memory the SM can give to resident programs (blocks)
    shared_per_block: int  # bytes one block may use at most (the opt-in maximum)
    reserved_shared_per_block: int  # bytes the CUDA driver keeps per block on top of what the kernel asks for
    max_warps_per_sm: int
    max_blocks_per_sm: int
    register_unit: int = 256  # registers are given to a warp in units of this many (8 per thread)
    shared_unit: int = 128  # shared memory is given to a block in units of this many bytes


KB = 1024
# Example inputs for a CPU, from NVIDIA's documentation (CUDA C++ Programming Guide, "Technical Specifications
# per Compute Capability", and the product pages for the multiprocessor counts): an H100 SXM (compute capability
# 9.0) and a T4 (7.5).
H100 = DeviceLimits("H100 SXM (sm_90)", sms=132, registers_per_sm=65536, max_registers_per_thread=255,
                    shared_per_sm=228 * KB, shared_per_block=227 * KB, reserved_shared_per_block=1 * KB,
                    max_warps_per_sm=64, max_blocks_per_sm=32)  # fmt: skip
T4 = DeviceLimits("T4 (sm_75)", sms=40, registers_per_sm=65536, max_registers_per_thread=255,
                  shared_per_sm=64 * KB, shared_per_block=64 * KB, reserved_shared_per_block=0,
                  max_warps_per_sm=32, max_blocks_per_sm=16, shared_unit=256)  # fmt: skip
# What torch's device properties do not report, by compute capability, from the same documentation: resident
# blocks per SM, the driver's shared-memory reserve per block and the unit shared memory is given in.
DOCUMENTED = {
    (7, 0): dict(max_blocks_per_sm=32, reserved_shared_per_block=0, shared_unit=256),
    (7, 5): dict(max_blocks_per_sm=16, reserved_shared_per_block=0, shared_unit=256),
    (8, 0): dict(max_blocks_per_sm=32, reserved_shared_per_block=1 * KB, shared_unit=128),
    (8, 6): dict(max_blocks_per_sm=16, reserved_shared_per_block=1 * KB, shared_unit=128),
    (8, 7): dict(max_blocks_per_sm=16, reserved_shared_per_block=1 * KB, shared_unit=128),
    (8, 9): dict(max_blocks_per_sm=24, reserved_shared_per_block=1 * KB, shared_unit=128),
    (9, 0): dict(max_blocks_per_sm=32, reserved_shared_per_block=1 * KB, shared_unit=128),
}
MAX_REGISTERS_PER_THREAD = 255  # every compute capability from 3.5 on


def device_limits(index: int = 0) -> DeviceLimits:
    """The limits of CUDA device `index`, read from `torch.cuda.get_device_properties` (multiprocessors,
    registers, shared memory per block and per SM, threads per SM); the rest (registers per thread, blocks per
    SM, the driver's reserve, the allocation unit) from the compute capability's documented values
    (`DOCUMENTED`). Raises ValueError rather than borrow another GPU's numbers: for a compute capability not
    in `DOCUMENTED`, or a PyTorch too old to report a limit (build a `DeviceLimits` by hand then)."""
    props = torch.cuda.get_device_properties(index)
    cc = (props.major, props.minor)
    if cc not in DOCUMENTED:
        known = ", ".join(f"{a}.{b}" for a, b in DOCUMENTED)
        raise ValueError(f"device_limits knows compute capabilities {known}; {props.name} is {cc[0]}.{cc[1]}")
    reported = {}
    for field, attribute in (
        ("registers_per_sm", "regs_per_multiprocessor"),
        ("shared_per_sm", "shared_memory_per_multiprocessor"),
        ("shared_per_block", "shared_memory_per_block_optin"),
        ("max_threads", "max_threads_per_multi_processor"),
    ):
        if not hasattr(props, attribute):
            raise ValueError(
                f"this PyTorch does not report {attribute}; build a DeviceLimits for {props.name}"
            )
        reported[field] = getattr(props, attribute)
    return DeviceLimits(
        name=f"{props.name} (sm_{props.major}{props.minor})",
        sms=props.multi_processor_count,
        registers_per_sm=reported["registers_per_sm"],
        max_registers_per_thread=MAX_REGISTERS_PER_THREAD,
        shared_per_sm=reported["shared_per_sm"],
        shared_per_block=reported["shared_per_block"],
        max_warps_per_sm=reported["max_threads"] // 32,
        **DOCUMENTED[cc],
    )


class Occupancy(NamedTuple):
    """`occupancy`'s answer: programs (blocks) resident per SM, the limit that sets it, each limit's count."""

    blocks_per_sm: int
    limit: str  # "registers", "shared memory", "warps" or "blocks"
    by_limit: dict
    warps_per_sm: int  # resident warps: blocks_per_sm * num_warps
    fraction: float  # warps_per_sm / the SM's maximum: the "occupancy" a profiler reports


def occupancy(
    regs_per_thread: int, shared_per_block: int, num_warps: int, device: DeviceLimits = H100
) -> Occupancy:
    """How many programs of a compiled kernel fit on one multiprocessor at once, and which limit binds.

    A program (a CUDA block) of `num_warps` warps takes registers for each of its threads (`regs_per_thread`,
    rounded up so that a warp takes a whole number of `register_unit`s) and `shared_per_block` bytes of shared
    memory (plus the driver's reserve, rounded up to `shared_unit`). Each resource allows some number of
    programs; the SM also caps its warps and its blocks. The answer is the minimum of the four.
    Raises ValueError for a kernel that cannot run on the device at all.
    """
    if not 0 < regs_per_thread <= device.max_registers_per_thread:
        raise ValueError(
            f"{regs_per_thread} registers per thread: the limit is {device.max_registers_per_thread}"
        )
    if not 0 <= shared_per_block <= device.shared_per_block:
        raise ValueError(
            f"{shared_per_block} bytes of shared memory: a block may use {device.shared_per_block}"
        )
    if num_warps < 1 or num_warps > device.max_warps_per_sm:
        raise ValueError(f"{num_warps} warps per program: an SM holds {device.max_warps_per_sm}")
    per_warp = math.ceil(regs_per_thread * 32 / device.register_unit) * device.register_unit
    shared = math.ceil((shared_per_block + device.reserved_shared_per_block) / device.shared_unit)
    shared *= device.shared_unit
    by_limit = {
        "registers": device.registers_per_sm // (per_warp * num_warps),
        "shared memory": device.shared_per_sm // shared if shared else device.max_blocks_per_sm,
        "warps": device.max_warps_per_sm // num_warps,
        "blocks": device.max_blocks_per_sm,
    }
    limit = min(by_limit, key=by_limit.get)  # the first of the smallest: registers before the others
    blocks = by_limit[limit]
    return Occupancy(
        blocks, limit, by_limit, blocks * num_warps, blocks * num_warps / device.max_warps_per_sm
    )


def _cuobjdump() -> Path:
    import triton.backends.nvidia as nvidia

    return Path(nvidia.__file__).parent / "bin" / "cuobjdump"


def _resources_sm90(job: dict) -> dict:
    """`batched_matmul_kernel` on bfloat16 compiled for sm_90 (nothing launched) with job's block, warps and
    stages; its registers per thread (from the cubin, read by Triton's own cuobjdump) and shared memory."""
    from kda_edu.kernels.offline import compile_source

    constexprs = dict(
        BM=job["block"][0], BN=job["block"][1], BK=job["block"][2], UPCAST=False, PRECISION=None
    )
    signature = {"a": "*bf16", "b": "*bf16", "c": "*bf16", "M": "i32", "N": "i32", "K": "i32"}
    aligned = {
        (i,): [["tt.divisibility", 16]] for i in range(6)
    }  # as a launch on aligned tensors specialises
    options = {"num_warps": job["warps"], "num_stages": job["stages"]}
    compiled = compile_source(
        batched_matmul_kernel,
        signature | dict.fromkeys(constexprs, "constexpr"),
        constexprs,
        options,
        (9, 0),
        aligned,
    )
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(_cuobjdump()), "-res-usage", str(cubin)], capture_output=True, text=True)
    regs = int(re.search(r"REG:(\d+)", usage.stdout).group(1))
    return {**job, "regs": regs, "shared": compiled.metadata.shared}


def compiled_resources(jobs: list[dict]) -> list[dict]:
    """For each job `{"block": [BM, BN, BK], "warps": w, "stages": s}`: `batched_matmul_kernel` compiled for an
    H100 (sm_90) without a GPU, with its registers per thread and shared memory in bytes (`"regs"`, `"shared"`).
    The compiler runs in a fresh Python (`kda_edu.kernels.offline.in_fresh_python`), as chapter 8's do."""
    from kda_edu.kernels.offline import in_fresh_python

    return in_fresh_python(__name__, "_resources_sm90", jobs)
