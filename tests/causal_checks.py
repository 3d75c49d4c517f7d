"""A bad value at step t must not reach anything before t: the outputs before t, and for a loss on them the
gradients of every earlier step and of the initial state, are those of the clean prefix. Shared by the sweeps
of tests/ops (the PyTorch references) and tests/kernels (the Triton kernels).

The reference is the float64 loop `kda_recurrent` run on the prefix alone (steps 0 .. t-1) with the same
initial state and the same loss: what the bad step cannot change. A path that lets the bad value through
gives NaN there (0 * NaN = NaN), which `rel` reports as inf.
"""

import math

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from kda_edu.ops.kda import kda_recurrent

BAD = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
NAMES = ("q", "k", "v", "g", "beta")


def make(T, H=1, HV=2, K=16, V=16, seed=0, dtype=torch.float32, device="cpu"):
    """Random inputs on `device` (drawn on the CPU, so a GPU sees the same values): unit keys, gates in
    [-1, 0], beta in (0, 1), an initial state."""
    gen = torch.Generator().manual_seed(seed)
    x = dict(
        q=torch.randn(1, T, H, K, generator=gen),
        k=F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1),
        v=torch.randn(1, T, HV, V, generator=gen),
        g=-torch.rand(1, T, HV, K, generator=gen),
        beta=torch.rand(1, T, HV, generator=gen),
        initial_state=torch.randn(1, HV, K, V, generator=gen),
    )
    return {n: t.to(dtype=dtype, device=device) for n, t in x.items()}


def spoil(x, name, t, value, head=0, channel=0):
    """A copy of x with `value` at step t of `name` (head `head`, key or value channel `channel`)."""
    y = {n: a.clone() for n, a in x.items()}
    head %= y[name].shape[2]
    if name == "beta":
        y[name][0, t, head] = value
    else:
        y[name][0, t, head, channel % y[name].shape[3]] = value
    return y


def rejected(name, value):
    """Whether the input check (kda_recurrent, kda_chunked, chunk_kda) refuses this value: any NaN or inf in
    beta, a NaN or +inf gate. A gate of -inf is a reset, legitimate everywhere."""
    return name == "beta" or (name == "g" and not value == -math.inf)


def prefix_gradients(fn, x, t, seed=1, **kw):
    """o and the gradients of sum(o[:, :t] * w) (w random) with respect to every input of x, from fn."""
    xs = {n: a.detach().clone().requires_grad_() for n, a in x.items()}
    o = fn(**xs, **kw)[0]
    w = torch.randn(o[:, :t].shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    w = w.to(o.device)
    (o[:, :t].double() * w).sum().backward()
    return o.detach(), {n: a.grad for n, a in xs.items()}


def rel(x, ref):
    """Relative norm error; inf when x is not finite."""
    x, ref = x.double().cpu(), ref.double().cpu()
    if not bool(torch.isfinite(x).all()):
        return math.inf
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def causal_errors(fn, x, name, t, value, head=0, channel=0, **kw):
    """Errors of fn with `value` at step t of `name`, before t, against the float64 loop on the clean prefix:
    {"o": ..., "dq": ..., ..., "dinitial_state": ...}."""
    o, grads = prefix_gradients(fn, spoil(x, name, t, value, head, channel), t, **kw)
    prefix = {n: (a if n == "initial_state" else a[:, :t]).double().cpu() for n, a in x.items()}
    ref_o, ref_grads = prefix_gradients(kda_recurrent, prefix, t)
    errors = {"o": rel(o[:, :t], ref_o)}
    for n, g in grads.items():
        errors["d" + n] = rel(g if n == "initial_state" else g[:, :t], ref_grads[n])
    return errors


@st.composite
def bad_steps(draw, T_min, T_max):
    """(T, name, t, value name, head, channel, seed): where a sweep puts one bad value."""
    T = draw(st.integers(T_min, T_max))
    return (
        T,
        draw(st.sampled_from(NAMES)),
        draw(st.integers(1, T - 1)),
        draw(st.sampled_from(sorted(BAD))),
        draw(st.integers(0, 1)),
        draw(st.integers(0, 15)),
        draw(st.integers(0, 2**16)),
    )


def _head(n, a, h, t):
    """Head h of input (or gradient) `n` of a, steps before t (the initial state has no time axis)."""
    return a[:, h] if n == "initial_state" else a[:, :t, h]


def causal_errors_per_head(fn, x, bads, seed=1, **kw):
    """`causal_errors` for one bad value in each head at once: bads[h] = (name, t, value, channel) puts `value`
    at step t of `name` in head h (value None: head h stays clean). The heads must share nothing (H == HV, no
    key head serving two value heads), so head h's outputs before t_h, and for the loss on them (the sum of
    o[:, :t_h, h] * w_h over the heads) head h's gradients before t_h and its slice of dinitial_state, are those
    of head h's clean prefix alone: one run checks every head's bad value. Returns one error dict per head."""
    if not x["q"].shape[2] == x["v"].shape[2] == len(bads):
        raise ValueError(f"one bad value per head of heads that share nothing: H == HV == {len(bads)}")
    y = x
    for h, (name, t, value, channel) in enumerate(bads):
        if value is not None:
            y = spoil(y, name, t, value, h, channel)
    xs = {n: a.detach().clone().requires_grad_() for n, a in y.items()}
    o = fn(**xs, **kw)[0]
    gen = torch.Generator().manual_seed(seed)
    ws = [
        torch.randn(_head("o", o, h, t).shape, generator=gen, dtype=torch.float64)
        for h, (_, t, *_) in enumerate(bads)
    ]
    sum(
        (_head("o", o, h, t).double() * w.to(o.device)).sum()
        for h, ((_, t, *_), w) in enumerate(zip(bads, ws, strict=True))
    ).backward()
    out = []
    for h, ((_, t, *_), w) in enumerate(zip(bads, ws, strict=True)):
        prefix = {n: _head(n, a, slice(h, h + 1), t).double().cpu().requires_grad_() for n, a in x.items()}
        ref_o = kda_recurrent(**prefix)[0]
        (ref_o[:, :, 0] * w).sum().backward()
        errors = {"o": rel(_head("o", o, h, t).detach(), ref_o[:, :, 0].detach())}
        for n, a in xs.items():
            errors["d" + n] = rel(_head(n, a.grad, h, t), _head(n, prefix[n].grad, 0, t))
        out.append(errors)
    return out
