"""Exercises of chapter 10 (the KDA layer): checkers and worked solutions.

Each `check_*` runs the reader's function on a few random inputs and compares it with what the library's
layer does (`ShortConv`, `kda_gate_lower_bound`, a live `KDACache`); each `solution_*` is the worked solution
the book shows.
"""

import torch
import torch.nn.functional as F

from kda_edu.exercises import expect, passed, raised
from kda_edu.layers.kda_layer import KDAConfig, KDALayer, ShortConv
from kda_edu.ops.gates import kda_gate_lower_bound


def _call(fn, *args):
    try:
        return fn(*args)
    except (TypeError, ValueError, RuntimeError, IndexError) as error:
        raise raised(error) from None


# Exercise 1: one decoding step of the short convolution.


def solution_conv_step(window: torch.Tensor, x_t: torch.Tensor, weight: torch.Tensor):
    """`(y_t, new_window)` for one token: window `[B, W - 1, C]`, x_t `[B, C]`, weight `[C, W]`.

    The output sees the W - 1 inputs before x_t and x_t itself, oldest first, each times its tap; the new
    window drops the oldest input and appends x_t.
    """
    taps = torch.cat([window, x_t[:, None]], dim=1)  # [B, W, C], oldest first
    y = F.silu((taps * weight.T).sum(dim=1))
    return y, taps[:, 1:]


def check_conv_step(fn) -> str:
    """`fn(window, x_t, weight) -> (y_t, new_window)` must continue a `ShortConv` token by token."""
    gen = torch.Generator().manual_seed(10)
    for B, C, W, T in ((1, 3, 2, 5), (2, 8, 4, 9), (3, 5, 6, 12)):
        conv = ShortConv(C, W).double()
        with torch.no_grad():
            conv.weight.copy_(torch.randn(C, W, generator=gen, dtype=torch.float64))
        x = torch.randn(B, T, C, generator=gen, dtype=torch.float64)
        with torch.no_grad():
            want, _ = conv(x)
        window = torch.zeros(B, W - 1, C, dtype=torch.float64)
        for t in range(T):
            out = _call(fn, window.clone(), x[:, t].clone(), conv.weight.detach().clone())
            expect(
                isinstance(out, tuple) and len(out) == 2,
                "return a pair (y_t, new_window)",
            )
            y, window = out
            expect(
                tuple(y.shape) == (B, C) and tuple(window.shape) == (B, W - 1, C),
                f"y_t must have shape {(B, C)} and the window {(B, W - 1, C)}, got {tuple(y.shape)} and "
                f"{tuple(window.shape)}",
            )
            error = (y - want[:, t]).abs().max().item()
            expect(
                error < 1e-10,
                f"step {t} (W = {W}): y_t off by {error:.3g}. Hint: weight[:, 0] takes the oldest input; "
                "SiLU after the sum.",
            )
    return passed("Decoding needs only the last W - 1 inputs: the convolution's whole cache.")


# Exercise 2: the lower-bounded gate.


def solution_lower_bound_gate(x, A_log, dt_bias, lower_bound):
    """`g = lower_bound * sigmoid(exp(A_log) * (x + dt_bias))`: x `[B, T, HV, K]`, A_log `[HV]`, dt_bias `[HV, K]`."""
    return lower_bound * torch.sigmoid(A_log.exp()[:, None] * (x + dt_bias))


def check_lower_bound_gate(fn) -> str:
    """`fn(x, A_log, dt_bias, lower_bound)` must equal `kda_edu.ops.gates.kda_gate_lower_bound`."""
    gen = torch.Generator().manual_seed(11)
    for B, T, HV, K, bound in ((1, 3, 2, 4, -5.0), (2, 5, 3, 8, -1.0), (1, 7, 4, 16, -8.0)):
        x = 4 * torch.randn(B, T, HV, K, generator=gen, dtype=torch.float64)
        A_log = torch.randn(HV, generator=gen, dtype=torch.float64)
        dt_bias = torch.randn(HV, K, generator=gen, dtype=torch.float64)
        got = _call(fn, x.clone(), A_log.clone(), dt_bias.clone(), bound)
        expect(
            isinstance(got, torch.Tensor) and got.shape == x.shape,
            f"return a tensor of shape [B, T, HV, K] = {tuple(x.shape)}",
        )
        expect(
            bool((got < 0).all() and (got > bound).all()),
            f"every g must lie in (lower_bound, 0) = ({bound}, 0): a sigmoid in (0, 1) times the bound",
        )
        want = kda_gate_lower_bound(x, A_log, dt_bias, lower_bound=bound)
        error = (got - want).abs().max().item()
        expect(
            error < 1e-10,
            f"g is off by {error:.3g}. Hint: exp(A_log) is one slope per value head, for all K; add dt_bias "
            "first.",
        )
    return passed("Every step now forgets at most a factor exp(lower_bound) per channel.")


# Exercise 3: the bytes a KDA layer keeps for decoding.


def solution_kda_cache_bytes(config: KDAConfig, batch: int, dtype: torch.dtype) -> int:
    """Bytes of a `KDACache` after any number of tokens: the window `(W - 1) C` in the model's dtype, the
    state `HV K V` in float32 (float64 for a float64 model), per sequence."""
    C = 2 * config.num_heads * config.head_dim + config.hv * config.v_dim
    window = (config.conv_size - 1) * C * torch.finfo(dtype).bits // 8
    state_bits = 64 if dtype == torch.float64 else 32
    state = config.hv * config.head_dim * config.v_dim * state_bits // 8
    return batch * (window + state)


def check_kda_cache_bytes(fn) -> str:
    """`fn(config, batch, dtype)` must equal the bytes of a live `KDACache` after a prefill and a decoded token."""
    cases = [
        (KDAConfig(num_heads=2, head_dim=8), 1, torch.float32, 7),
        (KDAConfig(num_heads=2, head_dim=8, num_v_heads=4, v_head_dim=6, conv_size=3), 3, torch.float32, 20),
        (KDAConfig(num_heads=1, head_dim=4, conv_size=5), 2, torch.bfloat16, 3),
        (KDAConfig(num_heads=3, head_dim=4, v_head_dim=5), 2, torch.float64, 11),
    ]
    for config, batch, dtype, T in cases:
        torch.manual_seed(0)
        layer = KDALayer(16, config).to(dtype)
        cache = layer.new_cache()
        with torch.no_grad():
            layer(torch.randn(batch, T, 16, dtype=dtype), cache=cache)
            layer(torch.randn(batch, 1, 16, dtype=dtype), cache=cache)
        got = _call(fn, config, batch, dtype)
        expect(
            got == cache.nbytes(),
            f"{str(dtype)[6:]}, batch {batch}: cache {cache.nbytes()} B, you said {got!r:.8}; "
            "(W - 1)(2HK + HV V) in dtype, state float32/64.",
        )
    return passed("A few kilobytes per layer and sequence, whatever the context length.")
