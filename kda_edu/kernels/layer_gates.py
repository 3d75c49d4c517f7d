"""The KDA layer's decay gate and write strength from their pre-activations, in one Triton kernel each way.

For every token (a row of f `[N, HV K]` and of b `[N, HV]`, N = B T), with `u = f + dt_bias` and the head's
rate `e = exp(A_log[h])`:

    softplus gate:     g = -e softplus(u)                     (`kda_edu.ops.gates.kda_gate`)
    lower-bound gate:  g = lower_bound sigmoid(e u)           (`kda_edu.ops.gates.kda_gate_lower_bound`)
    write strength:    beta = sigmoid(b)                      (`kda_edu.ops.gates.beta_sigmoid`)

In PyTorch each line is several elementwise passes over `[B, T, HV, K]` in float32, each kept for the
backward. Here one program owns BR tokens and GC of the HV K gate columns, reads f once, writes g once
(float32, as the references return it); the programs of the first column block also do beta.

Backward, with `dg` and `dbeta` the output gradients:

    softplus:     du = -e sigmoid(u) dg,                    dA_log = sum over tokens and K of g dg
    lower bound:  du = lower_bound s (1 - s) e dg,          dA_log = sum over tokens and K of du u
                  (s = sigmoid(e u))
    df = du,      ddt_bias = sum over tokens of du,         db = beta (1 - beta) dbeta

The sums over tokens are taken per program (one float32 partial row per program), then over the programs by
`torch.sum`: deterministic. softplus is computed as `max(u, 0) + log1p(exp(-|u|))` with a log1p that keeps its
relative precision for small arguments, since the gate starts near `u = -7` where softplus(u) is about 1e-3.
"""

import torch
import triton
import triton.language as tl

from kda_edu.backend import KERNEL_FLOATS
from kda_edu.kernels._backend import check_device, interpreting, jit
from kda_edu.kernels.chunk_bwd import refuse_double_backward

__all__ = ["fused_kda_gates"]

BR = 16  # tokens per program
GC = 128  # gate columns per program


@jit
def log1p(e):
    """log(1 + e) for e >= 0, to a few ulps also where 1 + e rounds (Goldberg's trick: the rounding of
    1 + e cancels in log(w) e / (w - 1))."""
    w = 1.0 + e
    return tl.where(w == 1.0, e, tl.log(w) * e / tl.where(w == 1.0, 1.0, w - 1.0))


