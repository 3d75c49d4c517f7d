"""The delta rule as online regression, and the experiments of chapter 3.

The delta rule treats one head's state `S` `[K, V]` as the weights of a linear map from keys to values and,
at every token, takes one gradient step on that token's regression loss:

    L_t(S) = 1/2 |S^T k_t - v_t|^2,     grad L_t(S) = k_t (S^T k_t - v_t)^T
    S_t    = S_{t-1} - beta_t grad L_t(S_{t-1}) = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T

- `read`, `regression_loss`, `gradient_step`, `transition`: that view in code, for single states or batches
  (`S` `[..., K, V]`, `k` `[..., K]`, `v` `[..., V]`, `beta` a number or `[...]`).
- `state_norms`: run `kda_edu.ops.delta_rule.delta_rule_recurrent` and record the size of its state at every step
  (chapter 3 uses it to show that keys must have unit length).
- `delta_writer`: the delta rule with any write strength, as a write rule for `kda_edu.chapters.ch02_memory.retrieval_error`.
- `overwrite_stream`, `overwrite_errors`: write one key again and again with fresh values, and measure how well
  linear attention and the delta rule return the latest one, with `relative_squared_error`, the metric of
  `kda_edu.chapters.ch02_memory.retrieval_error`.
"""

import torch

from kda_edu.ops.delta_rule import delta_rule_chunked, delta_rule_recurrent
from kda_edu.ops.gates import l2_normalize
from kda_edu.ops.linear_attention import linear_attention_chunked


