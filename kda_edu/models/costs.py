"""What one appended token costs a layer: FLOPs and bytes, counted from the formulas, not measured.

Two quantities per appended token, for one sequence (batch 1):

- **FLOPs** of the matrix products (2 per multiply-add), plus, for KDA, the elementwise work on the state
  (decay: 1 per entry; rank-1 update: 2 per entry), which is as large as a product there. Elementwise work on
  vectors (softmax, gates, norms, activations) is left out: it is O(S H) or O(D) per token, small next to the
  products. For MLA these are exactly the FLOPs `torch.utils.flop_counter.FlopCounterMode` counts for one
  forward call of our layer; for the KDA decoding step, that count plus the state work and the short
  convolution, which our code writes as elementwise operations (tested).
- **Bytes** of cache traffic: the cache read and written, plus the intermediates a mode materialises per
  position (MHA mode's expanded keys and values). Weights are left out (every mode reads the same weights once
  per call, whatever the context length).

A call appends `appended` tokens at once (1 = decoding; more = prefill or an agent appending a tool result)
to a context that then holds `context_len` tokens; work done once per call (expanding the latents, reading the
cache or the state) is divided over the appended tokens. The attention of the appended tokens is counted
over the whole `context_len` keys, as our layers compute it (masked scores included).

The MLA counts follow `MLAConfig.rope_head_dim` (d_r): each head's query and key have d_r numbers beside d_k,
the key part shared by all heads and cached beside the latent. DeepSeek rotates that slot (RoPE); Kimi Linear
keeps it and never rotates it (NoPE); the cost is the same. `KIMI_LINEAR_48B` is Kimi Linear's published
attention layout, `attention_flops_per_position` the attention FLOPs per cached position of either MLA mode,
and `counted_attention_flops_per_position` the same number counted by `FlopCounterMode` on a live layer.
"""

from dataclasses import dataclass, field

import torch
from torch.utils.flop_counter import FlopCounterMode

from kda_edu.layers.kda_layer import KDAConfig
from kda_edu.layers.mla import MLA, MLAConfig
from kda_edu.models.model import HybridConfig

# Kimi Linear 48B's mixers, from its published config: 27 layers, full attention (MLA) at layers 4, 8, ..., 24
# and 27 (7 of 27, one-based), KDA at the other 20; width 2304, vocabulary 163840. MLA: 32 heads, latent 512,
# nope/rope/v head widths 128/64/128, the 64-wide slot kept and never rotated, no query LoRA. KDA: 32 heads
# of 128, convolution 4. The feed-forward layers (a mixture of 256 experts) are not modelled: they change
# neither the caches nor the attention FLOPs.
KIMI_LINEAR_48B = HybridConfig(
    vocab_size=163840,
    d_model=2304,
    n_layers=27,
    layer_pattern="KKKA" * 6 + "KKA",
    kda=KDAConfig(num_heads=32, head_dim=128, conv_size=4),
    mla=MLAConfig(num_heads=32, kv_rank=512, qk_head_dim=128, v_head_dim=128, rope_head_dim=64),
)


@dataclass(frozen=True)
class TokenCost:
    """Cost per appended token.

    Attributes:
        flops: total FLOPs (the sum of `parts`).
        bytes: cache and intermediate bytes moved.
        parts: FLOPs by part, for example `{"projections": ..., "attention": ...}`.
    """

    flops: float
    bytes: float
    parts: dict[str, float] = field(default_factory=dict)


def _check_lengths(context_len: int, appended: int) -> None:
    if appended < 1:
        raise ValueError(f"appended must be >= 1, got {appended}")
    if context_len < appended:
        raise ValueError(
            f"context_len must be >= appended = {appended} (it includes them), got {context_len}"
        )


