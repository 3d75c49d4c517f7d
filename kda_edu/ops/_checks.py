"""Input validation shared by every public function of kda_edu.

Every model in the book, from softmax attention to KDA, reads the same layout:

    q, k           [B, T, H, K]    queries and keys, H query/key heads
    v              [B, T, HV, V]   values, HV value heads, HV a multiple of H (grouped values:
                                   value head j reads query/key head j // (HV // H))
    g              [B, T, HV, K]   KDA: one log-space decay per value head, step and key channel, <= 0
                   [B, T, HV]      Gated DeltaNet: one log-space decay per value head and step, <= 0
    beta           [B, T, HV]      delta-rule write strength in [0, 1]
    initial_state  [B, HV, K, V]   float32, or float64 when q, k, v are float64

`check_kda_inputs` checks all of it once, at the public boundary, and raises a `TypeError` (wrong type or
dtype) or `ValueError` (wrong rank, shape, device or value) whose message names the argument and what was
expected. The functions behind the boundary trust their inputs.

Some checks need tensor values on the host: on a GPU each is a synchronisation, which the decoding paths
(`fused_recurrent_kda`'s state indices, `ServingDecoder.step`) cannot afford per token. Those run when the
tensors are on the CPU, where reading a value costs nothing, and on a GPU only when the environment variable
`KDA_EDU_DEBUG=1` is set (`value_checks_enabled`).
"""

import math
import os
from numbers import Real

import numpy as np
import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the reference implementations compute and keep their state in.

    float64 inputs are computed in float64 (so the references can be checked to ~1e-12); everything else is
    computed in float32, as the recurrent state always is.
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


# A per-step log decay at or below this is a reset: exp of it is exactly 0 in the compute dtype (float32:
# exp(-105) = 2.5e-46 rounds to 0, below half the smallest subnormal, 1.4e-45; float64: exp(-750), below
# 4.9e-324). The chunked forms clamp each step's gate here before the cumulative sum within a chunk, which
# changes no decay (exp of the clamped and of the original gate are both 0, and so is every product with
# them) but keeps the sums finite (g = -inf would give -inf - (-inf) = NaN) and small (gates of -1000 make the
# float32 sums so large that their rounding, about 1e-7 of the sum, shows in the decays that do not cross the
# reset).
GATE_FLOOR = {torch.float32: -105.0, torch.float64: -750.0}


def clamp_gates(g: torch.Tensor) -> torch.Tensor:
    """g (in a compute dtype, float32 or float64) with every value below `GATE_FLOOR` raised to it; NaN stays."""
    return g.clamp_min(GATE_FLOOR[g.dtype])


def value_checks_enabled(device: torch.device) -> bool:
    """Whether the value checks of the hot decoding paths run for tensors on `device`: on the CPU always (a
    value is read there without waiting for anything), elsewhere only with `KDA_EDU_DEBUG=1` in the
    environment (each check then costs a host synchronisation)."""
    return device.type == "cpu" or os.environ.get("KDA_EDU_DEBUG", "0") not in ("", "0")


def under_vmap() -> bool:
    """Whether the caller runs inside `torch.func.vmap` (at any depth of torch.func's transforms).

    Under vmap a tensor stands for a whole stack of tensors (one per batched copy), and reading a value of it on
    the host (`bool(t.all())`, `t.item()`) is refused: there is no one value to read. The value checks are then
    skipped, as during a CUDA graph capture; the shape, dtype and device checks, which read only metadata, stay.
    """
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return any(i.key() == TransformType.Vmap for i in retrieve_all_functorch_interpreters())


def format_value(x: torch.Tensor) -> str:
    """A one-element tensor's value with the fewest digits that tell it apart from every other value of its
    dtype: 1.0000001 for the float32 just above 1 (which `:.4g` would print as 1), 0.1 for float32 0.1."""
    value = x.item()
    if x.dtype == torch.float64:
        return repr(value)
    return str(
        np.float16(value) if x.dtype == torch.float16 else np.float32(value)
    )  # bf16 values are float32's


