"""The exponents a chunked kernel must be able to hold, and where the split of a decay is anchored.

Inside a chunk the per-channel decays between steps j <= i are `exp(G_i - G_j)` (G the cumulative log decay
from the block's start, one value per key channel), and they sit inside sums over the channels:

    A_ij = sum_c k_ic k_jc exp(G_ic - G_jc)

To compute all `A_ij` with one matrix product, on the matrix units, a kernel splits each decay at an anchor b:

    exp(G_ic - G_jc) = exp(G_ic - b_c) * exp(b_c - G_jc)   so   A = (k * exp(G - b)) (k * exp(b - G))^T

With b = 0 (the block's start) the first factor is <= 1 and the second as large as `exp(n |g_min|)` after n
steps at the most negative gate; with b at the block's middle each factor spans at most half the block, so the
largest exponent halves. Neither factor may overflow the dtype they are kept in (float32: exp(88.7)).
"""

import math

import torch


def log_max(dtype: torch.dtype) -> float:
    """The largest x with `exp(x)` finite in `dtype`: `log(finfo(dtype).max)`."""
    return math.log(torch.finfo(dtype).max)


def subchunk_scores(
    k: torch.Tensor, g: torch.Tensor, dtype: torch.dtype, factorised: bool, anchor: int = 0
) -> torch.Tensor:
    """`A_ij = sum_c k_ic k_jc exp(G_ic - G_jc)` for j <= i (zero above the diagonal) over one block of steps.

    Args:
        k: keys `[n, K]`.
        g: log decays `[n, K]`, <= 0; `G = cumsum(g)` along the steps.
        dtype: the dtype the decays, their factors and the product are computed in.
        factorised: False: one `exp` per pair (i, j) from the difference `G_i - G_j` (never > 0 where
            used); True: the matrix-product form `(k * exp(G - b)) (k * exp(b - G))^T`.
        anchor: where the factorised form splits each decay, `b = G_{anchor - 1}` (`b = 0` for 0, the
            block's start; `n // 2` is its middle). The largest exponent is about
            `max(anchor, n - anchor) |g_min|`.

    Returns:
        `[n, n]` in `dtype`.
    """
    n = k.shape[0]
    if not 0 <= anchor <= n:
        raise ValueError(f"anchor must be in [0, n = {n}], got {anchor}")
    k = k.to(torch.float64)
    G = g.to(torch.float64).cumsum(dim=0)
    if factorised:
        b = G[anchor - 1] if anchor > 0 else torch.zeros_like(G[0])
        grow, shrink = (k * (G - b).to(dtype).exp()), (k * (b - G).to(dtype).exp())
        return (grow.to(dtype) @ shrink.to(dtype).T).tril()
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    diff = (G[:, None, :] - G[None, :, :]).masked_fill(~causal[..., None], float("-inf")).to(dtype)
    return torch.einsum("ic,ijc,jc->ij", k.to(dtype), diff.exp(), k.to(dtype))
