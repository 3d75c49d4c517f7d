"""The KDA layer: everything around the recurrence that turns `x [B, T, D]` into `y [B, T, D]`.

`kda_edu.ops.kda` is the recurrence itself. A layer has to produce its inputs from the hidden states and turn its
output back into hidden states:

    q, k, v = SiLU(ShortConv([W_q x; W_k x; W_v x]))        causal depthwise convolution, kernel 4
    q, k    = L2Norm(q), L2Norm(k)                          per head, so the delta rule stays stable
    g       = gate(W_f2 W_f1 x)                             low-rank decay per value head and key channel
    beta    = sigmoid(W_b x)                                one write strength per value head
    o       = KDA(q, k, v, g, beta)                         chunked for prefill/training, step for decoding
    o       = RMSNorm(o) * sigmoid(W_g2 W_g1 x + b_g)       per head, low-rank output gate
    y       = W_o o

`KDAConfig.full_rank` replaces a low-rank gate projection by one full matrix: `"decay"` (`W_f x`, D x HV K),
`"output"` (`W_g x + b_g`, D x HV V) or `"both"`. A low-rank product `W_2 W_1` of rank R can only express
matrices of rank <= R; the full matrix can express any, at `D HV K` parameters instead of `R (D + HV K)`.

`gate` is one of the two parametrisations of `kda_edu.ops.gates` (`KDAConfig.gate`):
`"softplus"`: `-exp(A_log) * softplus(. + dt_bias)`, or `"lower_bound"`:
`lower_bound * sigmoid(exp(A_log) * (. + dt_bias))`.

For decoding, a `KDACache` keeps what the next token needs: the last `conv_size - 1` inputs of the
convolution and the recurrent state `[B, HV, K, V]`. Both have a fixed size, whatever the context length.

`KDAConfig.backend` picks where the recurrence runs (`kda_edu.backend.use_triton`): by default in the Triton
kernels on a CUDA GPU (`kda_edu.kernels.chunk_kda`, whose backward of chapter 9 gives the gradients in
training; `fused_recurrent_kda` for a decoding step without gradients) and in the PyTorch `kda_chunked` /
`kda_step` elsewhere. Where the recurrence runs in the kernels, so do the parts around it, for a float32,
bfloat16 or float16 layer: the short convolution and SiLU (`fused_short_conv`), the L2 norm of q and k
(`fused_l2_normalize`), the gate and beta (`fused_kda_gates`) and the gated output norm (`fused_gated_rms_norm`),
each one kernel forward and one backward instead of a chain of PyTorch operations that each read and write
the whole activation and keep it for the backward. They compute what the modules below compute, with the same
parameters.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from kda_edu.backend import KERNEL_FLOATS, check_backend, use_triton
from kda_edu.ops._checks import compute_dtype
from kda_edu.ops.gates import beta_sigmoid, kda_gate, kda_gate_lower_bound, l2_normalize, overflow_scale
from kda_edu.ops.kda import kda_chunked, kda_step
from kda_edu.ops.varlen import check_attention_mask, check_cu_seqlens, positions_in_sequence, repad, unpad


@dataclass
class KDAConfig:
    """A KDA layer (its width `d_model` comes from the model).

    Attributes:
        num_heads: H, query/key heads.
        head_dim: K, query/key width per head.
        num_v_heads: HV, value heads, a multiple of H; None means H.
        v_head_dim: V, value width per head; None means K.
        conv_size: kernel width of the causal short convolution on q, k and v.
        gate: `"softplus"` (`-exp(A_log) * softplus(x + dt_bias)`) or `"lower_bound"`
            (`lower_bound * sigmoid(exp(A_log) * (x + dt_bias))`).
        lower_bound: the most negative log decay per step for the `"lower_bound"` gate, < 0.
        gate_rank: inner width of the low-rank decay and output-gate projections; None means V.
        full_rank: which gate projections are one full matrix instead of a low-rank pair: `"none"`,
            `"decay"`, `"output"` or `"both"`.
        chunk_size: chunk length of the chunked PyTorch form (the Triton kernel's chunk is always 64).
        norm_eps: epsilon of the per-head gated RMSNorm on the output.
        backend: where the recurrence runs, one of `kda_edu.backend.BACKENDS`: `"auto"` (the Triton kernels
            on a CUDA GPU, PyTorch elsewhere), `"torch"` or `"triton"` (on a CPU: Triton's interpreter).
        kernel_dtype: the dtype q, k and v are cast to for the Triton kernels (`"float32"`, `"bfloat16"` or
            `"float16"`; g and beta are not cast, the output is cast back); None keeps the layer's dtype.
    """

    num_heads: int = 4
    head_dim: int = 32
    num_v_heads: int | None = None
    v_head_dim: int | None = None
    conv_size: int = 4
    gate: str = "softplus"
    lower_bound: float = -5.0
    gate_rank: int | None = None
    full_rank: str = "none"
    chunk_size: int = 64
    norm_eps: float = 1e-5
    backend: str = "auto"
    kernel_dtype: str | None = None

    def __post_init__(self):
        check_backend(self.backend, "KDAConfig.backend")
        if self.kernel_dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(
                f"KDAConfig.kernel_dtype must be None, 'float32', 'bfloat16' or 'float16', got {self.kernel_dtype!r}"
            )
        for name in ("num_heads", "head_dim", "conv_size", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KDAConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_v_heads", "v_head_dim", "gate_rank"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"KDAConfig.{name} must be >= 1 or None, got {getattr(self, name)}")
        if self.num_v_heads is not None and self.num_v_heads % self.num_heads != 0:
            raise ValueError(
                f"KDAConfig.num_v_heads must be a multiple of num_heads = {self.num_heads}, got {self.num_v_heads}"
            )
        if self.gate not in ("softplus", "lower_bound"):
            raise ValueError(f"KDAConfig.gate must be 'softplus' or 'lower_bound', got {self.gate!r}")
        if self.full_rank not in ("none", "decay", "output", "both"):
            raise ValueError(
                f"KDAConfig.full_rank must be 'none', 'decay', 'output' or 'both', got {self.full_rank!r}"
            )
        if not (math.isfinite(self.lower_bound) and self.lower_bound < 0):
            raise ValueError(f"KDAConfig.lower_bound must be finite and < 0, got {self.lower_bound}")

    @property
    def hv(self) -> int:
        """HV, the number of value heads."""
        return self.num_heads if self.num_v_heads is None else self.num_v_heads

    @property
    def v_dim(self) -> int:
        """V, the value width per head."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def full_rank_decay(self) -> bool:
        """The decay gate's projection is one full matrix."""
        return self.full_rank in ("decay", "both")

    @property
    def full_rank_output(self) -> bool:
        """The output gate's projection is one full matrix."""
        return self.full_rank in ("output", "both")

    @property
    def rank(self) -> int:
        """Inner width of the low-rank gate projections."""
        return self.v_dim if self.gate_rank is None else self.gate_rank


class KDACache:
    """What a KDA layer keeps between calls. Its size does not grow with the context.

    Attributes:
        conv_window: the last `conv_size - 1` inputs of the short convolution `[B, conv_size - 1, C]`,
            C = 2 H K + HV V (q, k and v channels side by side); None before the first call.
        state: the recurrent state `[B, HV, K, V]`, float32 (float64 for a float64 model); None before the
            first call.
        seq_len: tokens seen so far (the longest sequence's count, or the columns of a padded batch, when
            the sequences differ in length).
    """

    def __init__(self):
        self.conv_window: torch.Tensor | None = None
        self.state: torch.Tensor | None = None
        self.seq_len = 0

    def nbytes(self) -> int:
        """Bytes held by the cache's tensors."""
        return sum(t.numel() * t.element_size() for t in (self.conv_window, self.state) if t is not None)


class ShortConv(nn.Module):
    """Causal depthwise convolution followed by SiLU: `y_t = SiLU(sum_i w_i * x_{t - W + 1 + i})` per channel.

    Written as a sum of W shifted copies, which is the definition and, at these sizes on a CPU, also much
    faster than `conv1d` with one group per channel.

    Args:
        channels: C.
        kernel_size: W.
    """

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        bound = 1 / math.sqrt(kernel_size)  # the default initialisation of nn.Conv1d
        self.weight = nn.Parameter(torch.empty(channels, kernel_size).uniform_(-bound, bound))

    def forward(
        self,
        x: torch.Tensor,
        window: torch.Tensor | None = None,
        cu_seqlens: list[int] | None = None,
        fused: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Convolve x, continuing from `window`.

        Args:
            x: `[B, T, C]`.
            window: the `W - 1` inputs before x, `[B, W - 1, C]`; None means zeros (start of a sequence).
            cu_seqlens: None, or the cumulative lengths (a list of ints, `kda_edu.ops.varlen`) of sequences packed
                along T (B = 1, no window): each starts from zeros, none sees the one before it.
            fused: run in the Triton kernels `kda_edu.kernels.fused_short_conv` (float32, bfloat16 or float16
                x) instead of the PyTorch sum below.

        Returns:
            `(y, window)`: y `[B, T, C]`, and the last `W - 1` inputs `[B, W - 1, C]` for the next call.
        """
        if fused:  # imported on use: `import kda_edu` never imports Triton
            from kda_edu.kernels import fused_short_conv

            pos = None if cu_seqlens is None else positions_in_sequence(cu_seqlens, x.device)
            return fused_short_conv(x, self.weight, window, positions=pos)
        B, T, C = x.shape
        W = self.kernel_size
        if window is None:
            window = x.new_zeros(B, W - 1, C)
        padded = torch.cat([window.to(x.dtype), x], dim=1)  # [B, W - 1 + T, C]
        if cu_seqlens is None:
            y = sum(padded[:, i : i + T] * self.weight[:, i] for i in range(W))
        else:  # term i reads the input W - 1 - i steps back: only where that is inside the same sequence
            pos = positions_in_sequence(cu_seqlens, x.device)[None, :, None]  # [1, T, 1]
            y = sum(padded[:, i : i + T] * self.weight[:, i] * (pos >= W - 1 - i) for i in range(W))
        return F.silu(y), padded[:, T:]


class GatedRMSNorm(nn.Module):
    """`RMSNorm(x) * weight * sigmoid(gate)` over the last dimension (one head's values).

    Args:
        dim: the normalised width.
        eps: added to the mean square.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """x, gate `[..., dim]` -> `[..., dim]` in gate's dtype, computed in at least float32; with `fused`, in
        the Triton kernels `kda_edu.kernels.fused_gated_rms_norm` (float32, bfloat16 or float16 inputs)."""
        if fused:
            from kda_edu.kernels import fused_gated_rms_norm

            return fused_gated_rms_norm(x, gate, self.weight, self.eps)
        dtype = compute_dtype(x.dtype)
        x = x.to(dtype)
        c = overflow_scale(
            x
        )  # a power of two: the mean square of x / c cannot overflow, the bits are the same
        x = x / c
        normed = x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + self.eps / (c * c))
        return (normed * self.weight.to(dtype) * torch.sigmoid(gate.to(dtype))).to(gate.dtype)


# The decay gate's parameters: not weights but the gate's rates and step sizes. They are created in float32 and
# the gate is computed in at least float32, so conversions keep them so (fla_compat), and weight decay spares
# them whatever their shape (training.train.make_optimizer): KDA's dt_bias is [H, K], a matrix by shape.
GATE_PARAMETERS = ("A_log", "dt_bias")


def apply_keeping_gates(module: nn.Module, fn, recurse: bool = True) -> nn.Module:
    """`nn.Module._apply` (what `to`, `half`, `bfloat16`, `cuda` ... call), except that the module's own
    `GATE_PARAMETERS` are never cast below float32: a layer converted to bf16 keeps its gate's rates and step
    sizes in float32, with the values they had (rounded to bf16, a `dt_bias` near -7, a step size near 0.001,
    would move that step size by up to about 1.6 %). Device moves and casts to float64 apply as usual."""
    own = [name for name in GATE_PARAMETERS if isinstance(getattr(module, name, None), nn.Parameter)]
    before = {name: getattr(module, name).detach().clone() for name in own}
    nn.Module._apply(module, fn, recurse)
    for name, old in before.items():
        parameter = getattr(module, name)
        wanted = compute_dtype(parameter.dtype)  # the dtype the gate is computed in
        if parameter.dtype != wanted:
            parameter.data = old.to(device=parameter.device, dtype=wanted)
            if parameter.grad is not None:
                parameter.grad = parameter.grad.to(wanted)
    return module


@torch.no_grad()
def init_gate_parameters(A_log: nn.Parameter, dt_bias: nn.Parameter, gate: str = "softplus") -> None:
    """Initialise a decay gate's `A_log` and `dt_bias` in place so the heads start with a spread of memory
    lengths.

    `dt_bias` is `softplus^-1(dt)` with `dt` log-uniform in [0.001, 0.1], so at x = 0 the softplus gate's
    step size is dt. The softplus gate's rate `exp(A_log)` starts uniform in [1, 16]; the lower-bound gate's
    slope starts at 1 (A_log = 0), which makes its initial decay about `lower_bound * dt`.
    """
    dt = torch.empty_like(dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp()
    dt_bias.copy_(torch.log(torch.expm1(dt)))
    if gate == "softplus":
        A_log.copy_(torch.empty_like(A_log).uniform_(1, 16).log())
    else:
        A_log.zero_()


class KDALayer(nn.Module):
    """Kimi Delta Attention as a sequence-mixing layer, `[B, T, D] -> [B, T, D]`.

    Args:
        d_model: D, input and output width.
        config: a `KDAConfig`.
    """

    def __init__(self, d_model: int, config: KDAConfig):
        super().__init__()
        self.d_model = d_model
        self.config = config
        H, HV, K, V, r = config.num_heads, config.hv, config.head_dim, config.v_dim, config.rank
        self.q_proj = nn.Linear(d_model, H * K, bias=False)
        self.k_proj = nn.Linear(d_model, H * K, bias=False)
        self.v_proj = nn.Linear(d_model, HV * V, bias=False)
        self.conv = ShortConv(2 * H * K + HV * V, config.conv_size)
        if config.full_rank_decay:  # decay: one value per (HV, K), from one matrix or a low-rank pair
            self.f_proj = nn.Linear(d_model, HV * K, bias=False)
        else:
            self.f_down = nn.Linear(d_model, r, bias=False)
            self.f_up = nn.Linear(r, HV * K, bias=False)
        self.A_log = nn.Parameter(torch.empty(HV))
        self.dt_bias = nn.Parameter(torch.empty(HV, K))
        self.b_proj = nn.Linear(d_model, HV, bias=False)
        if config.full_rank_output:  # output gate: one value per (HV, V)
            self.g_proj = nn.Linear(d_model, HV * V, bias=True)
        else:
            self.g_down = nn.Linear(d_model, r, bias=False)
            self.g_up = nn.Linear(r, HV * V, bias=True)
        self.o_norm = GatedRMSNorm(V, eps=config.norm_eps)
        self.o_proj = nn.Linear(HV * V, d_model, bias=False)
        self.reset_gate_parameters()

    def reset_gate_parameters(self) -> None:
        """Initialise `A_log` and `dt_bias` (`init_gate_parameters`)."""
        init_gate_parameters(self.A_log, self.dt_bias, self.config.gate)

    def new_cache(self) -> KDACache:
        """An empty cache for this layer."""
        return KDACache()

    def _apply(self, fn, recurse=True):  # `to(torch.bfloat16)` and the like leave the gate in float32
        return apply_keeping_gates(self, fn, recurse)

    def forward(
        self,
        x: torch.Tensor,
        cache: KDACache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Mix the tokens in x, continuing from the cache.

        Args:
            x: `[B, T, D]`, the next T tokens.
            cache: None for a self-contained sequence; otherwise the layer's `KDACache`, which holds the
                state after the tokens before x and is advanced past x in place. With a cache and T = 1 the
                layer takes one recurrent step; otherwise it runs the chunked form.
            cu_seqlens: int32/int64 `[N + 1]`: x `[1, T, D]` holds N sequences packed along T, each run as if
                alone (`kda_edu.ops.varlen`). With an empty cache, the cache then holds the N sequences as a batch
                of N (for decoding them together); not with a cache that holds tokens.
            attention_mask: `[B, T]` padding mask, 1 for a token, 0 for padding (`kda_edu.ops.varlen`): each row
                is the sequence of its tokens, and the output is zero at the padding. With an empty cache, the
                cache then holds each row's state after its last token. With a cache that holds S tokens the
                mask may span them too (`[B, S + T]`, as a generation loop keeps it): its last T columns must
                then be all 1 (padding only in the first call).

        Returns:
            `[B, T, D]` in x's dtype.
        """
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be a tensor of shape [B, T, D] with D = {self.d_model}, got {shape}")
        if cache is not None and not isinstance(cache, KDACache):
            raise TypeError(f"cache must be a KDACache or None, got {type(cache).__name__}")
        if cache is not None and cache.state is not None and cache.state.shape[0] != x.shape[0]:
            raise ValueError(
                f"x has batch size {x.shape[0]} but the cache holds batch size {cache.state.shape[0]}"
            )
        B, T, _ = x.shape
        if attention_mask is not None and cu_seqlens is not None:
            raise ValueError("pass attention_mask (padded batch) or cu_seqlens (packed batch), not both")
        if attention_mask is not None and cache is not None and cache.seq_len > 0:
            S = cache.seq_len
            mask_ok = isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
            if not mask_ok or attention_mask.shape[-1] not in (T, S + T):
                raise ValueError(
                    f"with a cache of S = {S} tokens, attention_mask must be [B, T] or [B, S + T] = "
                    f"({B}, {S + T}), got {getattr(attention_mask, 'shape', type(attention_mask).__name__)}"
                )
            if not bool(check_attention_mask(attention_mask[:, -T:], B, T, x.device).all()):
                raise ValueError("attention_mask may mark padding only in the first call of a cache")
            attention_mask = None
        if cu_seqlens is not None and cache is not None and cache.seq_len > 0:
            raise ValueError("cu_seqlens starts new sequences: pass cache=None or an empty cache")
        if attention_mask is not None:
            packed, indices, cu = unpad(x, check_attention_mask(attention_mask, B, T, x.device))
            y = repad(self._mix(packed, cache, (cu, cu.tolist())), indices, B, T)
            if cache is not None:
                cache.seq_len = T  # the columns of the padded batch, which a growing mask counts
            return y
        if cu_seqlens is not None:
            cu_list = check_cu_seqlens(cu_seqlens, B, T, x.device)
            return self._mix(x, cache, (cu_seqlens, cu_list))
        return self._mix(x, cache, None)

    def _mix(self, x: torch.Tensor, cache: KDACache | None, varlen) -> torch.Tensor:
        """`forward` after its checks; `varlen` is None or `(cu_seqlens tensor, the same as a list)`."""
        cfg = self.config
        B, T, _ = x.shape
        H, HV, K, V = cfg.num_heads, cfg.hv, cfg.head_dim, cfg.v_dim

        fused = self._fused_parts(x)
        if fused:  # imported on use: `import kda_edu` never imports Triton
            from kda_edu.kernels import fused_kda_gates, fused_l2_normalize

        qkv_in = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        window = None if cache is None else cache.conv_window
        qkv, window = self.conv(qkv_in, window, None if varlen is None else varlen[1], fused=fused)
        if varlen is not None and cache is not None:  # each sequence's own last W - 1 inputs
            window = _last_inputs(qkv_in, varlen[1], cfg.conv_size - 1)
        q, k, v = qkv.split([H * K, H * K, HV * V], dim=-1)
        normalize = fused_l2_normalize if fused else l2_normalize
        q = normalize(q.reshape(B, T, H, K))
        k = normalize(k.reshape(B, T, H, K))
        v = v.reshape(B, T, HV, V)

        f = (self.f_proj(x) if cfg.full_rank_decay else self.f_up(self.f_down(x))).view(B, T, HV, K)
        if fused:
            g, beta = fused_kda_gates(f, self.b_proj(x), self.A_log, self.dt_bias, cfg.gate, cfg.lower_bound)
        else:
            if cfg.gate == "softplus":
                g = kda_gate(f, self.A_log, self.dt_bias)
            else:
                g = kda_gate_lower_bound(f, self.A_log, self.dt_bias, lower_bound=cfg.lower_bound)
            beta = beta_sigmoid(self.b_proj(x))

        if cache is None:
            o, _ = self._prefill(
                q, k, v, g, beta, initial_state=None, output_final_state=False, varlen=varlen
            )
        elif varlen is not None:  # an empty cache: it will hold the N sequences as a batch of N
            o, state = self._prefill(
                q, k, v, g, beta, initial_state=None, output_final_state=True, varlen=varlen
            )
            cu = varlen[1]
            cache.conv_window, cache.state = window, state
            cache.seq_len = max(b - a for a, b in zip(cu[:-1], cu[1:], strict=True))  # forward corrects it
        else:
            if T == 1:
                state = cache.state
                if state is None:
                    state = q.new_zeros(B, HV, K, V, dtype=compute_dtype(q.dtype))
                o, state = self._step(q, k, v, g, beta, state)
            else:
                o, state = self._prefill(q, k, v, g, beta, initial_state=cache.state, output_final_state=True)
            cache.conv_window, cache.state, cache.seq_len = window, state, cache.seq_len + T

        gate = (self.g_proj(x) if cfg.full_rank_output else self.g_up(self.g_down(x))).view(B, T, HV, V)
        o = self.o_norm(o, gate, fused=fused)
        return self.o_proj(o.reshape(B, T, HV * V))

    def _fused_parts(self, x: torch.Tensor) -> bool:
        """Whether the parts around the recurrence run in the Triton kernels: where the recurrence does
        (`use_triton`), for a float32, bfloat16 or float16 layer (a float64 one keeps the PyTorch modules)."""
        return use_triton(self.config.backend, x) and x.dtype in KERNEL_FLOATS

    def _prefill(self, q, k, v, g, beta, initial_state, output_final_state, varlen=None):
        """The chunked form: Triton's `chunk_kda` (forward and backward) when the backend says so, else
        PyTorch's `kda_chunked` (once per sequence for packed sequences, `varlen`)."""
        if q.shape[1] == 0:  # no token (an all-padding batch): every sequence keeps the state it starts from
            N = q.shape[0] if varlen is None else len(varlen[1]) - 1
            if initial_state is None:
                initial_state = q.new_zeros(N, *g.shape[2:], v.shape[3], dtype=compute_dtype(q.dtype))
            return v.new_zeros(v.shape), initial_state if output_final_state else None
        if use_triton(self.config.backend, q):
            from kda_edu.kernels import chunk_kda  # imported on use: `import kda_edu` never imports Triton

            dtype = self._kernel_dtype(q)
            o, state = chunk_kda(  # g and beta are in range by construction: no value check (a host sync)
                q.to(dtype),
                k.to(dtype),
                v.to(dtype),
                g,
                beta,
                initial_state=initial_state,
                output_final_state=output_final_state,
                cu_seqlens=None if varlen is None else varlen[0],
                check_inputs=False,
            )
            return o.to(q.dtype), state
        if varlen is not None:  # each sequence from a zero state (forward allows only an empty cache here)
            cu, outs, states = varlen[1], [], []
            HV, K, V = g.shape[2], g.shape[3], v.shape[3]
            for a, b in zip(cu[:-1], cu[1:], strict=True):
                if b > a:
                    o, state = kda_chunked(
                        *(t[:, a:b] for t in (q, k, v, g, beta)),
                        output_final_state=output_final_state,
                        chunk_size=self.config.chunk_size,
                    )
                    outs.append(o)
                else:
                    state = q.new_zeros(1, HV, K, V, dtype=compute_dtype(q.dtype))
                states.append(state)
            return torch.cat(outs, dim=1), torch.cat(states) if output_final_state else None
        return kda_chunked(
            q,
            k,
            v,
            g,
            beta,
            initial_state=initial_state,
            output_final_state=output_final_state,
            chunk_size=self.config.chunk_size,
        )

    def _step(self, q, k, v, g, beta, state):
        """One recurrent step: Triton's `fused_recurrent_kda` when the backend says so (its gradients come
        from chunk_kda's backward), else PyTorch's `kda_step`."""
        if use_triton(self.config.backend, q):
            from kda_edu.kernels import fused_recurrent_kda

            dtype = self._kernel_dtype(q)
            o, state = fused_recurrent_kda(
                *(t.to(dtype) for t in (q, k, v)),
                g,
                beta,
                initial_state=state.float(),  # the kernel keeps its state in float32
                output_final_state=True,
            )
            return o.to(q.dtype), state
        return kda_step(q, k, v, g, beta, state)

    def _kernel_dtype(self, q: torch.Tensor) -> torch.dtype:
        """The dtype q, k and v are cast to for the Triton kernels (`KDAConfig.kernel_dtype`)."""
        return q.dtype if self.config.kernel_dtype is None else getattr(torch, self.config.kernel_dtype)


def _last_inputs(x: torch.Tensor, cu_seqlens: list[int], n: int) -> torch.Tensor:
    """The last n inputs of every packed sequence, zeros in front of a shorter one: x `[1, T, C]` ->
    `[N, n, C]`, the convolution windows of the sequences as a batch."""
    windows = x.new_zeros(len(cu_seqlens) - 1, n, x.shape[-1])
    for i, (a, b) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)):
        m = min(n, b - a)
        if m:
            windows[i, n - m :] = x[0, b - m : b]
    return windows
