"""fla's interface to the KDA layer: `KimiDeltaAttention`, and weights converted both ways.

flash-linear-attention (fla) is where most KDA models live. `KimiDeltaAttention` here takes the constructor
arguments and the `forward` signature of fla's `fla.layers.kda.KimiDeltaAttention` and computes the same
function, so code written against fla's layer runs on this one; it is a `KDALayer` underneath. kda_edu does
not import fla: the two only share names and shapes.

The weights differ in layout only:

    fla                               kda_edu (`KDALayer`)
    q_conv1d / k_conv1d / v_conv1d    conv.weight [2 H K + HV V, W]: the three depthwise filters side by side
      .weight [C, 1, W]
    f_proj.0 / f_proj.1               f_down / f_up (the low-rank decay projection)
    g_proj.0 / g_proj.1               g_down / g_up (the low-rank output gate)
    dt_bias [HV K]                    dt_bias [HV, K]
    everything else                   the same name and shape

`to_fla_state_dict(layer)` and `from_fla_state_dict(state_dict, config)` convert; they copy nothing they do
not need to (the results are views where the layout allows).

What fla's layer offers and this one does not: `use_short_conv=False`, `conv_bias=True` and
`allow_neg_eigval=True` (each raises a ValueError naming it), and fla's `Cache` objects: `past_key_values` is a
`kda_edu.layers.kda_layer.KDACache` (or None) here.
"""

import math

import torch

from kda_edu.layers.kda_layer import GATE_PARAMETERS, KDACache, KDAConfig, KDALayer
from kda_edu.ops._checks import compute_dtype

# Parameters whose name differs, ours -> fla's (dt_bias and the convolution also change shape).
_RENAMED = {
    "f_down.weight": "f_proj.0.weight",
    "f_up.weight": "f_proj.1.weight",
    "g_down.weight": "g_proj.0.weight",
    "g_up.weight": "g_proj.1.weight",
    "g_up.bias": "g_proj.1.bias",
}
_SAME = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "b_proj.weight",
    "A_log",
    "o_norm.weight",
    "o_proj.weight",
)


def _check_convertible(config: KDAConfig) -> None:
    if config.full_rank != "none":
        raise ValueError(
            f"fla's KimiDeltaAttention has low-rank gates only; this layer has full_rank={config.full_rank!r}"
        )
    if config.rank != config.v_dim:
        raise ValueError(
            f"fla's KimiDeltaAttention uses the value head width V = {config.v_dim} as the gates' rank; this layer "
            f"has gate_rank={config.gate_rank}"
        )


def to_fla_state_dict(layer: KDALayer) -> dict[str, torch.Tensor]:
    """The weights of a `KDALayer` under the names and shapes of fla's `KimiDeltaAttention`."""
    if not isinstance(layer, KDALayer):
        raise TypeError(f"layer must be a KDALayer, got {type(layer).__name__}")
    cfg = layer.config
    _check_convertible(cfg)
    ours = layer.state_dict()
    HK = cfg.num_heads * cfg.head_dim
    q, k, v = ours["conv.weight"][:, None, :].split([HK, HK, cfg.hv * cfg.v_dim], dim=0)
    out = {name: ours[name] for name in _SAME}
    out.update({fla: ours[name] for name, fla in _RENAMED.items()})
    out.update({"q_conv1d.weight": q, "k_conv1d.weight": k, "v_conv1d.weight": v})
    out["dt_bias"] = ours["dt_bias"].reshape(-1)
    return out


def from_fla_state_dict(state_dict: dict[str, torch.Tensor], config: KDAConfig) -> dict[str, torch.Tensor]:
    """fla `KimiDeltaAttention` weights -> the state dict of a `KDALayer` with `config`.

    Every tensor keeps its dtype except the gate's `A_log` and `dt_bias`, which come out in float32 at least
    (a bf16 state dict gives float32 ones, exactly its values), as `KDALayer` keeps them.

    Raises a ValueError naming the tensors that are missing or left over (fla's layer built with options this
    one lacks: a convolution bias, say) or that have the wrong shape for `config`.
    """
    _check_convertible(config)
    HK, HV, K, V = config.num_heads * config.head_dim, config.hv, config.head_dim, config.v_dim
    expected = {name: None for name in (*_SAME, *_RENAMED.values(), "dt_bias")}
    expected.update(
        {"q_conv1d.weight": (HK, 1, config.conv_size), "k_conv1d.weight": (HK, 1, config.conv_size)}
    )
    expected["v_conv1d.weight"] = (HV * V, 1, config.conv_size)
    expected["dt_bias"] = (HV * K,)
    missing, extra = sorted(set(expected) - set(state_dict)), sorted(set(state_dict) - set(expected))
    if missing or extra:
        raise ValueError(
            f"not the state dict of a matching fla KimiDeltaAttention: missing {missing}, unexpected {extra}"
        )
    wrong = [
        f"{n} {tuple(state_dict[n].shape)} (expected {shape})"
        for n, shape in expected.items()
        if shape is not None and tuple(state_dict[n].shape) != shape
    ]
    if wrong:
        raise ValueError(f"fla tensors of the wrong shape for this KDAConfig: {', '.join(wrong)}")
    out = {name: state_dict[name] for name in _SAME}
    out.update({name: state_dict[fla] for name, fla in _RENAMED.items()})
    conv = [state_dict[f"{p}_conv1d.weight"][:, 0, :] for p in "qkv"]
    out["conv.weight"] = torch.cat(conv, dim=0)
    out["dt_bias"] = state_dict["dt_bias"].reshape(HV, K)
    for name in GATE_PARAMETERS:
        out[name] = out[name].to(compute_dtype(out[name].dtype))
    return out


