"""Exercises of chapter 14 (Kimi K3's additions): checkers and worked solutions.

The checkers compare the reader's answers with live modules: the parameter counts with a built MoE, the
depth mixture with `DepthAttention`, the bias update with `MoE.update_routing_bias`. Each `solution_*` is the
worked solution the book shows.
"""

import torch

from kda_edu.exercises import expect, passed, raised
from kda_edu.layers.attn_residuals import DepthAttention
from kda_edu.layers.ffn import FFNConfig, build_ffn


def _call(fn, *args):
    try:
        return fn(*args)
    except (TypeError, ValueError, RuntimeError, ZeroDivisionError, AttributeError, IndexError) as error:
        raise raised(error) from None


# Exercise 1: total and active parameters of a (latent) mixture of experts.


def solution_moe_counts(d_model: int, config: FFNConfig) -> tuple[int, int]:
    """(total, active) parameters of the MoE `build_ffn(d_model, config)` builds (num_experts >= 1).

    Every SwiGLU from and to width d with hidden width h has `3 d h`. Routed experts read width `l` (the
    latent, or D): `3 l h` each; shared experts `3 D h` each; the router `D E`; a latent MoE adds its down-
    and up-projections `2 D l`. A token uses everything except the `E - top_k` routed experts it skips.
    """
    D, E, h, k = d_model, config.num_experts, config.expert_hidden, config.top_k
    width = config.latent_dim or D
    per_expert = 3 * width * h
    total = D * E + E * per_expert + config.num_shared * 3 * D * h
    if config.latent_dim is not None:
        total += 2 * D * config.latent_dim
    return total, total - (E - k) * per_expert


def check_moe_counts(fn) -> str:
    """`fn(d_model, config)` must give (total, active) for MoEs with and without a latent space."""
    cases = [
        (16, FFNConfig(num_experts=4, top_k=2, expert_hidden=8, num_shared=1)),
        (16, FFNConfig(num_experts=6, top_k=3, expert_hidden=8, num_shared=2, latent_dim=8)),
        (24, FFNConfig(num_experts=5, top_k=1, expert_hidden=4, num_shared=0, latent_dim=12)),
    ]
    for d, config in cases:
        got = _call(fn, d, config)
        expect(isinstance(got, (tuple, list)) and len(got) == 2, f"return (total, active), got {got!r:.40}")
        torch.manual_seed(0)
        moe = build_ffn(d, config)
        total = sum(p.numel() for p in moe.parameters())
        moe(torch.randn(1, d)).sum().backward()  # the parameters one token touches get a gradient
        active = sum(p.numel() for p in moe.parameters() if p.grad is not None)
        expect(
            tuple(int(x) for x in got) == (total, active),
            f"D = {d}, l = {config.latent_dim}: want ({total}, {active}), got {tuple(got)!r:.16}: router, "
            "shared always on; experts read l",
        )
    return passed(
        "At K3's shape the routed experts are 98% of the parameters and 16 / 896 of them are active."
    )


# Exercise 2: the softmax over depth.


def solution_depth_mix(sources: list[torch.Tensor], query: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`sum_i alpha_i v_i` with `alpha = softmax_i(query . RMSNorm(v_i))`, sources `[B, T, D]` each."""
    values = torch.stack(sources)  # [S, B, T, D]
    keys = values * torch.rsqrt(values.square().mean(dim=-1, keepdim=True) + eps)
    alpha = torch.softmax(keys @ query, dim=0)  # [S, B, T]
    return (alpha[..., None] * values).sum(dim=0)


def check_depth_mix(fn) -> str:
    """`fn(sources, query)` must equal `DepthAttention` with that pseudo-query (float64, to 1e-10)."""
    gen = torch.Generator().manual_seed(0)
    for S, D, scale in ((3, 8, 1.0), (5, 16, 3.0), (1, 4, 1.0)):
        sources = [torch.randn(2, 3, D, generator=gen, dtype=torch.float64) * (i + 1) for i in range(S)]
        query = scale * torch.randn(D, generator=gen, dtype=torch.float64)
        depth = DepthAttention(D).double()
        with torch.no_grad():
            depth.query.copy_(query)
        want = depth(sources)
        got = _call(fn, sources, query)
        expect(
            isinstance(got, torch.Tensor) and got.shape == want.shape,
            f"return a tensor of shape {tuple(want.shape)}, got {getattr(got, 'shape', got)!r:.40}",
        )
        expect(
            torch.allclose(got.double(), want, rtol=1e-10, atol=1e-10),
            f"{S} sources: off by {(got.double() - want).abs().max().item():.3g}. Hint: keys RMS-normed "
            "sources, values the raw ones; softmax over depth.",
        )
    return passed(
        "A zero query would give the mean of the sources: the ordinary residual after the next norm."
    )


# Exercise 3: the auxiliary-loss-free bias update.


def solution_bias_update(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """The routing bias after one update: `bias + rate * sign(mean(load) - load)`."""
    return bias + rate * torch.sign(load.mean() - load)


def check_bias_update(fn) -> str:
    """`fn(bias, load, rate)` must give what `MoE.update_routing_bias(rate)` does to a layer with that load."""
    gen = torch.Generator().manual_seed(1)
    for E, rate in ((4, 0.01), (8, 0.1), (5, 0.001)):
        moe = build_ffn(8, FFNConfig(num_experts=E, top_k=2, expert_hidden=4))
        bias = torch.randn(E, generator=gen)
        load = torch.randint(0, 50, (E,), generator=gen).float()
        load[0] = load.mean()  # an expert exactly at the mean keeps its bias
        moe.route_bias.copy_(bias)
        moe.load.copy_(load)
        moe.update_routing_bias(rate)
        got = _call(fn, bias.clone(), load.clone(), rate)
        expect(
            isinstance(got, torch.Tensor) and got.shape == (E,),
            f"return the new bias, a tensor of shape ({E},), got {getattr(got, 'shape', got)!r:.40}",
        )
        j = (got.float() - moe.route_bias).abs().argmax().item()  # the expert furthest off, for the hint
        expect(
            torch.allclose(got.float(), moe.route_bias, rtol=0, atol=1e-6),
            f"expert {j} (load {load[j]:g}, mean {load.mean():.4g}): bias {got[j]:.4g}, want "
            f"{moe.route_bias[j]:.4g}: move by the rate, down if overloaded.",
        )
    return passed("no loss term pulls against the language model; only the sign of each excess load counts.")
