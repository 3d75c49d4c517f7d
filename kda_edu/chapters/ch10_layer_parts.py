"""Chapter 10's measurements of the KDA layer: what each part costs and what it guarantees.

`kda_edu.layers.kda_layer.KDALayer` is the layer; this module takes it apart:

- `kda_layer_parameters(d_model, config)`: the parameter count of every part, from the shapes (a formula);
  `parameters_by_part(layer)` counts the same parts on a live module, so the two can be compared.
- `flops_by_part(fn)`: the FLOPs `torch.utils.flop_counter.FlopCounterMode` counts while `fn` runs, grouped
  by the layer's parts.
- `conv_dependence(conv, T)`: which inputs each output of the short convolution depends on (its receptive
  field, read off the Jacobian).
- `transition_eigenvalues(k, beta)`: the eigenvalues of the delta-rule transition `I - beta k k^T`, which
  show why q and k are L2-normalised.
"""

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from kda_edu.layers.kda_layer import KDAConfig, ShortConv

# The parts of a KDA layer and the parameters (attribute names of `KDALayer`) that belong to each.
PARTS = {
    "q, k, v projections": ("q_proj", "k_proj", "v_proj"),
    "short convolution": ("conv",),
    "decay gate": ("f_down", "f_up", "f_proj", "A_log", "dt_bias"),
    "beta": ("b_proj",),
    "output gate": ("g_down", "g_up", "g_proj"),
    "output norm": ("o_norm",),
    "output projection": ("o_proj",),
}


def kda_layer_parameters(d_model: int, config: KDAConfig) -> dict[str, int]:
    """Parameters of a `KDALayer` by part, from the shapes alone.

    With width D, H query/key heads and HV value heads of widths K and V, gate rank R, convolution width W
    over the C = 2 H K + HV V projected channels:

    - q, k, v projections `D C`; short convolution `W C` (one filter per channel);
    - decay gate `D R + R HV K` (low rank) `+ HV` (`A_log`) `+ HV K` (`dt_bias`);
    - beta `D HV`; output gate `D R + R HV V + HV V` (low rank, with a bias); output norm `V` (one weight
      vector shared by the heads); output projection `HV V D`.
    - a full-rank gate (`config.full_rank`) has `D HV K` (decay) or `D HV V` (output) in place of its
      low-rank pair.
    """
    D, H, HV, K, V, R, W = (
        d_model,
        config.num_heads,
        config.hv,
        config.head_dim,
        config.v_dim,
        config.rank,
        config.conv_size,
    )
    C = 2 * H * K + HV * V
    return {
        "q, k, v projections": D * C,
        "short convolution": W * C,
        "decay gate": (D * HV * K if config.full_rank_decay else D * R + R * HV * K) + HV + HV * K,
        "beta": D * HV,
        "output gate": (D * HV * V if config.full_rank_output else D * R + R * HV * V) + HV * V,
        "output norm": V,
        "output projection": HV * V * D,
    }


def parameters_by_part(layer: nn.Module) -> dict[str, int]:
    """Count the parameters of a live `KDALayer` by part (see `PARTS`); every parameter must belong to one."""
    counts = {part: 0 for part in PARTS}
    owner = {name: part for part, names in PARTS.items() for name in names}
    for name, p in layer.named_parameters():
        top = name.split(".")[0]
        if top not in owner:
            raise ValueError(f"parameter {name!r} belongs to no part of PARTS")
        counts[owner[top]] += p.numel()
    return counts


def flops_by_part(fn) -> dict[str, int]:
    """Run `fn()` under `FlopCounterMode` and return the FLOPs it counted, by part of the KDA layer.

    Products inside a part's submodules (the projections) go to that part; the rest (the recurrence's
    matrix products, which run outside any submodule) go to "recurrence". FlopCounterMode counts matrix
    products only (2 FLOPs per multiply-add); elementwise work is not counted.
    """
    with FlopCounterMode(display=False) as counter:
        fn()
    counts = counter.get_flop_counts()
    total = counter.get_total_flops()
    owner = {name: part for part, names in PARTS.items() for name in names}
    by_part: dict[str, int] = {}
    for key, ops in counts.items():
        pieces = key.split(".")
        if len(pieces) == 2 and pieces[1] in owner:  # "KDALayer.q_proj" and the like
            part = owner[pieces[1]]
            by_part[part] = by_part.get(part, 0) + sum(ops.values())
    by_part["recurrence"] = total - sum(by_part.values())
    return by_part


def conv_dependence(conv: ShortConv, T: int) -> torch.Tensor:
    """`[T, T]` boolean matrix: entry (t, s) is True when output t of the convolution depends on input s.

    Computed from the Jacobian of one channel (in float64, at a random input), so it shows what the code
    does, not what it is meant to do.
    """
    C = conv.weight.shape[0]
    x = torch.randn(1, T, C, dtype=torch.float64)
    weight = conv.weight.detach().cpu().double()
    probe = ShortConv(C, conv.kernel_size).double()
    with torch.no_grad():
        probe.weight.copy_(weight)

    def first_channel(x0: torch.Tensor) -> torch.Tensor:
        full = x.clone()
        full[0, :, 0] = x0
        return probe(full)[0][0, :, 0]

    jac = torch.autograd.functional.jacobian(first_channel, x[0, :, 0])
    return jac.abs() > 0


def transition_eigenvalues(k: torch.Tensor, beta: float) -> torch.Tensor:
    """Eigenvalues (real, ascending) of the delta-rule transition `I - beta k k^T` for one key `[K]`.

    All are 1 except one, `1 - beta |k|^2`, along k: with `|k| = 1` and beta in (0, 1) it lies in (0, 1), so
    a step never amplifies the state; with a longer key it can fall below -1 and the state grows.
    """
    K = k.shape[-1]
    k = k.double()
    return torch.linalg.eigvalsh(torch.eye(K, dtype=torch.float64) - beta * torch.outer(k, k))
