"""Launch choices of the chunked kernels, taken from the device they run on: the scan's value block, the
pipeline depth of the passes over the chunks, the pieces of the time axis and the stream their scans run on.
"""

import functools

import torch
import triton

from kda_edu.kernels._backend import interpreting


def scan_value_block(programs: int, V: int, BVP: int, itemsize: int = 2, sms: int | None = None) -> int:
    """Value columns per program of a pass over the chunks of each sequence (`_chunk_scan_kernel`, and the
    backward's two state passes), for `programs` sequences x value heads on a GPU of `sms` multiprocessors
    (the current one's when None).

    Each program is a chain over all its sequence's chunks, and only one fits on a multiprocessor (its
    pipelined tiles take 120-150 kB of shared memory), so the programs run in waves of `sms`, and a pass takes
    about (waves) x (one chain). Narrower blocks make more programs, wider ones a dearer chain: measured on the
    H200 (128 chunks, bf16, K = 128), one chain of 16 columns costs 0.81
    of one of 32, one of 64 costs 1.08. The block with the fewest waves times that cost wins: 32 at
    (1, 8192, 32) (one wave of 128 programs), 64 at (8, 4096, 16) (two waves of 256 instead of four of 512),
    16 at (1, 131072, 16) (one wave of 128 instead of a half-empty one of 64). 64 only with 16-bit
    intermediates (`itemsize` 2): float32 tiles of 64 columns would not fit beside the others. Under Triton's
    interpreter, unless `sms` is given: 32 (or V rounded up, if smaller)."""
    if sms is None:
        if interpreting():
            return min(BVP, 32)
        sms = _multiprocessors(torch.cuda.current_device())
    cost = {16: 0.81, 32: 1.0, 64: 1.08}
    blocks = [b for b in cost if b <= BVP and (b < 64 or itemsize <= 2)] or [16]
    return min(blocks, key=lambda b: (triton.cdiv(programs * triton.cdiv(V, b), sms) * cost[b], b))


def pass_stages(BK: int, itemsize: int, BV: int = 64, alone: bool = True) -> int:
    """Pipeline depth of a pass over the chunks of each sequence (`_chunk_scan_kernel`, and the backward's
    `_states_kernel` and `_dstates_kernel`) for BK key rows of intermediates of `itemsize` bytes.

    Each step of such a pass loads about 60 kB of tiles (w, qg or u, kd, Aqk, dO) for the chunk after it.
    Triton's pipeliner with two stages issues those copies at the end of a step and waits for all of them at
    the start of the next one, so every chunk's tiles arrive while the program computes nothing; with three,
    it waits only for the copies issued a whole step earlier, and a chunk's loads overlap the previous
    chunk's products. Three stages of 16-bit tiles fit a Hopper multiprocessor (compiled for sm_90 with
    Triton 3.9, K = V = 128, 16 to 64 value columns: scan 183-213 kB, states 109-139 kB, dstates 184-221 kB;
    the limit is 227 kB); float32 tiles fit two stages up to K = 128 and one beyond.

    `alone`: the pass has the multiprocessor to itself. When the time axis is cut into pieces
    (`time_pieces`), the forward's scan shares it with the next piece's prepare kernels, and a three-stage
    scan of BV = 32 or 64 value columns (193 or 213 kB) leaves less than the gram kernel's 37 kB of a
    multiprocessor's 228: two stages then. With 16 columns (183 kB) the gram kernel still fits beside it. On
    the H200, 3 stages made the scan 1.5x faster at
    (1, 32768, 32) but slowed the gram kernel beside it, and the forward 2 % (BV = 32, four pieces); at
    (1, 131072, 16) (BV = 16, eight pieces) the forward was 7 % faster; where the scan runs alone, at
    (8, 4096, 16), 6 % (the scan 359 -> 250 us), and the backward's passes 23-25 %."""
    if BK * itemsize > 512:
        return 1
    return 3 if itemsize <= 2 and BK <= 128 and (alone or BV <= 16) else 2