def _require_tensor(name: str, x, expected: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {expected}, got {type(x).__name__}")


def _require_float(name: str, x: torch.Tensor, expected: str) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} of shape {expected} must have a floating dtype, got {x.dtype}")


def _require_shape(name: str, x: torch.Tensor, expected: str, shape: tuple) -> None:
    if x.dim() != len(shape):
        raise ValueError(
            f"{name} must have rank {len(shape)}, shape {expected} = {shape}, got {tuple(x.shape)}"
        )
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {expected} = {shape}, got {tuple(x.shape)}")


def _require_device(name: str, x: torch.Tensor, expected: str, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"{name} of shape {expected} must be on q's device ({device}), got {x.device}")


def check_floating_tensor(name: str, x, expected: str, *, nonempty: bool = False) -> None:
    """Check that `x` is a floating `torch.Tensor` of the rank `expected` names, for functions outside the
    KDA layout.

    Args:
        name: the argument's name, for the messages.
        x: the argument.
        expected: its shape in words, one name per dimension, as the docstrings write it: `"[B, T, H, D]"`
            asks for rank 4.
        nonempty: also refuse a tensor with a dimension of size 0.

    Raises:
        TypeError: x is not a tensor, or not of a floating dtype.
        ValueError: x has another rank (or, with `nonempty`, an empty dimension).
    """
    rank = len(expected.strip("[]").split(","))
    _require_tensor(name, x, expected)
    if x.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}, shape {expected}, got {tuple(x.shape)}")
    if nonempty and x.numel() == 0:
        raise ValueError(f"{name} must have no empty dimension in {expected}, got {tuple(x.shape)}")
    _require_float(name, x, expected)


