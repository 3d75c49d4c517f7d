"""What the chunked KDA kernels share, forward (`chunk_fwd`) and backward (`chunk_bwd`): the chunk's shape,
how the tokens are cut into chunks and how a program finds its chunk, how gates are loaded, what the forward
keeps for the backward, and the precision of the intermediates. The algorithm is in `chunk_fwd`'s docstring.
"""

import torch
import triton
import triton.language as tl

from kda_edu.kernels._backend import interpreting, jit
from kda_edu.ops._checks import GATE_FLOOR

CHUNK = 64  # steps per chunk (C)


SUB = 16  # rows per sub-chunk: the smallest block tl.dot accepts on a GPU


# Above this many powers of two, a half sub-chunk's gate sum is too large for the anchored split of the
# diagonal block (both factors must stay normal float32 numbers, 2^-126 .. 2^127, with room for |k| < 1).
DIAG_LIMIT = tl.constexpr(96.0)


# Gates are raised to this as they are loaded (kda_edu.ops._checks.GATE_FLOOR: exp of it is 0 in float32), so a
# reset of -1000 or -inf decays exactly as before while every gate sum stays finite.
KERNEL_GATE_FLOOR = tl.constexpr(GATE_FLOOR[torch.float32])


@jit
def base2_gates(x):
    """Base-2 gates from loaded natural-log ones, raised to GATE_FLOOR first (NaN stays NaN)."""
    x = x.to(tl.float32)
    return tl.where(x < KERNEL_GATE_FLOOR, KERNEL_GATE_FLOOR, x) * 1.4426950408889634


@jit
def load_rows(ptr, t, row_stride, cols, n_cols, t_end):
    """Load a [len(t), len(cols)] tile whose row t starts at ptr + t * row_stride, zeros at t >= t_end.

    The kernels pass chunk-local rows t (int32) and a pointer already moved to the chunk's first token, so
    the per-element offsets stay 32-bit (64-bit offsets cost two registers per element)."""
    mask = (t[:, None] < t_end) & (cols[None, :] < n_cols)
    return tl.load(ptr + t[:, None] * row_stride + cols[None, :], mask=mask, other=0.0)


