"""The recurrent KDA kernel: one token at a time, the kernel that serves decoding.

KDA keeps, for every value head, a state ``S`` of shape ``[K, V]``. For each token ``t``:

    S   <- diag(exp(g_t)) S                         decay, one factor per key channel
    S   <- S + beta_t k_t (v_t - S^T k_t)^T         delta rule: move S^T k_t towards v_t
    o_t  = S^T (scale * q_t)                        read out

During decoding ``T`` is 1 and there is nothing to chunk: the work per token is a handful of
multiply-adds per state entry, while the state itself (``K * V`` fp32 numbers per head) has to
come from memory and go back. So the kernel is memory-bound, and the best it can do is read
the state once and write it once. Its design follows from that:

* One program owns the state tile ``S[:, j0:j0 + BV]`` of one (sequence, value head): all ``K``
  rows, a block of ``BV`` value columns. Every step above is column-wise independent (the
  decay scales rows, ``S^T k`` and ``S^T q`` reduce over rows), so value blocks never talk to
  each other and the grid is ``(V / BV, N * HV)``: with B = 64, HV = 32, V = 128 and BV = 64
  that is 4096 programs, enough to keep all 132 SMs of an H200 streaming.
* The tile lives in registers for the whole sequence: loaded once before the time loop,
  stored once after it. Per token only ``q_t``, ``k_t``, ``g_t`` (``K`` numbers), ``v_t``
  (``BV`` numbers) and ``beta_t`` are read, and ``o_t`` (``BV`` numbers) written.
* There is no matrix product: ``S^T k`` is an elementwise product reduced over the key axis
  (``tl.sum``), which also keeps the kernel exact under Triton's CPU interpreter.
* With ``inplace_final_state=True`` the final state is stored over the initial one. Each
  program reads its tile before writing it and no two programs share a tile, so this is safe,
  and a decoding loop needs no new state allocation per step.
"""

import collections
import functools

import torch
import triton
import triton.language as tl

from kda_edu.kernels._backend import check_device, interpreting, jit
from kda_edu.kernels.chunk_bwd import chunk_kda_bwd, refuse_double_backward
from kda_edu.ops._checks import check_kda_inputs, resolve_scale, value_checks_enabled
from kda_edu.ops.varlen import check_cu_seqlens, check_varlen_state

__all__ = ["fused_recurrent_kda"]


