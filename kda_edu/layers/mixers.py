"""Token mixers that differ only in their recurrence: the layers of the models chapter 12 trains.

To compare memories fairly, every linear mixer here is the same layer with a different recurrence in the
middle. They share the projections, the short convolution, the L2-normalised q and k, the output gate and
norm, and the state size `H x K x V`:

    q, k, v = SiLU(ShortConv([W_q x; W_k x; W_v x]));  q, k = L2Norm(q), L2Norm(k)
    o       = recurrence(q, k, v, ...)                            the only part that changes
    y       = W_o (RMSNorm(o) * sigmoid(W_g2 W_g1 x + b_g))

    kind                recurrence                                 extra inputs
    "linear_attention"  S += k v^T                                 none
    "decay_only"        S = exp(g) S + k v^T (Mamba-2, RetNet)     g per head (Mamba-2 style gate), no beta
    "deltanet"          S += beta k (v - S^T k)^T                  beta = sigmoid(W_b x)
    "gated_deltanet"    S = exp(g) S, then the delta rule          beta; g per head (Mamba-2 style gate)
    "kda"               S = Diag(exp(g)) S, then the delta rule    beta; g per head and key channel
    "attention"         softmax attention over all earlier tokens  none (no state: a cache that grows)

"kda" is `kda_edu.layers.kda_layer.KDALayer` itself (one value head per key head, the softplus gate, `gate_rank` for
both low-rank gates); the other kinds rebuild that frame around their own recurrence.

The recurrences run in their chunked PyTorch forms (`linear_attention_chunked`, `delta_rule_chunked`,
`gated_delta_chunked`, `kda_chunked`), which are differentiable and far faster on a CPU than the loop. When
the backend says so (`kda_edu.backend.use_triton`: `backend="triton"`, or `"auto"` on a CUDA GPU) the three
delta-rule mixers run through the book's Triton kernel `kda_edu.kernels.chunk_kda` instead (forward and
backward): DeltaNet is KDA with g = 0, Gated DeltaNet is KDA with its per-head gate copied to every key
channel. On a GPU that replaces thousands of small PyTorch operations per training step with a few
kernels; linear attention and attention have no such kernel here and stay in PyTorch.
"attention" keeps the same layer around `kda_edu.ops.attention.softmax_attention`: its scores are the cosines of the
L2-normalised q and k times a learned temperature per head (starting at sqrt(K)), since a softmax over scores in
[-1, 1] could not pick one token out of many. It is the reference with unbounded memory. No mixer has a positional
encoding; order comes from the causal structure, the short convolution and the gates.

`kda_edu.models.recall.RecallLM` stacks them, one mixer in every block.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from kda_edu.backend import check_backend, use_triton
from kda_edu.layers.kda_layer import (
    GatedRMSNorm,
    KDAConfig,
    KDALayer,
    ShortConv,
    apply_keeping_gates,
    init_gate_parameters,
)
from kda_edu.ops.attention import softmax_attention
from kda_edu.ops.delta_rule import delta_rule_chunked
from kda_edu.ops.gated_delta import gated_delta_chunked
from kda_edu.ops.gates import beta_sigmoid, kda_gate, l2_normalize
from kda_edu.ops.linear_attention import decayed_linear_attention_chunked, linear_attention_chunked

KINDS = ("linear_attention", "deltanet", "gated_deltanet", "kda", "attention")
# Decay without the delta rule (chapter 4's 2 x 2 ablation). Kept out of KINDS, which the recall sweeps' presets
# list, so that adding it to a sweep is a decision of the sweep; every mixer accepts it.
EXTRA_KINDS = ("decay_only",)
DELTA_RULE_KINDS = ("deltanet", "gated_deltanet", "kda")  # the kinds with beta, which the Triton kernel runs
KERNEL_DTYPES = ("float32", "bfloat16", "float16")
LABELS = {
    "linear_attention": "linear attention",
    "decay_only": "decay only (Mamba-2)",
    "deltanet": "DeltaNet",
    "gated_deltanet": "Gated DeltaNet",
    "kda": "KDA",
    "attention": "softmax attention",
}


@dataclass
class MixerConfig:
    """One token mixer (its width `d_model` comes from the model).

    Attributes:
        kind: one of `KINDS` or `EXTRA_KINDS`.
        num_heads: H.
        head_dim: K = V, the width of q, k and v per head; the state of a linear mixer is `H x K x K`.
        conv_size: kernel width of the short convolution on q, k and v.
        gate_rank: inner width of the low-rank KDA decay projection and of the output gate.
        chunk_size: chunk length of the chunked recurrences (the Triton kernel's chunk is always 64).
        backend: one of `kda_edu.backend.BACKENDS`: `"torch"` (the chunked PyTorch forms), `"triton"`
            (`kda_edu.kernels.chunk_kda` for "deltanet", "gated_deltanet" and "kda"; the same as "torch" for the
            other kinds) or `"auto"` (Triton on a CUDA GPU, PyTorch elsewhere).
        kernel_dtype: when the Triton kernel runs, the dtype q, k and v are cast to for it
            (`"float32"`, `"bfloat16"` or `"float16"`; the gate and beta stay float32, the output is cast back).
            float32 makes every product inside the kernel exact float32; the 16-bit dtypes take its tensor-core
            path, as fla's kernels do in training. Only `"float32"` is allowed with `backend="torch"`.
    """

    kind: str = "kda"
    num_heads: int = 2
    head_dim: int = 32
    conv_size: int = 4
    gate_rank: int = 16
    chunk_size: int = 32
    backend: str = "torch"
    kernel_dtype: str = "float32"

    def __post_init__(self):
        if self.kind not in KINDS + EXTRA_KINDS:
            raise ValueError(f"MixerConfig.kind must be one of {KINDS + EXTRA_KINDS}, got {self.kind!r}")
        check_backend(self.backend, "MixerConfig.backend")
        if self.kernel_dtype not in KERNEL_DTYPES:
            raise ValueError(
                f"MixerConfig.kernel_dtype must be one of {KERNEL_DTYPES}, got {self.kernel_dtype!r}"
            )
        if self.backend == "torch" and self.kernel_dtype != "float32":
            raise ValueError(
                f"MixerConfig.kernel_dtype={self.kernel_dtype!r} needs backend='triton' or 'auto' (the PyTorch "
                "forms run in the model's dtype)"
            )
        for name in ("num_heads", "head_dim", "conv_size", "gate_rank", "chunk_size"):
            if isinstance(getattr(self, name), bool) or getattr(self, name) < 1:
                raise ValueError(f"MixerConfig.{name} must be an int >= 1, got {getattr(self, name)!r}")

    @property
    def state_size(self) -> int | None:
        """Numbers in the recurrent state per sequence, `H K K`; None for attention (its cache grows)."""
        return None if self.kind == "attention" else self.num_heads * self.head_dim**2


class TokenMixer(nn.Module):
    """A sequence-mixing layer `[B, T, D] -> [B, T, D]` with the recurrence chosen by `config.kind`.

    For "kda" the layer is a `KDALayer` (`self.kda`, built by `kda_config`), whose parameters it holds;
    every other kind holds its own projections, convolution, gates and output norm, named as `KDALayer`'s.

    Args:
        d_model: D.
        config: a `MixerConfig`.
    """

    def __init__(self, d_model: int, config: MixerConfig):
        super().__init__()
        self.d_model, self.config = d_model, config
        if config.kind == "kda":
            self.kda = KDALayer(d_model, kda_config(config))
            self._register_load_state_dict_pre_hook(_rename_flat_kda_names, with_module=True)
            return
        self.kda = None
        H, K, r = config.num_heads, config.head_dim, config.gate_rank
        self.q_proj = nn.Linear(d_model, H * K, bias=False)
        self.k_proj = nn.Linear(d_model, H * K, bias=False)
        self.v_proj = nn.Linear(d_model, H * K, bias=False)
        self.conv = ShortConv(3 * H * K, config.conv_size)
        if config.kind in DELTA_RULE_KINDS:
            self.b_proj = nn.Linear(d_model, H, bias=False)
        if config.kind in (
            "gated_deltanet",
            "decay_only",
        ):  # one decay per head: -exp(A_log) softplus(W_f x + dt_bias)
            self.f_proj = nn.Linear(d_model, H, bias=False)
            self.A_log, self.dt_bias = nn.Parameter(torch.empty(H)), nn.Parameter(torch.empty(H))
        if config.kind == "attention":  # softmax needs sharp scores: cosine similarity times sqrt(K) at first
            self.log_temperature = nn.Parameter(torch.full((H,), 0.5 * math.log(K)))
        self.g_down = nn.Linear(d_model, r, bias=False)
        self.g_up = nn.Linear(r, H * K, bias=True)
        self.o_norm = GatedRMSNorm(K, eps=1e-5)
        self.o_proj = nn.Linear(H * K, d_model, bias=False)
        if hasattr(self, "A_log"):
            self.reset_gate_parameters()

    def reset_gate_parameters(self) -> None:
        """As `KDALayer` (`kda_edu.layers.kda_layer.init_gate_parameters`, softplus gate): step sizes log-uniform in
        [0.001, 0.1] (through `dt_bias`), rates `exp(A_log)` uniform in [1, 16], so the heads start with a
        spread of memory lengths. Kinds without a decay have nothing to initialise."""
        if self.kda is not None:
            self.kda.reset_gate_parameters()
        elif hasattr(self, "A_log"):
            init_gate_parameters(self.A_log, self.dt_bias, "softplus")

    @property
    def output_projection(self) -> nn.Linear:
        """The projection that writes into the residual stream (`o_proj`, of the `KDALayer` for "kda")."""
        return self.o_proj if self.kda is None else self.kda.o_proj

    def _apply(self, fn, recurse=True):  # `to(torch.bfloat16)` and the like leave the gate in float32
        return apply_keeping_gates(self, fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[B, T, D]` -> `[B, T, D]`."""
        if self.kda is not None:
            return self.kda(x)
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be a tensor of shape [B, T, D] with D = {self.d_model}, got {shape}")
        cfg = self.config
        B, T, _ = x.shape
        H, K, C = cfg.num_heads, cfg.head_dim, cfg.chunk_size
        qkv, _ = self.conv(torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1))
        q, k, v = (t.reshape(B, T, H, K) for t in qkv.split(H * K, dim=-1))
        q, k = l2_normalize(q), l2_normalize(k)
        if cfg.kind == "attention":  # cosine scores times a learned temperature per head
            o = softmax_attention(q * self.log_temperature.exp()[:, None], k, v, scale=1.0)
        elif cfg.kind == "linear_attention":
            o, _ = linear_attention_chunked(q, k, v, chunk_size=C)
        elif cfg.kind == "decay_only":
            g = kda_gate(self.f_proj(x), self.A_log, self.dt_bias)  # [B, T, H]
            o, _ = decayed_linear_attention_chunked(q, k, v, g, chunk_size=C)
        else:
            beta = beta_sigmoid(self.b_proj(x))
            g = (
                None if cfg.kind == "deltanet" else kda_gate(self.f_proj(x), self.A_log, self.dt_bias)
            )  # [B, T, H]
            o = self._delta_rule(q, k, v, g, beta)
        o = self.o_norm(o, self.g_up(self.g_down(x)).view(B, T, H, K))
        return self.o_proj(o.reshape(B, T, H * K))

    def _delta_rule(self, q, k, v, g, beta) -> torch.Tensor:
        """DeltaNet (g None) or Gated DeltaNet (g `[B, T, H]`), by the config's backend."""
        C = self.config.chunk_size
        if use_triton(self.config.backend, q):
            from kda_edu.kernels import chunk_kda  # imported on use: `import kda_edu` never imports Triton

            g = torch.zeros_like(k, dtype=torch.float32) if g is None else g[..., None].expand_as(k)
            dtype = getattr(torch, self.config.kernel_dtype)
            # g <= 0 and beta in (0, 1) by construction (log-sigmoid-type gates, a sigmoid): no value check,
            # which would cost a host synchronisation per layer call.
            o = chunk_kda(q.to(dtype), k.to(dtype), v.to(dtype), g.float(), beta, check_inputs=False)[0]
            return o.to(q.dtype)
        if g is None:
            return delta_rule_chunked(q, k, v, beta, chunk_size=C)[0]
        return gated_delta_chunked(q, k, v, g, beta, chunk_size=C)[0]


