"""`chunk_kda`, the chunked KDA operator in Triton: its checks, its autograd function and its value check.

The forward's kernels are in `chunk_fwd` (the algorithm is described there), the backward's in `chunk_bwd`;
both share `chunk_common`, and take their launch choices from `chunk_launch`. This module imports them and
nothing imports it back.
"""

import collections

import torch

from kda_edu.kernels import chunk_bwd, chunk_fwd
from kda_edu.kernels._backend import check_device
from kda_edu.kernels.chunk_bwd import refuse_double_backward
from kda_edu.kernels.chunk_common import KEEP_MODES, keep_mode
from kda_edu.ops._checks import check_kda_inputs, format_value, resolve_scale
from kda_edu.ops.varlen import check_cu_seqlens, check_varlen_state


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    keep_intermediates: bool | str = "matrices",
    check_inputs: bool | str = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA with Triton kernels; the contract of `kda_edu.ops.kda.kda_chunked`, with the differences below.

    The forward launches the four kernels of `kda_edu.kernels.chunk_fwd` (gram, inverse, w/u, scan) once per
    piece of the time axis: four launches in all, unless `chunk_launch.time_pieces` cuts a long sequence into
    pieces on a GPU (then four per piece, each piece's scan on a second stream). On CUDA with the default
    `check_inputs`, a fill of the one-number flag buffer and its copy to the host come on top. When any input
    requires a gradient, the call goes through `ChunkKDAFunction`, whose backward kernels give gradients for
    q, k, v, g, beta and initial_state: first derivatives only (a backward with create_graph=True raises a
    RuntimeError; `kda_chunked` has second derivatives). The backward is as causal as the forward: with a bad value at step
    t, the gradients of the earlier steps for a loss on the outputs before t are those of the clean prefix.

    Args:
        q: queries `[B, T, H, K]`, bfloat16, float16 or float32; K <= 256.
        k: keys `[B, T, H, K]`, same dtype as q (usually L2-normalised).
        v: values `[B, T, HV, V]`, same dtype as q, HV a multiple of H; V <= 256.
        g: log-space decay per key channel `[B, T, HV, K]`, any floating dtype, <= 0.
        beta: write strength `[B, T, HV]`, any floating dtype, in [0, 1].
        scale: query scale; `K ** -0.5` when None.
        initial_state: optional `[B, HV, K, V]` float32 (`[N, HV, K, V]` with cu_seqlens); zeros when None.
        output_final_state: also return the state after the last step (of each sequence).
        cu_seqlens: optional int32/int64 `[N + 1]` cumulative sequence lengths (FlashAttention's convention)
            for N sequences packed along T with B = 1; each sequence runs as if alone, from its own state.
        keep_intermediates: only with gradients: what the forward keeps of its chunk intermediates until the
            backward, instead of recomputing them there (`KEEP_MODES`). "matrices" (the default): the two
            C x C matrices per chunk, X = (I + L)^-1 (float32) and Aqk, and qg; the backward then runs only
            the w/u kernel of the three prepare kernels, the cheapest, to remake w, u, kd and gl. "all" (or
            True): everything the prepare kernels make (w, u, qg, kd, Aqk, gl and X, about 1.1 times the
            bytes of q, k, v and g together at K = V = 128 in bf16); the backward skips all three. "none"
            (or False): nothing; the backward recomputes all three. The gradients are the same in every
            mode; the memory held between forward and backward, and the time, are not (chapter 9, "Recompute
            or store", has the H200's numbers).
        check_inputs: how the values of g (<= 0, not NaN; -inf is a reset) and beta (in [0, 1], not NaN)
            are checked, as `kda_chunked` checks them. Whatever it says, the kernels run a step whose g or
            beta is invalid as a zero step and set the outputs from that step on, and the final state, to NaN
            (as for a NaN key): an invalid value never gives a finite, wrong answer.
            True (the default): CPU tensors (Triton's interpreter) are checked before the kernels run, and a
            bad value raises a ValueError at once. CUDA tensors are checked by the w/u kernel as it reads g
            and beta anyway (two compares per value: no extra pass over memory, no synchronisation). Its
            verdict comes back to the host asynchronously, as CUDA's own errors do: the ValueError is raised
            by the first later `chunk_kda` call, or backward, that finds the verdict ready, or by
            `raise_value_errors()`, which waits for it. Not while a CUDA graph is being captured (a replay
            runs no Python; the NaN outputs remain).
            "sync": checked before the kernels run on any device, the error raised by this call, at the cost
            of a reduction over g and beta and a synchronisation. False: no verdict at all.

    What is checked, always and from metadata only: the shapes, dtypes and devices of every tensor, and that
    the kernels can run where the tensors are (`kda_edu.kernels._backend.check_device`: CPU tensors under the
    interpreter, CUDA tensors when compiled, bfloat16 only from compute capability 8.0). cu_seqlens' values
    are checked too (one small copy to the host: they decide which memory the kernels read). Never checked:
    the values of q, k, v and initial_state. As in `kda_chunked`, a NaN or inf in the key or value of step t
    makes the outputs from t on NaN and leaves the earlier ones exact (the kernels run that step as a zero
    step and set the outputs from it on to NaN); a non-finite query spoils only its own output.
    Gates below `kda_edu.ops._checks.GATE_FLOOR` (-105) are raised to it as they are loaded: the same decay,
    exactly 0 in float32.

    Returns:
        `(o, final_state)`: o `[B, T, HV, V]` in q's dtype; final_state `[B, HV, K, V]` (`[N, HV, K, V]` with
        cu_seqlens) float32, or None.
    """
    B, T, H, HV, K, V = check_kda_inputs(
        q, k, v, g, beta, initial_state if cu_seqlens is None else None, check_values=False
    )
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"q, k, v must be bfloat16, float16 or float32 for chunk_kda, got {q.dtype}")
    if K > 256 or V > 256:
        raise ValueError(
            f"chunk_kda supports K, V <= 256 (q is [B, T, H, K], v is [B, T, HV, V]), got K={K}, V={V}"
        )
    check_device(q)
    if cu_seqlens is not None:
        N = len(check_cu_seqlens(cu_seqlens, B, T, q.device)) - 1
        cu_seqlens = cu_seqlens.contiguous()  # the scan kernel reads it through its pointer
        if initial_state is not None:
            check_varlen_state(initial_state, N, HV, K, V, q.device)
    if check_inputs not in (True, False, "sync"):
        raise ValueError(f'check_inputs must be True, False or "sync", got {check_inputs!r}')
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    flags = None
    if check_inputs and not capturing:
        raise_value_errors(wait=False)  # an earlier call's verdict, if it has arrived
        if check_inputs == "sync" or not q.is_cuda:
            check_gate_values(g, beta)
        else:
            flags = torch.zeros(1, dtype=torch.int32, device=q.device)
    h0 = initial_state.contiguous() if initial_state is not None else None
    scale = resolve_scale(scale, K)
    keep = keep_mode(keep_intermediates)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, g, beta, h0)):
        out = ChunkKDAFunction.apply(q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, keep, flags)
    else:
        out = chunk_fwd.chunk_kda_fwd(
            q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, flags=flags
        )
    if flags is not None:
        _queue_verdict(flags)
    return out


# The in-kernel value checks of CUDA calls whose verdict has not been read yet: (event, pinned host copy of the
# flags) in call order. Bounded: past MAX_PENDING the oldest verdicts are waited for.
_PENDING: collections.deque = collections.deque()


MAX_PENDING = 256


def _queue_verdict(flags: torch.Tensor) -> None:
    host = torch.empty(1, dtype=torch.int32, pin_memory=True)
    host.copy_(flags, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    _PENDING.append((done, host))
    if len(_PENDING) > MAX_PENDING:
        _read_verdicts(wait=True, limit=len(_PENDING) - MAX_PENDING)


def raise_value_errors(wait: bool = True) -> None:
    """Raise the ValueError of an earlier `chunk_kda` call on CUDA tensors whose kernels found a g or beta out
    of range (`chunk_kda`'s `check_inputs`). wait=True waits for every verdict still on its way (a
    synchronisation); wait=False reads only those that have arrived."""
    _read_verdicts(wait)


def _read_verdicts(wait: bool, limit: int | None = None) -> None:
    while _PENDING and (limit is None or limit > 0):
        done, host = _PENDING[0]
        if not wait and not done.query():
            return
        done.synchronize()
        _PENDING.popleft()
        limit = None if limit is None else limit - 1
        bits = int(host[0])
        if bits:
            name, rule = (
                ("g", "be <= 0 (a log-space decay) and not NaN") if bits & 1 else ("beta", "lie in [0, 1]")
            )
            shape = "[B, T, HV, K]" if name == "g" else "[B, T, HV]"
            raise ValueError(
                f"{name} of shape {shape} must {rule}, and an earlier chunk_kda call on the GPU got a value that "
                "does not: its kernels ran that step as a zero step and set its outputs from there on to NaN "
                '(chunk_kda(..., check_inputs="sync") raises in the call itself)'
            )


def check_gate_values(g: torch.Tensor, beta: torch.Tensor) -> None:
    """Raise a ValueError unless g <= 0 and 0 <= beta <= 1 everywhere (NaN fails both), with one
    device-to-host copy (the messages, on the error path, cost more)."""
    ok = torch.stack([(g <= 0).all(), ((beta >= 0) & (beta <= 1)).all()])
    g_ok, beta_ok = ok.tolist()
    if not g_ok:
        raise ValueError(
            f"g of shape [B, T, HV, K] must be <= 0 (a log-space decay) and not NaN, got max {g.max():.4g} "
            "(chunk_kda(..., check_inputs=False) skips this check)"
        )
    if not beta_ok:
        lo, hi = torch.aminmax(beta)
        raise ValueError(
            "beta of shape [B, T, HV] must lie in [0, 1] and not be NaN, got values in "
            f"[{format_value(lo)}, {format_value(hi)}] "
            "(chunk_kda(..., check_inputs=False) skips this check)"
        )


class ChunkKDAFunction(torch.autograd.Function):
    """`chunk_kda` with a Triton backward. The forward saves its inputs, and the chunk intermediates that
    `keep_intermediates` (a `KEEP_MODES` name) names; the backward recomputes the others.

    The intermediates are not saved tensors but a dict on ctx that the first backward empties (each buffer is
    freed as soon as that backward is done with it, and `aqk` becomes dAqk in place). A second backward
    through the same graph (`retain_graph=True`) finds the dict empty and recomputes them. The backward is
    not differentiable: taken with create_graph=True it raises (`refuse_double_backward`)."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        keep_intermediates,
        flags=None,
    ):
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        h0 = initial_state.contiguous() if initial_state is not None else None
        ctx.kept = {} if keep_intermediates != "none" else None
        o, ht = chunk_fwd.chunk_kda_fwd(  # looked up here: tools may swap it
            q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, keep=ctx.kept, flags=flags
        )
        if ctx.kept is not None:  # the rest of the forward's buffers are freed here
            ctx.kept = {name: ctx.kept[name] for name in KEEP_MODES[keep_intermediates]}
        ctx.save_for_backward(q, k, v, g, beta, h0, cu_seqlens)
        ctx.scale = scale
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        refuse_double_backward("chunk_kda")
        q, k, v, g, beta, h0, cu_seqlens = ctx.saved_tensors
        raise_value_errors(wait=False)  # the forward's value check, if its verdict has arrived
        do = do.contiguous()
        dht = dht.contiguous() if dht is not None else None
        kept, ctx.kept = (ctx.kept or None), None  # None: a second backward, recompute
        dq, dk, dv, dg, dbeta, dh0 = chunk_bwd.chunk_kda_bwd(  # looked up here: tools may swap it
            q, k, v, g, beta, ctx.scale, h0, do, dht, cu_seqlens, kept=kept
        )
        return dq, dk, dv, dg, dbeta, None, dh0, None, None, None, None
