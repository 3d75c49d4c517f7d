"""Recall with forgetting: the experiments of chapter 4 (Gated DeltaNet).

Gated DeltaNet multiplies its state by `alpha_t = exp(g_t)` before every delta-rule write. These functions
measure what that decay does to a memory, always by running Gated DeltaNet: `gated_delta_chunked`, which gives
the same outputs and states as the loop `gated_delta_recurrent` with far fewer (and larger) tensor operations.
Each experiment runs many decay settings at once by giving every setting its own value head: all heads see
the same keys and values, and head j decays with its own gate.

- `retrieval_strength`: write one pair, then filler pairs, and follow how much of the first value its key
  still returns, age by age.
- `fitted_half_life`: the half-life of a strength curve, from a straight-line fit of its logarithm.
- `document_stream`: pairs of an old document followed by pairs of the current one (optionally with a first
  pair whose key no later key overlaps).
- `recall_error`: how well the final state of a stream returns the values of chosen pairs, for every head.

Keys are unit vectors (`kda_edu.ops.gates.l2_normalize`); values have entries of variance `1 / V`, so `|v| ~ 1`.
"""

import math

import torch

from kda_edu.ops.gated_delta import gated_delta_chunked
from kda_edu.ops.gates import l2_normalize


def _random_keys(shape: tuple, generator: torch.Generator, avoid: torch.Tensor | None = None) -> torch.Tensor:
    """Unit keys `[B, T, 1, K]`; with `avoid` `[B, 1, 1, K]` (unit), keys orthogonal to it."""
    x = torch.randn(*shape, generator=generator, dtype=torch.float64)
    if avoid is not None:
        x = x - (x * avoid).sum(dim=-1, keepdim=True) * avoid
    return l2_normalize(x).float()


def _per_head(values, batch: int, T: int, name: str) -> torch.Tensor:
    """A list of per-head numbers (or a `[T, HV]` tensor) as a `[batch, T, HV]` float32 tensor."""
    x = torch.as_tensor(values, dtype=torch.float32)
    if x.dim() == 1:
        x = x.expand(T, -1)
    if x.dim() != 2 or x.shape[0] != T:
        raise ValueError(
            f"{name} must be a list of per-head values or a [T = {T}, HV] tensor, got {tuple(x.shape)}"
        )
    return x.expand(batch, T, x.shape[1])


