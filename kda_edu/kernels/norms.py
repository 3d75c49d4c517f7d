"""The KDA layer's two row norms in Triton: the L2 norm of q and k, and the gated RMSNorm of the output.

Both normalise each row (one head's vector) of a `[..., D]` tensor on its own, so one program owns a block of
BR rows and the whole row (D padded to a power of two, BD): the reductions over D stay inside the program,
every row is read once and written once, in float32 arithmetic whatever the input dtype.

    L2 norm:       y = x r,                               r = 1 / sqrt(sum(x^2) + eps)
    gated RMSNorm: y = x r * weight * sigmoid(z),         r = 1 / sqrt(mean(x^2) + eps)

Overflow. A sum of squares of float32 numbers overflows once a row's norm passes about 1.8e19, and then r = 0
would zero the row. The kernels divide the row by c = max(max |x|, 1) first and normalise x / c with eps / c^2,
which is the same function: x / sqrt(sum(x^2) + eps) = (x / c) / sqrt(sum((x / c)^2) + eps / c^2), and the
sum of squares of x / c is at most D. (`kda_edu.ops.gates.overflow_scale` takes a power of two for c, which
keeps every rounding of the reference; the kernels take max |x| itself.)

Backward, with `xhat = x r` the normalised row:

    L2 norm:       dx = r (dy - y sum(dy y))
    gated RMSNorm: dz = dy xhat weight s (1 - s),  s = sigmoid(z);  dweight = sum over rows of dy xhat s;
                   dx = r (d - xhat mean(d xhat)),  d = dy weight s

The L2 norm saves its output and r per row (the KDA kernels keep q and k anyway); the gated RMSNorm saves x
and z and recomputes r. `dweight` is summed per program, then over the programs by `torch.sum`: deterministic.
"""

import torch
import triton
import triton.language as tl

from kda_edu.backend import KERNEL_FLOATS
from kda_edu.kernels._backend import check_device, interpreting, jit
from kda_edu.kernels.chunk_bwd import refuse_double_backward

__all__ = ["fused_gated_rms_norm", "fused_l2_normalize"]

BR = 16  # rows per program


