"""The recurrent state as an associative memory: write key-value pairs, read them back, measure the blur.

A linear-attention-family layer keeps a `[K, V]` state per head. Writing n pairs `(k_i, v_i)` into an empty
state and then reading with a stored key, `v_hat_i = S^T k_i`, asks the state to act as a lookup table. This
module measures how well it does, for any writing rule, so chapters 2 (linear attention) and 3 (the delta rule)
run the same experiment.

API:

- `retrieval_error(rule, n_pairs, d_k, *, d_v=32, keys="random", trials=64, seed=0, device=None)`
  returns a float64 tensor `[len(n_pairs)]`: for each n, the relative squared retrieval error
  `sum_i ||S^T k_i - v_i||^2 / sum_i ||v_i||^2` over the n stored pairs, pooled over `trials` independent
  memories. The n-pair memories are nested: the memory of n pairs holds the first n pairs of the largest one.
  `rule` is a name in `WRITE_RULES` (`"linear"`, `"delta"`, `"least_squares"`: the best possible state, a
  floor for every rule) or any callable
  `write(k [B, n, 1, K], v [B, n, 1, V]) -> S [B, 1, K, V]` that writes the n pairs in order into an empty
  state and returns it (B = trials, one head).
- `make_keys(trials, n, d_k, kind, generator)` draws unit-length keys `[trials, n, 1, d_k]`: `"random"`
  (uniform directions) or `"orthogonal"` (orthonormal, needs n <= d_k).
- `linear_crosstalk(n, d_k)`: the expected relative error of the linear rule with random unit keys,
  `(n - 1) / d_k` (derived in chapter 2); `least_squares_floor(n, d_k)`: the expected error of the best
  possible state with random keys and Gaussian values, `max(0, (n - d_k) / n)`.
- `key_overlaps(n, d_k, kind, seed)`: the `[n, n]` matrix of overlaps `k_i . k_j` of one draw of keys, and
  `draw_interference(ax, n, d_k, seed)`, its heatmap on a matplotlib Axes.

Keys, values and states are float32; the error is accumulated in float64.
"""

from collections.abc import Callable

import torch

from kda_edu.ops.delta_rule import delta_rule_chunked
from kda_edu.ops.linear_attention import linear_attention_chunked