class KimiDeltaAttention(KDALayer):
    """A `KDALayer` with fla's constructor and `forward`: a drop-in for `fla.layers.kda.KimiDeltaAttention`.

    Args (fla's, same defaults):
        hidden_size: D.
        expand_v: V / K; `head_dim * expand_v` must be an integer.
        head_dim: K.
        num_heads: H.
        num_v_heads: HV (a multiple of H); None means H.
        mode: `"chunk"` or `"fused_recurrent"`: fla's choice of kernel. Accepted and kept; this layer picks
            its form itself (chunked for several tokens, one recurrent step for a cached single token).
        use_short_conv: must be True.
        allow_neg_eigval: must be False.
        safe_gate: fla's permission to use a faster kernel for gates in `[lower_bound, 0)`; needs lower_bound.
            Changes nothing here.
        lower_bound: None for the softplus gate; a negative number for the lower-bound gate
            `lower_bound * sigmoid(exp(A_log) * (f + dt_bias))` (`KDAConfig.gate = "lower_bound"`).
        conv_size: W.
        conv_bias: must be False.
        layer_idx: kept as an attribute, as fla does.
        norm_eps: epsilon of the output RMSNorm.
        backend: where the recurrence runs (`KDAConfig.backend`); not one of fla's arguments.
        **kwargs: ignored, as fla ignores them.
    """

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 1,
        head_dim: int = 128,
        num_heads: int = 16,
        num_v_heads: int | None = None,
        mode: str = "chunk",
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
        safe_gate: bool = False,
        lower_bound: float | None = None,
        conv_size: int = 4,
        conv_bias: bool = False,
        layer_idx: int | None = None,
        norm_eps: float = 1e-5,
        backend: str = "auto",
        **kwargs,
    ):
        if mode not in ("chunk", "fused_recurrent"):
            raise ValueError(f"mode must be 'chunk' or 'fused_recurrent', got {mode!r}")
        for name, value, supported in (
            ("use_short_conv", use_short_conv, True),
            ("allow_neg_eigval", allow_neg_eigval, False),
            ("conv_bias", conv_bias, False),
        ):
            if bool(value) != supported:
                raise ValueError(
                    f"{name}={value!r} is not supported by kda_edu's KimiDeltaAttention (only {supported})"
                )
        if safe_gate and lower_bound is None:
            raise ValueError("safe_gate=True needs a lower_bound (as in fla)")
        v_head_dim = head_dim * expand_v
        if not math.isclose(v_head_dim, round(v_head_dim), rel_tol=1e-9):
            raise ValueError(
                f"head_dim * expand_v must be an integer, got {head_dim} * {expand_v} = {v_head_dim}"
            )
        config = KDAConfig(
            num_heads=num_heads,
            head_dim=head_dim,
            num_v_heads=num_v_heads,
            v_head_dim=int(round(v_head_dim)),
            conv_size=conv_size,
            gate="softplus" if lower_bound is None else "lower_bound",
            lower_bound=-5.0 if lower_bound is None else lower_bound,
            norm_eps=norm_eps,
            backend=backend,
        )
        super().__init__(hidden_size, config)
        self.mode, self.layer_idx, self.safe_gate = mode, layer_idx, safe_gate
        self.hidden_size = hidden_size

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: KDACache | None = None,
        use_cache: bool | None = False,
        output_attentions: bool | None = False,
        **kwargs,
    ) -> tuple[torch.Tensor, None, KDACache | None]:
        """fla's forward: `(o [B, T, D], None, past_key_values)`.

        Args:
            hidden_states: `[B, T, D]`.
            attention_mask: `[B, T]` padding mask, 1 = token, 0 = padding (zeros come out at the padding).
            past_key_values: a `KDACache` to continue from and advance in place, or None.
            use_cache: return a cache: `past_key_values`, or a new `KDACache` holding the state after
                hidden_states when it is None.
            output_attentions: ignored (there are no attention weights), as in fla.
            **kwargs: `cu_seqlens` (int32/int64 `[N + 1]`, sequences packed along T with B = 1); others
                are ignored, as in fla.
        """
        cache = past_key_values
        if cache is None and use_cache:
            cache = self.new_cache()
        o = super().forward(
            hidden_states, cache=cache, cu_seqlens=kwargs.get("cu_seqlens"), attention_mask=attention_mask
        )
        return o, None, cache if use_cache else past_key_values

    def to_fla_state_dict(self) -> dict[str, torch.Tensor]:
        """This layer's weights under fla's names and shapes (`to_fla_state_dict`)."""
        return to_fla_state_dict(self)

    @classmethod
    def from_fla_state_dict(cls, state_dict: dict[str, torch.Tensor], **fla_kwargs) -> "KimiDeltaAttention":
        """The layer `KimiDeltaAttention(**fla_kwargs)` holding the weights of an fla layer built with the same
        arguments (`from_fla_state_dict`), on the weights' device and in their dtype (that of `q_proj.weight`),
        but for the gate's `A_log` and `dt_bias`, which stay in float32 (float64 for float64 weights)."""
        layer = cls(**fla_kwargs)
        weights = from_fla_state_dict(state_dict, layer.config)
        reference = weights["q_proj.weight"]
        layer.to(device=reference.device, dtype=reference.dtype)  # the gate stays in at least float32
        layer.load_state_dict(weights)
        return layer
