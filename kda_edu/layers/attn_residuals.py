"""Attention residuals: a layer's input is a learned softmax mixture of the earlier layers' outputs.

A pre-norm residual stream adds every sublayer's output with weight one: the input of sublayer l is

    h_l = v_0 + v_1 + ... + v_{l-1}          v_0 the token embedding, v_i the output of sublayer i

(a sublayer is a mixer or a feed-forward layer; a model of n blocks has L = 2 n of them). Attention
residuals replace the fixed weights by a softmax over depth, with one learned pseudo-query `w_l` per
sublayer (a vector of width D that does not depend on the token) and the normalised outputs as keys:

    h_l = sum_{i < l} alpha_{i,l} v_i,       alpha_{., l} = softmax_i( w_l . RMSNorm(v_i) )

The keys' RMSNorm has no weight of its own: a per-channel weight would multiply `w_l` channel by channel,
which `w_l` can learn by itself. A final pseudo-query mixes the sources once more for the output head.

**Why zero queries give back the ordinary residual.** With `w_l = 0` every logit is 0, the softmax is
uniform and `h_l = (1 / l) sum_i v_i`, the residual sum divided by l. The sublayer reads `RMSNorm(h_l)`, and
`RMSNorm(c h) = RMSNorm(h)` for every c > 0 (up to its epsilon), so the model computes exactly what the
pre-norm model computes. Pseudo-queries start at zero: training starts from the ordinary residual.

**Block form.** Keeping every v_i costs `L + 1` vectors of width D per token. The block form groups
`block_size` consecutive sublayers: inside a block outputs are summed as usual, and the softmax runs over the
completed blocks' sums, the embedding and the current block's partial sum. At most
`1 + ceil(L / block_size)` vectors are kept. With `block_size = 1` it is the plain form. Zero queries again
give the ordinary residual: every block sum gets the same weight, and the blocks add up to the residual sum.

`DepthStream` holds the sources of one forward pass and `DepthAttention` is one pseudo-query.
`kept_vectors(L, block_size)` is the count of vectors kept, per token, after L sublayers.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def kept_vectors(num_sublayers: int, block_size: int) -> int:
    """Vectors of width D a `DepthStream` holds per token after `num_sublayers` outputs: the embedding,
    one per completed block and the partial sum of an unfinished block, `1 + ceil(L / block_size)`."""
    if num_sublayers < 0 or block_size < 1:
        raise ValueError(f"need num_sublayers >= 0 and block_size >= 1, got {num_sublayers}, {block_size}")
    return 1 + math.ceil(num_sublayers / block_size)


class DepthStream:
    """The sources a layer can attend to over depth, for one forward pass.

    Args:
        embedding: v_0, the token embeddings `[B, T, D]`.
        block_size: sublayers summed into one source; 1 keeps every output (the plain form).

    Attributes:
        max_kept: the most sources held at once so far (the memory the form keeps, in vectors per token).
    """

    def __init__(self, embedding: torch.Tensor, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.blocks = [embedding]  # v_0 and the completed blocks' sums
        self.partial: torch.Tensor | None = None
        self.in_block = 0
        self.max_kept = 1

    def sources(self) -> list[torch.Tensor]:
        """The completed sources and, inside an unfinished block, its partial sum."""
        return self.blocks if self.partial is None else [*self.blocks, self.partial]

    def add(self, v: torch.Tensor) -> None:
        """Add one sublayer's output; close the block after `block_size` of them."""
        self.partial = v if self.partial is None else self.partial + v
        self.in_block += 1
        if self.in_block == self.block_size:
            self.blocks.append(self.partial)
            self.partial, self.in_block = None, 0
        self.max_kept = max(self.max_kept, len(self.sources()))


class DepthAttention(nn.Module):
    """One pseudo-query w `[D]` and the softmax over depth it defines.

    Args:
        d_model: D.
        eps: epsilon of the keys' RMSNorm.
    """

    def __init__(self, d_model: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.query = nn.Parameter(torch.zeros(d_model))

    def weights(self, sources: list[torch.Tensor]) -> torch.Tensor:
        """alpha `[S, B, T]`: the softmax over the S sources of `w . RMSNorm(v_i)`, in float32 or wider."""
        values = torch.stack(sources)  # [S, B, T, D]
        dtype = torch.promote_types(values.dtype, torch.float32)
        keys = F.rms_norm(values.to(dtype), (values.shape[-1],), eps=self.eps)
        return torch.softmax(keys @ self.query.to(dtype), dim=0)

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        """`sum_i alpha_i v_i` `[B, T, D]` in the sources' dtype."""
        values = torch.stack(sources)
        alpha = self.weights(sources)
        return (alpha[..., None] * values.to(alpha.dtype)).sum(dim=0).to(values.dtype)
