"""Multi-head latent attention (MLA) without positional encoding, the global-attention layer of the hybrid.

Standard multi-head attention caches, per token, a key and a value for every head: `H (d_k + d_v)` numbers.
MLA caches one latent vector `c_t` of width `r` per token instead and rebuilds keys and values from it:

    c_t   = RMSNorm(W_dkv x_t)                       the latent, [r]: the only thing cached
    k_t,h = W_uk,h c_t,   v_t,h = W_uv,h c_t         per-head keys [d_k] and values [d_v]
    q_t,h = W_q,h x_t
    o_t,h = sum_{s <= t} softmax_s(q_t,h . k_s,h / sqrt(d_k)) v_s,h
    y_t   = W_o [o_t,1; ...; o_t,H]                  (times a sigmoid gate per channel, optionally)

There is no RoPE: as in Kimi Linear, position information comes from the KDA layers of the hybrid (and from
the causal mask). Without RoPE the key up-projection can be folded into the query, which gives two ways to
compute the same attention:

- **MHA mode** (prefill): expand the latents into per-head keys and values, then ordinary attention.
  Cheap per key when many queries share the expansion, but the expanded keys and values take `H (d_k + d_v)`
  numbers per position.
- **MQA mode** (decoding): `q_h . (W_uk,h c_s) = (W_uk,h^T q_h) . c_s`, so absorb `W_uk,h` into the query,
  attend directly over the latents (one shared "key head" of width r, multi-query attention), and apply
  `W_uv,h` after the weighted sum of latents: `sum_s p_s W_uv,h c_s = W_uv,h sum_s p_s c_s`. Nothing per
  head is ever materialised for the cached positions (`kda_edu.attention.causal_attention` folds the heads into the query
  rows rather than broadcasting the latents over them); a decoding step's temporaries are the `[B, H, 1,
  S]` float32 scores and probabilities and a bounded float32 slice of the latents.

Both modes read the same `MLACache` and agree up to rounding (tested). The default picks MHA mode when
several tokens arrive at once and MQA mode for a single decoded token.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn

from kda_edu.attention import causal_attention
from kda_edu.varlen import check_attention_mask, check_cu_seqlens, repad, unpad


@dataclass
class MLAConfig:
    """An MLA layer (its width `d_model` comes from the model).

    Attributes:
        num_heads: H, attention heads.
        kv_rank: r, width of the cached latent `c_t`.
        qk_head_dim: d_k, query/key width per head.
        v_head_dim: d_v, value width per head.
        output_gate: multiply the attention output by `sigmoid(W_g x)` per channel before `W_o`.
        norm_eps: epsilon of the RMSNorm on the latent.
    """

    num_heads: int = 4
    kv_rank: int = 64
    qk_head_dim: int = 32
    v_head_dim: int = 32
    output_gate: bool = False
    norm_eps: float = 1e-6

    def __post_init__(self):
        for name in ("num_heads", "kv_rank", "qk_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"MLAConfig.{name} must be >= 1, got {getattr(self, name)}")


class MLACache:
    """What an MLA layer keeps between calls: the latents of every token seen so far.

    Attributes:
        latent: `[B, S, r]` after the layer has seen S tokens; None before the first call.
    """

    def __init__(self):
        self.latent: torch.Tensor | None = None

    @property
    def seq_len(self) -> int:
        """S, the number of tokens cached."""
        return 0 if self.latent is None else self.latent.shape[1]

    def nbytes(self) -> int:
        """Bytes held by the cache's tensors."""
        return 0 if self.latent is None else self.latent.numel() * self.latent.element_size()

    def append(self, latent: torch.Tensor) -> torch.Tensor:
        """Add the latents `[B, T, r]` of new tokens; return all cached latents `[B, S + T, r]`."""
        if self.latent is not None:
            if latent.shape[0] != self.latent.shape[0]:
                cached = self.latent.shape[0]
                raise ValueError(
                    f"x has batch size {latent.shape[0]} but the cache holds batch size {cached}"
                )
            latent = torch.cat([self.latent, latent.to(self.latent.dtype)], dim=1)
        self.latent = latent
        return latent