@jit
def _fused_recurrent_kda_kernel(
    q,
    k,
    v,
    g,
    beta,
    o,
    h0,
    ht,
    cu_seqlens,
    state_indices,
    scale,
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    USE_STATE_INDICES: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)  # grouped values: HV // H value heads share one q/k head

    # The tokens of sequence i_n: a slice of the single flattened batch row when varlen,
    # otherwise row i_n of the batch. Offsets are int64: B * T * HV * V can pass 2**31.
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T

    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    k_mask = ck < K
    v_mask = cv < V
    s_mask = k_mask[:, None] & v_mask[None, :]

    # The state tile [BK, BV]; padded rows and columns stay exactly zero throughout, since the
    # masked loads below fill k_t, q_t and v_t with zeros there.
    # With state indices, sequence i_n's state is row state_indices[i_n] of a pool (continuous batching).
    if USE_STATE_INDICES:
        i_state = tl.load(state_indices + i_n).to(tl.int64) * HV + i_hv
    else:
        i_state = i_nh.to(tl.int64)
    s_off = i_state * K * V + ck[:, None] * V + cv[None, :]
    if USE_H0:
        S = tl.load(h0 + s_off, mask=s_mask, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)

    for t in range(bos, eos):
        qk_row = (t * H + i_h) * K
        vh_row = t * HV + i_hv
        q_t = tl.load(q + qk_row + ck, mask=k_mask, other=0.0).to(tl.float32) * scale
        k_t = tl.load(k + qk_row + ck, mask=k_mask, other=0.0).to(tl.float32)
        g_t = tl.load(g + vh_row * K + ck, mask=k_mask, other=0.0).to(tl.float32)
        v_t = tl.load(v + vh_row * V + cv, mask=v_mask, other=0.0).to(tl.float32)
        beta_t = tl.load(beta + vh_row).to(tl.float32)

        S = S * tl.exp(g_t)[:, None]
        U_t = beta_t * (v_t - tl.sum(S * k_t[:, None], axis=0))  # beta (v - S^T k), shape [BV]
        S = S + k_t[:, None] * U_t[None, :]
        o_t = tl.sum(S * q_t[:, None], axis=0)  # S^T (scale q), shape [BV]
        tl.store(o + vh_row * V + cv, o_t.to(o.dtype.element_ty), mask=v_mask)

    if STORE_HT:
        tl.store(ht + s_off, S, mask=s_mask)


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 for the interpreter, which runs programs in turn."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_config(K: int, V: int, n_states: int, device: torch.device) -> tuple[int, int]:
    """Value block BV and warps for ``n_states`` (sequence, value head) pairs.

    Start from an fp32 state tile of 8192 numbers (32 KiB, 64 per thread at 4 warps): on an
    H200 at B = 64, HV = 32, K = V = 128 that is BV = 64 and 4096 programs. A small batch gives
    too few programs to keep every SM streaming, so halve BV (doubling the programs) until there
    are at least four per SM or BV reaches 16.
    """
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), max(8192 // BK, 16))
    while BV > 16 and triton.cdiv(V, BV) * n_states < 4 * _sm_count(device):
        BV //= 2
    return BV, 4


def fused_recurrent_fwd(
    q, k, v, g, beta, scale, initial_state, final_state, cu_seqlens, block_v, num_warps, state_indices=None
):
    """Launch the kernel on validated, contiguous inputs; write o and (if given) final_state."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    o = torch.empty_like(v)
    if N * HV == 0 or V == 0:
        return o
    BK = triton.next_power_of_2(K)
    grid = (triton.cdiv(V, block_v), N * HV)
    _fused_recurrent_kda_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        o,
        initial_state,
        final_state,
        cu_seqlens,
        state_indices,
        scale,
        T,
        H=H,
        HV=HV,
        K=K,
        V=V,
        BK=BK,
        BV=block_v,
        USE_H0=initial_state is not None,
        STORE_HT=final_state is not None,
        IS_VARLEN=cu_seqlens is not None,
        USE_STATE_INDICES=state_indices is not None,
        num_warps=num_warps,
    )
    return o


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    inplace_final_state: bool = False,
    state_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA, token by token, in one Triton kernel: the decoding path.

    Args:
        q: queries ``[B, T, H, K]``.
        k: keys ``[B, T, H, K]``.
        v: values ``[B, T, HV, V]``; ``HV`` is a multiple of ``H`` and value head ``j`` uses
            query/key head ``j // (HV // H)``.
        g: log-space decay ``[B, T, HV, K]`` (``<= 0``), one factor ``exp(g)`` per key channel.
        beta: delta-rule step sizes ``[B, T, HV]``.
        scale: multiplies ``q``; defaults to ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` state before the first token (zeros if ``None``);
            ``N = B``, or the number of sequences with ``cu_seqlens``; float32.
        output_final_state: return the state after the last token, fp32 ``[N, HV, K, V]``.
        cu_seqlens: int32/int64 ``[N + 1]`` cumulative lengths (0, ..., T, nondecreasing) of
            ``N`` sequences packed into one batch row (``B`` must be 1), FlashAttention's
            convention. Each sequence starts from its own initial state and gets its own final
            state, exactly as if run alone. Zero-length sequences are allowed: their final
            state is their initial state.
        inplace_final_state: write the final state over ``initial_state`` instead of a new
            tensor. ``initial_state`` must then be an fp32 contiguous tensor; it is modified,
            and the returned ``final_state`` IS that tensor (same storage), whatever
            ``output_final_state`` says. Meant for decoding loops that keep one state buffer.
        state_indices: int32/int64 ``[N]``: sequence ``i``'s state is row ``state_indices[i]`` of
            ``initial_state``, a pool ``[P, HV, K, V]`` of any size P, read and overwritten in place
            (needs ``inplace_final_state=True``; vLLM's state indices for continuous batching).
            They must be distinct and in ``[0, P)``: an index outside would make the kernel read
            and write memory outside the pool, two equal ones race on one row. They are checked
            (a ValueError) when the tensors are on the CPU, or with ``KDA_EDU_DEBUG=1`` in the
            environment; on a GPU otherwise not, since the check costs a host sync per step.

    Returns:
        ``(o, final_state)``: ``o`` is ``[B, T, HV, V]`` in the inputs' dtype; ``final_state`` as
        described above, or ``None``. Internally everything is computed in fp32.

    Shapes, dtypes, devices and ``cu_seqlens`` are checked; the values of ``g`` (``<= 0``) and
    ``beta`` are not, since that would cost a device-to-host sync on every decoding step. A
    ``cu_seqlens`` check does cost one sync (its values decide which memory the kernel reads).

    Gradients: when an input requires one (and grad mode is on), the call goes through
    `FusedRecurrentKDAFunction`, whose backward is the chunked backward of `chunk_kda`
    (`kda_edu.kernels.chunk_bwd`): the same function, differentiated by kernels tested against
    float64. It needs K, V <= 256 and no ``inplace_final_state`` (the backward reads the initial
    state); otherwise such a call raises a ValueError. First derivatives only: a backward taken with
    ``create_graph=True`` raises a RuntimeError (`kda_edu.ops.kda.kda_chunked` has second derivatives).
    """
    # Shapes, dtypes and devices only: checking g <= 0 and beta in [0, 1] would cost a
    # device-to-host sync per call, longer than the decoding step itself.
    pooled = state_indices is not None
    B, T, H, HV, K, V = check_kda_inputs(
        q, k, v, g, beta, initial_state if cu_seqlens is None and not pooled else None, check_values=False
    )
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(
            f"fused_recurrent_kda takes float16, bfloat16 or float32 inputs (it computes in float32), "
            f"got q of dtype {q.dtype}; use kda_edu.ops.kda.kda_recurrent for float64"
        )
    check_device(q)
    tensors = (q, k, v, g, beta, initial_state)
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)
    if grad and (inplace_final_state or K > 256 or V > 256):
        raise ValueError(
            "fused_recurrent_kda's gradients (an input requires grad) need K, V <= 256 and "
            f"inplace_final_state=False, got K={K}, V={V}, inplace_final_state={inplace_final_state}; "
            "call it under torch.no_grad() for decoding"
        )
    if cu_seqlens is None:
        N = B
    else:
        N = len(check_cu_seqlens(cu_seqlens, B, T, q.device)) - 1
        cu_seqlens = cu_seqlens.contiguous()
        if initial_state is not None and not pooled:
            check_varlen_state(initial_state, N, HV, K, V, q.device)
    if pooled:
        _check_state_pool(state_indices, initial_state, inplace_final_state, N, HV, K, V, q.device)
    if inplace_final_state:
        if initial_state is None:
            raise ValueError("inplace_final_state=True needs an initial_state to write the final state into")
        if not initial_state.is_contiguous():
            raise ValueError(
                "inplace_final_state=True needs a contiguous initial_state (the kernel writes its storage "
                "directly); pass initial_state.contiguous() and keep that tensor"
            )
        final_state = initial_state
    elif output_final_state:
        final_state = q.new_empty(N, HV, K, V, dtype=torch.float32)
    else:
        final_state = None
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    scale = resolve_scale(scale, K)

    if grad:
        return FusedRecurrentKDAFunction.apply(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens
        )
    return _run(q, k, v, g, beta, scale, initial_state, final_state, cu_seqlens, state_indices)