@functools.lru_cache
def _multiprocessors(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def device_multiprocessors(device) -> int | None:
    """The multiprocessor count of `device` if it is a CUDA GPU (the current one for "cuda"), else None."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _multiprocessors(torch.cuda.current_device() if device.index is None else device.index)


def time_pieces(
    N: int, NT: int, HV: int, V: int, BVP: int, itemsize: int, varlen: bool, sms=None, pieces=None
) -> list[tuple[int, int, int, int]]:
    """How `chunk_kda_fwd` cuts its work, as a list of (first sequence, sequences, first chunk, chunks): the
    prepare kernels of one piece, then its scan on the side stream, then the next piece. N sequences of NT
    chunks (with cu_seqlens: NT all the chunks, one piece), HV value heads, V value columns, on a GPU of `sms`
    multiprocessors (`device_multiprocessors`; None where no waves limit the scan: a CPU, the interpreter).

    One piece when there are fewer than PIECE_MIN_CHUNK_HEADS chunks x value heads (the launches of more
    pieces would cost more than the overlap saves: 0.18 ms in one piece at (1, 2048, 16) on the H200, 0.32 in
    two), and when the scan takes more than one wave of programs on this GPU (`scan_value_block`): it then
    fills the GPU itself, and nothing is left to overlap (at (8, 4096, 16), two waves: 1.86 ms in one piece,
    1.86 in two of the time axis, 1.92 in four pieces of two sequences each). Else pieces of the time axis of
    every sequence, round(sqrt(NT / 32)) of them, at most PIECES_MAX: 2 at 8K tokens, 4 at 32K, 8 from 128K
    (the overlap grows with the count, and so do the launches; on the H200 at (1, 8192, 32) 1.04 / 1.00 /
    1.02 ms in 1 / 2 / 4 pieces, at (1, 32768, 32) 4.00 / 3.77 / 3.71 / 3.78 in 1 / 2 / 4 / 8, at
    (1, 131072, 16) 9.59 / 8.20 / 8.13 in 1 / 4 / 8).

    The pieces are not equal: the last one's scan runs alone after every prepare kernel, so it gets half a
    share (NT // pieces // 2 chunks) and the first piece the other half; the first piece's prepare kernels run
    alone anyway. On the H200 (two-stage scans) the cut [96, 32]
    made the forward at (1, 8192, 32) 4.4 % faster than [64, 64] (0.971 against 1.016 ms), and
    [192, 128, 128, 64] at (1, 32768, 32) 2.2 % faster than four of 128 (3.661 against 3.743; the best cut
    tried, five pieces, 3.653). `pieces` overrides: an int (that many pieces of the time axis, cut this way)
    or a list of pieces (sequences and time, as the kernels take them)."""
    if isinstance(pieces, list):
        return pieces
    whole = [(0, N, 0, NT)]
    if varlen or NT == 0 or pieces == 1:
        return whole
    if pieces is None:
        if N * NT * HV < PIECE_MIN_CHUNK_HEADS:
            return whole
        if sms is not None and N * HV * triton.cdiv(V, scan_value_block(N * HV, V, BVP, itemsize, sms)) > sms:
            return whole  # the scan fills the GPU in more than one wave
        pieces = min(PIECES_MAX, max(1, round((NT / 32) ** 0.5)))
    p = max(1, min(pieces, NT))
    if p == 1:
        return whole
    # The last piece's scan is the one that runs alone, after every prepare kernel: it gets half a share, and
    # the first piece, whose prepare kernels run alone anyway, the other half.
    size = NT // p
    last = max(1, size // 2)
    cuts = [NT - last - size * (p - 2), *[size] * (p - 2), last]
    starts = [sum(cuts[:i]) for i in range(p)]
    return [(0, N, cs, cn) for cs, cn in zip(starts, cuts, strict=True)]


PIECES_MAX = 8  # pieces of the time axis at most (`time_pieces`)


PIECE_MIN_CHUNK_HEADS = 2048


_SCAN_STREAMS: dict = {}


def scan_stream(device) -> torch.cuda.Stream:
    """The side stream of the forward's scans on `device`, at the highest priority CUDA offers: when a
    multiprocessor frees room, the scan's waiting program is placed before the prepare kernels' next ones."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _SCAN_STREAMS:
        _SCAN_STREAMS[index] = torch.cuda.Stream(device=index, priority=torch.cuda.Stream.priority_range()[1])
    return _SCAN_STREAMS[index]