def check_absorbed_attention_inputs(q, cache, slots, lengths, value_dim: int) -> None:
    """The arguments of absorbed MLA attention over a pool of cached rows (the kernel
    `kda_edu.kernels.mla_decode.mla_absorbed_attention` and its PyTorch reference): q a floating non-empty
    `[B, T, H, D]`, cache a floating `[P, L_max, D]` on q's device with q's D, `1 <= value_dim <= D`, slots and
    lengths int32/int64 `[B]` on q's device. Raises TypeError or ValueError naming the argument."""
    check_floating_tensor("q", q, "[B, T, H, D]", nonempty=True)
    check_floating_tensor("cache", cache, "[P, L_max, D]")
    B, D = q.shape[0], q.shape[3]
    if cache.shape[2] != D or not 1 <= value_dim <= D:
        raise ValueError(
            f"cache must be [P, L_max, D] with q's D = {D} and 1 <= value_dim <= D, got "
            f"{tuple(cache.shape)}, value_dim = {value_dim}"
        )
    if cache.device != q.device:
        raise ValueError(f"cache [P, L_max, D] must be on q's device ({q.device}), got {cache.device}")
    for name, t in (("slots", slots), ("lengths", lengths)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape [B], got {type(t).__name__}")
        if t.dtype not in (torch.int32, torch.int64) or tuple(t.shape) != (B,) or t.device != q.device:
            raise ValueError(
                f"{name} must be int32/int64 [B] = [{B}] on {q.device}, got {tuple(t.shape)} {t.dtype} {t.device}"
            )


def check_block_table(q, pool, block_table, lengths, value_dim: int) -> None:
    """The arguments of absorbed MLA attention read through a block table
    (`kda_edu.kernels.mla_decode.paged_mla_absorbed_attention`): q a floating non-empty `[B, T, H, D]`, pool a
    floating `[N, block_size, D]` on q's device with q's D, `1 <= value_dim <= D`, block_table int32/int64
    `[B, max_blocks]` (max_blocks >= 1) and lengths int32/int64 `[B]`, both on q's device. Raises TypeError or
    ValueError naming the argument."""
    check_floating_tensor("q", q, "[B, T, H, D]", nonempty=True)
    check_floating_tensor("pool", pool, "[N, block_size, D]")
    B, D = q.shape[0], q.shape[3]
    if pool.shape[2] != D or pool.shape[1] < 1 or not 1 <= value_dim <= D:
        raise ValueError(
            f"pool must be [N, block_size, D] with q's D = {D}, block_size >= 1 and 1 <= value_dim <= D, got "
            f"{tuple(pool.shape)}, value_dim = {value_dim}"
        )
    if pool.device != q.device:
        raise ValueError(f"pool [N, block_size, D] must be on q's device ({q.device}), got {pool.device}")
    for name, t, shape in (("block_table", block_table, "[B, max_blocks]"), ("lengths", lengths, "[B]")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape {shape}, got {type(t).__name__}")
        rank = 2 if name == "block_table" else 1
        if (
            t.dtype not in (torch.int32, torch.int64)
            or t.dim() != rank
            or t.shape[0] != B
            or (rank == 2 and t.shape[1] < 1)
            or t.device != q.device
        ):
            raise ValueError(
                f"{name} must be int32/int64 {shape} with B = {B} on {q.device}, got "
                f"{tuple(t.shape)} {t.dtype} {t.device}"
            )


def check_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    initial_state: torch.Tensor | None = None,
    *,
    gate: str | None = "channel",
    with_beta: bool = True,
    check_values: bool = True,
    state_name: str = "initial_state",
) -> tuple[int, int, int, int, int, int]:
    """Validate the inputs of a KDA-family function and return its sizes.

    Args:
        q: queries `[B, T, H, K]`, floating dtype.
        k: keys `[B, T, H, K]`, same dtype as q.
        v: values `[B, T, HV, V]`, same dtype as q, `HV % H == 0`.
        g: log-space decay, any floating dtype, values `<= 0`. Its shape depends on `gate`:
            `"channel"` (KDA) `[B, T, HV, K]`; `"head"` (Gated DeltaNet) `[B, T, HV]`; `None` (models without
            decay) `g` must be None.
        beta: write strength `[B, T, HV]`, any floating dtype, values in `[0, 1]`; must be None when
            `with_beta` is False.
        initial_state: optional state `[B, HV, K, V]` in `compute_dtype(q.dtype)`: float32, or float64 when q
            is float64. States are never kept in half precision.
        gate: which shape `g` has, see above.
        with_beta: whether the model has a `beta` input.
        check_values: check `g <= 0` and `0 <= beta <= 1`. This costs one reduction per tensor and, on a GPU,
            a device-to-host sync; callers on a hot path (kernel launchers) may pass False and keep the shape,
            dtype and device checks, which read only metadata.
        state_name: the argument name used in messages about `initial_state` (`kda_step` calls it `state`).

    Returns:
        `(B, T, H, HV, K, V)`.

    Raises:
        TypeError: an input is not a tensor, or has the wrong dtype.
        ValueError: an input has the wrong rank, shape or device, or `g`/`beta` are out of range.
    """
    _require_tensor("q", q, "[B, T, H, K]")
    if q.dim() != 4:
        raise ValueError(f"q must have rank 4, shape [B, T, H, K], got {tuple(q.shape)}")
    if q.numel() == 0:
        raise ValueError(f"q must have no empty dimension in [B, T, H, K], got {tuple(q.shape)}")
    _require_float("q", q, "[B, T, H, K]")
    B, T, H, K = q.shape
    device = q.device

    _require_tensor("k", k, "[B, T, H, K]")
    _require_shape("k", k, "[B, T, H, K]", (B, T, H, K))
    if k.dtype != q.dtype:
        raise TypeError(f"k of shape [B, T, H, K] must have q's dtype ({q.dtype}), got {k.dtype}")
    _require_device("k", k, "[B, T, H, K]", device)

    _require_tensor("v", v, "[B, T, HV, V]")
    if v.dim() != 4:
        raise ValueError(f"v must have rank 4, shape [B, T, HV, V], got {tuple(v.shape)}")
    if v.dtype != q.dtype:
        raise TypeError(f"v of shape [B, T, HV, V] must have q's dtype ({q.dtype}), got {v.dtype}")
    _require_device("v", v, "[B, T, HV, V]", device)
    HV, V = v.shape[2], v.shape[3]
    if tuple(v.shape[:2]) != (B, T) or HV == 0 or V == 0 or HV % H != 0:
        raise ValueError(
            f"v must have shape [B, T, HV, V] = ({B}, {T}, HV, V) with HV a positive multiple of H = {H}, "
            f"got {tuple(v.shape)}"
        )

    if gate is None:
        if g is not None:
            raise TypeError("g must be None: this model has no decay gate")
    else:
        if gate not in ("channel", "head"):
            raise ValueError(f"gate must be 'channel', 'head' or None, got {gate!r}")
        expected = {"channel": ("[B, T, HV, K]", (B, T, HV, K)), "head": ("[B, T, HV]", (B, T, HV))}[gate]
        _require_tensor("g", g, expected[0])
        _require_shape("g", g, *expected)
        _require_float("g", g, expected[0])
        _require_device("g", g, expected[0], device)

    if not with_beta:
        if beta is not None:
            raise TypeError("beta must be None: this model has no write strength")
    else:
        _require_tensor("beta", beta, "[B, T, HV]")
        _require_shape("beta", beta, "[B, T, HV]", (B, T, HV))
        _require_float("beta", beta, "[B, T, HV]")
        _require_device("beta", beta, "[B, T, HV]", device)

    if initial_state is not None:
        _require_tensor(state_name, initial_state, "[B, HV, K, V]")
        _require_shape(state_name, initial_state, "[B, HV, K, V]", (B, HV, K, V))
        state_dtype = compute_dtype(q.dtype)
        if initial_state.dtype != state_dtype:
            raise TypeError(
                f"{state_name} of shape [B, HV, K, V] must be {state_dtype} for {q.dtype} inputs, "
                f"got {initial_state.dtype}"
            )
        _require_device(state_name, initial_state, "[B, HV, K, V]", device)

    # The value checks read a reduction back to the host, which is not allowed while a CUDA graph is being
    # captured (the capture fails with "operation not permitted when stream is capturing"): a captured step
    # keeps the shape, dtype and device checks, and its inputs were checked by the ordinary step before it.
    # Under torch.func.vmap (the batched trainer of chapter 12 trains several models at once) there is no one
    # value to read either (`under_vmap`).
    if check_values and not (q.is_cuda and torch.cuda.is_current_stream_capturing()) and not under_vmap():
        # Written as "all values inside the range" so that NaN, which fails every comparison, is caught too.
        if g is not None and not bool((g <= 0).all()):
            raise ValueError(
                f"g of shape {expected[0]} must be <= 0 (a log-space decay) and not NaN, got max {g.max():.4g}"
            )
        if beta is not None and not bool(((beta >= 0) & (beta <= 1)).all()):
            lo, hi = torch.aminmax(beta)
            raise ValueError(
                "beta of shape [B, T, HV] must lie in [0, 1] and not be NaN, got values in "
                f"[{format_value(lo)}, {format_value(hi)}]"
            )

    return B, T, H, HV, K, V


def resolve_scale(scale: float | None, K: int) -> float:
    """The query scale: `K ** -0.5` when `scale` is None, else `scale` as a float (must be finite and > 0)."""
    if scale is None:
        return K**-0.5
    if isinstance(scale, bool) or not isinstance(scale, Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be finite and > 0, got {scale}")
    return float(scale)


def check_chunk_size(chunk_size: int) -> int:
    """Return `chunk_size` after checking it is a positive int."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return chunk_size