def mla_token_cost(
    config: MLAConfig,
    d_model: int,
    context_len: int,
    mode: str,
    appended: int = 1,
    rope_head_dim: int | None = None,
    dtype_bytes: int = 2,
) -> TokenCost:
    """FLOPs and bytes per appended token of an MLA layer in MHA or MQA mode.

    With H heads, latent width r, per-head widths d_k, d_v, RoPE width d_r, context S and n appended tokens:

    - projections (both modes): `2 D (H (d_k + d_r) + r + d_r + H d_v [gate]) + 2 H d_v D`
    - MHA mode: expand all S latents to keys and values once per call, `2 S r H (d_k + d_v) / n`; attention
      `2 S H (d_k + d_r + d_v)`. Bytes: read the cache `S (r + d_r)`, write and read back the expanded keys and
      values `2 S H (d_k + d_v)`, both per call, so divided by n; write the new latent `r + d_r`.
    - MQA mode: absorb `W_uk` into the query `2 H d_k r`, attention over the latents `2 S H (r + d_r + r)`,
      apply `W_uv` after it `2 H r d_v`. Bytes: read the cache `S (r + d_r)` per call, divided by n; write
      the new latent.

    Args:
        config: the layer's `MLAConfig`.
        d_model: D.
        context_len: S, tokens in the context after the append (appended ones included).
        mode: `"mha"` or `"mqa"`.
        appended: n, tokens appended in one call.
        rope_head_dim: d_r; None takes `config.rope_head_dim`.
        dtype_bytes: bytes per cached number (2 for bf16).
    """
    _check_lengths(context_len, appended)
    if mode not in ("mha", "mqa"):
        raise ValueError(f"mode must be 'mha' or 'mqa', got {mode!r}")
    dr = config.rope_head_dim if rope_head_dim is None else rope_head_dim
    H, r, dk, dv = config.num_heads, config.kv_rank, config.qk_head_dim, config.v_head_dim
    S, n, D, b = context_len, appended, d_model, dtype_bytes
    gate = H * dv if config.output_gate else 0
    parts = {"projections": 2 * D * (H * (dk + dr) + r + dr + gate) + 2 * H * dv * D}
    cache_read, latent_write = S * (r + dr) * b / n, (r + dr) * b
    if mode == "mha":
        parts["expand"] = 2 * S * r * H * (dk + dv) / n
        parts["attention"] = 2 * S * H * (dk + dr + dv)
        nbytes = cache_read + 2 * S * H * (dk + dv) * b / n + latent_write
    else:
        parts["absorb"] = 2 * H * dk * r + 2 * H * r * dv
        parts["attention"] = 2 * S * H * (r + dr + r)
        nbytes = cache_read + latent_write
    return TokenCost(flops=sum(parts.values()), bytes=nbytes, parts=parts)


def kda_token_cost(
    config: KDAConfig, d_model: int, appended: int = 1, dtype_bytes: int = 2, state_bytes: int = 4
) -> TokenCost:
    """FLOPs and bytes per appended token of a KDA layer; independent of the context length.

    With H query/key heads, HV value heads of widths K and V, gate rank R, convolution width W over
    C = 2 H K + HV V channels and n appended tokens:

    - projections: `2 D (2 H K + HV V + R + HV + R) + 2 R HV (K + V) + 2 HV V D`; convolution `2 W C`.
    - recurrence, n = 1 (one step, per value head): `S^T k` and `S^T q` `4 K V`, decay `K V`, rank-1 update
      `2 K V`: `7 K V`.
    - recurrence, n > 1 (chunked, chunk C_h = `config.chunk_size`, per value head and token, counting the
      chunked algorithm's products at full chunk size as a kernel computes them): the C_h x C_h matrices A and
      Aqk `4 C_h K`, the triangular solves for u and w `C_h (K + V)`, `Aqk U` `2 C_h V`, and the three
      products with the state `U = u - w S`, `q S`, `k^T U`: `6 K V`, plus the state decay `K V / C_h`.
    - bytes: read and write the state (`HV K V` numbers of `state_bytes`) and the convolution window
      (`(W - 1) C` numbers of `dtype_bytes`) once per call, divided by n.

    Args:
        config: the layer's `KDAConfig`.
        d_model: D.
        appended: n, tokens appended in one call.
        dtype_bytes: bytes per number of the convolution window.
        state_bytes: bytes per number of the recurrent state (4: float32).
    """
    if appended < 1:
        raise ValueError(f"appended must be >= 1, got {appended}")
    H, HV, K, V, R, W = (
        config.num_heads,
        config.hv,
        config.head_dim,
        config.v_dim,
        config.rank,
        config.conv_size,
    )
    D, n, Ch = d_model, appended, config.chunk_size
    C = 2 * H * K + HV * V
    parts = {
        "projections": 2 * D * (C + R + HV + R) + 2 * R * HV * (K + V) + 2 * HV * V * D,
        "conv": 2 * W * C,
    }
    if n == 1:
        parts["recurrence"] = HV * 7 * K * V
    else:
        parts["recurrence"] = HV * (4 * Ch * K + Ch * (K + V) + 2 * Ch * V + 6 * K * V + K * V / Ch)
    nbytes = (2 * HV * K * V * state_bytes + 2 * (W - 1) * C * dtype_bytes) / n
    return TokenCost(flops=sum(parts.values()), bytes=nbytes, parts=parts)