def read(S: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The memory's answer for key k: `S^T k`, `[..., V]` for S `[..., K, V]` and k `[..., K]`."""
    return torch.einsum("...k,...kv->...v", k, S)


def regression_loss(S: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The delta rule's per-token loss `1/2 |S^T k - v|^2`, shape `[...]`.

    Args:
        S: state `[..., K, V]`.
        k: key `[..., K]`.
        v: value `[..., V]`.
    """
    _check_pair(S, k, v)
    return 0.5 * (read(S, k) - v).pow(2).sum(dim=-1)


def gradient_step(S: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta) -> torch.Tensor:
    """One gradient step on `regression_loss` with learning rate beta: `S - beta k (S^T k - v)^T`.

    This is the delta-rule update, written from the gradient `k (S^T k - v)^T` (derived in chapter 3).

    Args:
        S: state `[..., K, V]`.
        k: key `[..., K]`.
        v: value `[..., V]`.
        beta: learning rate (write strength), a number or a tensor `[...]`.

    Returns:
        the new state `[..., K, V]`.
    """
    _check_pair(S, k, v)
    beta = torch.as_tensor(beta, dtype=S.dtype, device=S.device)
    error = read(S, k) - v  # what the memory gets wrong for this key: [..., V]
    return S - beta[..., None, None] * k[..., :, None] * error[..., None, :]


def transition(k: torch.Tensor, beta) -> torch.Tensor:
    """The delta rule's transition matrix `I - beta k k^T`, `[..., K, K]` for k `[..., K]`.

    With it the update reads `S_t = transition(k_t, beta_t) @ S_{t-1} + beta_t k_t v_t^T`.
    """
    beta = torch.as_tensor(beta, dtype=k.dtype, device=k.device)
    eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
    return eye - beta[..., None, None] * k[..., :, None] * k[..., None, :]


def state_norms(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Run the delta rule one step at a time and return the Frobenius norm of its state after every step.

    Args:
        k: keys `[B, T, H, K]` (normalised or not: this function is for watching what happens).
        v: values `[B, T, HV, V]`, same dtype as k.
        beta: write strengths `[B, T, HV]`.

    Returns:
        `[B, T, HV]`: `|S_t|_F` for t = 1..T, in the state's dtype (inf or nan once the state overflows).
    """
    B, T, HV = beta.shape
    state, norms = None, []
    for t in range(T):
        step = slice(t, t + 1)
        _, state = delta_rule_recurrent(
            k[:, step], k[:, step], v[:, step], beta[:, step], initial_state=state, output_final_state=True
        )
        norms.append(torch.linalg.matrix_norm(state))  # [B, HV]
    return torch.stack(norms, dim=1)


def delta_writer(beta: float):
    """The delta rule with constant write strength beta, as a write rule for `kda_edu.chapters.ch02_memory.retrieval_error`.

    Returns `write(k [B, n, 1, K], v [B, n, 1, V]) -> S [B, 1, K, V]`, the state after writing the n pairs in
    order into an empty memory (`kda_edu.chapters.ch02_memory.write_delta` is `delta_writer(1.0)`).
    """
    if not 0 <= beta <= 1:
        raise ValueError(f"beta must lie in [0, 1], got {beta}")

    def write(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        beta_t = k.new_full((k.shape[0], k.shape[1], 1), beta)
        return delta_rule_chunked(k, k, v, beta_t, output_final_state=True)[1]

    return write


def overwrite_stream(
    n_rewrites: int, fillers: int, dim: int, batch: int = 32, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rewrite stream of `overwrite_errors`: `n_rewrites` blocks of one rewrite of `k*` and `fillers` pairs.

    Keys are unit vectors in `dim` dimensions; values are random with entries of variance `1 / dim`, so
    `|v| ~ 1`.

    Returns:
        `(q, k, v, latest)`, float32 on the CPU: the query `k*` at every step `[batch, T, 1, dim]`, the keys and
        values written `[batch, T, 1, dim]`, and the value `k*` should return at each step `[batch, T, 1, dim]`,
        with T = `n_rewrites * (1 + fillers)`.
    """
    if n_rewrites < 1 or fillers < 0:
        raise ValueError(f"need n_rewrites >= 1 and fillers >= 0, got {n_rewrites} and {fillers}")
    gen = torch.Generator().manual_seed(seed)
    block = 1 + fillers
    T = n_rewrites * block
    k = l2_normalize(torch.randn(batch, T, 1, dim, generator=gen))
    v = torch.randn(batch, T, 1, dim, generator=gen) / dim**0.5
    rewrite = torch.arange(T) % block == 0  # steps that write k*
    k[:, rewrite] = k[:, :1]  # the same key k* at every rewrite
    q = k[:, :1].expand(batch, T, 1, dim)  # read k* at every step
    latest = v[:, rewrite].repeat_interleave(block, dim=1)  # the value k* should return at each step
    return q, k, v, latest


def relative_squared_error(read: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`sum |read - target|^2 / sum |target|^2`, sums over dims 0, 2 and 3 of `[B, T, H, V]`: float64 `[T]`.

    The one error metric of chapters 2 and 3 (and of `kda_edu.chapters.ch02_memory.retrieval_error`): answering zero scores 1.
    """
    miss = (read - target).pow(2).sum(dim=(0, 2, 3), dtype=torch.float64)
    return miss / target.pow(2).sum(dim=(0, 2, 3), dtype=torch.float64)


def overwrite_errors(
    beta: float,
    n_rewrites: int,
    fillers: int,
    dim: int,
    batch: int = 32,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Rewrite one key with a fresh value `n_rewrites` times and measure how well each model returns the latest.

    The stream (`overwrite_stream`) is `n_rewrites` blocks; a block writes the key `k*` with a new random
    value, then `fillers` pairs with random keys. At the end of every block the key `k*` is read (a query
    equal to `k*`, scale 1) and compared with the value of the block's rewrite.

    Args:
        beta: the delta rule's write strength, in [0, 1] (linear attention has none).
        n_rewrites: number of blocks, >= 1.
        fillers: random pairs written after each rewrite, >= 0.
        dim: key and value dimension.
        batch: independent streams pooled over.
        seed: seed of the random streams.
        device: where to run.

    Returns:
        `{"linear attention": err, "delta rule": err}`, each `[n_rewrites]` in float64: at the end of block
        1, 2, ..., n_rewrites, the relative squared error `sum |S^T k* - v_latest|^2 / sum |v_latest|^2`, sums
        over the `batch` streams (`relative_squared_error`; answering zero scores 1).
    """
    if not 0 <= beta <= 1:
        raise ValueError(f"beta must lie in [0, 1], got {beta}")
    q, k, v, latest = (x.to(device) for x in overwrite_stream(n_rewrites, fillers, dim, batch, seed))
    T = q.shape[1]
    o_linear, _ = linear_attention_chunked(q, k, v, scale=1.0)
    o_delta, _ = delta_rule_chunked(q, k, v, torch.full((batch, T, 1), float(beta), device=device), scale=1.0)
    end_of_block = torch.arange(T) % (1 + fillers) == fillers

    def error(o):
        return relative_squared_error(o, latest).cpu()[end_of_block]

    return {"linear attention": error(o_linear), "delta rule": error(o_delta)}


def _check_pair(S: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if S.dim() < 2 or k.shape != S.shape[:-1] or v.shape != S.shape[:-2] + S.shape[-1:]:
        raise ValueError(
            f"need S [..., K, V], k [..., K], v [..., V] with matching sizes; got S {tuple(S.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
