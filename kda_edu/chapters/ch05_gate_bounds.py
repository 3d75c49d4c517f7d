"""Why KDA's gate has a lower bound: the exponents a chunked kernel must be able to hold.

Inside a chunk the per-channel decays between steps j <= i are `exp(G_i - G_j)` (G the cumulative log decay
from the chunk start, one value per key channel), and they sit inside sums over the channels:

    A_ij = sum_c k_ic k_jc exp(G_ic - G_jc)

To compute all `A_ij` with one matrix product, on the matrix units, a kernel splits each decay around the
start of the block of steps it works on (or a point near its middle):

    exp(G_ic - G_jc) = exp(G_ic) * exp(-G_jc)      so      A = (k * exp(G)) (k * exp(-G))^T

The first factor is <= 1, the second >= 1 and as large as `exp(n |g_min|)` after n steps of the most
negative gate. It must not overflow in the dtype the factors are kept in. That is why KDA's kernels bound
the gate below (-5) and split the chunk into sub-chunks of 16 steps: 16 * 5 = 80 < log(float32 max) = 88.7.
"""

import math

import torch


def log_max(dtype: torch.dtype) -> float:
    """The largest x with `exp(x)` finite in `dtype`: `log(finfo(dtype).max)`."""
    return math.log(torch.finfo(dtype).max)


def subchunk_scores(k: torch.Tensor, g: torch.Tensor, dtype: torch.dtype, factorised: bool) -> torch.Tensor:
    """`A_ij = sum_c k_ic k_jc exp(G_ic - G_jc)` for j <= i (zero above the diagonal) over one block of steps.

    Args:
        k: keys `[n, K]`.
        g: log decays `[n, K]`, <= 0; `G = cumsum(g)` along the steps.
        dtype: the dtype the decays, their factors and the product are computed in.
        factorised: False: one `exp` per pair (i, j) from the difference `G_i - G_j` (never > 0 where
            used); True: the matrix-product form `(k * exp(G)) (k * exp(-G))^T`.

    Returns:
        `[n, n]` in `dtype`.
    """
    k = k.to(torch.float64)
    G = g.to(torch.float64).cumsum(dim=0)
    if factorised:
        grow, shrink = (k * G.to(dtype).exp()), (k * (-G).to(dtype).exp())
        return (grow.to(dtype) @ shrink.to(dtype).T).tril()
    n = k.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    diff = (G[:, None, :] - G[None, :, :]).masked_fill(~causal[..., None], float("-inf")).to(dtype)
    return torch.einsum("ic,ijc,jc->ij", k.to(dtype), diff.exp(), k.to(dtype))