def cache_bytes(config: HybridConfig, context_len: int, batch_size: int = 1, dtype_bytes: int = 4) -> dict:
    """Bytes a `HybridLM`'s cache holds after `context_len` tokens, by layer kind: `{"kda": ..., "mla": ...}`.

    KDA layers hold a fixed `(W - 1) C` window (`dtype_bytes` each) and `HV K V` state (float32, or 8 bytes
    each for a float64 model, `dtype_bytes = 8`); MLA layers hold `context_len` rows of width r + d_r.
    This is the formula; `HybridCache.nbytes_by_kind()` measures a live cache (they agree, tested).
    """
    kda, mla = config.kda, config.mla
    state_bytes = max(dtype_bytes, 4)
    per_kda = (kda.conv_size - 1) * (2 * kda.num_heads * kda.head_dim + kda.hv * kda.v_dim) * dtype_bytes
    per_kda += kda.hv * kda.head_dim * kda.v_dim * state_bytes
    per_mla = context_len * mla.cache_width * dtype_bytes
    kinds = config.layer_kinds
    return {
        "kda": batch_size * kinds.count("K") * per_kda,
        "mla": batch_size * kinds.count("A") * per_mla,
    }


def attention_flops_per_position(config: MLAConfig, mode: str) -> int:
    """Attention FLOPs one query token spends per cached position, all heads, from the config alone.

    MHA mode: scores over `d_k + d_r`, values of `d_v`: `2 H (d_k + d_r + d_v)`. MQA (absorbed) mode: scores
    over the cached row `r + d_r`, values are its first r numbers: `2 H (r + d_r + r)`. (MHA mode's expansion
    of the latents is not attention; `mla_token_cost` counts it apart.) Kimi Linear: 1088 / 320 = 3.4.
    """
    if mode not in ("mha", "mqa"):
        raise ValueError(f"mode must be 'mha' or 'mqa', got {mode!r}")
    H, r, dr = config.num_heads, config.kv_rank, config.rope_head_dim
    per_head = config.qk_head_dim + dr + config.v_head_dim if mode == "mha" else 2 * r + dr
    return 2 * H * per_head


def counted_attention_flops_per_position(
    config: MLAConfig, d_model: int, mode: str, contexts=(64, 128)
) -> float:
    """`attention_flops_per_position`, counted: `FlopCounterMode` over one decoded token of a live `MLA`
    layer after two context lengths, minus the FLOPs of the layer's own linear maps (projections, and MHA
    mode's expansion of the latents), divided by the difference in length.

    The layer is built on PyTorch's "meta" device, which runs shapes without numbers, so Kimi's real widths
    cost nothing to count.
    """
    counts = []
    with torch.device("meta"):
        layer = MLA(d_model, config)
        for S in contexts:
            cache = layer.new_cache()
            cache.latent = torch.empty(1, S, config.cache_width)
            with FlopCounterMode(display=False) as counter, torch.no_grad():
                layer(torch.empty(1, 1, d_model), cache=cache, mode=mode)
            linear = sum(
                sum(ops.values())
                for name, ops in counter.get_flop_counts().items()
                if name.count(".") == 1  # "MLA.q_proj" and the like: the layer's submodules
            )
            counts.append(counter.get_total_flops() - linear)
    return (counts[1] - counts[0]) / (contexts[1] - contexts[0])
