"""The KDA layer's causal short convolution and SiLU in one Triton kernel each way.

Every channel c of x `[B, T, C]` has its own filter `weight[c] = (w_0, ..., w_{W-1})`:

    a_t = sum_i w_i x_{t - (W - 1) + i}          i = 0 .. W - 1, so w_{W-1} multiplies x_t itself
    y_t = SiLU(a_t) = a_t sigmoid(a_t)

with the `W - 1` inputs before the first one taken from `window` `[B, W - 1, C]` (zeros when there is none).
`kda_edu.layers.kda_layer.ShortConv` writes it as a sum of W shifted copies; in PyTorch that is W products and
W sums over the whole `[B, T, C]` tensor, each kept for the backward. Here one program owns a block of BT
positions and BC channels: it loads the W shifted tiles of x (neighbouring programs read the same rows, which
the cache serves), adds them up in float32 and writes y once. The backward recomputes `a` instead of saving it.

The backward, with `dA_t = dy_t SiLU'(a_t)` and `SiLU'(a) = s (1 + a (1 - s))`, `s = sigmoid(a)`:

    dx_s      = sum_k w_{W-1-k} dA_{s+k}                 k = 0 .. W - 1, the outputs that read input s
    dweight_i = sum_{b, t} dA_t x_{t - (W - 1) + i}      a reduction over B and T

A backward program owns a block of input positions s. For each k it recomputes `a` at the outputs s + k
(W loads of x each, from the cache), so no `dA` tensor goes through memory. The window's positions are the
W - 1 positions before 0, so the blocks start at s = -(W - 1) and the window's gradient comes out of the same
kernel. `dweight` is summed twice: inside a program over its rows (into one `[W, BC]` partial sum per
program), then by `torch.sum` over the programs; both orders are fixed, so the result is deterministic.

Packed sequences (`cu_seqlens`, B = 1): the kernels read each token's position in its own sequence, and a
term that would reach into the sequence before is dropped (`w_i` reads back `W - 1 - i` steps: only where the
position is at least that).
"""

import torch
import triton
import triton.language as tl

from kda_edu.backend import KERNEL_FLOATS
from kda_edu.kernels._backend import check_device, interpreting, jit
from kda_edu.kernels.chunk_bwd import refuse_double_backward
from kda_edu.ops.varlen import check_cu_seqlens, positions_in_sequence

__all__ = ["fused_short_conv"]

# Block sizes, chosen for registers (ptxas for sm_90, bf16, W = 4, 4 warps): the forward's 16 x 128 tile takes
# 80 registers; the backward holds about 2W - 1 shifted tiles of x and W of dy at once, 232 registers at
# 16 x 64 with no spill (16 x 128 spills).
BT = 16  # positions per block
BLOCKS_PER_PROGRAM = 4  # row blocks a backward program runs in turn, adding to one dweight partial sum