def kda_config(config: MixerConfig) -> KDAConfig:
    """The `KDAConfig` of a "kda" `MixerConfig`: H heads of width K for q, k and v, the softplus gate, the
    mixer's gate rank, chunk, backend and kernel dtype."""
    return KDAConfig(
        num_heads=config.num_heads,
        head_dim=config.head_dim,
        conv_size=config.conv_size,
        gate="softplus",
        gate_rank=config.gate_rank,
        chunk_size=config.chunk_size,
        norm_eps=1e-5,
        backend=config.backend,
        kernel_dtype=None if config.backend == "torch" else config.kernel_dtype,
    )


# The names a "kda" TokenMixer's parameters had when it held them itself, and their names in its KDALayer.
_FLAT_KDA_NAMES = {"f_proj.0.weight": "kda.f_down.weight", "f_proj.1.weight": "kda.f_up.weight"}


def _rename_flat_kda_names(module, state_dict, prefix, *args) -> None:
    """Load a "kda" TokenMixer's state dict saved with flat names (`q_proj.weight`, `f_proj.0.weight`, ...)
    into the `KDALayer` it holds (`kda.q_proj.weight`, `kda.f_down.weight`, ...)."""
    for name in [n for n in state_dict if n.startswith(prefix) and not n.startswith(prefix + "kda.")]:
        local = name[len(prefix) :]
        state_dict[prefix + _FLAT_KDA_NAMES.get(local, "kda." + local)] = state_dict.pop(name)