@jit
def _l2_norm_fwd_kernel(
    x, y, rstd, N, H, x_stride, h_stride, eps, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr
):
    i_a = tl.program_id(0)
    rows = i_a * BR + tl.arange(0, BR)  # row n is x[n // H, n % H, :] of the `[M, H, K]` view
    ck = tl.arange(0, BK)
    r_mask = rows < N
    x_mask = r_mask[:, None] & (ck < K)[None, :]
    x_off = (rows // H).to(tl.int64) * x_stride + (rows % H) * h_stride
    x_a = tl.load(x + x_off[:, None] + ck[None, :], mask=x_mask, other=0.0).to(tl.float32)
    c = tl.maximum(tl.max(tl.abs(x_a), axis=1), 1.0)
    xs = x_a / c[:, None]
    r = tl.rsqrt(tl.sum(xs * xs, axis=1) + eps / c / c)  # r c, in fact: r of x / c
    y_off = rows.to(tl.int64)[:, None] * K + ck[None, :]
    tl.store(y + y_off, (xs * r[:, None]).to(y.dtype.element_ty), mask=x_mask)
    tl.store(rstd + rows, r / c, mask=r_mask)


@jit
def _l2_norm_bwd_kernel(y, rstd, dy, dx, N, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    i_a = tl.program_id(0)
    rows = i_a * BR + tl.arange(0, BR)
    ck = tl.arange(0, BK)
    r_mask = rows < N
    x_mask = r_mask[:, None] & (ck < K)[None, :]
    off = rows.to(tl.int64)[:, None] * K + ck[None, :]
    y_a = tl.load(y + off, mask=x_mask, other=0.0).to(tl.float32)
    dy_a = tl.load(dy + off, mask=x_mask, other=0.0).to(tl.float32)
    r = tl.load(rstd + rows, mask=r_mask, other=0.0)
    dx_a = r[:, None] * (dy_a - y_a * tl.sum(dy_a * y_a, axis=1)[:, None])
    tl.store(dx + off, dx_a.to(dx.dtype.element_ty), mask=x_mask)


@jit
def normalised_rows(x, rows, cd, N, eps, D: tl.constexpr):
    """Rows `rows` of x `[N, D]`, normalised by their root mean square: `(xhat, r)`, xhat = x r `[BR, BD]`
    and r `[BR]`, float32, without overflow (the module docstring's c)."""
    x_mask = (rows < N)[:, None] & (cd < D)[None, :]
    x_a = tl.load(x + rows.to(tl.int64)[:, None] * D + cd[None, :], mask=x_mask, other=0.0).to(tl.float32)
    c = tl.maximum(tl.max(tl.abs(x_a), axis=1), 1.0)
    xs = x_a / c[:, None]
    r = tl.rsqrt(tl.sum(xs * xs, axis=1) / D + eps / c / c)
    return xs * r[:, None], r / c


@jit
def _gated_rms_norm_fwd_kernel(x, z, weight, y, N, eps, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    i_a = tl.program_id(0)
    rows = i_a * BR + tl.arange(0, BR)
    cd = tl.arange(0, BD)
    xhat, _ = normalised_rows(x, rows, cd, N, eps, D)
    x_mask = (rows < N)[:, None] & (cd < D)[None, :]
    off = rows.to(tl.int64)[:, None] * D + cd[None, :]
    z_a = tl.load(z + off, mask=x_mask, other=0.0).to(tl.float32)
    w = tl.load(weight + cd, mask=cd < D, other=0.0).to(tl.float32)
    tl.store(y + off, (xhat * w[None, :] * tl.sigmoid(z_a)).to(y.dtype.element_ty), mask=x_mask)


@jit
def _gated_rms_norm_bwd_kernel(
    x, z, weight, dy, dx, dz, dw_part, N, eps, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr
):
    i_a = tl.program_id(0)
    rows = i_a * BR + tl.arange(0, BR)
    cd = tl.arange(0, BD)
    xhat, r = normalised_rows(x, rows, cd, N, eps, D)
    x_mask = (rows < N)[:, None] & (cd < D)[None, :]
    off = rows.to(tl.int64)[:, None] * D + cd[None, :]
    z_a = tl.load(z + off, mask=x_mask, other=0.0).to(tl.float32)
    dy_a = tl.load(dy + off, mask=x_mask, other=0.0).to(tl.float32)
    w = tl.load(weight + cd, mask=cd < D, other=0.0).to(tl.float32)
    s = tl.sigmoid(z_a)
    tl.store(dz + off, (dy_a * xhat * w[None, :] * s * (1.0 - s)).to(dz.dtype.element_ty), mask=x_mask)
    tl.store(dw_part + i_a.to(tl.int64) * D + cd, tl.sum(dy_a * xhat * s, axis=0), mask=cd < D)
    d = dy_a * w[None, :] * s
    dx_a = r[:, None] * (d - xhat * (tl.sum(d * xhat, axis=1) / D)[:, None])
    tl.store(dx + off, dx_a.to(dx.dtype.element_ty), mask=x_mask)


def _warps() -> int:
    return 1 if interpreting() else 4


def l2_norm_fwd(x, eps):
    """Launch the L2 norm's forward: `(y, rstd)`, y contiguous in x's shape and dtype, rstd `[rows]` float32.
    x is read through an `[M, H, K]` view (a slice of a wider tensor stays in place when it has one)."""
    x3 = x.reshape(-1, x.shape[-2] if x.dim() > 1 else 1, x.shape[-1])
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    M, H, K = x3.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(M * H, dtype=torch.float32, device=x.device)
    if y.numel() > 0:
        BK = triton.next_power_of_2(K)
        _l2_norm_fwd_kernel[(triton.cdiv(M * H, BR),)](
            x3, y, rstd, M * H, H, x3.stride(0), x3.stride(1), eps, K=K, BR=BR, BK=BK, num_warps=_warps()
        )
    return y, rstd


def l2_norm_bwd(y, rstd, dy):
    """Launch the L2 norm's backward on contiguous y and dy: dx, contiguous in y's shape and dtype."""
    dx = torch.empty_like(y)
    K = y.shape[-1]
    if y.numel() > 0:
        N = y.numel() // K
        BK = triton.next_power_of_2(K)
        _l2_norm_bwd_kernel[(triton.cdiv(N, BR),)](y, rstd, dy, dx, N, K=K, BR=BR, BK=BK, num_warps=_warps())
    return dx


def gated_rms_norm_fwd(x, z, weight, eps):
    """Launch the gated RMSNorm's forward on contiguous rows x, z `[N, D]`: y `[N, D]` in z's dtype."""
    N, D = x.shape
    y = torch.empty_like(z)
    if N > 0:
        BD = triton.next_power_of_2(D)
        _gated_rms_norm_fwd_kernel[(triton.cdiv(N, BR),)](
            x, z, weight, y, N, eps, D=D, BR=BR, BD=BD, num_warps=_warps()
        )
    return y


def gated_rms_norm_bwd(x, z, weight, dy, eps):
    """Launch the gated RMSNorm's backward on contiguous rows `[N, D]`: dx, dz and dweight (float32)."""
    N, D = x.shape
    dx, dz = torch.empty_like(x), torch.empty_like(z)
    NP = triton.cdiv(N, BR)
    dw_part = torch.zeros(NP, D, dtype=torch.float32, device=x.device)
    if N > 0:
        BD = triton.next_power_of_2(D)
        _gated_rms_norm_bwd_kernel[(NP,)](
            x, z, weight, dy, dx, dz, dw_part, N, eps, D=D, BR=BR, BD=BD, num_warps=_warps()
        )
    return dx, dz, dw_part.sum(0)


class L2NormFunction(torch.autograd.Function):
    """`fused_l2_normalize` with its gradient; saves the output and r per row."""

    @staticmethod
    def forward(ctx, x, eps):
        y, rstd = l2_norm_fwd(x, eps)
        ctx.save_for_backward(y, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_double_backward("fused_l2_normalize")
        y, rstd = ctx.saved_tensors
        return l2_norm_bwd(y, rstd, dy.contiguous()), None


class GatedRMSNormFunction(torch.autograd.Function):
    """`fused_gated_rms_norm` with gradients for x, z and weight; saves x and z, recomputes the norm."""

    @staticmethod
    def forward(ctx, x, z, weight, eps):
        D = x.shape[-1]
        x2, z2 = x.reshape(-1, D).contiguous(), z.reshape(-1, D).contiguous()
        weight = weight.contiguous()
        ctx.save_for_backward(x2, z2, weight)
        ctx.eps, ctx.shapes = eps, (x.shape, z.shape)
        return gated_rms_norm_fwd(x2, z2, weight, eps).view(z.shape)

    @staticmethod
    def backward(ctx, dy):
        refuse_double_backward("fused_gated_rms_norm")
        x2, z2, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, x2.shape[1]).contiguous()
        dx, dz, dweight = gated_rms_norm_bwd(x2, z2, weight, dy2, ctx.eps)
        x_shape, z_shape = ctx.shapes
        return dx.view(x_shape), dz.view(z_shape), dweight.to(weight.dtype), None


def _check_rows(name: str, x, shape_text: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a torch.Tensor of shape {shape_text}, got {got}")
    if x.dtype not in KERNEL_FLOATS:
        raise TypeError(
            f"{name} {shape_text} must be float32, bfloat16 or float16 for the kernels, got {x.dtype}; the "
            "PyTorch forms (kda_edu.ops.gates.l2_normalize, kda_edu.layers.kda_layer.GatedRMSNorm) take float64"
        )


def _check_eps(eps) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a number > 0, got {eps!r}")


def fused_l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(sum(x^2) + eps)` along the last dim, as `kda_edu.ops.gates.l2_normalize`, in Triton kernels
    (forward and backward), without overflow for any finite x.

    Args:
        x: `[..., K]` (q or k, `[B, T, H, K]`; a slice of a wider tensor is read in place when its rows are
            evenly spaced in the last two dims), float32, bfloat16 or float16.
        eps: > 0, added under the square root so a zero vector stays zero.

    Returns:
        a new contiguous tensor of x's shape and dtype, computed in float32. Differentiable (first
        derivatives).
    """
    _check_rows("x", x, "[..., K]")
    _check_eps(eps)
    check_device(x, "x")
    return L2NormFunction.apply(x, float(eps))


def fused_gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`RMSNorm(x) * weight * sigmoid(gate)` over the last dim, as `kda_edu.layers.kda_layer.GatedRMSNorm`,
    in Triton kernels (forward and backward), without overflow for any finite x.

    Args:
        x: `[..., D]` (the KDA output, `[B, T, HV, V]`), float32, bfloat16 or float16.
        gate: the gate's pre-activation, x's shape, float32, bfloat16 or float16.
        weight: `[D]`.
        eps: > 0, added to the mean square.

    Returns:
        `[..., D]` in gate's dtype, computed in float32. Gradients reach x, gate and weight (first derivatives).
    """
    _check_rows("x", x, "[..., D]")
    _check_rows("gate", gate, "[..., D]")
    _check_rows("weight", weight, "[D]")
    if gate.shape != x.shape:
        raise ValueError(f"gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    if tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"weight must have shape [D] = [{x.shape[-1]}], got {tuple(weight.shape)}")
    if gate.device != x.device or weight.device != x.device:
        raise ValueError(
            f"gate and weight must be on x's device {x.device}, got {gate.device} and {weight.device}"
        )
    _check_eps(eps)
    check_device(x, "x")
    return GatedRMSNormFunction.apply(x, gate, weight, float(eps))
