"""A small Kimi-Linear-style language model: KDA layers and MLA layers stacked in a repeating pattern.

Every block is pre-norm, `x = x + mixer(RMSNorm(x))` then `x = x + ffn(RMSNorm(x))`, where the mixer is a
`KDALayer` ("K") or an `MLA` layer ("A") and the feed-forward layer is a SwiGLU or a small mixture of experts.
`HybridConfig.layer_pattern` repeats over the depth:

    "KKKA"  the hybrid: three KDA layers to one MLA layer, Kimi Linear's ratio (the default)
    "K"     pure KDA, for comparison
    "A"     pure (latent) attention, for comparison

Options that Kimi K3 adds (chapter 14), all off by default: a (latent) mixture of experts in `ffn`, with
`dense_layers` dense blocks first; attention residuals over depth (`attn_residuals`, `kda_edu.layers.attn_residuals`);
the MLA output gate (`MLAConfig.output_gate`); full-rank KDA gates (`KDAConfig.full_rank`).

There is no positional encoding anywhere: the KDA layers (gates, short convolutions) and the causal mask carry
the order of the tokens, as in Kimi Linear, whose MLA layers are NoPE.

Decoding uses a `HybridCache`, one cache per layer: a `KDACache` (convolution window and recurrent state,
fixed size) for a KDA layer, an `MLACache` (one latent per token, growing) for an MLA layer. Feeding tokens
one at a time through the cache gives the same logits as one forward pass over the whole sequence.
"""

import dataclasses
import math
import typing
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn as nn

from kda_edu.layers.attn_residuals import DepthAttention, DepthStream
from kda_edu.layers.ffn import FFNConfig, LatentMoE, MoE, SwiGLU, build_ffn
from kda_edu.layers.kda_layer import KDACache, KDAConfig, KDALayer
from kda_edu.layers.mla import MLA, MLACache, MLAConfig
from kda_edu.ops.varlen import check_attention_mask, check_cu_seqlens, repad, unpad

HYBRID = "KKKA"
PURE_KDA = "K"
PURE_ATTENTION = "A"