@jit
def load_inputs(x, window, i_b, s, cc, T, C, W: tl.constexpr, USE_WINDOW: tl.constexpr):
    """The inputs at positions s (a row vector, may be negative) and channels cc of batch row i_b, float32
    `[len(s), len(cc)]`: x where 0 <= s < T, the window where -(W - 1) <= s < 0, zeros elsewhere."""
    c_mask = cc < C
    in_x = (s >= 0) & (s < T)
    x_off = (i_b.to(tl.int64) * T + s)[:, None] * C + cc[None, :]
    tile = tl.load(x + x_off, mask=in_x[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
    if USE_WINDOW:
        in_w = (s < 0) & (s >= 1 - W)
        w_off = (i_b.to(tl.int64) * (W - 1) + s + W - 1)[:, None] * C + cc[None, :]
        tile += tl.load(window + w_off, mask=in_w[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
    return tile


@jit
def conv_preactivation(x, weight, window, pos, i_b, r, cc, T, C, W: tl.constexpr, USE_WINDOW: tl.constexpr,
                       IS_VARLEN: tl.constexpr):  # fmt: skip
    """`a_r = sum_i w_i x_{r - (W - 1) + i}` at output positions r, float32 `[len(r), len(cc)]` (a term that
    reaches back into the previous packed sequence is dropped)."""
    c_mask = cc < C
    if IS_VARLEN:
        pos_r = tl.load(pos + r, mask=(r >= 0) & (r < T), other=0)
    A = tl.zeros([r.shape[0], cc.shape[0]], dtype=tl.float32)
    for i in tl.static_range(W):
        w_c = tl.load(weight + cc * W + i, mask=c_mask, other=0.0).to(tl.float32)
        x_n = load_inputs(x, window, i_b, r - (W - 1 - i), cc, T, C, W, USE_WINDOW)
        if IS_VARLEN:
            x_n = tl.where((pos_r >= W - 1 - i)[:, None], x_n, 0.0)
        A += x_n * w_c[None, :]
    return A


@jit
def _short_conv_fwd_kernel(
    x,
    weight,
    window,
    pos,
    y,
    T,
    C,
    W: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = i_t * BT + tl.arange(0, BT)  # the program's output positions
    cc = i_c * BC + tl.arange(0, BC)
    A = conv_preactivation(x, weight, window, pos, i_b, rows, cc, T, C, W, USE_WINDOW, IS_VARLEN)
    y_off = (i_b.to(tl.int64) * T + rows)[:, None] * C + cc[None, :]
    o_mask = (rows < T)[:, None] & (cc < C)[None, :]
    tl.store(y + y_off, (A * tl.sigmoid(A)).to(y.dtype.element_ty), mask=o_mask)


@jit
def _short_conv_bwd_kernel(
    x,
    weight,
    window,
    pos,
    dy,
    dx,
    dwindow,
    dw_part,
    T,
    C,
    NP,
    W: tl.constexpr,
    BW: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    NB: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    i_p, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cc = i_c * BC + tl.arange(0, BC)
    c_mask = cc < C
    cw = tl.arange(0, BW)
    dW = tl.zeros([BW, BC], dtype=tl.float32)  # this program's part of dweight, transposed: [W, C]
    for n in range(NB):
        s = (i_p * NB + n) * BT + tl.arange(0, BT) - (W - 1)  # input positions; the window's are < 0
        dX = tl.zeros([BT, BC], dtype=tl.float32)
        for k in tl.static_range(W):  # output s + k reads input s through w_{W-1-k}
            r = s + k
            A = conv_preactivation(x, weight, window, pos, i_b, r, cc, T, C, W, USE_WINDOW, IS_VARLEN)
            r_ok = (r >= 0) & (r < T)
            dy_off = (i_b.to(tl.int64) * T + r)[:, None] * C + cc[None, :]
            dy_n = tl.load(dy + dy_off, mask=r_ok[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
            sig = tl.sigmoid(A)
            dA = dy_n * sig * (1.0 + A * (1.0 - sig))
            if k == 0:  # dA at the block's own positions: their share of dweight
                for i in tl.static_range(W):
                    x_n = load_inputs(x, window, i_b, s - (W - 1 - i), cc, T, C, W, USE_WINDOW)
                    if IS_VARLEN:
                        pos_s = tl.load(pos + s, mask=(s >= 0) & (s < T), other=0)
                        x_n = tl.where((pos_s >= W - 1 - i)[:, None], x_n, 0.0)
                    dW += tl.where(cw[:, None] == i, tl.sum(dA * x_n, axis=0)[None, :], 0.0)
            if IS_VARLEN:  # output r reads s only if r's sequence started at least k positions earlier
                pos_r = tl.load(pos + r, mask=r_ok, other=0)
                dA = tl.where((pos_r >= k)[:, None], dA, 0.0)
            w_c = tl.load(weight + cc * W + (W - 1 - k), mask=c_mask, other=0.0).to(tl.float32)
            dX += dA * w_c[None, :]
        x_off = (i_b.to(tl.int64) * T + s)[:, None] * C + cc[None, :]
        tl.store(dx + x_off, dX.to(dx.dtype.element_ty), mask=((s >= 0) & (s < T))[:, None] & c_mask[None, :])
        if USE_WINDOW:
            w_off = (i_b.to(tl.int64) * (W - 1) + s + W - 1)[:, None] * C + cc[None, :]
            in_w = (s < 0) & (s >= 1 - W)
            tl.store(dwindow + w_off, dX.to(dwindow.dtype.element_ty), mask=in_w[:, None] & c_mask[None, :])
    p_off = ((i_b.to(tl.int64) * NP + i_p) * W + cw)[:, None] * C + cc[None, :]
    tl.store(dw_part + p_off, dW, mask=(cw < W)[:, None] & c_mask[None, :])


def channel_block(C: int, widest: int) -> int:
    """BC, the channels of one program: up to `widest`, so that the tiles of BT x BC float32 stay in
    registers (the backward keeps about 2W - 1 shifted tiles of x, the forward W)."""
    return min(widest, triton.next_power_of_2(C))


def short_conv_fwd(x, weight, window, pos):
    """Launch the forward on contiguous inputs: y `[B, T, C]` in x's dtype."""
    B, T, C = x.shape
    W = weight.shape[1]
    y = torch.empty_like(x)
    if y.numel() == 0:
        return y
    BC = channel_block(C, 128)
    grid = (triton.cdiv(T, BT), triton.cdiv(C, BC), B)
    _short_conv_fwd_kernel[grid](
        x, weight, window, pos, y, T, C, W=W, BT=BT, BC=BC, USE_WINDOW=window is not None,
        IS_VARLEN=pos is not None, num_warps=1 if interpreting() else 4,
    )  # fmt: skip
    return y


def short_conv_bwd(x, weight, window, pos, dy):
    """Launch the backward on contiguous inputs: dx, dwindow (None without a window) and dweight `[C, W]`
    (float32; the caller casts)."""
    B, T, C = x.shape
    W = weight.shape[1]
    dx = torch.empty_like(x)
    dwindow = None if window is None else torch.empty_like(window)
    BC = channel_block(C, 64)
    NP = triton.cdiv(T + W - 1, BT * BLOCKS_PER_PROGRAM)  # programs along T, from position -(W - 1)
    dw_part = x.new_zeros(B, NP, W, C, dtype=torch.float32)
    if x.numel() > 0:
        grid = (NP, triton.cdiv(C, BC), B)
        _short_conv_bwd_kernel[grid](
            x, weight, window, pos, dy, dx, dwindow, dw_part, T, C, NP, W=W, BW=triton.next_power_of_2(W),
            BT=BT, BC=BC, NB=BLOCKS_PER_PROGRAM, USE_WINDOW=window is not None, IS_VARLEN=pos is not None,
            num_warps=1 if interpreting() else 4,
        )  # fmt: skip
    elif window is not None:  # no position: the window reaches no output
        dwindow.zero_()
    return dx, dwindow, dw_part.sum(dim=(0, 1)).t()


class ShortConvFunction(torch.autograd.Function):
    """`fused_short_conv`'s y with gradients for x, weight and window: saves the inputs, recomputes the
    pre-activation in the backward. First derivatives only."""

    @staticmethod
    def forward(ctx, x, weight, window, pos):
        x, weight = x.contiguous(), weight.contiguous()
        window = None if window is None else window.contiguous()
        ctx.save_for_backward(x, weight, window, pos)
        return short_conv_fwd(x, weight, window, pos)

    @staticmethod
    def backward(ctx, dy):
        refuse_double_backward("fused_short_conv")
        x, weight, window, pos = ctx.saved_tensors
        dx, dwindow, dweight = short_conv_bwd(x, weight, window, pos, dy.contiguous())
        return dx, dweight.to(weight.dtype), dwindow, None


def fused_short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    window: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution and SiLU, `y_t = SiLU(sum_i weight[:, i] x_{t - W + 1 + i})` per channel,
    as `kda_edu.layers.kda_layer.ShortConv` computes it, in Triton kernels (forward and backward).

    Args:
        x: `[B, T, C]`, float32, bfloat16 or float16 (any strides; computed in float32).
        weight: the filters `[C, W]`, W >= 1, a float dtype of the kernels.
        window: the `W - 1` inputs before x, `[B, W - 1, C]`; None means zeros (start of a sequence).
        cu_seqlens: None, or int32/int64 `[N + 1]` cumulative lengths of sequences packed along T (B = 1, no
            window): each starts from zeros, none sees the one before it.
        positions: instead of cu_seqlens, each token's position in its own sequence, int32/int64 `[T]` on x's
            device (`kda_edu.ops.varlen.positions_in_sequence` of checked lengths); B = 1, no window. For a
            caller that has checked the lengths already: checking cu_seqlens costs a device-to-host copy.

    Returns:
        `(y, window)`: y `[B, T, C]` in x's dtype, and the last `W - 1` inputs `[B, W - 1, C]` (with the
        window's in front when T < W - 1), the window of the next call. Gradients reach x, weight and
        window (first derivatives).
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"x must be a torch.Tensor of shape [B, T, C], got {_shape(x)}")
    if x.dtype not in KERNEL_FLOATS:
        raise TypeError(
            f"x [B, T, C] must be float32, bfloat16 or float16 for the kernels, got {x.dtype}; use "
            "kda_edu.layers.kda_layer.ShortConv for float64"
        )
    B, T, C = x.shape
    if (
        not isinstance(weight, torch.Tensor)
        or weight.dim() != 2
        or weight.shape[0] != C
        or weight.shape[1] < 1
    ):
        raise ValueError(
            f"weight must be a torch.Tensor of shape [C, W] = [{C}, W >= 1], got {_shape(weight)}"
        )
    if weight.dtype not in KERNEL_FLOATS or weight.device != x.device:
        raise TypeError(
            f"weight [C, W] must be float32, bfloat16 or float16 on x's device {x.device}, got "
            f"{weight.dtype} on {weight.device}"
        )
    W = weight.shape[1]
    if window is not None:
        if not isinstance(window, torch.Tensor) or tuple(window.shape) != (B, W - 1, C):
            raise ValueError(f"window must be a torch.Tensor of shape [B, W - 1, C] = {[B, W - 1, C]}, got "
                             f"{_shape(window)}")  # fmt: skip
        if window.device != x.device or window.dtype not in KERNEL_FLOATS:
            raise TypeError(
                f"window [B, W - 1, C] must be float32, bfloat16 or float16 on x's device {x.device}, got "
                f"{window.dtype} on {window.device}"
            )
        window = window.to(x.dtype)
    check_device(x, "x")
    pos = None
    if cu_seqlens is not None and positions is not None:
        raise ValueError("pass cu_seqlens or positions, not both")
    if (cu_seqlens is not None or positions is not None) and window is not None:
        name = "cu_seqlens" if cu_seqlens is not None else "positions"
        raise ValueError(f"{name} starts every sequence from zeros: pass window=None with it")
    if cu_seqlens is not None:
        cu = check_cu_seqlens(cu_seqlens, B, T, x.device)
        pos = positions_in_sequence(cu, x.device).to(torch.int32)
    elif positions is not None:
        if (
            not isinstance(positions, torch.Tensor)
            or positions.dtype not in (torch.int32, torch.int64)
            or tuple(positions.shape) != (T,)
            or positions.device != x.device
            or B != 1
        ):
            raise ValueError(
                f"positions must be an int32/int64 tensor [T] = [{T}] on {x.device} with B = 1, got "
                f"{_shape(positions)} with B = {B}"
            )
        pos = positions.to(torch.int32)
    y = ShortConvFunction.apply(x, weight, window if W > 1 else None, pos)
    keep = W - 1
    start = window if window is not None else x.new_zeros(B, keep, C)
    tail = torch.cat([start, x[:, max(T - keep, 0) :]], dim=1)  # at most 2 (W - 1) rows
    return y, tail[:, tail.shape[1] - keep :]


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