def _check_state_pool(state_indices, pool, inplace, N: int, HV: int, K: int, V: int, device) -> None:
    """With state indices, initial_state is a pool `[P, HV, K, V]` updated in place, one index per sequence."""
    if not isinstance(state_indices, torch.Tensor):
        raise TypeError(f"state_indices must be a torch.Tensor, got {type(state_indices).__name__}")
    if state_indices.dtype not in (torch.int32, torch.int64) or tuple(state_indices.shape) != (N,):
        raise ValueError(
            f"state_indices must be int32 or int64 of shape [N] = [{N}], one pool row per sequence, got "
            f"{tuple(state_indices.shape)} {state_indices.dtype}"
        )
    if state_indices.device != device or not state_indices.is_contiguous():
        raise ValueError(f"state_indices must be contiguous and on q's device ({device})")
    if not inplace or not isinstance(pool, torch.Tensor):
        raise ValueError("state_indices needs the pool as initial_state and inplace_final_state=True")
    if pool.dim() != 4 or tuple(pool.shape[1:]) != (HV, K, V) or pool.dtype != torch.float32:
        raise ValueError(
            f"with state_indices, initial_state must be a float32 pool [P, HV, K, V] with (HV, K, V) = "
            f"{(HV, K, V)}, got {tuple(pool.shape)} {pool.dtype}"
        )
    if pool.device != device:
        raise ValueError(f"initial_state must be on q's device ({device}), got {pool.device}")
    if value_checks_enabled(device):
        rows = state_indices.tolist()
        outside = sorted({r for r in rows if not 0 <= r < pool.shape[0]})
        repeated = sorted(r for r, n in collections.Counter(rows).items() if n > 1)
        if outside or repeated:
            raise ValueError(
                f"state_indices must be distinct rows of the pool, in [0, P = {pool.shape[0]}), got {rows}"
                + (f": {outside} outside" if outside else "")
                + (f": {repeated} repeated" if repeated else "")
            )


