"""Chapter 8's first chunked KDA forward (v0): the plainest two kernels that compute it, to measure and improve.

The maths is `kda_edu.ops.kda.kda_chunked`'s, with chunks of C = 64 steps. Inside a chunk, with gc the
cumulative log decay from the chunk start (per key channel, <= 0 and falling):

    A_ij   = sum_c k_ic k_jc exp(gc_ic - gc_jc)            for j < i  (decayed key products)
    Aqk_ij = scale sum_c q_ic k_jc exp(gc_ic - gc_jc)      for j <= i
    L = Diag(beta) A,   w = (I + L)^-1 Diag(beta) (K * exp(gc)),   u = (I + L)^-1 Diag(beta) V
    qg = scale Q * exp(gc),   kd = K * exp(gc_C - gc)

and between chunks, with the state S entering the chunk:

    U = u - w S,   O = qg S + Aqk U,   S <- Diag(exp(gc_C)) S + kd^T U.

Kernel 1, `v0_chunk_kernel`: one program per (chunk, batch x value head) computes the first block of lines,
holding the whole 64-row chunk as one tile. It builds A and Aqk one key channel at a time, with the decay of
each pair (i, j) taken whole, exp(gc_i - gc_j) <= 1: no factor can overflow, whatever the gates. It inverts
I + L by forward substitution, one row of 64 at a time, then multiplies the inverse into the right-hand sides.
Kernel 2, `v0_state_kernel`: one program per (batch x value head) walks the chunks in order with the whole
K x V state in registers and computes the second block of lines.
Between them go w, u, qg, kd, Aqk and exp(gc_C) in float32, one padded chunk of 64 rows per chunk.

What v0 leaves out: packed sequences (`cu_seqlens`: a clear error), gradients (forward only), and every
trick that makes it fast; chapter 8 measures it beside `kda_edu.kernels.chunk.chunk_kda`.
"""

import torch
import triton
import triton.language as tl

from kda_edu.kernels._backend import check_device, jit
from kda_edu.ops._checks import GATE_FLOOR, check_kda_inputs, resolve_scale

C = 64  # steps per chunk
FLOOR = tl.constexpr(
    GATE_FLOOR[torch.float32]
)  # gates below this are raised to it: exp of it is 0 in float32