@jit
def gate_and_slopes(f, dt_bias, A_log, rows, cg, N, lower_bound, K: tl.constexpr, G: tl.constexpr,
                    LOWER_BOUND: tl.constexpr):  # fmt: skip
    """`(g, dg/du, dg/dA_log)` for tokens `rows` and gate columns `cg`, float32 `[BR, GC]`."""
    mask = (rows < N)[:, None] & (cg < G)[None, :]
    f_a = tl.load(f + rows.to(tl.int64)[:, None] * G + cg[None, :], mask=mask, other=0.0).to(tl.float32)
    u = f_a + tl.load(dt_bias + cg, mask=cg < G, other=0.0).to(tl.float32)[None, :]
    e = tl.exp(tl.load(A_log + cg // K, mask=cg < G, other=0.0).to(tl.float32))[None, :]
    if LOWER_BOUND:
        s = tl.sigmoid(e * u)
        slope = lower_bound * s * (1.0 - s) * e
        return lower_bound * s, slope, slope * u
    g = -e * (tl.maximum(u, 0.0) + log1p(tl.exp(-tl.abs(u))))
    return g, -e * tl.sigmoid(u), g


@jit
def _kda_gates_fwd_kernel(
    f,
    dt_bias,
    A_log,
    b,
    g,
    beta,
    N,
    lower_bound,
    HV: tl.constexpr,
    K: tl.constexpr,
    BR: tl.constexpr,
    GC: tl.constexpr,
    BHV: tl.constexpr,
    LOWER_BOUND: tl.constexpr,
):
    i_a, i_g = tl.program_id(0), tl.program_id(1)
    rows = i_a * BR + tl.arange(0, BR)
    cg = i_g * GC + tl.arange(0, GC)
    g_a, _, _ = gate_and_slopes(f, dt_bias, A_log, rows, cg, N, lower_bound, K, HV * K, LOWER_BOUND)
    g_mask = (rows < N)[:, None] & (cg < HV * K)[None, :]
    tl.store(g + rows.to(tl.int64)[:, None] * (HV * K) + cg[None, :], g_a, mask=g_mask)
    if i_g == 0:
        ch = tl.arange(0, BHV)
        b_mask = (rows < N)[:, None] & (ch < HV)[None, :]
        b_off = rows.to(tl.int64)[:, None] * HV + ch[None, :]
        b_a = tl.load(b + b_off, mask=b_mask, other=0.0).to(tl.float32)
        tl.store(beta + b_off, tl.sigmoid(b_a).to(beta.dtype.element_ty), mask=b_mask)


@jit
def _kda_gates_bwd_kernel(
    f,
    dt_bias,
    A_log,
    b,
    dg,
    dbeta,
    df,
    db,
    ddt_part,
    dA_part,
    N,
    lower_bound,
    HV: tl.constexpr,
    K: tl.constexpr,
    BR: tl.constexpr,
    GC: tl.constexpr,
    BHV: tl.constexpr,
    LOWER_BOUND: tl.constexpr,
):
    i_a, i_g = tl.program_id(0), tl.program_id(1)
    rows = i_a * BR + tl.arange(0, BR)
    cg = i_g * GC + tl.arange(0, GC)
    _, du_dg, dA_dg = gate_and_slopes(f, dt_bias, A_log, rows, cg, N, lower_bound, K, HV * K, LOWER_BOUND)
    g_mask = (rows < N)[:, None] & (cg < HV * K)[None, :]
    g_off = rows.to(tl.int64)[:, None] * (HV * K) + cg[None, :]
    dg_a = tl.load(dg + g_off, mask=g_mask, other=0.0).to(tl.float32)
    du = du_dg * dg_a
    tl.store(df + g_off, du.to(df.dtype.element_ty), mask=g_mask)
    p_off = i_a.to(tl.int64) * (HV * K) + cg
    tl.store(ddt_part + p_off, tl.sum(du, axis=0), mask=cg < HV * K)
    tl.store(dA_part + p_off, tl.sum(dA_dg * dg_a, axis=0), mask=cg < HV * K)
    if i_g == 0:
        ch = tl.arange(0, BHV)
        b_mask = (rows < N)[:, None] & (ch < HV)[None, :]
        b_off = rows.to(tl.int64)[:, None] * HV + ch[None, :]
        beta_a = tl.sigmoid(tl.load(b + b_off, mask=b_mask, other=0.0).to(tl.float32))
        dbeta_a = tl.load(dbeta + b_off, mask=b_mask, other=0.0).to(tl.float32)
        tl.store(db + b_off, (dbeta_a * beta_a * (1.0 - beta_a)).to(db.dtype.element_ty), mask=b_mask)


def _launch(kernel, N, HV, K, lower_bound, *tensors):
    grid = (triton.cdiv(N, BR), triton.cdiv(HV * K, GC))
    kernel[grid](
        *tensors, N, -1.0 if lower_bound is None else lower_bound, HV=HV, K=K, BR=BR, GC=GC,
        BHV=triton.next_power_of_2(HV), LOWER_BOUND=lower_bound is not None,
        num_warps=1 if interpreting() else 4,
    )  # fmt: skip


def kda_gates_fwd(f, b, A_log, dt_bias, lower_bound):
    """Launch the forward on contiguous f `[B, T, HV, K]`, b `[B, T, HV]`: `(g, beta)`; `lower_bound` None
    means the softplus gate."""
    B, T, HV, K = f.shape
    g = torch.empty(B, T, HV, K, dtype=torch.float32, device=f.device)
    beta = torch.empty_like(b)
    if B * T > 0:
        _launch(_kda_gates_fwd_kernel, B * T, HV, K, lower_bound, f, dt_bias, A_log, b, g, beta)
    return g, beta


def kda_gates_bwd(f, b, A_log, dt_bias, lower_bound, dg, dbeta):
    """Launch the backward on contiguous tensors: `(df, db, dA_log, ddt_bias)`, the last two float32."""
    B, T, HV, K = f.shape
    N = B * T
    df, db = torch.empty_like(f), torch.empty_like(b)
    NP = triton.cdiv(N, BR)
    ddt_part = torch.zeros(NP, HV * K, dtype=torch.float32, device=f.device)
    dA_part = torch.zeros_like(ddt_part)
    if N > 0:
        _launch(
            _kda_gates_bwd_kernel, N, HV, K, lower_bound, f, dt_bias, A_log, b, dg, dbeta, df, db, ddt_part,
            dA_part,
        )  # fmt: skip
    return df, db, dA_part.sum(0).view(HV, K).sum(1), ddt_part.sum(0).view(HV, K)


class KDAGatesFunction(torch.autograd.Function):
    """`fused_kda_gates` with gradients for f, b, A_log and dt_bias; saves the inputs, recomputes the rest."""

    @staticmethod
    def forward(ctx, f, b, A_log, dt_bias, lower_bound):
        f, b, A_log, dt_bias = (t.contiguous() for t in (f, b, A_log, dt_bias))
        ctx.save_for_backward(f, b, A_log, dt_bias)
        ctx.lower_bound = lower_bound
        return kda_gates_fwd(f, b, A_log, dt_bias, lower_bound)

    @staticmethod
    def backward(ctx, dg, dbeta):
        refuse_double_backward("fused_kda_gates")
        f, b, A_log, dt_bias = ctx.saved_tensors
        df, db, dA_log, ddt_bias = kda_gates_bwd(
            f, b, A_log, dt_bias, ctx.lower_bound, dg.contiguous(), dbeta.contiguous()
        )
        return df, db, dA_log.to(A_log.dtype), ddt_bias.to(dt_bias.dtype), None


def fused_kda_gates(
    f: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    gate: str = "softplus",
    lower_bound: float = -5.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The KDA layer's decay gate and write strength, `(g, beta)`, in Triton kernels (forward and backward).

    Args:
        f: the decay gate's pre-activation `[B, T, HV, K]`, float32, bfloat16 or float16.
        b: the write strength's pre-activation `[B, T, HV]`, float32, bfloat16 or float16.
        A_log: log rate (softplus gate) or log slope (lower-bound gate) per head `[HV]`.
        dt_bias: `[HV, K]`.
        gate: `"softplus"` (`g = -exp(A_log) softplus(f + dt_bias)`, `kda_edu.ops.gates.kda_gate`) or
            `"lower_bound"` (`g = lower_bound sigmoid(exp(A_log) (f + dt_bias))`,
            `kda_edu.ops.gates.kda_gate_lower_bound`).
        lower_bound: the lower-bound gate's most negative log decay, finite and < 0 (unused by softplus).

    Returns:
        `(g, beta)`: g `[B, T, HV, K]` float32, beta = sigmoid(b) `[B, T, HV]` in b's dtype, both computed in
        float32. Gradients reach f, b, A_log and dt_bias (first derivatives).
    """
    if not isinstance(f, torch.Tensor) or f.dim() != 4:
        raise ValueError(f"f must be a torch.Tensor of shape [B, T, HV, K], got {_shape(f)}")
    B, T, HV, K = f.shape
    expected = {"b": (b, (B, T, HV), "[B, T, HV]"), "A_log": (A_log, (HV,), "[HV]"),
                "dt_bias": (dt_bias, (HV, K), "[HV, K]")}  # fmt: skip
    for name, (t, shape, text) in expected.items():
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            raise ValueError(
                f"{name} must be a torch.Tensor of shape {text} = {list(shape)}, got {_shape(t)}"
            )
    for name, t in (("f", f), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        if t.dtype not in KERNEL_FLOATS or t.device != f.device:
            raise TypeError(
                f"{name} must be float32, bfloat16 or float16 on f's device {f.device} for the kernels, got "
                f"{t.dtype} on {t.device}; kda_edu.ops.gates takes float64"
            )
    if gate not in ("softplus", "lower_bound"):
        raise ValueError(f"gate must be 'softplus' or 'lower_bound', got {gate!r}")
    if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
        raise TypeError(f"lower_bound must be a number, got {type(lower_bound).__name__}")
    if not (abs(lower_bound) < float("inf") and lower_bound < 0):
        raise ValueError(f"lower_bound must be finite and < 0, got {lower_bound}")
    check_device(f, "f")
    return KDAGatesFunction.apply(f, b, A_log, dt_bias, float(lower_bound) if gate == "lower_bound" else None)


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