@jit
def chunk_span(i_c, chunks, T, NT, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """First token of chunk i_c and the end (exclusive) of its sequence, in tokens of the flattened [B * T]."""
    if IS_VARLEN:
        t0 = tl.load(chunks + 2 * i_c).to(tl.int64)
        t_end = tl.load(chunks + 2 * i_c + 1).to(tl.int64)
    else:
        i_b = (i_c // NT).to(tl.int64)
        t0 = i_b * T + (i_c % NT) * BT
        t_end = i_b * T + T
    return t0, t_end


@jit
def piece_chunk(NT, N0, CS, CN):
    """The chunk (numbered over all sequences) of a program over (chunk, value head) launched on one piece of
    the work (`time_pieces`): chunks CS .. CS + CN - 1 of sequences N0, N0 + 1, ... of NT chunks each, CN
    programs per sequence. A launch over every chunk has N0 = CS = 0 and CN = NT (with cu_seqlens: NT = CN =
    the number of chunks)."""
    i = tl.program_id(0)
    return (N0 + i // CN) * NT + CS + i % CN


@jit
def chunk_program(chunks, T, NT, H, HV, NCH, N0, CS, CN, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """What a program over (chunk, value head) works on, from its ids (`piece_chunk`): the value head i_hv,
    its key head i_h, the chunk's first token t0 (in the flattened [B * T]), its valid rows n_t (int32; more
    than BT when the sequence goes on) and its first row in the intermediates, row0."""
    i_c = tl.program_id(0) if IS_VARLEN else piece_chunk(NT, N0, CS, CN)
    i_hv = tl.program_id(1)
    t0, t_end = chunk_span(i_c, chunks, T, NT, BT, IS_VARLEN)
    return i_hv, i_hv // (HV // H), t0, (t_end - t0).to(tl.int32), (i_hv * NCH + i_c).to(tl.int64) * BT


@jit
def diag_span(gc_a, BC: tl.constexpr):
    """Largest half-block gate sum (base 2) of a 16-row block: decides if the middle anchor is safe."""
    rc = tl.arange(0, BC)
    mid = tl.sum(tl.where((rc == BC // 2)[:, None], gc_a, 0.0), axis=0)
    first = tl.sum(tl.where((rc == 0)[:, None], gc_a, 0.0), axis=0)
    last = tl.sum(tl.where((rc == BC - 1)[:, None], gc_a, 0.0), axis=0)
    span = tl.maximum(tl.max(first - mid, axis=0), tl.max(mid - last, axis=0))
    return mid, span


@jit
def seq_chunks(i_n, offsets, NT, IS_VARLEN: tl.constexpr):
    """First chunk (global index) and number of chunks of sequence i_n (a batch row without cu_seqlens)."""
    if IS_VARLEN:
        c0 = tl.load(offsets + i_n)
        n_chunks = tl.load(offsets + i_n + 1) - c0
    else:
        c0 = i_n * NT
        n_chunks = NT
    return c0, n_chunks


def pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


# What `chunk_kda(keep_intermediates=...)` keeps for the backward, by mode: the names of `prepare_chunks`'
# buffers. "matrices" keeps what the gram and inverse kernels make, so that the backward runs only the w/u kernel.
KEEP_MODES = {
    "none": (),
    "matrices": ("x", "aqk", "qg"),
    "all": ("w", "u", "qg", "kd", "aqk", "gl", "x"),
}


def keep_mode(keep_intermediates) -> str:
    """The `KEEP_MODES` name of a `keep_intermediates` argument (True is "all", False is "none")."""
    if keep_intermediates is True or keep_intermediates is False:
        return "all" if keep_intermediates else "none"
    if isinstance(keep_intermediates, str) and keep_intermediates in KEEP_MODES:
        return keep_intermediates
    raise ValueError(
        f"keep_intermediates must be True, False or one of {sorted(KEEP_MODES)}, got {keep_intermediates!r}"
    )


def chunk_layout(T: int, B: int = 1, cu_seqlens: torch.Tensor | None = None, chunk: int = CHUNK):
    """How the kernels cut the tokens into chunks: `(NT, NCH, chunks, offsets)`.

    Without cu_seqlens: NT = chunks per sequence, NCH = B * NT chunks in all, chunk i_c covers sequence
    i_c // NT (the kernels compute the rest). With cu_seqlens (N sequences packed along T): NCH = the sum
    of ceil(T_n / chunk), `chunks` an int32 `[NCH, 2]` table (first token, end of its sequence) and `offsets`
    int32 `[N + 1]`, the first chunk of each sequence; a sequence never shares a chunk with another.
    """
    if cu_seqlens is None:
        NT = triton.cdiv(T, chunk)
        return NT, B * NT, None, None
    cu = cu_seqlens.tolist()
    table, offsets = [], [0]
    for bos, eos in zip(cu[:-1], cu[1:], strict=True):
        table += [(t, eos) for t in range(bos, eos, chunk)]
        offsets.append(len(table))
    dev = cu_seqlens.device
    chunks = torch.tensor(table if table else [(0, 0)], dtype=torch.int32).to(dev)
    return 0, len(table), chunks, torch.tensor(offsets, dtype=torch.int32).to(dev)


def work_precision(dtype: torch.dtype) -> tuple[torch.dtype, str]:
    """What the kernels keep their intermediates in, and the input precision of their products, for inputs
    of `dtype`: float32 and exact ("ieee") products for float32 inputs; else the input's 16-bit dtype and
    tf32 products. Triton's interpreter keeps everything in float32."""
    idt = torch.float32 if (interpreting() or dtype == torch.float32) else dtype
    return idt, "ieee" if dtype == torch.float32 else "tf32"
