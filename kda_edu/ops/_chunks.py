"""What every chunked form shares: splitting a sequence into chunks and back, and the state pass.

A chunked form has three parts. The preamble (`chunk_inputs`) pads time to a multiple of the chunk, puts
every tensor in the layout `[B, HV, NC, C, ...]` and sums the gates inside each chunk. The matrices of a
chunk (`Aqk`, and for the delta rule `w` and `u`) do not depend on the state and differ per mechanism.
The state pass (`state_passing`) runs the chunks in order; it is the same for every mechanism.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kda_edu.ops._checks import check_chunk_size, clamp_gates, compute_dtype, resolve_scale


def to_chunks(x: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """`[B, T, HV, ...]` -> `[B, HV, NC, C, ...]` in `dtype`, NC = ceil(T / C).

    The last chunk is zero-padded. Every chunked form in the book treats a zero step (k = v = 0, g = 0,
    beta = 0) as one that leaves the state alone, so padding never changes a result.
    """
    B, T, HV = x.shape[:3]
    NC = -(-T // chunk_size)
    x = x.to(dtype).transpose(1, 2)
    x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, NC * chunk_size - T))
    return x.reshape(B, HV, NC, chunk_size, *x.shape[3:])


def from_chunks(x: torch.Tensor, T: int, dtype: torch.dtype) -> torch.Tensor:
    """`[B, HV, NC, C, D]` -> `[B, T, HV, D]` in `dtype`, dropping the padding."""
    B, HV, NC, C, D = x.shape
    return x.reshape(B, HV, NC * C, D)[:, :, :T].transpose(1, 2).to(dtype)


class Chunks(NamedTuple):
    """The inputs of a chunked form, `[B, HV, NC, C, ...]`; g, gc and beta are None where the form has none."""

    q: torch.Tensor  # [B, HV, NC, C, K], scaled
    k: torch.Tensor  # [B, HV, NC, C, K]
    v: torch.Tensor  # [B, HV, NC, C, V]
    g: torch.Tensor | None  # [B, HV, NC, C, K] per key channel, or [B, HV, NC, C] per head
    gc: torch.Tensor | None  # g summed from the chunk start, inclusive
    beta: torch.Tensor | None  # [B, HV, NC, C]


def chunk_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    *,
    scale: float | None,
    chunk_size: int,
    resets: bool = False,
    dtype: torch.dtype | None = None,
) -> Chunks:
    """The preamble of every chunked form: inputs `[B, T, ...]` that passed `check_kda_inputs` -> `Chunks`.

    The tensors are in `dtype` (None: `kda_edu.ops._checks.compute_dtype` of q's, float32 or float64), so the
    chunk size C and the compute dtype are `q.shape[3]` and `q.dtype` of the result. q and k are repeated to
    the HV value heads (value head j reads key head `j // (HV // H)`) and q is multiplied by `scale` (None:
    `K ** -0.5`); `chunk_size` is checked to be a positive int. `gc` is the cumulative log decay within each
    chunk, in [C * min(g), 0]. With `resets`, gates at or below `kda_edu.ops._checks.GATE_FLOOR` are first
    raised to it (a reset down to -inf decays exactly as before, but gc stays finite) and gc is summed in
    float64, so that the sums of resets do not round (see `kda_edu.ops.kda.kda_chunked`).
    """
    scale, chunk_size = resolve_scale(scale, q.shape[3]), check_chunk_size(chunk_size)
    dtype = compute_dtype(q.dtype) if dtype is None else dtype
    rep = v.shape[2] // q.shape[2]
    q_c = to_chunks(q.repeat_interleave(rep, dim=2), chunk_size, dtype) * scale
    k_c = to_chunks(k.repeat_interleave(rep, dim=2), chunk_size, dtype)
    v_c, g_c, beta_c = (None if x is None else to_chunks(x, chunk_size, dtype) for x in (v, g, beta))
    gc = None
    if g_c is not None:
        g_c = clamp_gates(g_c) if resets else g_c
        gc = (g_c.double() if resets else g_c).cumsum(dim=3)
    return Chunks(q_c, k_c, v_c, g_c, gc, beta_c)


def state_passing(q, k, gc, Aqk, w, u, state, *, entering: bool = False):
    """Run the chunks in order: the only sequential part of every chunked form. Chunk tensors are `[..., NC, C, *]`.

    With S the state entering a chunk:
        U   = u - w S                               the values the chunk actually writes
        O   = (Q * exp(gc)) S + Aqk U               read the old state, plus the chunk's own writes
        S  <- Diag(exp(gc_C)) S + (K * exp(gc_C - gc))^T U
    Every exponent here is <= 0: gc is non-increasing within a chunk. The mechanisms differ only in what
    they leave out: `gc=None` is no decay (linear attention, DeltaNet), a gc of one decay per step
    `[..., NC, C, 1]` is a decay per head (Gated DeltaNet), and `w=None` is no delta rule (`U = u`, the
    values themselves). The exponents are taken in gc's dtype and rounded to q's after `exp`.

    Args:
        q: scaled queries `[..., NC, C, K]`. k: keys `[..., NC, C, K]`. gc: `[..., NC, C, K or 1]` or None.
        Aqk: `[..., NC, C, C]`. w: `[..., NC, C, K]` or None. u: `[..., NC, C, V]`.
        state: the state entering the first chunk `[..., K, V]`, or None for zeros; computed in u's dtype.
        entering: also return the states entering the chunks.

    Returns:
        `(O [..., NC, C, V], final state)`, and with `entering` the states entering the chunks
        `[..., NC, K, V]` after them.
    """
    if state is None:
        state = u.new_zeros(*u.shape[:-3], k.shape[-1], u.shape[-1])
    state = state.to(u.dtype)
    reads, writes, carry = q, k.transpose(-1, -2), None
    if gc is not None:
        reads = q * gc.exp().to(q.dtype)
        writes = (k * (gc[..., -1:, :] - gc).exp().to(k.dtype)).transpose(-1, -2)
        carry = gc[..., -1, :, None].exp().to(state.dtype)  # [..., NC, K or 1, 1]
    outputs, states = [], []
    for n in range(q.shape[-3]):
        states.append(state)
        U = u[..., n, :, :] if w is None else u[..., n, :, :] - w[..., n, :, :] @ state
        outputs.append(reads[..., n, :, :] @ state + Aqk[..., n, :, :] @ U)
        state = (state if carry is None else carry[..., n, :, :] * state) + writes[..., n, :, :] @ U
    if entering:
        return torch.stack(outputs, dim=-3), state, torch.stack(states, dim=-3)
    return torch.stack(outputs, dim=-3), state