@dataclass
class HybridConfig:
    """The whole model.

    Attributes:
        vocab_size: number of token ids.
        d_model: D, the width of the residual stream.
        n_layers: number of blocks.
        layer_pattern: the mixer of each block, "K" (KDA) or "A" (MLA), repeated over the depth: block i
            uses `layer_pattern[i % len(layer_pattern)]`. See `HYBRID`, `PURE_KDA`, `PURE_ATTENTION`.
        kda: the configuration of every KDA layer.
        mla: the configuration of every MLA layer.
        ffn: the configuration of every feed-forward layer.
        dense_layers: the first `dense_layers` blocks use a dense SwiGLU of width `ffn.hidden` even when
            `ffn` has experts (Kimi Linear and K3 keep their first block dense).
        attn_residuals: `"none"` (the ordinary residual sum), `"full"` (every sublayer's input is a softmax
            over all earlier sublayers' outputs) or `"block"` (over sums of `attn_res_block_size` sublayers);
            see `kda_edu.layers.attn_residuals`.
        attn_res_block_size: sublayers (a block has two: its mixer and its feed-forward layer) per source of
            the `"block"` form.
        tie_embeddings: the output projection reuses the token embedding matrix.
        norm_eps: epsilon of the blocks' RMSNorms.
        init_std: standard deviation of the initial projection and embedding weights.
    """

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    layer_pattern: str = HYBRID
    kda: KDAConfig = field(default_factory=KDAConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)
    ffn: FFNConfig = field(default_factory=FFNConfig)
    dense_layers: int = 0
    attn_residuals: str = "none"
    attn_res_block_size: int = 4
    tie_embeddings: bool = True
    norm_eps: float = 1e-6
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"HybridConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.layer_pattern or set(self.layer_pattern) - {"K", "A"}:
            raise ValueError(
                f"HybridConfig.layer_pattern must be a non-empty string of 'K' (KDA) and 'A' (MLA), "
                f"got {self.layer_pattern!r}"
            )
        if not 0 <= self.dense_layers <= self.n_layers:
            raise ValueError(f"HybridConfig.dense_layers must lie in [0, n_layers], got {self.dense_layers}")
        if self.attn_residuals not in ("none", "full", "block"):
            raise ValueError(
                f"HybridConfig.attn_residuals must be 'none', 'full' or 'block', got {self.attn_residuals!r}"
            )
        if self.attn_res_block_size < 1:
            raise ValueError(f"HybridConfig.attn_res_block_size must be >= 1, got {self.attn_res_block_size}")
        for name, cls in (("kda", KDAConfig), ("mla", MLAConfig), ("ffn", FFNConfig)):
            if not isinstance(getattr(self, name), cls):
                raise TypeError(
                    f"HybridConfig.{name} must be a {cls.__name__}, got {type(getattr(self, name))}"
                )

    @property
    def depth_block_size(self) -> int | None:
        """Sublayers per source of the attention residuals: 1 for `"full"`, None without them."""
        return {"none": None, "full": 1, "block": self.attn_res_block_size}[self.attn_residuals]

    @property
    def layer_kinds(self) -> str:
        """The mixer of every block, one letter per block: "KKKAKKKA" for 8 layers of the default pattern."""
        return "".join(self.layer_pattern[i % len(self.layer_pattern)] for i in range(self.n_layers))

    def to_dict(self) -> dict:
        """Plain nested dicts (JSON-ready)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HybridConfig":
        """The inverse of `to_dict`; unknown keys, and values of the wrong type (such as `"n_layers": 4.0`
        from a hand-edited JSON file), raise a `ValueError` naming them."""
        sub = {"kda": KDAConfig, "mla": MLAConfig, "ffn": FFNConfig}
        _check_keys(cls, d, "HybridConfig")
        kwargs = dict(d)
        for name, sub_cls in sub.items():
            if name in kwargs:
                _check_keys(sub_cls, kwargs[name], f"HybridConfig.{name}")
                kwargs[name] = sub_cls(**kwargs[name])
        return cls(**kwargs)


def _check_keys(cls, d: dict, what: str) -> None:
    """Every key of `d` is a field of the dataclass `cls`, and its value has the field's type (an int where
    the field is an int, not a float or a bool; a float field also takes an int)."""
    if not isinstance(d, dict):
        raise ValueError(f"{what} must be a dict, got {type(d).__name__}")
    unknown = set(d) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"{what} has unknown fields {sorted(unknown)}")
    hints = typing.get_type_hints(cls)
    for name, value in d.items():
        allowed = typing.get_args(hints[name]) or (hints[name],)
        if dataclasses.is_dataclass(allowed[0]):
            continue  # a nested config, checked on its own
        if value is None:
            ok = type(None) in allowed
        elif isinstance(value, bool):
            ok = bool in allowed
        elif isinstance(value, int):
            ok = int in allowed or float in allowed
        else:
            ok = type(value) in allowed
        if not ok:
            names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(f"{what}.{name} must be {names}, got {value!r} ({type(value).__name__})")


class HybridCache:
    """The per-layer caches of a `HybridLM`, in block order.

    Attributes:
        layers: a `KDACache` for every KDA block and an `MLACache` for every MLA block.
    """

    def __init__(self, layers: list):
        self.layers = layers

    @property
    def seq_len(self) -> int:
        """Tokens seen so far."""
        return self.layers[0].seq_len

    def nbytes(self) -> int:
        """Bytes held by all layer caches together."""
        return sum(c.nbytes() for c in self.layers)

    def nbytes_by_kind(self) -> dict[str, int]:
        """Bytes held by the KDA caches and by the MLA caches: `{"kda": ..., "mla": ...}`."""
        return {
            "kda": sum(c.nbytes() for c in self.layers if isinstance(c, KDACache)),
            "mla": sum(c.nbytes() for c in self.layers if isinstance(c, MLACache)),
        }


class Block(nn.Module):
    """Pre-norm residual block: `x + mixer(RMSNorm(x))`, then `x + ffn(RMSNorm(x))`.

    The block of every model here: `HybridLM` (a `KDALayer` or an `MLA` mixer) and
    `kda_edu.models.recall.RecallLM` (a `TokenMixer`).

    Args:
        d_model: D.
        mixer: a sequence mixer `[B, T, D] -> [B, T, D]`; one that keeps a cache takes it as `cache=`.
        ffn: a feed-forward layer `[B, T, D] -> [B, T, D]`.
        norm_eps: epsilon of the two RMSNorms.
    """

    def __init__(self, d_model: int, mixer: nn.Module, ffn: nn.Module, norm_eps: float):
        super().__init__()
        self.mixer_norm = nn.RMSNorm(d_model, eps=norm_eps)
        self.mixer = mixer
        self.ffn_norm = nn.RMSNorm(d_model, eps=norm_eps)
        self.ffn = ffn

    def forward(self, x: torch.Tensor, cache=None, **mixer_kwargs) -> torch.Tensor:
        """x `[B, T, D]` -> `[B, T, D]`; the mixer reads and advances `cache` when given, and gets
        `mixer_kwargs` (masks, sequence boundaries) as they are."""
        h = self.mixer_norm(x)
        x = x + (
            self.mixer(h, **mixer_kwargs) if cache is None else self.mixer(h, cache=cache, **mixer_kwargs)
        )
        return x + self.ffn(self.ffn_norm(x))


@torch.no_grad()
def init_projections_(module: nn.Module, std: float) -> None:
    """Normal(0, std) weights for every `nn.Linear` and `nn.Embedding` inside `module`, zero `nn.Linear` biases;
    other parameters (gates, convolutions, norms) are left as their layers initialised them."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=std)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)