class MLA(nn.Module):
    """Multi-head latent attention with no positional encoding and a latent KV cache.

    Args:
        d_model: D, input and output width.
        config: an `MLAConfig`.
    """

    def __init__(self, d_model: int, config: MLAConfig):
        super().__init__()
        self.d_model = d_model
        self.config = config
        H, r, dk, dv = config.num_heads, config.kv_rank, config.qk_head_dim, config.v_head_dim
        self.q_proj = nn.Linear(d_model, H * dk, bias=False)
        self.kv_down = nn.Linear(d_model, r, bias=False)
        self.kv_norm = nn.RMSNorm(r, eps=config.norm_eps)
        self.k_up = nn.Linear(r, H * dk, bias=False)
        self.v_up = nn.Linear(r, H * dv, bias=False)
        self.gate_proj = nn.Linear(d_model, H * dv, bias=False) if config.output_gate else None
        self.o_proj = nn.Linear(H * dv, d_model, bias=False)

    def new_cache(self) -> MLACache:
        """An empty cache for this layer."""
        return MLACache()

    def forward(
        self,
        x: torch.Tensor,
        cache: MLACache | None = None,
        mode: str = "auto",
        cu_seqlens: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend from the tokens in x to themselves and to everything in the cache.

        Args:
            x: `[B, T, D]`, the next T tokens.
            cache: None for a self-contained sequence; otherwise the layer's `MLACache`, which holds the
                tokens before x and is extended with x's latents in place.
            mode: `"mha"` (expand latents to per-head keys and values), `"mqa"` (absorbed projections,
                attention over the latents), or `"auto"`: MQA for T = 1, MHA otherwise.
            cu_seqlens: int32/int64 `[N + 1]`: x `[1, T, D]` holds N sequences packed along T, each attending
                only within itself (`kda_edu.varlen`); not with a cache.
            attention_mask: `[B, T]` padding mask, 1 for a token, 0 for padding: each row attends over its
                tokens only, and the output is zero at the padding; not with a cache.

        Returns:
            `[B, T, D]` in x's dtype.
        """
        if cache is not None and (cu_seqlens is not None or attention_mask is not None):
            raise ValueError("cu_seqlens and attention_mask run self-contained sequences: pass cache=None")
        if attention_mask is not None and cu_seqlens is not None:
            raise ValueError("pass attention_mask (padded batch) or cu_seqlens (packed batch), not both")
        if attention_mask is not None or cu_seqlens is not None:
            if not isinstance(x, torch.Tensor) or x.dim() != 3:
                raise ValueError(f"x must be a tensor of shape [B, T, D] with D = {self.d_model}")
            B, T, _ = x.shape
            if attention_mask is not None:
                packed, indices, cu = unpad(x, check_attention_mask(attention_mask, B, T, x.device))
                return repad(self(packed, mode=mode, cu_seqlens=cu), indices, B, T)
            cu = check_cu_seqlens(cu_seqlens, B, T, x.device)
            # Attention never crosses a sequence boundary: each sequence is its own call.
            return torch.cat(
                [self(x[:, a:b], mode=mode) for a, b in zip(cu[:-1], cu[1:], strict=True) if b > a], 1
            )
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be a tensor of shape [B, T, D] with D = {self.d_model}, got {shape}")
        if cache is not None and not isinstance(cache, MLACache):
            raise TypeError(f"cache must be an MLACache or None, got {type(cache).__name__}")
        if mode not in ("auto", "mha", "mqa"):
            raise ValueError(f"mode must be 'auto', 'mha' or 'mqa', got {mode!r}")
        B, T, _ = x.shape
        H, dk, dv = self.config.num_heads, self.config.qk_head_dim, self.config.v_head_dim
        if mode == "auto":
            mode = "mqa" if T == 1 else "mha"

        q = self.q_proj(x).view(B, T, H, dk)
        latent = self.kv_norm(self.kv_down(x))  # [B, T, r]
        if cache is not None:
            latent = cache.append(latent)  # [B, S, r], S = cached + T

        if mode == "mha":
            S = latent.shape[1]
            k = self.k_up(latent).view(B, S, H, dk)
            v = self.v_up(latent).view(B, S, H, dv)
            o = causal_attention(q, k, v, scale=dk**-0.5)  # [B, T, H, dv] in x's dtype
        else:
            w_uk = self.k_up.weight.view(H, dk, -1)  # [H, dk, r]
            w_uv = self.v_up.weight.view(H, dv, -1)  # [H, dv, r]
            q_latent = torch.einsum("bthd,hdr->bthr", q, w_uk)  # absorbed queries [B, T, H, r]
            c = latent[:, :, None, :]  # one key/value head shared by all query heads: [B, S, 1, r]
            work = torch.promote_types(q_latent.dtype, torch.float32)
            o_latent = causal_attention(q_latent, c, c, scale=dk**-0.5, out_dtype=work)  # [B, T, H, r]
            o = torch.einsum("bthr,hdr->bthd", o_latent, w_uv.to(o_latent.dtype))

        o = o.to(x.dtype)
        if self.gate_proj is not None:
            o = o * torch.sigmoid(self.gate_proj(x)).view(B, T, H, dv)
        return self.o_proj(o.reshape(B, T, H * dv))
