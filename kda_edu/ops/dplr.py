"""KDA's transition as a diagonal-plus-rank-one (DPLR) matrix, and what tying both vectors to k saves.

One KDA step multiplies the state by

    (I - beta k k^T) Diag(alpha) = Diag(alpha) - (beta k) (alpha * k)^T

a diagonal plus a rank-one matrix whose two vectors both come from k. A general DPLR recurrence (RWKV-7 has
this shape) has free vectors a, b and a separate write key:

    S_t = (Diag(alpha_t) - a_t b_t^T) S_{t-1} + k_t v_t^T,        o_t = S_t^T (scale q_t)

KDA is the case a = beta k, b = alpha * k, with the value beta v. This module holds the general recurrence
(as a loop and chunk by chunk) so that the two chunked algorithms can be compared matrix by matrix, and a
count of the work each needs. Layout: q, k, a, b, g `[B, T, H, K]`, v `[B, T, H, V]` (one value head per
key head), states `[B, H, K, V]`; computed in float64 for float64 inputs, float32 otherwise.
"""

import torch

from kda_edu.ops._checks import compute_dtype
from kda_edu.ops._chunks import chunk_inputs, from_chunks, to_chunks


def kda_transition(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """The matrix one KDA step applies to the state: `(I - beta k k^T) Diag(exp(g))`.

    Args:
        k: key `[..., K]`.
        g: log decay `[..., K]`, <= 0.
        beta: write strength `[...]`.

    Returns:
        `[..., K, K]`.
    """
    eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
    erase = eye - beta[..., None, None] * k[..., :, None] * k[..., None, :]
    return erase * g.exp()[..., None, :]  # right-multiplying by Diag(alpha) scales column c by alpha_c


def dplr_recurrent(q, k, v, g, a, b, scale: float = 1.0, initial_state=None):
    """General DPLR recurrence as a loop: `S = (Diag(exp(g_t)) - a_t b_t^T) S + k_t v_t^T`, `o_t = S^T (scale q_t)`.

    Args:
        q, k, a, b: `[B, T, H, K]`.
        v: `[B, T, H, V]`.
        g: log decay `[B, T, H, K]`, <= 0.
        scale: query scale.
        initial_state: optional `[B, H, K, V]`; zeros when None.

    Returns:
        `(o, S)`: o `[B, T, H, V]` and the final state `[B, H, K, V]`, in the compute dtype.
    """
    dtype = compute_dtype(q.dtype)
    q, k, v, g, a, b = (x.to(dtype) for x in (q, k, v, g, a, b))
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    o = []
    for t in range(T):
        read = torch.einsum("bhk,bhkv->bhv", b[:, t], S)  # b_t^T S: what the rank-one part removes
        S = g[:, t, :, :, None].exp() * S - a[:, t, :, :, None] * read[:, :, None, :]
        S = S + k[:, t, :, :, None] * v[:, t, :, None, :]
        o.append(torch.einsum("bhk,bhkv->bhv", scale * q[:, t], S))
    return torch.stack(o, dim=1), S


def _pairwise_decay(gc: torch.Tensor, rows: torch.Tensor, strict: bool) -> torch.Tensor:
    """`exp(rows_i - gc_j)` for j < i (strict) or j <= i, exact zeros elsewhere: `[..., C, C, K]`."""
    C = gc.shape[-2]
    keep = torch.ones(C, C, dtype=torch.bool, device=gc.device).tril(-1 if strict else 0)
    diff = rows[..., :, None, :] - gc[..., None, :, :]
    return diff.masked_fill(~keep[..., None], float("-inf")).exp()


def dplr_chunked(q, k, v, g, a, b, scale: float = 1.0, initial_state=None, chunk_size: int = 16):
    """The general DPLR recurrence chunk by chunk: four `[C, C]` matrices per chunk.

    In a chunk entering with state `S_0`, with `gc_i = g_1 + ... + g_i` (per channel, `gc_0 = 0`), let
    `r_i = S_{i-1}^T b_i` be what step i's rank-one part reads. Unrolling the recurrence,

        S_i = Diag(exp(gc_i)) S_0 + sum_{j <= i} Diag(exp(gc_i - gc_j)) (k_j v_j^T - a_j r_j^T)

    and reading it with b_{i+1} gives C equations for the C unknown rows of R, one triangular system:

        (I + A_ba) R = (B * exp(gc_prev)) S_0 + A_bk V
        A_ba_ij = sum_c b_ic a_jc exp(gc_{i-1,c} - gc_jc)  (j < i),  A_bk the same with k_j for a_j

    and the outputs and the next state follow with two more matrices, A_qk and A_qa (j <= i):

        O   = (scale Q * exp(gc)) S_0 + A_qk V - A_qa R
        S_C = Diag(exp(gc_C)) S_0 + (K * exp(gc_C - gc))^T V - (A * exp(gc_C - gc))^T R

    KDA needs only two matrices because its a, b and write key are all k (scaled): A_ba, A_bk collapse to
    one `[C, C]` matrix, A_qa and A_qk to another (`kda_edu.ops.kda.kda_chunked`). Every exponent here is <= 0.

    Args:
        q, k, a, b, g: `[B, T, H, K]` (g <= 0).
        v: `[B, T, H, V]`.
        scale: query scale.
        initial_state: optional `[B, H, K, V]`; zeros when None.
        chunk_size: C.

    Returns:
        `(o, S)` as `dplr_recurrent`.
    """
    B, T, H, K = q.shape
    # [B, H, NC, C, *]
    q, k, v_c, g, gc, _ = chunk_inputs(q, k, v, g, None, scale=scale, chunk_size=chunk_size)
    C, dtype = q.shape[3], q.dtype
    a, b = (to_chunks(x, C, dtype) for x in (a, b))  # [B, H, NC, C, K]
    gc_prev = gc - g  # gc_{i-1}: the decay S_{i-1} has seen since the chunk start

    strict, causal = _pairwise_decay(gc, gc_prev, strict=True), _pairwise_decay(gc, gc, strict=False)
    A_ba = torch.einsum("...ic,...ijc,...jc->...ij", b, strict, a)
    A_bk = torch.einsum("...ic,...ijc,...jc->...ij", b, strict, k)
    A_qa = torch.einsum("...ic,...ijc,...jc->...ij", q, causal, a)
    A_qk = torch.einsum("...ic,...ijc,...jc->...ij", q, causal, k)

    L = torch.eye(C, dtype=dtype, device=q.device) + A_ba
    w = torch.linalg.solve_triangular(L, b * gc_prev.exp(), upper=False, unitriangular=True)  # [.., C, K]
    u = torch.linalg.solve_triangular(L, A_bk @ v_c, upper=False, unitriangular=True)  # [.., C, V]
    q_decayed, to_end = q * gc.exp(), (gc[..., -1:, :] - gc).exp()
    k_end, a_end, chunk_decay = k * to_end, a * to_end, gc[..., -1, :, None].exp()

    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    o = []
    for n in range(q.shape[2]):
        R = w[:, :, n] @ S + u[:, :, n]  # [B, H, C, V]
        o.append(q_decayed[:, :, n] @ S + A_qk[:, :, n] @ v_c[:, :, n] - A_qa[:, :, n] @ R)
        S = chunk_decay[:, :, n] * S + k_end[:, :, n].transpose(-1, -2) @ v_c[:, :, n]
        S = S - a_end[:, :, n].transpose(-1, -2) @ R
    return from_chunks(torch.stack(o, dim=2), T, dtype), S


def chunk_cost(C: int, K: int, V: int, tied: bool) -> dict[str, int]:
    """Matrix-multiply FLOPs per chunk and head of the chunked algorithm, item by item.

    `tied=True` is KDA (`kda_edu.ops.kda.kda_chunked`), `tied=False` the general DPLR form of `dplr_chunked`.
    A product `[m, n] @ [n, p]` costs `2 m n p`; a unit-triangular solve with N right-hand columns costs
    `C (C - 1) N`. Elementwise work (decays, masks) is left out: it is O(C K) or O(C^2 K) additions that
    do not run on the matrix units. The operands are the decayed copies such as `K * exp(gc)`; chapter 6
    shows how the chunked kernel forms them.

    Returns:
        `{item: FLOPs}` in the order the algorithm runs them.
    """
    solve = C * (C - 1)
    if tied:
        return {
            "A_kk = (K exp(gc)) (K exp(-gc))^T": 2 * C * C * K,
            "A_qk = (Q exp(gc)) (K exp(-gc))^T": 2 * C * C * K,
            "solve (I + A) [u, w] = beta [V, K exp(gc)]": solve * (V + K),
            "U = u - w S_0": 2 * C * K * V,
            "O = (Q exp(gc)) S_0": 2 * C * K * V,
            "O += A_qk U": 2 * C * C * V,
            "S_C += (K exp(gc_C - gc))^T U": 2 * C * K * V,
        }
    return {
        "A_ba = (B exp(gc_prev)) (A exp(-gc))^T": 2 * C * C * K,
        "A_bk = (B exp(gc_prev)) (K exp(-gc))^T": 2 * C * C * K,
        "A_qa = (Q exp(gc)) (A exp(-gc))^T": 2 * C * C * K,
        "A_qk = (Q exp(gc)) (K exp(-gc))^T": 2 * C * C * K,
        "A_bk V": 2 * C * C * V,
        "solve (I + A_ba) [u, w] = [A_bk V, B exp(gc_prev)]": solve * (V + K),
        "R = w S_0 + u": 2 * C * K * V,
        "O = (Q exp(gc)) S_0": 2 * C * K * V,
        "O += A_qk V - A_qa R": 2 * 2 * C * C * V,
        "S_C += (K exp(gc_C - gc))^T V - (A exp(gc_C - gc))^T R": 2 * 2 * C * K * V,
    }