WriteRule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def write_linear(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Linear attention's write, `S = sum_i k_i v_i^T`: the final state of linear attention over the pairs.

    Uses the chunked form (equal to the recurrent one, and much faster than a Python loop over pairs).
    k `[B, n, 1, K]`, v `[B, n, 1, V]`; returns S `[B, 1, K, V]`.
    """
    return linear_attention_chunked(k, k, v, output_final_state=True)[1]


def write_delta(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The delta rule's write with full strength (beta = 1): `S += k_i (v_i - S^T k_i)^T`, pair after pair.

    Uses DeltaNet's chunked form (equal to its recurrent form). k `[B, n, 1, K]`, v `[B, n, 1, V]`; returns
    S `[B, 1, K, V]`.
    """
    beta = k.new_ones(k.shape[0], k.shape[1], 1)
    return delta_rule_chunked(k, k, v, beta, output_final_state=True)[1]


def write_least_squares(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The best state any rule could write: `S = argmin ||K S - V||^2 = pinv(K) V` (minimum norm).

    Not a recurrence: it sees all pairs at once. Its retrieval error is the floor of every writing rule.
    k `[B, n, 1, K]`, v `[B, n, 1, V]`; returns S `[B, 1, K, V]`.
    """
    K, V = k[:, :, 0], v[:, :, 0]  # [B, n, K], [B, n, V]
    return (torch.linalg.pinv(K) @ V).unsqueeze(1)


WRITE_RULES: dict[str, WriteRule] = {
    "linear": write_linear,
    "delta": write_delta,
    "least_squares": write_least_squares,
}


def make_keys(trials: int, n: int, d_k: int, kind: str, generator: torch.Generator) -> torch.Tensor:
    """Unit-length keys `[trials, n, 1, d_k]`, float32, on the generator's device.

    `kind="random"`: independent uniform directions (normalised Gaussian vectors).
    `kind="orthogonal"`: n orthonormal directions (the Q factor of a Gaussian matrix); needs n <= d_k.
    """
    device = generator.device
    x = torch.randn(trials, d_k, n, generator=generator, device=device)
    if kind == "random":
        keys = x / x.norm(dim=1, keepdim=True)
    elif kind == "orthogonal":
        if n > d_k:
            raise ValueError(f"at most d_k = {d_k} keys can be orthogonal, asked for n = {n}")
        keys = torch.linalg.qr(x).Q  # [trials, d_k, n], orthonormal columns
    else:
        raise ValueError(f"kind must be 'random' or 'orthogonal', got {kind!r}")
    return keys.transpose(1, 2).unsqueeze(2).contiguous()


def retrieval_error(
    rule: str | WriteRule,
    n_pairs: list[int],
    d_k: int,
    *,
    d_v: int = 32,
    keys: str = "random",
    trials: int = 64,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Relative squared retrieval error of a memory holding n pairs, for every n in `n_pairs`.

    Args:
        rule: a name in `WRITE_RULES` or a callable `write(k [B, n, 1, K], v [B, n, 1, V]) -> S [B, 1, K, V]`.
        n_pairs: numbers of stored pairs, each >= 1.
        d_k: key dimension K.
        d_v: value dimension V; values are standard Gaussian.
        keys: `"random"` or `"orthogonal"` unit keys (see `make_keys`).
        trials: independent memories per n (the batch dimension).
        seed: seed of the keys and values.
        device: where to compute; CPU when None.

    Returns:
        float64 tensor `[len(n_pairs)]` of `sum ||S^T k_i - v_i||^2 / sum ||v_i||^2`, sums over the stored pairs
        and the trials.
    """
    write = WRITE_RULES[rule] if isinstance(rule, str) else rule
    if not n_pairs or min(n_pairs) < 1:
        raise ValueError(f"n_pairs must be a non-empty list of counts >= 1, got {n_pairs}")
    generator = torch.Generator(device=device or "cpu").manual_seed(seed)
    n_max = max(n_pairs)
    k = make_keys(trials, n_max, d_k, keys, generator)
    v = torch.randn(trials, n_max, 1, d_v, generator=generator, device=generator.device)
    errors = []
    for n in n_pairs:
        S = write(k[:, :n], v[:, :n])  # [trials, 1, K, V]
        v_hat = torch.einsum("bnhk,bhkv->bnhv", k[:, :n], S)
        err = (v_hat - v[:, :n]).double().pow(2).sum() / v[:, :n].double().pow(2).sum()
        errors.append(err)
    return torch.stack(errors).cpu()


def linear_crosstalk(n, d_k: int):
    """Expected relative retrieval error of the linear rule with n random unit keys in d_k dimensions.

    `S^T k_i = v_i + sum_{j != i} (k_j . k_i) v_j`; each overlap has mean 0 and variance `1 / d_k`, so the
    noise carries `(n - 1) / d_k` times the energy of a value. Works on numbers and tensors.
    """
    return (n - 1) / d_k


def least_squares_floor(n, d_k: int):
    """Expected relative error of the best state `pinv(K) V` for n random keys in d_k dimensions, Gaussian values.

    `K S` can only reach the d_k-dimensional column space of K (`[n, d_k]`); each column of V has n independent
    Gaussian entries, and the part outside that space, `(n - d_k) / n` of its energy on average, is lost.
    """
    return max(0.0, (n - d_k) / n)


def key_overlaps(n: int, d_k: int, kind: str = "random", seed: int = 0) -> torch.Tensor:
    """The `[n, n]` overlap matrix `k_i . k_j` of one draw of n unit keys (ones on the diagonal)."""
    k = make_keys(1, n, d_k, kind, torch.Generator().manual_seed(seed))[0, :, 0]  # [n, d_k]
    return k @ k.T


def draw_interference(ax, n: int, d_k: int, seed: int = 0):
    """Draw the overlaps `k_i . k_j` (i != j) of n random unit keys in d_k dimensions as a heatmap on `ax`.

    The keys are those of `retrieval_error(..., seed=seed)`'s first memory. The diagonal (each key with itself,
    always 1) is set to 0 so that only the interference shows. Returns the image, for a colour bar.
    """
    overlaps = key_overlaps(n, d_k, "random", seed)
    overlaps.fill_diagonal_(0.0)
    ax.grid(False)
    return ax.imshow(overlaps.numpy(), cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
