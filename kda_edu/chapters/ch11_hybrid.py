"""Chapter 11's measurements of MLA and the 3:1 hybrid: parameters, what NoPE buys, what order each layer sees.

- `mla_parameters(d_model, config)` and `hybrid_parameters(config)`: parameter counts by part, from the
  shapes (compared with live modules in the chapter and the tests).
- `absorption_residual(rope=...)`: how well one absorbed query vector reproduces the attention scores over
  cached latents, with and without a rotary position encoding (RoPE): exactly without, not at all with.
- `history_order_changes(layer, x)`: does shuffling the earlier tokens change a layer's output at the last
  position? (No for one NoPE attention layer; yes for a KDA layer.)
"""

import torch

from kda_edu.chapters.ch10_layer_parts import kda_layer_parameters
from kda_edu.layers.ffn import ffn_parameters
from kda_edu.layers.mla import MLAConfig
from kda_edu.models.model import HybridConfig


def mla_parameters(d_model: int, config: MLAConfig) -> dict[str, int]:
    """Parameters of an `MLA` layer by part: with width D, H heads of widths d_k (+ d_r, the shared key slot),
    d_v and latent width r, queries `D H (d_k + d_r)`, latent and slot down-projection `D (r + d_r)` and the
    latent's RMSNorm `r`, key and value up-projections `r H (d_k + d_v)`, the optional output gate `D H d_v`,
    the output projection `H d_v D`."""
    D, H, r, dk, dv = d_model, config.num_heads, config.kv_rank, config.qk_head_dim, config.v_head_dim
    dr = config.rope_head_dim
    parts = {
        "queries": D * H * (dk + dr),
        "latent (down + norm)": D * (r + dr) + r,
        "key/value up-projections": r * H * (dk + dv),
        "output projection": H * dv * D,
    }
    if config.output_gate:
        parts["output gate"] = D * H * dv
    return parts


def hybrid_parameters(config: HybridConfig) -> dict[str, int]:
    """Parameters of a `HybridLM` by part: embedding (and an untied output matrix), KDA mixers, MLA mixers,
    feed-forward layers, RMSNorms (two per block and a final one), and the pseudo-queries of attention
    residuals (one per sublayer and one for the output) when the config has them."""
    D, kinds = config.d_model, config.layer_kinds
    embedding = config.vocab_size * D * (1 if config.tie_embeddings else 2)
    dense = 3 * D * config.ffn.hidden
    ffn = sum(ffn_parameters(D, config.ffn).values())
    parts = {
        "embedding": embedding,
        "KDA mixers": kinds.count("K") * sum(kda_layer_parameters(D, config.kda).values()),
        "MLA mixers": kinds.count("A") * sum(mla_parameters(D, config.mla).values()),
        "feed-forward": config.dense_layers * dense + (len(kinds) - config.dense_layers) * ffn,
        "norms": (2 * len(kinds) + 1) * D,
    }
    if config.attn_residuals != "none":
        parts["depth queries"] = (2 * len(kinds) + 1) * D
    return parts


def _rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate consecutive pairs of x `[S, d]` by angle `position * base^(-2i/d)` (RoPE)."""
    d = x.shape[-1]
    freqs = base ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)  # [d / 2]
    angle = positions[:, None].to(x.dtype) * freqs  # [S, d / 2]
    cos, sin = angle.cos(), angle.sin()
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def absorption_residual(r: int = 16, dk: int = 8, S: int = 64, rope: bool = False, seed: int = 0) -> float:
    """Relative error of the best single absorbed query for one head's scores over S cached latents.

    The scores of the last query (position S - 1) over keys `k_s = W_uk c_s` are `s_j = q . k_j`, or with
    RoPE `R_{S-1} q . R_j k_j`. Absorption needs one vector `a` (r numbers) with `a . c_j = s_j` for every
    cached latent. Without RoPE `a = W_uk^T q` is exact; with RoPE the rotation `R_j` sits between `W_uk` and
    `c_j` and changes with j, so for S > r no single `a` fits. Returns `|C a* - s| / |s|` for the
    least-squares `a*` (float64).
    """
    gen = torch.Generator().manual_seed(seed)
    w_uk = torch.randn(dk, r, generator=gen, dtype=torch.float64) / r**0.5
    c = torch.randn(S, r, generator=gen, dtype=torch.float64)
    q = torch.randn(dk, generator=gen, dtype=torch.float64)
    keys = c @ w_uk.T  # [S, dk]
    if rope:
        positions = torch.arange(S)
        keys = _rope(keys, positions)
        q = _rope(q[None], positions[-1:])[0]
    scores = keys @ q  # [S]
    a = torch.linalg.lstsq(c, scores[:, None]).solution[:, 0]
    return ((c @ a - scores).norm() / scores.norm()).item()


def history_order_changes(layer, x: torch.Tensor, seed: int = 0) -> float:
    """Largest change of `layer`'s output at the last position when the tokens before it are shuffled.

    Args:
        layer: a sequence layer `[B, T, D] -> [B, T, D]` (an `MLA`, a `KDALayer`, a model's block, ...).
        x: `[B, T, D]`.

    Returns:
        `max |y_T(shuffled) - y_T(x)|`, 0 up to rounding when the layer sees its history as a set.
    """
    gen = torch.Generator().manual_seed(seed)
    T = x.shape[1]
    perm = torch.cat([torch.randperm(T - 1, generator=gen), torch.tensor([T - 1])])
    with torch.no_grad():
        return (layer(x[:, perm])[:, -1] - layer(x)[:, -1]).abs().max().item()
