"""How a KDA layer turns projections into the recurrence's inputs: decay gates, beta, normalised q and k.

The recurrence needs `g <= 0` (a log-space decay, so `exp(g)` lies in (0, 1]), `beta` in [0, 1] and, for the
delta rule to be stable, keys of unit length. Each function here builds one of them from an unconstrained
projection `x`:

- `kda_gate`:             g = -exp(A_log) * softplus(x + dt_bias)                  in (-inf, 0)
- `kda_gate_lower_bound`: g = lower_bound * sigmoid(exp(A_log) * (x + dt_bias))    in (lower_bound, 0)
- `beta_sigmoid`:         beta = sigmoid(x)                                       in (0, 1)
- `l2_normalize`:         x / sqrt(sum(x^2) + eps)                                length ~1

The first is the Mamba-2 style decay (one learned rate `exp(A_log)` per head times a softplus step size).
The second bounds each step's decay below, which keeps every `exp(g)` at least `exp(lower_bound)`; the
kernels rely on that bound, the references in this package do not need it.
"""

import math

import torch
import torch.nn.functional as F

from kda_edu.ops._checks import FLOAT_DTYPES, compute_dtype


def _check_gate_inputs(x: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"x must be a torch.Tensor of shape [B, T, HV, K] or [B, T, HV], got {type(x).__name__}"
        )
    if x.dim() not in (3, 4):
        raise ValueError(f"x must have rank 4 ([B, T, HV, K]) or 3 ([B, T, HV]), got {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x of shape [B, T, HV, ...] must have a floating dtype, got {x.dtype}")
    _check_param("A_log", A_log, "[HV]", (x.shape[2],), x.device)
    if dt_bias is not None:
        _check_param("dt_bias", dt_bias, "[HV, K]" if x.dim() == 4 else "[HV]", tuple(x.shape[2:]), x.device)


def _check_param(name: str, t: torch.Tensor, expected: str, shape: tuple, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {expected}, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {expected} = {shape}, got {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} of shape {expected} must have a floating dtype, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on the same device as x ({device}), got {t.device}")


def _rate_and_input(x: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None):
    """`exp(A_log)` shaped to broadcast over x, and `x + dt_bias`, both in the compute dtype."""
    dtype = compute_dtype(x.dtype)
    rate = A_log.to(dtype).exp().reshape(-1, *([1] * (x.dim() - 3)))  # [HV] or [HV, 1]
    x = x.to(dtype)
    return rate, (x if dt_bias is None else x + dt_bias.to(dtype))


def kda_gate(x: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The unbounded decay gate `g = -exp(A_log) * softplus(x + dt_bias)`.

    Args:
        x: gate projection `[B, T, HV, K]` (KDA, one decay per channel) or `[B, T, HV]` (Gated DeltaNet,
            one decay per head), floating dtype.
        A_log: log decay rate per head `[HV]`.
        dt_bias: optional bias `[HV, K]` (or `[HV]` for a rank-3 x).

    Returns:
        g with x's shape, in float32 (float64 for float64 x), every value < 0 (or 0 where softplus
        underflows).
    """
    _check_gate_inputs(x, A_log, dt_bias)
    rate, x = _rate_and_input(x, A_log, dt_bias)
    return -rate * F.softplus(x)


def kda_gate_lower_bound(
    x: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None, lower_bound: float = -5.0
) -> torch.Tensor:
    """The bounded decay gate `g = lower_bound * sigmoid(exp(A_log) * (x + dt_bias))`.

    Each step then decays a channel by at least `exp(lower_bound)` and at most 1, so `k` steps decay it by
    at least `exp(k * lower_bound)`.

    Args:
        x: gate projection `[B, T, HV, K]` or `[B, T, HV]`, floating dtype.
        A_log: log slope per head `[HV]`.
        dt_bias: optional bias `[HV, K]` (or `[HV]` for a rank-3 x).
        lower_bound: the most negative log decay per step, a finite number < 0.

    Returns:
        g with x's shape, in float32 (float64 for float64 x), values in `[lower_bound, 0]`.
    """
    _check_gate_inputs(x, A_log, dt_bias)
    if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
        raise TypeError(f"lower_bound must be a number, got {type(lower_bound).__name__}")
    if not (math.isfinite(lower_bound) and lower_bound < 0):
        raise ValueError(f"lower_bound must be finite and < 0, got {lower_bound}")
    rate, x = _rate_and_input(x, A_log, dt_bias)
    return lower_bound * torch.sigmoid(rate * x)


def beta_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """The write strength `beta = sigmoid(x)`.

    Args:
        x: beta projection `[B, T, HV]`, floating dtype.

    Returns:
        beta `[B, T, HV]` in x's dtype, values in (0, 1) (exactly 0 or 1 only where sigmoid saturates).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor of shape [B, T, HV], got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"x must have rank 3, shape [B, T, HV], got {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x of shape [B, T, HV] must have a floating dtype, got {x.dtype}")
    return torch.sigmoid(x.to(compute_dtype(x.dtype))).to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Scale each vector along the last dim to unit length: `x / sqrt(sum(x^2) + eps)`.

    Used on q and k: with `|k| = 1` and `beta` in [0, 1], the delta-rule transition `I - beta k k^T` has
    eigenvalues in [0, 1], so the state cannot grow.

    Args:
        x: `[..., K]`, floating dtype (q or k, `[B, T, H, K]`).
        eps: added under the square root so a zero vector stays zero; > 0.

    Returns:
        `[..., K]` in x's dtype, computed in float32 (float64 for float64 x).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor of shape [..., K], got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension, shape [..., K], got a scalar")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x of shape [..., K] must have a floating dtype, got {x.dtype}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a number > 0, got {eps!r}")
    y = x.to(compute_dtype(x.dtype))
    # sum(y^2) overflows for norms above ~1.8e19 in float32 (rsqrt(inf) = 0 would zero the vector), so
    # y is first divided by a power of two c (`overflow_scale`):
    # y / sqrt(sum(y^2) + eps) = (y / c) / sqrt(sum((y / c)^2) + eps / c^2).
    c = overflow_scale(y)
    y = y / c
    return (y * torch.rsqrt((y * y).sum(dim=-1, keepdim=True) + eps / (c * c))).to(x.dtype)


def overflow_scale(y: torch.Tensor) -> torch.Tensor:
    """`c [..., 1]`, a power of two with max |y| / 2 < c <= max |y| over the last dim (c = 1 where max |y| < 2),
    constant for autograd: dividing by it keeps a sum of squares of y from overflowing (it is at most K).

    Because c is a power of two, every rounding of a computation on y / c is the unscaled one shifted by the
    exponent: normalising y / c with eps / c^2 in place of eps gives the same bits as normalising y wherever
    the unscaled sum did not overflow, and eps / c^2 <= eps cannot overflow.
    """
    peak = y.detach().abs().amax(dim=-1, keepdim=True).clamp_min(1.0)
    return torch.ldexp(torch.ones_like(peak), torch.frexp(peak).exponent - 1)