@jit
def v0_chunk_kernel(
    q, k, v, g, beta,  # inputs [B, T, H, K], [B, T, H, K], [B, T, HV, V], [B, T, HV, K], [B, T, HV]
    w, u, qg, kd, aqk, gl,  # outputs [B * HV, NT * C, BK | BV | BK | BK | C] and [B * HV, NT, BK]
    T, H, HV, K, V, NT, scale,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Everything of one chunk (of one sequence and value head) that does not depend on the state."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)  # the query/key head this value head reads
    r = tl.arange(0, C)  # row of the chunk
    t = i_c * C + r  # token of the sequence
    ck, cv = tl.arange(0, BK), tl.arange(0, BV)
    in_seq = t < T  # the last chunk may be partial: rows past T load as zeros

    # Pointers to token 0 of this sequence and head; token t of it is `t * row stride` further on.
    q_h = q + (i_b * T * H + i_h).to(tl.int64) * K
    k_h = k + (i_b * T * H + i_h).to(tl.int64) * K
    g_h = g + (i_b * T * HV + i_hv).to(tl.int64) * K
    v_h = v + (i_b * T * HV + i_hv).to(tl.int64) * V
    beta_h = beta + (i_b * T * HV + i_hv).to(tl.int64)
    beta_all = tl.load(beta_h + t * HV, mask=in_seq, other=0.0).to(tl.float32)

    # A and Aqk, one key channel at a time: an outer product times the pairwise decay exp(gc_i - gc_j).
    causal = r[:, None] >= r[None, :]
    A = tl.zeros([C, C], dtype=tl.float32)
    Aqk = tl.zeros([C, C], dtype=tl.float32)
    for c in range(K):
        q_c = tl.load(q_h + t * H * K + c, mask=in_seq, other=0.0).to(tl.float32)
        k_c = tl.load(k_h + t * H * K + c, mask=in_seq, other=0.0).to(tl.float32)
        g_c = tl.load(g_h + t * HV * K + c, mask=in_seq, other=0.0).to(tl.float32)
        gc_c = tl.cumsum(tl.maximum(g_c, FLOOR), axis=0)
        decay = tl.exp(tl.where(causal, gc_c[:, None] - gc_c[None, :], float("-inf")))  # 0 above the diagonal
        A += k_c[:, None] * k_c[None, :] * decay
        Aqk += q_c[:, None] * k_c[None, :] * decay
    L = tl.where(r[:, None] > r[None, :], beta_all[:, None] * A, 0.0)  # strictly lower: L = Diag(beta) A

    # X = (I + L)^-1 by forward substitution: row i of (I + L) X = I reads X_i = e_i - sum_{j<i} L_ij X_j.
    X = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in range(1, C):
        l_i = tl.sum(tl.where(r[:, None] == i, L, 0.0), axis=0)  # row i of L, zeros from column i on
        x_i = tl.sum(l_i[:, None] * X, axis=0)  # sum_j L_ij X_j (rows j >= i of X are not read: L_ij = 0)
        X = tl.where(r[:, None] == i, X - x_i[None, :], X)

    # The whole chunk's tiles: keys, queries and gate cumsums [C, BK], values [C, BV].
    k_mask = in_seq[:, None] & (ck[None, :] < K)
    v_mask = in_seq[:, None] & (cv[None, :] < V)
    k_all = tl.load(k_h + t[:, None] * H * K + ck[None, :], mask=k_mask, other=0.0).to(tl.float32)
    q_all = tl.load(q_h + t[:, None] * H * K + ck[None, :], mask=k_mask, other=0.0).to(tl.float32)
    v_all = tl.load(v_h + t[:, None] * HV * V + cv[None, :], mask=v_mask, other=0.0).to(tl.float32)
    G = tl.load(g_h + t[:, None] * HV * K + ck[None, :], mask=k_mask, other=0.0).to(tl.float32)
    G = tl.cumsum(tl.maximum(G, FLOOR), axis=0)  # gc; rows past T add 0, so the last row is gc_C
    G_end = tl.sum(tl.where(r[:, None] == C - 1, G, 0.0), axis=0)  # gc_C, [BK]

    # Write the chunk's intermediates: one padded chunk of C rows per chunk, rows of the sequence in order.
    row = (i_bh * NT * C + t).to(tl.int64)[:, None]
    W = tl.dot(X, beta_all[:, None] * k_all * tl.exp(G), input_precision=PREC)
    U = tl.dot(X, beta_all[:, None] * v_all, input_precision=PREC)
    tl.store(w + row * BK + ck[None, :], W)
    tl.store(u + row * BV + cv[None, :], U)
    tl.store(qg + row * BK + ck[None, :], scale * q_all * tl.exp(G))
    tl.store(kd + row * BK + ck[None, :], k_all * tl.exp(G_end[None, :] - G))
    tl.store(aqk + row * C + r[None, :], scale * Aqk)
    tl.store(gl + (i_bh * NT + i_c).to(tl.int64) * BK + ck, tl.exp(G_end))


@jit
def v0_state_kernel(
    w, u, qg, kd, aqk, gl,  # the intermediates of `v0_chunk_kernel`
    o, h0, ht,  # output [B, T, HV, V]; initial and final state [B, HV, K, V] (float32)
    T, HV, K, V, NT,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
):  # fmt: skip
    """One sequence and value head, chunk after chunk, with the whole state S [BK, BV] in registers."""
    i_bh = tl.program_id(0)
    i_b, i_hv = i_bh // HV, i_bh % HV
    r, ck, cv = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
    s_mask = (ck[:, None] < K) & (cv[None, :] < V)
    s_off = i_bh.to(tl.int64) * K * V + ck[:, None] * V + cv[None, :]

    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        S += tl.load(h0 + s_off, mask=s_mask, other=0.0)
    o_h = o + (i_b * T * HV + i_hv).to(tl.int64) * V
    for n in range(NT):
        row = (i_bh * NT * C + n * C + r).to(tl.int64)[:, None]
        w_n = tl.load(w + row * BK + ck[None, :])
        qg_n = tl.load(qg + row * BK + ck[None, :])
        kd_n = tl.load(kd + row * BK + ck[None, :])
        u_n = tl.load(u + row * BV + cv[None, :])
        a_n = tl.load(aqk + row * C + r[None, :])
        decay = tl.load(gl + (i_bh * NT + n).to(tl.int64) * BK + ck)

        U = u_n - tl.dot(w_n, S, input_precision=PREC)
        O = tl.dot(qg_n, S, input_precision=PREC) + tl.dot(a_n, U, input_precision=PREC)
        S = S * decay[:, None] + tl.dot(tl.trans(kd_n), U, input_precision=PREC)

        t = n * C + r
        o_mask = (t[:, None] < T) & (cv[None, :] < V)
        tl.store(o_h + t[:, None] * HV * V + cv[None, :], O.to(o.dtype.element_ty), mask=o_mask)
    if STORE_HT:
        tl.store(ht + s_off, S, mask=s_mask)


def v0_forward(q, k, v, g, beta, scale, initial_state, output_final_state, info=None):
    """Launch the two kernels on validated inputs (`chunk_kda_v0` checks them); returns `(o, final_state)`.

    One program per chunk and (batch x value head) for kernel 1, one per (batch x value head) for kernel 2.
    `info`, a dict, receives the registers and spilled registers of each compiled kernel (nothing under
    Triton's interpreter).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    NT = triton.cdiv(T, C)
    BK, BV = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
    prec = "ieee" if q.dtype == torch.float32 else "tf32"  # float32 inputs get exact float32 products
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    f32 = dict(device=q.device, dtype=torch.float32)
    rows = B * HV * NT * C
    w, qg, kd = (torch.empty(rows, BK, **f32) for _ in range(3))
    u, aqk, gl = (
        torch.empty(rows, BV, **f32),
        torch.empty(rows, C, **f32),
        torch.empty(B * HV * NT, BK, **f32),
    )
    o = torch.empty(B, T, HV, V, device=q.device, dtype=q.dtype)
    ht = torch.empty(B, HV, K, V, **f32) if output_final_state else None
    h0 = initial_state.contiguous() if initial_state is not None else None

    kernel1 = v0_chunk_kernel[(NT, B * HV)](
        q, k, v, g, beta, w, u, qg, kd, aqk, gl, T, H, HV, K, V, NT, scale, C=C, BK=BK, BV=BV, PREC=prec
    )
    kernel2 = v0_state_kernel[(B * HV,)](
        w, u, qg, kd, aqk, gl, o, h0, ht, T, HV, K, V, NT, C=C, BK=BK, BV=BV, PREC=prec,
        USE_H0=h0 is not None, STORE_HT=output_final_state,
        num_stages=1,  # no copies of the float32 tiles in flight: one stage of them already fills shared memory
    )  # fmt: skip
    if info is not None:
        for name, kernel in (("chunk", kernel1), ("state", kernel2)):
            if getattr(kernel, "metadata", None) is not None:  # compiled (the interpreter returns no kernel)
                info[name] = dict(regs=kernel.n_regs, spills=kernel.n_spills)
    return o, ht


def chunk_kda_v0(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA forward with the v0 kernels (module docstring), fla's calling convention.

    Args:
        q, k: `[B, T, H, K]`, bfloat16, float16 or float32; K <= 256.
        v: `[B, T, HV, V]`, q's dtype, HV a multiple of H; V <= 256.
        g: log-space decay `[B, T, HV, K]`, any floating dtype, <= 0 (-inf is a reset).
        beta: write strength `[B, T, HV]`, any floating dtype, in [0, 1].
        scale: query scale; `K ** -0.5` when None.
        initial_state: optional `[B, HV, K, V]` float32; zeros when None.
        output_final_state: also return the state after the last step.
        cu_seqlens: not supported (v0 has no packed sequences): anything but None raises. Use
            `kda_edu.kernels.chunk_kda` for packed sequences.

    Forward only: inputs that require gradients raise (use `kda_edu.kernels.chunk_kda`). The values of g and
    beta are checked (one reduction each, a synchronisation on a GPU); shapes, dtypes and devices always.

    Returns:
        `(o, final_state)`: o `[B, T, HV, V]` in q's dtype; final_state `[B, HV, K, V]` float32, or None.
    """
    if cu_seqlens is not None:
        raise NotImplementedError(
            "chunk_kda_v0 has no packed sequences (cu_seqlens): pass cu_seqlens=None with one sequence per "
            "batch row, or use kda_edu.kernels.chunk_kda"
        )
    B, T, H, HV, K, V = check_kda_inputs(q, k, v, g, beta, initial_state)
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"q, k, v must be bfloat16, float16 or float32 for chunk_kda_v0, got {q.dtype}")
    if K > 256 or V > 256:
        raise ValueError(
            f"chunk_kda_v0 supports K, V <= 256 (q is [B, T, H, K], v is [B, T, HV, V]), got K={K}, V={V}"
        )
    check_device(q)
    if torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state)
    ):
        raise ValueError(
            "chunk_kda_v0 is forward only: an input requires a gradient. Run it under torch.no_grad(), or use "
            "kda_edu.kernels.chunk_kda, which has a backward"
        )
    return v0_forward(q, k, v, g, beta, resolve_scale(scale, K), initial_state, output_final_state)