def retrieval_strength(
    g: list[float],
    beta: float,
    dim: int,
    max_age: int,
    *,
    orthogonal: bool,
    batch: int = 64,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """How much of an old value its key still returns, as a function of the pair's age.

    At step 0 the pair `(k_0, v_0)` is written; then `max_age` filler pairs with random keys. After every
    step the memory is read with `k_0` (query `k_0`, scale 1) and the strength `v_0 . (S_t^T k_0) / |v_0|^2`
    is recorded: `beta` right after the write, then smaller as the pair ages.

    Args:
        g: one constant log decay per head, each <= 0 (`[0.0]` is the plain delta rule).
        beta: write strength of every step, in [0, 1].
        dim: key and value dimension.
        max_age: number of filler pairs after the first.
        orthogonal: filler keys orthogonal to `k_0` (then only the decay weakens the pair) or independent.
        batch: independent streams averaged over.
        seed: seed of the streams.
        device: where to run.

    Returns:
        `[len(g), max_age + 1]`: the mean strength at ages 0, 1, ..., max_age, one row per gate, on the CPU.
    """
    gen = torch.Generator().manual_seed(seed)
    T = max_age + 1
    k0 = _random_keys((batch, 1, 1, dim), gen)
    fillers = _random_keys((batch, max_age, 1, dim), gen, avoid=k0.double() if orthogonal else None)
    k = torch.cat([k0, fillers], dim=1)
    v = torch.randn(batch, T, 1, dim, generator=gen) / math.sqrt(dim)
    HV = len(g)
    q, k, v = k0.expand(batch, T, 1, dim).to(device), k.to(device), v.expand(batch, T, HV, dim).to(device)
    g_t = _per_head(g, batch, T, "g").to(device)
    beta_t = torch.full((batch, T, HV), float(beta), device=device)
    o, _ = gated_delta_chunked(q, k, v, g_t, beta_t, scale=1.0)  # o_t = S_t^T k_0: [batch, T, HV, dim]
    v0 = v[:, :1]  # [batch, 1, HV, dim]
    strength = (o * v0).sum(dim=-1) / v0.pow(2).sum(dim=-1)  # [batch, T, HV]
    return strength.mean(dim=0).T.cpu()


def fitted_half_life(strength: torch.Tensor) -> torch.Tensor:
    """Half-life (in steps) of strength curves `[..., A]` that decay like `c exp(-rate * age)`.

    Fits `log(strength)` against the age by least squares and returns `ln 2 / rate`, `[...]`; a curve that does
    not decay gives inf. Only use ages where the strength is clearly positive.
    """
    ages = torch.arange(strength.shape[-1], dtype=torch.float64)
    y = strength.double().log()
    centred = ages - ages.mean()
    slope = ((y - y.mean(dim=-1, keepdim=True)) * centred).sum(dim=-1) / centred.pow(2).sum()
    return math.log(2) / -slope


def document_stream(
    n_old: int, n_new: int, dim: int, *, batch: int = 64, protect_first: bool = False, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of `n_old` pairs of an old document followed by `n_new` pairs of the current one.

    Args:
        n_old: pairs before the boundary (their values are no longer needed).
        n_new: pairs after it, the ones a reader asks about.
        dim: key and value dimension.
        batch: independent streams.
        protect_first: make every key after the first orthogonal to the first one, so that only the decay,
            never a later write, can weaken pair 0 (an instruction given at the start, say).
        seed: seed of the streams.

    Returns:
        `(k, v)`: keys `[batch, n_old + n_new, 1, dim]` (unit length) and values of the same shape, float32.
    """
    gen = torch.Generator().manual_seed(seed)
    T = n_old + n_new
    first = _random_keys((batch, 1, 1, dim), gen)
    rest = _random_keys((batch, T - 1, 1, dim), gen, avoid=first.double() if protect_first else None)
    v = torch.randn(batch, T, 1, dim, generator=gen) / math.sqrt(dim)
    return torch.cat([first, rest], dim=1), v


def recall_error(
    g,
    beta: float,
    k: torch.Tensor,
    v: torch.Tensor,
    steps,
    *,
    query_noise: float = 0.0,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Relative errors `|S_T^T k_s - v_s| / |v_s|` of the pairs written at `steps`, read from the final state.

    Args:
        g: log decays, each <= 0: a list with one constant per head, or a `[T, HV]` tensor (one per step and
            head, for gates that change along the stream).
        beta: write strength of every step, in [0, 1].
        k: keys `[B, T, 1, K]`.
        v: values `[B, T, 1, V]`.
        steps: indices of the pairs to read back from the final state.
        query_noise: read with `l2_normalize(k_s + query_noise * u)`, u a random unit vector, instead of k_s
            itself (a trained model's queries only approximate its keys).
        seed: seed of the query noise.
        device: where to run.

    Returns:
        `[len(steps), HV]`: the error of each pair for each head, averaged over the batch, on the CPU.
    """
    B, T = k.shape[:2]
    g_t = _per_head(g, B, T, "g").to(device)
    HV = g_t.shape[-1]
    k, v = k.to(device), v.to(device)
    beta_t = torch.full((B, T, HV), float(beta), device=device)
    _, S = gated_delta_chunked(k, k, v.expand(B, T, HV, v.shape[-1]), g_t, beta_t, output_final_state=True)
    steps = torch.as_tensor(steps, device=device)
    q = k[:, steps, 0]  # [B, len(steps), K]
    if query_noise:
        noise = _random_keys((B, len(steps), 1, k.shape[-1]), torch.Generator().manual_seed(seed))
        q = l2_normalize(q + query_noise * noise[:, :, 0].to(device))
    read = torch.einsum("bsk,bhkv->bshv", q, S)  # [B, len(steps), HV, V]
    target = v[:, steps]  # [B, len(steps), 1, V]
    return ((read - target).norm(dim=-1) / target.norm(dim=-1)).mean(dim=0).cpu()
