"""Multi-head latent attention (MLA) without positional encoding, the global-attention layer of the hybrid.

Standard multi-head attention caches, per token, a key and a value for every head: `H (d_k + d_v)` numbers.
MLA caches one latent vector `c_t` of width `r` per token instead and rebuilds keys and values from it:

    c_t   = RMSNorm(W_dkv x_t)                       the latent, [r]: the only thing cached
    k_t,h = W_uk,h c_t,   v_t,h = W_uv,h c_t         per-head keys [d_k] and values [d_v]
    q_t,h = W_q,h x_t
    o_t,h = sum_{s <= t} softmax_s(q_t,h . k_s,h / sqrt(d_k)) v_s,h
    y_t   = W_o [o_t,1; ...; o_t,H]                  (times a sigmoid gate per channel, optionally)

There is no RoPE: as in Kimi Linear, position information comes from the KDA layers of the hybrid (and from
the causal mask). Kimi Linear keeps DeepSeek's layout all the same (`rope_head_dim = 64`, `mla_use_nope`): each
head's query has `d_r` extra numbers and every token caches a `d_r`-wide key shared by all heads beside its
latent, a slot that DeepSeek rotates and Kimi never does. `MLAConfig.rope_head_dim` keeps that slot (0, the
default, is pure NoPE):

    [c_t; k^R_t] = [RMSNorm(W_dkv x_t)_{:r}; (W_dkv x_t)_{r:}]     cached: r + d_r numbers per token
    score_t,s,h  = q_t,h[:d_k] . W_uk,h c_s + q_t,h[d_k:] . k^R_s     scale (d_k + d_r)^-1/2
 Without RoPE the key up-projection can be folded into the query, which gives two ways to
compute the same attention:

- **MHA mode** (prefill): expand the latents into per-head keys and values, then ordinary attention.
  Cheap per key when many queries share the expansion, but the expanded keys and values take `H (d_k + d_v)`
  numbers per position.
- **MQA mode** (decoding): `q_h . (W_uk,h c_s) = (W_uk,h^T q_h) . c_s`, so absorb `W_uk,h` into the query,
  attend directly over the latents (one shared "key head" of width r + d_r, multi-query attention; the values
  are the first r numbers of the same cached rows), and apply
  `W_uv,h` after the weighted sum of latents: `sum_s p_s W_uv,h c_s = W_uv,h sum_s p_s c_s`. Nothing per
  head is ever materialised for the cached positions (`kda_edu.ops.attention.causal_attention` folds the heads into the query
  rows rather than broadcasting the latents over them); a decoding step's temporaries are the `[B, H, 1,
  S]` float32 scores and probabilities and a bounded float32 slice of the latents.

Both modes read the same `MLACache` and agree up to rounding (tested). The default picks MHA mode when
several tokens arrive at once and MQA mode for a single decoded token.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn

from kda_edu.ops._checks import check_absorbed_attention_inputs
from kda_edu.ops.attention import causal_attention
from kda_edu.ops.varlen import check_attention_mask, check_cu_seqlens, repad, unpad


@dataclass
class MLAConfig:
    """An MLA layer (its width `d_model` comes from the model).

    Attributes:
        num_heads: H, attention heads.
        kv_rank: r, width of the cached latent `c_t`.
        qk_head_dim: d_k, query/key width per head.
        v_head_dim: d_v, value width per head.
        rope_head_dim: d_r, the width of the extra query/key slot every head has beside d_k, whose key is
            shared by the heads and cached beside the latent; never rotated (Kimi Linear: 64). 0: pure NoPE.
        output_gate: multiply the attention output by `sigmoid(W_g x)` per channel before `W_o`.
        norm_eps: epsilon of the RMSNorm on the latent.
    """

    num_heads: int = 4
    kv_rank: int = 64
    qk_head_dim: int = 32
    v_head_dim: int = 32
    rope_head_dim: int = 0
    output_gate: bool = False
    norm_eps: float = 1e-6

    def __post_init__(self):
        for name in ("num_heads", "kv_rank", "qk_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"MLAConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.rope_head_dim < 0:
            raise ValueError(f"MLAConfig.rope_head_dim must be >= 0, got {self.rope_head_dim}")

    @property
    def cache_width(self) -> int:
        """Numbers cached per token: the latent and the shared key slot, `r + d_r`."""
        return self.kv_rank + self.rope_head_dim


class MLACache:
    """What an MLA layer keeps between calls: the latents of every token seen so far.

    Attributes:
        latent: `[B, S, r + d_r]` after the layer has seen S tokens (the latent, then the shared key slot);
            None before the first call.
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
        """Add the latents `[B, T, r + d_r]` of new tokens; return all cached latents `[B, S + T, r + d_r]`."""
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
        H, r, dk, dv, dr = (
            config.num_heads,
            config.kv_rank,
            config.qk_head_dim,
            config.v_head_dim,
            config.rope_head_dim,
        )
        self.q_proj = nn.Linear(d_model, H * (dk + dr), bias=False)
        self.kv_down = nn.Linear(d_model, r + dr, bias=False)
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
                only within itself (`kda_edu.ops.varlen`); not with a cache.
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
            parts = [self(x[:, a:b], mode=mode) for a, b in zip(cu[:-1], cu[1:], strict=True) if b > a]
            return torch.cat(parts, 1) if parts else self(x, mode=mode)  # no token at all: T = 0
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be a tensor of shape [B, T, D] with D = {self.d_model}, got {shape}")
        if cache is not None and not isinstance(cache, MLACache):
            raise TypeError(f"cache must be an MLACache or None, got {type(cache).__name__}")
        if mode not in ("auto", "mha", "mqa"):
            raise ValueError(f"mode must be 'auto', 'mha' or 'mqa', got {mode!r}")
        B, T, _ = x.shape
        cfg = self.config
        H, r, dk, dv, dr = cfg.num_heads, cfg.kv_rank, cfg.qk_head_dim, cfg.v_head_dim, cfg.rope_head_dim
        if mode == "auto":
            mode = "mqa" if T == 1 else "mha"

        q = self.q_proj(x).view(B, T, H, dk + dr)
        latent = self.latents(x)  # [B, T, r + dr]
        if cache is not None:
            latent = cache.append(latent)  # [B, S, r + dr], S = cached + T
        scale = (dk + dr) ** -0.5

        if mode == "mha":
            S = latent.shape[1]
            k = self.k_up(latent[..., :r]).view(B, S, H, dk)
            if dr:  # the shared slot joins every head's key
                k = torch.cat([k, latent[:, :, None, r:].expand(B, S, H, dr)], dim=-1)
            v = self.v_up(latent[..., :r]).view(B, S, H, dv)
            o = causal_attention(q, k, v, scale=scale)  # [B, T, H, dv]
        else:
            q_latent = self.absorb_query(q)  # [B, T, H, r + dr]
            c = latent[:, :, None, :]  # one key head shared by all query heads: [B, S, 1, r + dr]
            work = torch.promote_types(q_latent.dtype, torch.float32)
            o_latent = causal_attention(q_latent, c, c[..., :r], scale=scale, out_dtype=work)  # [B, T, H, r]
            o = self.expand_output(o_latent)

        return self.project_out(o, x)

    def latents(self, x: torch.Tensor) -> torch.Tensor:
        """What the tokens x `[B, T, D]` add to the cache: `[B, T, r + d_r]`, the normed latent, then the
        shared key slot (not normed, never rotated)."""
        kv = self.kv_down(x)
        r = self.config.kv_rank
        if self.config.rope_head_dim == 0:
            return self.kv_norm(kv)
        return torch.cat([self.kv_norm(kv[..., :r]), kv[..., r:]], dim=-1)

    def absorb_query(self, q: torch.Tensor) -> torch.Tensor:
        """MQA mode's query: `[W_uk,h^T q_h[:d_k]; q_h[d_k:]]`, `[B, T, H, d_k + d_r] -> [B, T, H, r + d_r]`,
        so that its dot product with a cached row `[c_s; k^R_s]` is the score of MHA mode."""
        cfg = self.config
        w_uk = self.k_up.weight.view(cfg.num_heads, cfg.qk_head_dim, -1)  # [H, dk, r]
        absorbed = torch.einsum("bthd,hdr->bthr", q[..., : cfg.qk_head_dim], w_uk.to(q.dtype))
        if cfg.rope_head_dim == 0:
            return absorbed
        return torch.cat([absorbed, q[..., cfg.qk_head_dim :]], dim=-1)

    def expand_output(self, o_latent: torch.Tensor) -> torch.Tensor:
        """MQA mode's values: `W_uv,h` applied after the weighted sum of latents, `[..., H, r] -> [..., H, d_v]`."""
        w_uv = self.v_up.weight.view(self.config.num_heads, self.config.v_head_dim, -1)  # [H, dv, r]
        return torch.einsum("...hr,hdr->...hd", o_latent, w_uv.to(o_latent.dtype))

    def project_out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The attention output `[B, T, H, d_v]` to `[B, T, D]`: the optional gate from x, then `W_o`."""
        B, T, H, dv = o.shape
        o = o.to(x.dtype)
        if self.gate_proj is not None:
            o = o * torch.sigmoid(self.gate_proj(x)).view(B, T, H, dv)
        return self.o_proj(o.reshape(B, T, H * dv))


def mla_absorbed_reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    value_dim: int,
) -> torch.Tensor:
    """Absorbed MLA attention of the last T tokens of each sequence over a pool of cached rows, in PyTorch.

    The reference of `kda_edu.kernels.mla_decode.mla_absorbed_attention` (same arguments: q `[B, T, H, D]`,
    the pool `[P, L_max, D]`, `slots` and `lengths` `[B]` with the T new tokens cached at positions
    `lengths - T ...`, values the first `value_dim` numbers of each row). It gathers the sequences' rows
    (a copy) and masks, for token t, the positions after `lengths - T + t`. Returns `[B, T, H, R]` in
    float32 (float64 for float64 inputs); runs on any device. Checks its arguments as the kernel does.

    Raises:
        TypeError, ValueError: an argument of another type, rank, dtype, size or device, named."""
    check_absorbed_attention_inputs(q, cache, slots, lengths, value_dim)
    T = q.shape[1]
    dtype = torch.promote_types(q.dtype, torch.float32)
    rows = cache[slots.long()].to(dtype)  # [B, L_max, D]
    scores = torch.einsum("bthd,bld->bthl", q.to(dtype), rows) * scale
    last = lengths[:, None] - T + torch.arange(T, device=q.device)  # [B, T]: each token's own position
    visible = torch.arange(cache.shape[1], device=q.device) <= last[..., None]  # [B, T, L_max]
    probs = torch.softmax(scores.masked_fill(~visible[:, :, None, :], float("-inf")), dim=-1)
    # A row that sees a non-finite cached value outputs NaN (a score of -inf alone would weight it zero);
    # the rows a token does not see (past the length, or a later new token's) are zeroed, so that no
    # non-finite value there reaches its output as 0 * inf.
    sees_bad = (~torch.isfinite(scores) & visible[:, :, None, :]).any(-1, keepdim=True)  # [B, T, H, 1]
    values = rows[:, None, :, :value_dim].masked_fill(~visible[..., None], 0.0)  # [B, T, L_max, R]
    return torch.einsum("bthl,btlr->bthr", probs, values).masked_fill(sees_bad, float("nan"))
