"""The feed-forward half of a block: a SwiGLU MLP, or a mixture of experts built from SwiGLUs.

A block mixes information across time in its first half (KDA or MLA) and transforms every token on its
own in its second half. Every feed-forward variant here acts token by token, so it needs no cache and
decoding one token at a time gives exactly what a full forward pass gives.

- `SwiGLU`: `W_down (silu(W_gate x) * W_up x)`, the MLP of most current language models.
- `MoE`: a router scores `E` experts (each a small SwiGLU) for every token, the token goes to its `top_k`
  best experts, and their outputs are summed with the router's renormalised probabilities as weights.
  `num_shared` shared experts see every token. Compute per token grows with `top_k`, parameters with `E`.
- `LatentMoE` (`FFNConfig.latent_dim` set): the same router and shared experts, but the routed experts work
  in a narrower latent space: `x` is projected down to `latent_dim` once, every chosen expert reads and writes
  the latent, and the weighted sum is projected back up once. Expert weights (and, in a distributed model,
  the tokens sent to the experts) shrink by `d_model / latent_dim`.

Load balancing is auxiliary-loss free (as in DeepSeek-V3 and Kimi K2): each expert has a routing bias that
is added to its score *for choosing* the top-k only, never to the weights of the sum. During training the
layer counts how many tokens each expert received; `update_routing_bias(rate)` then lowers the bias of every
expert above the mean load by `rate` and raises the others, so the next batches are spread more evenly. No
loss term is added, so the language-modelling gradient is the only gradient the router sees.

`build_ffn(d_model, config)` returns the one the config asks for; `ffn_parameters(d_model, config)` counts
its parameters from the shapes and `ffn_active_parameters` the ones a single token uses.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class FFNConfig:
    """The feed-forward layer of every block.

    Attributes:
        hidden: hidden width of the dense SwiGLU (used when `num_experts == 0`, and by the blocks that
            `HybridConfig.dense_layers` keeps dense).
        num_experts: E, the number of routed experts; 0 gives a dense SwiGLU.
        top_k: experts each token is sent to, `1 <= top_k <= num_experts`.
        expert_hidden: hidden width of each routed expert and of each shared expert.
        num_shared: shared experts, each of width `expert_hidden`, seen by every token (0 for none).
        latent_dim: None runs the routed experts at the model width (`MoE`); a number runs them in a latent
            space of that width between one down- and one up-projection (`LatentMoE`).
    """

    hidden: int = 256
    num_experts: int = 0
    top_k: int = 2
    expert_hidden: int = 64
    num_shared: int = 1
    latent_dim: int | None = None

    def __post_init__(self):
        for name in ("hidden", "expert_hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"FFNConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_experts < 0:
            raise ValueError(f"FFNConfig.num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts > 0 and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"FFNConfig.top_k must lie in [1, num_experts = {self.num_experts}], got {self.top_k}"
            )
        if self.num_shared < 0:
            raise ValueError(f"FFNConfig.num_shared must be >= 0, got {self.num_shared}")
        if self.latent_dim is not None and (self.latent_dim < 1 or self.num_experts == 0):
            raise ValueError(
                f"FFNConfig.latent_dim must be None or >= 1 with num_experts >= 1, "
                f"got latent_dim = {self.latent_dim}, num_experts = {self.num_experts}"
            )


def _check_x(x: torch.Tensor, d_model: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor of shape [..., D], got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] != d_model:
        raise ValueError(f"x must have shape [..., D] with D = {d_model}, got {tuple(x.shape)}")


class SwiGLU(nn.Module):
    """`W_down (silu(W_gate x) * W_up x)`: a gated MLP applied to every token independently.

    Args:
        d_model: D, input and output width.
        hidden: the hidden width.
    """

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.d_model = d_model
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., D]` -> `[..., D]`."""
        _check_x(x, self.d_model)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """A mixture of SwiGLU experts with top-k routing, shared experts and a load-balancing routing bias.

    For a token x with router logits `z = W_r x` (one per expert), `p = softmax(z)`, routing bias b, `I` the
    `top_k` experts with the largest `p + b`, and `w_e = p_e / sum_{i in I} p_i`:

        y = shared(x) + sum_{e in I} w_e expert_e(x)

    The bias only chooses; the weights come from p alone. The `num_shared` shared experts of width h are one
    SwiGLU of width `num_shared h`: a SwiGLU's hidden units are independent, so the sum of two SwiGLUs is the
    SwiGLU with both sets of units side by side.

    Buffers:
        route_bias: b `[E]`, float32, starts at 0; changed only by `update_routing_bias`.
        load: tokens routed to each expert `[E]` (float32) since the last `update_routing_bias`, counted in
            training mode only.

    Args:
        d_model: D, input and output width.
        config: an `FFNConfig` with `num_experts >= 1`.
        expert_dim: the width the routed experts read and write; None means `d_model` (`LatentMoE` passes
            its latent width).
    """

    def __init__(self, d_model: int, config: FFNConfig, expert_dim: int | None = None):
        super().__init__()
        if config.num_experts < 1:
            raise ValueError(f"MoE needs config.num_experts >= 1, got {config.num_experts}")
        self.d_model = d_model
        self.top_k = config.top_k
        expert_dim = d_model if expert_dim is None else expert_dim
        self.router = nn.Linear(d_model, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            SwiGLU(expert_dim, config.expert_hidden) for _ in range(config.num_experts)
        )
        shared = config.num_shared * config.expert_hidden
        self.shared_expert = SwiGLU(d_model, shared) if shared > 0 else None
        self.register_buffer("route_bias", torch.zeros(config.num_experts))
        self.register_buffer("load", torch.zeros(config.num_experts), persistent=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Choose experts for each token.

        Args:
            x: tokens `[N, D]`.

        Returns:
            `(weights, experts)`, both `[N, top_k]`: the renormalised router probabilities (x's dtype,
            each row sums to 1) and the chosen expert indices (int64), in the order of `p + b`, best first.
        """
        probs = torch.softmax(self.router(x).float(), dim=-1)
        experts = (probs + self.route_bias.float()).topk(self.top_k, dim=-1).indices
        chosen = probs.gather(-1, experts)
        weights = chosen / chosen.sum(dim=-1, keepdim=True)
        if self.training:
            with torch.no_grad():
                self.load += torch.bincount(experts.flatten(), minlength=self.load.numel()).to(
                    self.load.dtype
                )
        return weights.to(x.dtype), experts

    def combine(self, tokens: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """`sum_{e in I} w_e expert_e(token)` for every token: tokens `[N, d]` (d the experts' width), weights
        and experts `[N, top_k]` from `route` -> `[N, d]`. Each expert runs once, on the tokens sent to it."""
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            rows, slot = (experts == e).nonzero(as_tuple=True)  # tokens routed to expert e, and in which slot
            if rows.numel() > 0:
                out = out.index_add(0, rows, weights[rows, slot, None] * expert(tokens[rows]))
        return out

    def shared(self, tokens: torch.Tensor) -> torch.Tensor:
        """The shared experts' output `[N, D]` (zeros when there are none)."""
        return torch.zeros_like(tokens) if self.shared_expert is None else self.shared_expert(tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., D]` -> `[..., D]`."""
        _check_x(x, self.d_model)
        tokens = x.reshape(-1, self.d_model)
        weights, experts = self.route(tokens)
        return (self.shared(tokens) + self.combine(tokens, weights, experts)).reshape(x.shape)

    @torch.no_grad()
    def update_routing_bias(self, rate: float) -> None:
        """Auxiliary-loss-free balancing: `b_e += rate * sign(mean load - load_e)`, then reset the counts.

        An expert that received more tokens than the mean since the last update becomes a little less likely
        to be chosen, one that received fewer a little more. Nothing happens when no token was counted.
        """
        if not rate >= 0:
            raise ValueError(f"rate must be a number >= 0, got {rate!r}")
        if self.load.sum() > 0:
            self.route_bias += rate * torch.sign(self.load.mean() - self.load)
        self.load.zero_()

    def imbalance(self) -> float:
        """Largest load over the mean load since the last update (1 = perfectly even; 0 with no tokens)."""
        mean = self.load.mean()
        return (self.load.max() / mean).item() if mean > 0 else 0.0


class LatentMoE(MoE):
    """A mixture of experts whose routed experts work in a latent space of width `latent_dim` (LatentMoE).

    Routing and the shared experts see the full-width token x; the routed experts see its latent:

        u = W_down x                                          [latent_dim]
        y = shared(x) + W_up sum_{e in I} w_e expert_e(u)

    The down- and up-projections run once per token whatever `top_k` is, and commute with the weighted sum
    (both are linear), so with `latent_dim = D` and identity projections this is exactly `MoE`.

    Args:
        d_model: D, input and output width.
        config: an `FFNConfig` with `num_experts >= 1` and `latent_dim` set.
    """

    def __init__(self, d_model: int, config: FFNConfig):
        if config.latent_dim is None:
            raise ValueError("LatentMoE needs config.latent_dim, got None")
        super().__init__(d_model, config, expert_dim=config.latent_dim)
        self.latent_down = nn.Linear(d_model, config.latent_dim, bias=False)
        self.latent_up = nn.Linear(config.latent_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., D]` -> `[..., D]`."""
        _check_x(x, self.d_model)
        tokens = x.reshape(-1, self.d_model)
        weights, experts = self.route(tokens)
        routed = self.latent_up(self.combine(self.latent_down(tokens), weights, experts))
        return (self.shared(tokens) + routed).reshape(x.shape)


def build_ffn(d_model: int, config: FFNConfig) -> nn.Module:
    """A `SwiGLU` of width `config.hidden` when `config.num_experts == 0`, else a `MoE`, or a `LatentMoE`
    when `config.latent_dim` is set."""
    if config.num_experts == 0:
        return SwiGLU(d_model, config.hidden)
    return MoE(d_model, config) if config.latent_dim is None else LatentMoE(d_model, config)


def ffn_parameters(d_model: int, config: FFNConfig) -> dict[str, int]:
    """Parameters of the layer `build_ffn(d_model, config)` builds, by part, from the shapes.

    A SwiGLU of width h from and to width d has `3 d h`. With E routed experts of width h reading width
    d_e (D, or the latent width l), S shared experts: router `D E`, routed `3 E d_e h`, shared `3 D S h`,
    latent projections `2 D l`.
    """
    D = d_model
    if config.num_experts == 0:
        return {"dense": 3 * D * config.hidden}
    E, h, d_e = config.num_experts, config.expert_hidden, config.latent_dim or D
    parts = {
        "router": D * E,
        "routed experts": 3 * E * d_e * h,
        "shared experts": 3 * D * config.num_shared * h,
    }
    if config.latent_dim is not None:
        parts["latent projections"] = 2 * D * config.latent_dim
    return parts


def ffn_active_parameters(d_model: int, config: FFNConfig) -> int:
    """Parameters one token uses: everything but the `E - top_k` routed experts it is not sent to."""
    total = sum(ffn_parameters(d_model, config).values())
    if config.num_experts == 0:
        return total
    per_expert = 3 * (config.latent_dim or d_model) * config.expert_hidden
    return total - (config.num_experts - config.top_k) * per_expert