def hybrid_block(config: HybridConfig, kind: str, dense: bool = False) -> Block:
    """A block of a `HybridLM`: a `KDALayer` ("K") or an `MLA` ("A") mixer, and a dense SwiGLU of width
    `config.ffn.hidden` when `dense`, else the feed-forward layer `config.ffn` asks for."""
    d = config.d_model
    mixer = KDALayer(d, config.kda) if kind == "K" else MLA(d, config.mla)
    ffn = SwiGLU(d, config.ffn.hidden) if dense else build_ffn(d, config.ffn)
    return Block(d, mixer, ffn, config.norm_eps)


class HybridLM(nn.Module):
    """Token embedding, `n_layers` blocks, a final RMSNorm and the output projection to logits.

    Args:
        config: a `HybridConfig`.
    """

    def __init__(self, config: HybridConfig):
        super().__init__()
        if not isinstance(config, HybridConfig):
            raise TypeError(f"config must be a HybridConfig, got {type(config).__name__}")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(
            hybrid_block(config, kind, dense=i < config.dense_layers)
            for i, kind in enumerate(config.layer_kinds)
        )
        # One pseudo-query per sublayer and one for the output head, when the residuals attend over depth.
        self.depth = (
            nn.ModuleList(
                DepthAttention(config.d_model, config.norm_eps) for _ in range(2 * config.n_layers + 1)
            )
            if config.attn_residuals != "none"
            else None
        )
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """Normal(0, init_std) for every projection and the embedding, zero biases; the projections that
        write into the residual stream are scaled by `1 / sqrt(2 n_layers)` so the stream's variance does not
        grow with depth (for a latent MoE, the up-projection out of the latent, not the experts' own). Layer-
        specific parameters (gates, convolutions, norms, the zero pseudo-queries) keep their own initialisation.
        """
        std = self.config.init_std
        init_projections_(self, std)
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        for block in self.blocks:
            nn.init.normal_(block.mixer.o_proj.weight, mean=0.0, std=residual_std)
            ffn = block.ffn
            writers = [ffn.down_proj] if isinstance(ffn, SwiGLU) else []
            if isinstance(ffn, MoE):
                writers = (
                    [ffn.latent_up] if isinstance(ffn, LatentMoE) else [e.down_proj for e in ffn.experts]
                )
                if ffn.shared_expert is not None:
                    writers.append(ffn.shared_expert.down_proj)
            for linear in writers:
                nn.init.normal_(linear.weight, mean=0.0, std=residual_std)

    def num_parameters(self) -> int:
        """Number of trainable numbers (a tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def update_routing_bias(self, rate: float) -> None:
        """Call `MoE.update_routing_bias(rate)` on every mixture-of-experts layer (after an optimiser step)."""
        for block in self.blocks:
            if isinstance(block.ffn, MoE):
                block.ffn.update_routing_bias(rate)

    def new_cache(self) -> HybridCache:
        """An empty cache with one layer cache per block."""
        return HybridCache([block.mixer.new_cache() for block in self.blocks])

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: HybridCache | None = None,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for every position.

        Args:
            input_ids: token ids `[B, T]`, int64, in `[0, vocab_size)`.
            cache: None for a self-contained sequence; otherwise a `HybridCache` from `new_cache()`, which
                holds the tokens before input_ids and is advanced past them in place.
            attention_mask: `[B, T]` padding mask, 1 for a token, 0 for padding (`kda_edu.ops.varlen`): each row
                is the sequence of its tokens (the ids at the padding must still be valid ids); the logits
                at the padding are zero. Not with a cache.
            cu_seqlens: int32/int64 `[N + 1]`: input_ids `[1, T]` holds N sequences packed along T, each run
                as if alone. Not with a cache.

        Returns:
            logits `[B, T, vocab_size]` in the model's dtype.
        """
        self._check_ids(input_ids)
        if cache is not None:
            self._check_cache(cache)
            if attention_mask is not None or cu_seqlens is not None:
                raise ValueError(
                    "cu_seqlens and attention_mask run self-contained sequences: pass cache=None"
                )
        B, T = input_ids.shape
        if attention_mask is not None:
            if cu_seqlens is not None:
                raise ValueError("pass attention_mask (padded batch) or cu_seqlens (packed batch), not both")
            mask = check_attention_mask(attention_mask, B, T, input_ids.device)
            packed, indices, cu = unpad(input_ids, mask)
            return repad(self._logits(packed, None, cu_seqlens=cu), indices, B, T)
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, B, T, input_ids.device)
            return self._logits(input_ids, None, cu_seqlens=cu_seqlens)
        return self._logits(input_ids, cache)

    def _logits(
        self, input_ids: torch.Tensor, cache: HybridCache | None, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`forward` without the input checks (which cost a device-to-host sync per call on a GPU)."""
        x = self.embed(input_ids)
        if self.depth is not None:
            return self.lm_head(self.norm(self.depth_residuals(x, cache, cu_seqlens=cu_seqlens)[0]))
        kwargs = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        for i, block in enumerate(self.blocks):
            x = block(x, cache=None if cache is None else cache.layers[i], **kwargs)
        return self.lm_head(self.norm(x))

    def depth_residuals(
        self, x: torch.Tensor, cache: HybridCache | None = None, cu_seqlens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, DepthStream]:
        """The blocks with attention residuals: embeddings x `[B, T, D]` -> (the output head's input `[B, T, D]`,
        the `DepthStream` of the pass, which records the sources it kept). Every sublayer reads the softmax
        mixture of the sources its pseudo-query asks for, and its output joins the sources. `cu_seqlens` as
        in `forward`."""
        stream = DepthStream(x, self.config.depth_block_size)
        kwargs = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        for i, block in enumerate(self.blocks):
            h = self.depth[2 * i](stream.sources())
            layer_cache = None if cache is None else cache.layers[i]
            stream.add(block.mixer(block.mixer_norm(h), cache=layer_cache, **kwargs))
            h = self.depth[2 * i + 1](stream.sources())
            stream.add(block.ffn(block.ffn_norm(h)))
        return self.depth[-1](stream.sources()), stream

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
    ) -> torch.Tensor:
        """Continue every sequence by up to `max_new_tokens` tokens, one forward step per token through a cache.

        The prompt is processed in one call (chunked KDA, MHA-mode MLA); each new token then costs one
        decoding step (recurrent KDA step, MQA-mode MLA).

        Args:
            input_ids: prompts `[B, T]`, int64.
            max_new_tokens: how many tokens to add at most, >= 0.
            temperature: 0 picks the most likely token (greedy); > 0 samples from `softmax(logits / temperature)`
                (computed so that a temperature too small for the division, such as 1e-300, is the greedy
                limit rather than an overflow).
            top_k: when sampling, only the k most likely tokens can be drawn; None means all.
            generator: the random generator for sampling (for reproducible samples).
            eos_token_id: an end-of-sequence id (or a list of them): a sequence that produces one is finished,
                and every later position of it holds `pad_token_id`. Generation stops early once every
                sequence is finished. None: always `max_new_tokens` tokens.
            pad_token_id: what follows a finished sequence's end; None means the (first) eos_token_id.

        Returns:
            `[B, T + n]`: the prompts followed by the generated tokens, n <= max_new_tokens (n <
            max_new_tokens only when every sequence ended early).
        """
        self._check_ids(input_ids)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
        eos = self._check_special_ids(eos_token_id, pad_token_id)
        if max_new_tokens == 0:
            return input_ids.clone()  # a tensor of its own, as every other call returns
        pad = None if eos is None else (eos[0] if pad_token_id is None else pad_token_id)
        tokens = [input_ids]
        cache = self.new_cache()
        finished = torch.zeros(input_ids.shape[0], 1, dtype=torch.bool, device=input_ids.device)
        logits = self._logits(input_ids, cache)[:, -1]
        for i in range(max_new_tokens):
            next_id = _pick(logits, temperature, top_k, generator)  # [B, 1]
            if eos is not None:
                next_id = next_id.masked_fill(finished, pad)
                finished |= torch.isin(next_id, eos)
            tokens.append(next_id)
            if i + 1 == max_new_tokens or (eos is not None and bool(finished.all())):
                break
            logits = self._logits(next_id, cache)[:, -1]
        return torch.cat(tokens, dim=1)

    def _check_special_ids(self, eos_token_id, pad_token_id) -> torch.Tensor | None:
        """eos_token_id as a 1-D int64 tensor on the model's device (None stays None), after checking both ids."""
        vocab = self.config.vocab_size

        def is_id(t) -> bool:
            return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab

        if pad_token_id is not None and not is_id(pad_token_id):
            raise ValueError(
                f"pad_token_id must be None or an int in [0, vocab_size = {vocab}), got {pad_token_id!r}"
            )
        if eos_token_id is None:
            if pad_token_id is not None:
                raise ValueError("pad_token_id needs an eos_token_id (it fills the positions after one)")
            return None
        ids = (
            [eos_token_id]
            if isinstance(eos_token_id, int) and not isinstance(eos_token_id, bool)
            else eos_token_id
        )
        if not isinstance(ids, (list, tuple)) or not ids or not all(is_id(t) for t in ids):
            raise ValueError(
                f"eos_token_id must be None, an int or a non-empty list of ints in [0, vocab_size = {vocab}), "
                f"got {eos_token_id!r}"
            )
        return torch.tensor(ids, dtype=torch.long, device=self.embed.weight.device)

    def _check_ids(self, input_ids: torch.Tensor) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
            got = (
                f"{tuple(input_ids.shape)} {input_ids.dtype}"
                if isinstance(input_ids, torch.Tensor)
                else type(input_ids).__name__
            )
            raise ValueError(f"input_ids must be an int64 tensor of shape [B, T], got {got}")
        if input_ids.numel() == 0:
            raise ValueError(f"input_ids must have B, T >= 1, got {tuple(input_ids.shape)}")
        if input_ids.min() < 0 or input_ids.max() >= self.config.vocab_size:
            raise ValueError(
                f"input_ids must lie in [0, vocab_size = {self.config.vocab_size}), "
                f"got values in [{input_ids.min().item()}, {input_ids.max().item()}]"
            )

    def _check_cache(self, cache: HybridCache) -> None:
        if not isinstance(cache, HybridCache):
            raise TypeError(
                f"cache must be a HybridCache (from new_cache()) or None, got {type(cache).__name__}"
            )
        expected = {"K": KDACache, "A": MLACache}
        kinds = self.config.layer_kinds
        if len(cache.layers) != len(kinds) or not all(
            isinstance(c, expected[kind]) for c, kind in zip(cache.layers, kinds, strict=True)
        ):
            letter = {KDACache: "K", MLACache: "A"}
            got = "".join(letter.get(type(c), "?") for c in cache.layers)
            raise ValueError(f"cache must have one layer cache per block, kinds {kinds!r}, got {got!r}")


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, generator) -> torch.Tensor:
    """The next token `[B, 1]` from last-position logits `[B, vocab]`: argmax, or a (top-k) sample.

    Sampling draws from `softmax((logits - max) / temperature)`, the division in float64, where any
    temperature > 0 is a nonzero number: the most likely tokens get exactly 0 and the others a number <= 0
    that may overflow to -inf, so the probabilities stay finite for every temperature. As the temperature
    goes to 0 this becomes greedy decoding (a uniform draw among tokens tied for the maximum).
    """
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float()
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    shifted = (logits - logits.amax(dim=-1, keepdim=True)).double() / temperature
    probs = torch.softmax(shifted, dim=-1).float()
    return torch.multinomial(probs, num_samples=1, generator=generator)
