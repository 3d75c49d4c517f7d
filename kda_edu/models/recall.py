"""The small language model chapter 12 trains on recall tasks: a pre-norm stack of `n_layers`
`kda_edu.models.model.Block`s (a token mixer of `kda_edu.layers.mixers`, then a SwiGLU), the blocks of
`kda_edu.models.model.HybridLM`, with the same mixer in every block."""

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from kda_edu.layers.ffn import SwiGLU
from kda_edu.layers.mixers import MixerConfig, TokenMixer
from kda_edu.models.model import Block, init_projections_


@dataclass
class RecallConfig:
    """The model trained on the memory tasks.

    Attributes:
        vocab_size: number of token ids.
        d_model: D.
        n_layers: number of blocks.
        mixer: the `MixerConfig` of every block.
        ffn_hidden: hidden width of every SwiGLU.
        init_std: standard deviation of the initial projection and embedding weights.
    """

    vocab_size: int = 64
    d_model: int = 64
    n_layers: int = 2
    mixer: MixerConfig = field(default_factory=MixerConfig)
    ffn_hidden: int = 128
    init_std: float = 0.02

    def __post_init__(self):
        if isinstance(self.mixer, dict):
            self.mixer = MixerConfig(**self.mixer)
        for name in ("vocab_size", "d_model", "n_layers", "ffn_hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"RecallConfig.{name} must be >= 1, got {getattr(self, name)}")

    def to_dict(self) -> dict:
        """Plain nested dicts (JSON-ready); `RecallConfig(**d)` reads them back."""
        return asdict(self)


def recall_block(config: RecallConfig) -> Block:
    """A block of a `RecallLM`: `kda_edu.models.model.Block` with the config's `TokenMixer` and a SwiGLU."""
    d = config.d_model
    return Block(d, TokenMixer(d, config.mixer), SwiGLU(d, config.ffn_hidden), norm_eps=1e-6)


class RecallLM(nn.Module):
    """Embedding, `n_layers` blocks (`recall_block`), a final RMSNorm and a tied output projection to logits.

    Args:
        config: a `RecallConfig`.
    """

    def __init__(self, config: RecallConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(recall_block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.d_model, eps=1e-6)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """Normal(0, init_std) projections and embedding (the gates keep their own initialisation); the
        projections into the residual stream are scaled by `1 / sqrt(2 n_layers)`, as in `HybridLM`."""
        std = self.config.init_std
        init_projections_(self, std)
        for block in self.blocks:
            for proj in (block.mixer.output_projection, block.ffn.down_proj):
                nn.init.normal_(proj.weight, mean=0.0, std=std / math.sqrt(2 * self.config.n_layers))

    def num_parameters(self) -> int:
        """Number of trainable numbers."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """token ids `[B, T]` (int64) -> logits `[B, T, vocab_size]`."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise ValueError(f"input_ids must be an int64 tensor of shape [B, T], got {input_ids!r:.80}")
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.T