def _run(q, k, v, g, beta, scale, initial_state, final_state, cu_seqlens, state_indices=None):
    """Pick the launch configuration and run the kernel on contiguous copies of the inputs."""
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    block_v, num_warps = default_config(q.shape[3], v.shape[3], N * v.shape[2], q.device)
    if interpreting():
        num_warps = 1
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = fused_recurrent_fwd(
        q, k, v, g, beta, scale, initial_state, final_state, cu_seqlens, block_v, num_warps, state_indices
    )
    return o, final_state


class FusedRecurrentKDAFunction(torch.autograd.Function):
    """`fused_recurrent_kda` with gradients: the recurrent kernel forward, the chunked backward.

    The two compute the same function (the chunked form is the loop regrouped), so the gradients of
    `kda_edu.kernels.chunk_bwd`'s kernels, which recompute what they need from the inputs, are the
    gradients of this forward. The forward saves the inputs only. The backward is not differentiable: taken
    with create_graph=True it raises (second derivatives need `kda_edu.ops.kda.kda_chunked`)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        shape = (N, v.shape[2], q.shape[3], v.shape[3])
        final_state = q.new_empty(shape, dtype=torch.float32) if output_final_state else None
        o, final_state = _run(q, k, v, g, beta, scale, initial_state, final_state, cu_seqlens)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
        ctx.scale = scale
        return o, final_state

    @staticmethod
    def backward(ctx, do, dht):

        refuse_double_backward("fused_recurrent_kda")

        q, k, v, g, beta, h0, cu_seqlens = ctx.saved_tensors
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        dht = dht.contiguous() if dht is not None else None
        dq, dk, dv, dg, dbeta, dh0 = chunk_kda_bwd(
            q, k, v, g, beta, ctx.scale, h0, do.contiguous(), dht, cu_seqlens
        )
        return dq, dk, dv, dg, dbeta, None, dh0, None, None
