"""The feed-forward half of a block: a SwiGLU MLP, or a small mixture of experts built from SwiGLUs.

A block mixes information across time in its first half (KDA or MLA) and transforms every token on its
own in its second half. Both feed-forward variants here act token by token, so they need no cache and
decoding one token at a time gives exactly what a full forward pass gives.

- `SwiGLU`: `W_down (silu(W_gate x) * W_up x)`, the MLP of most current language models.
- `MoE`: a router scores `E` experts (each a small SwiGLU) for every token, the token goes to its `top_k`
  best experts, and their outputs are summed with the router's renormalised probabilities as weights. One
  shared expert sees every token. Compute per token grows with `top_k`, parameters with `E`.

`build_ffn(d_model, config)` returns the one the config asks for.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class FFNConfig:
    """The feed-forward layer of every block.

    Attributes:
        hidden: hidden width of the dense SwiGLU (used when `num_experts == 0`).
        num_experts: E, the number of routed experts; 0 gives a dense SwiGLU.
        top_k: experts each token is sent to, `1 <= top_k <= num_experts`.
        expert_hidden: hidden width of each routed expert and of the one shared expert.
    """

    hidden: int = 256
    num_experts: int = 0
    top_k: int = 2
    expert_hidden: int = 64

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
    """A mixture of SwiGLU experts with top-k routing and one shared expert.

    For a token x with router logits `z = W_r x` (one per expert), `p = softmax(z)`, `I` the `top_k`
    experts with the largest p, and `w_e = p_e / sum_{i in I} p_i`:

        y = shared(x) + sum_{e in I} w_e expert_e(x)

    Args:
        d_model: D, input and output width.
        config: an `FFNConfig` with `num_experts >= 1`.
    """

    def __init__(self, d_model: int, config: FFNConfig):
        super().__init__()
        if config.num_experts < 1:
            raise ValueError(f"MoE needs config.num_experts >= 1, got {config.num_experts}")
        self.d_model = d_model
        self.top_k = config.top_k
        self.router = nn.Linear(d_model, config.num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(d_model, config.expert_hidden) for _ in range(config.num_experts))
        self.shared_expert = SwiGLU(d_model, config.expert_hidden)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Choose experts for each token.

        Args:
            x: tokens `[N, D]`.

        Returns:
            `(weights, experts)`, both `[N, top_k]`: the renormalised router probabilities (x's dtype,
            each row sums to 1) and the chosen expert indices (int64), best first.
        """
        probs = torch.softmax(self.router(x).float(), dim=-1)
        top_probs, experts = probs.topk(self.top_k, dim=-1)
        weights = top_probs / top_probs.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., D]` -> `[..., D]`."""
        _check_x(x, self.d_model)
        tokens = x.reshape(-1, self.d_model)
        weights, experts = self.route(tokens)
        out = self.shared_expert(tokens)
        for e, expert in enumerate(self.experts):
            rows, slot = (experts == e).nonzero(as_tuple=True)  # tokens routed to expert e, and in which slot
            if rows.numel() > 0:
                out = out.index_add(0, rows, weights[rows, slot, None] * expert(tokens[rows]))
        return out.reshape(x.shape)


def build_ffn(d_model: int, config: FFNConfig) -> nn.Module:
    """A `SwiGLU` of width `config.hidden` when `config.num_experts == 0`, else a `MoE`."""
    return SwiGLU(d_model, config.hidden) if config.num_experts == 0 else MoE(d_model, config)
