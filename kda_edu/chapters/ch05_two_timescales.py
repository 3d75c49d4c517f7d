"""A memory task that needs a fast and a slow memory at once, and the per-channel retention it asks for.

The key channels of one head are split into two halves of `half` channels each:

- the slow half stores `n_facts` facts, written once at the start (orthonormal keys, so they do not interfere)
  and asked for at the very end, `n_stream` steps later;
- the fast half is a scratchpad: every one of the `n_stream` later steps writes a new item with a random key,
  and at the end the last `recent` items are asked for.

Queries are approximate, as in a trained model: each one is its key plus `noise` times a random unit vector
of the same half, renormalised. A noisy query also reads whatever else the half holds, so the scratchpad
should keep only its last few items, while the facts must survive all `n_stream` steps. A per-channel decay
(KDA) gives each half its own rate; one decay for the whole head (Gated DeltaNet) must serve both.

Every model here is `kda_edu.ops.kda.kda_recurrent` with beta = 1 and a constant gate per channel. Many gate
settings are evaluated in one call: setting number i is value head i (q and k have one head, shared by all).
"""

import math
from dataclasses import dataclass

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from kda_edu.ops.gated_delta import gated_delta_recurrent
from kda_edu.ops.gates import kda_gate, kda_gate_lower_bound
from kda_edu.ops.kda import kda_recurrent
from kda_edu.ops.recurrence import general_recurrence


@dataclass
class TwoTimescaleTask:
    """A batch of two-timescale episodes.

    Attributes:
        k: keys written `[B, T, 1, K]`, K = 2 * half: facts (slow half) then the stream (fast half).
        v: values written `[B, T, 1, V]`, unit vectors.
        queries: the final read-outs `[B, Q, K]`, Q = n_facts + recent: noisy fact keys, then noisy recent keys.
        targets: the values the queries should return `[B, Q, V]`.
        n_facts: the first n_facts queries ask for facts, the rest for recent items.
        half: channels per half; channels `[0, half)` are slow, `[half, 2 half)` fast.
    """

    k: torch.Tensor
    v: torch.Tensor
    queries: torch.Tensor
    targets: torch.Tensor
    n_facts: int
    half: int


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def make_task(
    batch: int = 32,
    half: int = 8,
    value_dim: int = 8,
    n_facts: int = 4,
    n_stream: int = 124,
    recent: int = 2,
    noise: float = 0.5,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> TwoTimescaleTask:
    """Draw `batch` episodes of length `n_facts + n_stream` (see the module docstring).

    Args:
        batch: B, independent episodes.
        half: channels per half (K = 2 * half).
        value_dim: V.
        n_facts: facts written at the start, at most `half` (their keys are orthonormal).
        n_stream: stream items written after the facts, one per step.
        recent: how many of the last stream items are asked for, at most `n_stream`.
        noise: size of the random perturbation added to each query's key before renormalising.
        seed: seed of the generator that draws everything.
        device: where the tensors live.

    Returns:
        A `TwoTimescaleTask` in float32.
    """
    if not 1 <= n_facts <= half:
        raise ValueError(f"n_facts must be in [1, half = {half}], got {n_facts}")
    if not 1 <= recent <= n_stream:
        raise ValueError(f"recent must be in [1, n_stream = {n_stream}], got {recent}")
    gen = torch.Generator().manual_seed(seed)
    K, T = 2 * half, n_facts + n_stream
    k = torch.zeros(batch, T, 1, K)
    facts = torch.linalg.qr(torch.randn(batch, half, half, generator=gen))[0]  # orthonormal columns
    k[:, :n_facts, 0, :half] = facts[:, :, :n_facts].transpose(1, 2)
    k[:, n_facts:, 0, half:] = _unit(torch.randn(batch, n_stream, half, generator=gen))
    v = _unit(torch.randn(batch, T, 1, value_dim, generator=gen))

    asked = list(range(n_facts)) + list(range(T - recent, T))
    same_half = torch.zeros(len(asked), K)
    same_half[:n_facts, :half] = 1
    same_half[n_facts:, half:] = 1
    perturbation = _unit(torch.randn(batch, len(asked), K, generator=gen) * same_half)
    queries = _unit(k[:, asked, 0] + noise * perturbation)
    to = dict(device=device)
    return TwoTimescaleTask(k.to(**to), v.to(**to), queries.to(**to), v[:, asked, 0].to(**to), n_facts, half)


def channel_gates(slow: torch.Tensor, fast: torch.Tensor, half: int) -> torch.Tensor:
    """Per-channel log decays `[G, 2 half]`: `slow[i]` on the slow half and `fast[i]` on the fast half.

    A scalar gate (Gated DeltaNet) is the case `slow == fast`.
    """
    slow, fast = torch.as_tensor(slow, dtype=torch.float32), torch.as_tensor(fast, dtype=torch.float32)
    return torch.cat([slow[:, None].expand(-1, half), fast[:, None].expand(-1, half)], dim=1)


def retrieval_errors(task: TwoTimescaleTask, gates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run KDA (beta = 1, scale = 1) with each constant per-channel gate and score the final read-outs.

    Args:
        task: the episodes.
        gates: log decays `[G, K]`, values in [-inf, 0]; row i is one model (one value head).

    Returns:
        `(fact_error, recent_error)`, each `[G]`: the mean squared error `|S^T q - v|^2` of the fact queries
        and of the recent-item queries, averaged over the batch. Values are unit vectors, so answering zero
        scores 1.
    """
    B, T, _, K = task.k.shape
    G = gates.shape[0]
    if tuple(gates.shape) != (G, K):
        raise ValueError(f"gates must have shape [G, K] with K = {K}, got {tuple(gates.shape)}")
    g = gates.to(task.k)[None, None].expand(B, T, G, K)
    v = task.v.expand(B, T, G, task.v.shape[-1])
    beta = task.k.new_ones(B, T, G)
    _, S = kda_recurrent(task.k, task.k, v, g, beta, scale=1.0, output_final_state=True)  # S [B, G, K, V]
    read = torch.einsum("bqk,bgkv->bgqv", task.queries, S)
    err = (read - task.targets[:, None]).pow(2).sum(-1)  # [B, G, Q]
    return err[..., : task.n_facts].mean((0, 2)), err[..., task.n_facts :].mean((0, 2))


def retention(g: torch.Tensor, steps: int) -> torch.Tensor:
    """How much of a memory each channel still holds after n = 0..steps steps of a constant gate.

    Args:
        g: log decay per channel `[K]`, <= 0.
        steps: the last step.

    Returns:
        `[steps + 1, K]`: `exp(n g_c)`, the factor a channel-c memory is multiplied by in n steps.
    """
    n = torch.arange(steps + 1, dtype=g.dtype, device=g.device)
    return torch.exp(n[:, None] * g[None, :])


def measured_retention(g: torch.Tensor, steps: int) -> torch.Tensor:
    """The same retention, measured by running KDA: write one memory per channel, then only decay.

    Episode c writes the value 1 under the one-hot key e_c at step 0 (beta = 1), then runs `steps` steps
    with beta = 0 (no writes) and reads with q = e_c after every step.

    Returns:
        `[steps + 1, K]`: the value read from channel c after n steps.
    """
    K = g.shape[0]
    T = steps + 1
    eye = torch.eye(K, dtype=g.dtype, device=g.device)
    k = eye[:, None, None, :].expand(K, T, 1, K)  # episode c: key e_c at every step
    v = torch.ones(K, T, 1, 1, dtype=g.dtype, device=g.device)
    beta = torch.zeros(K, T, 1, dtype=g.dtype, device=g.device)
    beta[:, 0] = 1
    gate = g.expand(K, T, 1, K)
    o, _ = kda_recurrent(k, k, v, gate, beta, scale=1.0)  # o [K, T, 1, 1]
    return o[:, :, 0, 0].T


def channel_decays(
    gate: str, A_log: float, dt_center: float, dt_spread: float, x: float, channels: int = 8
) -> torch.Tensor:
    """Per-channel log decays from KDA's gate, for one head whose channels differ only in `dt_bias`.

    Args:
        gate: `"softplus"` (`kda_edu.ops.gates.kda_gate`) or `"lower bound"` (`kda_gate_lower_bound`, bound -5).
        A_log: the head's log rate.
        dt_center, dt_spread: `dt_bias` runs linearly from `dt_center - dt_spread` to `dt_center + dt_spread`
            over the channels.
        x: the gate projection, the same on every channel (a constant input).
        channels: K.

    Returns:
        g `[channels]` in float64.
    """
    if gate not in ("softplus", "lower bound"):
        raise ValueError(f"gate must be 'softplus' or 'lower bound', got {gate!r}")
    dt_bias = torch.linspace(dt_center - dt_spread, dt_center + dt_spread, channels, dtype=torch.float64)
    proj = torch.full((1, 1, 1, channels), float(x), dtype=torch.float64)
    a_log = torch.tensor([float(A_log)], dtype=torch.float64)
    fn = kda_gate if gate == "softplus" else kda_gate_lower_bound
    return fn(proj, a_log, dt_bias[None])[0, 0, 0]


def plot_channel_retention(ax, g: torch.Tensor, steps: int = 1000, legend: bool = True) -> None:
    """Draw each channel's retention `exp(n g_c)` against n (log axis) and mark its half-life on the 1/2 line.

    With `legend`, a legend to the right of the axes names each channel's half-life.
    """
    n = torch.unique(torch.logspace(0, math.log10(steps), 200).round())
    kept = torch.exp(n[:, None] * g[None, :].to(n))
    colors = plt.cm.viridis(torch.linspace(0, 0.9, g.shape[0]).tolist())
    for c in range(g.shape[0]):
        half_life = float("inf") if g[c] == 0 else math.log(2) / -g[c].item()
        ax.plot(n, kept[:, c], color=colors[c], label=f"channel {c}: half-life {half_life:.3g}")
        if 1 <= half_life <= steps:
            ax.plot([half_life], [0.5], "o", color=colors[c], ms=4)
    ax.axhline(0.5, color="gray", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_ylim(-0.02, 1.02)
    if legend:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))


def plot_gate_shapes(x: torch.Tensor, g_soft: torch.Tensor, g_low: torch.Tensor) -> None:
    """Chapter 5's figure of the two gates against their input `x` `[N]`: log decay (left), decay (right)."""
    from kda_edu.plotting import figure, finish

    fig, axes = figure(
        r"The softplus gate can erase a channel in one step; the bounded gate keeps at least $e^{-5}$",
        [
            (r"gate input $x + \delta$ ($A_{\log} = 0$)", "log decay $g$ per step"),
            (r"gate input $x + \delta$ ($A_{\log} = 0$)", r"decay $\alpha = e^{g}$ per step"),
        ],
        width=3.9,
    )
    for ax, f in zip(axes, (lambda t: t, torch.exp), strict=True):
        ax.plot(x, f(g_soft), label=r"softplus: $-\mathrm{softplus}(x)$")
        ax.plot(x, f(g_low), label=r"lower bound: $-5\,\sigma(x)$")
        ax.legend(fontsize=8)
    axes[0].axhline(-5, color="gray", ls=":", lw=1)
    axes[0].set_ylim(-12, 0.5)
    finish(fig)


def plot_channel_half_lives(
    gate: str = "softplus",
    A_log: float = 0.0,
    dt_center: float = -4.0,
    dt_spread: float = 3.0,
    x: float = 0.0,
) -> None:
    """Chapter 5's explorer: `plot_channel_retention` for the gates `channel_decays` builds from these settings."""
    from kda_edu.plotting import figure, finish

    g = channel_decays(gate, A_log, dt_center, dt_spread, x)
    lives = math.log(2) / -g.min(), math.log(2) / -g.max()
    fig, (ax,) = figure(
        f"Half-lives from {lives[0]:.3g} to {lives[1]:.3g} steps",
        [("steps $n$ since the write (log scale)", "fraction of the memory kept, $e^{n g}$")],
        width=7.5,
    )
    plot_channel_retention(ax, g)
    finish(fig)


def plot_retention_settings(settings: list[tuple[str, float, str]], dt_center: float = -4.0) -> None:
    """Chapter 5's static figure: `plot_channel_retention` for each `(gate, dt_spread, title)` side by side."""
    from kda_edu.plotting import figure, finish

    fig, axes = figure(
        "A dt_bias per channel spreads the half-lives over orders of magnitude; a scalar gate has one",
        [("steps $n$ since the write (log)", "fraction kept, $e^{n g}$")] * len(settings),
        width=3.1,
        height=3.4,
    )
    for ax, (gate, spread, name) in zip(axes, settings, strict=True):
        g = channel_decays(gate, 0.0, dt_center, spread, 0.0)
        plot_channel_retention(ax, g, legend=False)
        lives = math.log(2) / -g
        ax.set_title(f"{name}\nhalf-lives {lives.min():.3g} to {lives.max():.3g} steps", fontsize=9)
    finish(fig)


def plot_gate_sweeps(decays: torch.Tensor, scalar: tuple, kda: tuple) -> None:
    """Chapter 5's figure of the task: fact, recent and mean errors against the decay `-decays[1:]` (log axis).

    Args:
        decays: log decays `[G]`, `decays[0] = 0` (drawn as dotted horizontal lines).
        scalar: `(fact, recent)` errors `[G]` of a scalar gate on all channels (left panel).
        kda: `(fact, recent)` errors `[G]` of KDA with g = 0 on the slow half and the decay on the fast half.
    """
    from kda_edu.plotting import figure, finish

    fig, axes = figure(
        "One scalar decay must choose between facts and recent items; per-channel decay keeps both",
        [("decay $-g$ per step (log scale)", "squared error (1 = answer zero)")] * 2,
        width=3.9,
        height=3.6,
    )
    names = (
        "scalar gate $g$ on all channels (Gated DeltaNet)",
        "KDA: $g = 0$ on the slow half, $g$ on the fast half",
    )
    for ax, (fact, recent), name in zip(axes, (scalar, kda), names, strict=True):
        for err, label, color in (
            (fact, "facts", "C0"),
            (recent, "recent items", "C1"),
            ((fact + recent) / 2, "mean", "k"),
        ):
            ax.plot(-decays[1:], err[1:], color=color, label=label)
            ax.axhline(err[0], color=color, ls=":", lw=1)
        ax.set_xscale("log")
        ax.set_title(name + "\n(dotted: $g = 0$)", fontsize=9)
        ax.set_ylim(0, 1.05)
    best_kda = ((kda[0] + kda[1]) / 2).min().item()
    axes[0].axhline(best_kda, color="C2", ls="--", label=f"best KDA mean, {best_kda:.2f}")
    axes[0].legend(fontsize=8)
    finish(fig)


def plot_controls(controls: dict[str, list[float]]) -> None:
    """Chapter 5's bar chart: each model's best mean error, a bar for the first task draw and ticks for all."""
    from kda_edu.plotting import figure, finish

    fig, (ax,) = figure(
        "Per-channel decay beats one head and needs keys aligned with its channels",
        [("mean squared retrieval error (1 = answering zero)", "model (equal state size)")],
        width=7.0,
        height=3.8,
    )
    for row, (name, means) in enumerate(controls.items()):
        ax.barh(row, means[0], color="C2" if "KDA" in name else "C0", alpha=0.8)
        ax.plot(means, [row] * len(means), "k|", ms=12)
        ax.text(max(means) + 0.005, row, f"{means[0]:.3f}", va="center")
    ax.set_yticks(range(len(controls)), list(controls))
    ax.invert_yaxis()
    ax.set_xlim(0, 0.3)
    finish(fig)


def rotate_keys(task: TwoTimescaleTask, seed: int = 1) -> TwoTimescaleTask:
    """The same episodes with every key and query multiplied by one random orthogonal matrix `R` `[K, K]`.

    Overlaps between keys and queries do not change, so a memory whose decay is the same on every channel
    (Gated DeltaNet with one head) gives the same errors; a per-channel decay now sees each half of the task
    spread over all channels. This is the control for "per-channel decay helps": the help should survive only
    if the channels that decay differently can be aligned with what must be kept for different times.
    """
    K = task.k.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    R = torch.linalg.qr(torch.randn(K, K, generator=gen, dtype=torch.float64))[0].to(task.k)
    return TwoTimescaleTask(task.k @ R.T, task.v, task.queries @ R.T, task.targets, task.n_facts, task.half)


def mix_halves(task: TwoTimescaleTask, angle: float) -> TwoTimescaleTask:
    """The same episodes with every key and query leaning `angle` radians into the other half.

    Channel i of the slow half and channel i of the fast half are rotated by `angle` in their plane: a fact's
    key keeps `cos(angle)` of its length on the slow half and moves `sin(angle)` onto the fast half (and a
    stream key the other way). Overlaps between keys and queries do not change, so one scalar-gated head gives
    the same errors at every angle; a per-channel decay now decays part of every fact with the fast half. At
    `angle = 0` the episodes are unchanged; at `pi / 4` each key is spread evenly over both halves.
    """
    K = task.k.shape[-1]
    half = K // 2
    c, s = math.cos(angle), math.sin(angle)
    R = torch.eye(K, dtype=torch.float64)
    i = torch.arange(half)
    R[i, i], R[i, i + half], R[i + half, i], R[i + half, i + half] = c, -s, s, c
    R = R.to(task.k)
    return TwoTimescaleTask(task.k @ R.T, task.v, task.queries @ R.T, task.targets, task.n_facts, task.half)


def gdn_heads_errors(task: TwoTimescaleTask, head_gates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet with H heads and KDA's state size, scored like `retrieval_errors`.

    The K key channels are cut into H blocks of K / H; head h sees block h of every key and query, L2-normalised
    as a Gated DeltaNet head normalises its own key (a zero block stays zero and writes nothing), keeps a
    `[K / H, V]` state with its own constant decay, and the read-out is the sum of the heads' reads. H heads of
    `[K / H, V]` hold exactly as many numbers as one `[K, V]` state.

    Args:
        task: the episodes; each key and query must lie inside one block (true for `make_task`'s halves when
            H divides 2), otherwise the per-head normalisation counts a key more than once.
        head_gates: log decays `[G, H]`; row i is one model.

    Returns:
        `(fact_error, recent_error)`, each `[G]`.
    """
    B, T, _, K = task.k.shape
    G, H = head_gates.shape
    if K % H:
        raise ValueError(f"head_gates must have a number of heads H dividing K = {K}, got H = {H}")
    Q, V = task.queries.shape[1], task.v.shape[-1]
    k = F.normalize(task.k.reshape(B, T, H, K // H), dim=-1)
    q = F.normalize(task.queries.reshape(B, Q, H, K // H), dim=-1)
    v = task.v.expand(B, T, H * G, V)  # value head h * G + i reads key head h
    g = head_gates.to(task.k).T.reshape(H * G)[None, None].expand(B, T, H * G)
    beta = task.k.new_ones(B, T, H * G)
    _, S = gated_delta_recurrent(k, k, v, g, beta, scale=1.0, output_final_state=True)
    read = torch.einsum("bqhk,bhgkv->bgqv", q, S.reshape(B, H, G, K // H, V))
    err = (read - task.targets[:, None]).pow(2).sum(-1)  # [B, G, Q]
    return err[..., : task.n_facts].mean((0, 2)), err[..., task.n_facts :].mean((0, 2))


def control_errors(
    task: TwoTimescaleTask,
    grid: torch.Tensor,
    pairs: torch.Tensor,
    angles: dict[str, float],
    rotate_seed: int = 1,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every model of the equal-state comparison on one batch of episodes, at every gate of its grid.

    Args:
        task: the episodes.
        grid: scalar log decays `[G]` for one Gated DeltaNet head (the same on every channel).
        pairs: log decay pairs `[P, 2]`: (slow half, fast half) for KDA, (head 0, head 1) for two heads.
        angles: `{label: angle}`, the tilts of `mix_halves` run with KDA.
        rotate_seed: the seed of `rotate_keys`' random rotation.

    Returns:
        `{model: (fact_error, recent_error)}` on the CPU, each `[G]` or `[P]` as `retrieval_errors` returns.
    """
    half, rotated = task.half, rotate_keys(task, seed=rotate_seed)
    scalar, split = channel_gates(grid, grid, half), channel_gates(pairs[:, 0], pairs[:, 1], half)
    runs = {
        "GDN, 1 head": retrieval_errors(task, scalar),
        "GDN, 2 heads": gdn_heads_errors(task, pairs),
        "KDA": retrieval_errors(task, split),
        "GDN, 1 head, rotated keys": retrieval_errors(rotated, scalar),
        "KDA, rotated keys": retrieval_errors(rotated, split),
    }
    for label, angle in angles.items():
        runs[f"KDA, keys tilted {label}"] = retrieval_errors(mix_halves(task, angle), split)
    return {name: (fact.cpu(), recent.cpu()) for name, (fact, recent) in runs.items()}


def best_mean(fact_recent: tuple[torch.Tensor, torch.Tensor]) -> float:
    """The lowest mean of the fact and recent-item errors over a model's grid of gates."""
    fact, recent = fact_recent
    return ((fact + recent) / 2).min().item()


GATE_INITS = ("flat", "spread")
SPREAD = (0.005, 1.0)  # the decay rates -g a "spread" start covers


class LearnedMemory(torch.nn.Module):
    """The smallest trained version of the task's memory: learned keys and learned constant decays.

    The episodes arrive in a rotated basis (`rotate_keys`), so no channel is a half of the task any more. The
    model maps every key and query through one learned matrix `W` `[K, K]` (started at a random rotation), cuts
    the result into `heads` blocks, L2-normalises each block, and runs the delta rule (beta = 1) with learned
    constant log decays `-softplus(theta)`: one per head for Gated DeltaNet, one per key channel for KDA
    (`per_channel=True`, one head), started all at -0.0025 (`gate_init="flat"`) or spread log-uniformly over
    the rates in `SPREAD` (`"spread"`). The read-out is a learned weighted sum of the heads' reads. Every variant
    keeps `K x V` numbers of state.

    With `per_token=True` the gates are computed from each token, as a KDA layer computes them: the token's
    input key `x_t` (the rotated key, before `W`) goes through a learned projection `W_g` `[n, K]` into
    `kda_edu.ops.gates.kda_gate` with `A_log = 0` and `theta` as its bias, `g_t = -softplus(W_g x_t + theta)`.
    `W_g` starts at zero, so training starts from the same constant gates. The projection is linear and a key
    and its negative are equally likely, so it cannot give one half of the task a lower mean gate by the sign of
    its keys; it can only make the gate vary from token to token (and, through softplus's curvature, lower the
    mean gate of tokens whose keys it projects far from zero).
    """

    def __init__(
        self,
        K: int,
        heads: int,
        per_channel: bool,
        seed: int,
        gate_init: str = "flat",
        per_token: bool = False,
    ):
        super().__init__()
        if gate_init not in GATE_INITS:
            raise ValueError(f"gate_init must be one of {GATE_INITS}, got {gate_init!r}")
        if not isinstance(per_token, bool):
            raise TypeError(f"per_token must be True or False, got {per_token!r}")
        if per_channel and heads != 1:
            raise ValueError(f"per_channel decay is KDA: heads must be 1, got {heads}")
        if K % heads:
            raise ValueError(f"heads must divide K = {K}, got {heads}")
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.per_channel = heads, per_channel
        self.W = torch.nn.Parameter(torch.linalg.qr(torch.randn(K, K, generator=gen))[0])
        n = K if per_channel else heads
        # "flat": every gate in softplus's flat tail, g about -0.0025, its gradient scaled by 0.0025. "spread":
        # rates log-uniform over SPREAD (half-lives 0.7 to 139 steps), as Mamba spreads its step sizes; a
        # single gate sits at the middle.
        lo, hi = (math.log(r) for r in SPREAD)
        if gate_init == "flat":
            theta = torch.full((n,), -6.0)
        else:
            rates = torch.exp(torch.linspace(lo, hi, n)) if n > 1 else torch.tensor([math.exp((lo + hi) / 2)])
            theta = torch.log(torch.expm1(rates))  # softplus(theta) = rate
        self.theta = torch.nn.Parameter(theta)
        self.out = torch.nn.Parameter(torch.ones(heads))
        self.per_token = per_token
        if per_token:
            self.W_g = torch.nn.Parameter(torch.zeros(n, K))

    def gates(self) -> torch.Tensor:
        """The log decays: `[K]` (per channel) or `[heads]`; with per-token gates, those of a zero input."""
        return -F.softplus(self.theta)

    def token_gates(self, task: TwoTimescaleTask) -> torch.Tensor:
        """Every token's log decays `[B, T, H, K / H]`: a per-channel gate (KDA) or `[B, T, H, 1]` (per head).

        Constant gates repeat `gates()` at every token; per-token gates come from each token's input key.
        """
        B, T, _, K = task.k.shape
        H = self.heads
        if not self.per_token:
            g = self.gates()
            g = g.reshape(1, 1, 1, K) if self.per_channel else g.reshape(1, 1, H, 1)
            return g.expand(B, T, H, g.shape[-1])
        proj = task.k[:, :, 0] @ self.W_g.T  # [B, T, K] (KDA) or [B, T, H]
        A_log = self.theta.new_zeros(1 if self.per_channel else H)
        if self.per_channel:
            return kda_gate(proj[:, :, None, :], A_log, self.theta[None])  # [B, T, 1, K]
        return kda_gate(proj, A_log, self.theta)[..., None]  # [B, T, H, 1]

    def errors(self, task: TwoTimescaleTask) -> tuple[torch.Tensor, torch.Tensor]:
        """`(fact_error, recent_error)`, two scalars, scored like `retrieval_errors`."""
        B, T, _, K = task.k.shape
        H, Q = self.heads, task.queries.shape[1]
        k = F.normalize((task.k[:, :, 0] @ self.W.T).reshape(B, T, H, K // H), dim=-1)
        q = F.normalize((task.queries @ self.W.T).reshape(B, Q, H, K // H), dim=-1)
        v = task.v.expand(B, T, H, task.v.shape[-1])
        _, S = general_recurrence(
            k,
            k,
            v,
            self.token_gates(task),
            k.new_ones(B, T, H),
            delta_rule=True,
            scale=1.0,
            output_final_state=True,
        )
        read = torch.einsum("bqhk,bhkv,h->bqv", q, S, self.out)
        err = (read - task.targets).pow(2).sum(-1)  # [B, Q]
        return err[:, : task.n_facts].mean(), err[:, task.n_facts :].mean()


def train_learned_memory(
    heads: int,
    per_channel: bool,
    seed: int,
    steps: int = 150,
    lr: float = 0.05,
    task_kwargs: dict | None = None,
    rotation_seed: int = 1,
    gate_init: str = "flat",
    per_token: bool = False,
) -> dict:
    """Train a `LearnedMemory` with Adam on fresh rotated episodes and score it on held-out ones.

    Args:
        heads, per_channel: the model (see `LearnedMemory`).
        seed: seed of the model's start and of the training episodes.
        steps: Adam steps, one fresh batch of episodes each.
        lr: Adam's learning rate.
        task_kwargs: arguments of `make_task` (besides `seed`); the chapter's CPU task when None.
        rotation_seed: the rotation of the key basis (`rotate_keys`), fixed for training and evaluation.
        gate_init: where the gates start (see `LearnedMemory`).
        per_token: gates computed from each token (see `LearnedMemory`) instead of constants.

    Returns:
        A dict with the held-out `fact`, `recent` and `mean` errors (floats), the learned `gates` (list), the
        `initial_gates` and the training curve `loss` (list, the mean error of each step's batch). With
        `per_token`, `gates` is each gate's mean over the held-out tokens, and the dict adds
        `gates_fact_tokens` and `gates_stream_tokens` (the means over the fact and the stream tokens),
        `gates_token_std` (each gate's standard deviation over the stream tokens) and `W_g_norm` (the
        projection's Frobenius norm, 0 at the start).
    """
    kw = dict(batch=32, half=8, value_dim=8, n_facts=4, n_stream=124, recent=2, noise=0.5)
    kw.update(task_kwargs or {})
    torch.manual_seed(seed)
    model = LearnedMemory(2 * kw["half"], heads, per_channel, seed, gate_init, per_token)
    initial_gates = model.gates().tolist()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    curve = []
    for step in range(steps):
        task = rotate_keys(make_task(**kw, seed=1_000_000 * (seed + 1) + step), rotation_seed)
        fact, recent = model.errors(task)
        loss = (fact + recent) / 2
        opt.zero_grad()
        loss.backward()
        opt.step()
        curve.append(loss.item())
    with torch.no_grad():
        held_out = rotate_keys(make_task(**{**kw, "batch": 4 * kw["batch"]}, seed=999), rotation_seed)
        fact, recent = (e.item() for e in model.errors(held_out))
        result = dict(
            fact=fact,
            recent=recent,
            mean=(fact + recent) / 2,
            gates=model.gates().tolist(),
            initial_gates=initial_gates,
            loss=curve,
        )
        if per_token:
            g = model.token_gates(held_out).flatten(2)  # [B, T, gates]
            stream = g[:, held_out.n_facts :]
            result.update(
                gates=g.mean((0, 1)).tolist(),
                gates_fact_tokens=g[:, : held_out.n_facts].mean((0, 1)).tolist(),
                gates_stream_tokens=stream.mean((0, 1)).tolist(),
                gates_token_std=stream.std(1).mean(0).tolist(),
                W_g_norm=model.W_g.norm().item(),
            )
    return result


def compare_gate_runs(constant: list[dict], per_token: list[dict]) -> dict:
    """What per-token gates changed: each run of `train_learned_memory(..., per_token=True)` against the
    constant-gate run of the same model, start and seed.

    Args:
        constant, per_token: run records with `model`, `seed`, `gate_init`, `mean`, `gates` (and, per token,
            `gates_stream_tokens`, `gates_token_std`, `loss_every_50`), the same runs in the same order.

    Returns:
        A dict: `runs`, the number of pairs; `error_change`, the largest relative change of a run's held-out
        mean error; `kda_split`, for each spread-start KDA pair the (kept, decayed) channel counts, g > -0.01
        and g < -0.1, of the constant gates and of the per-token gates' means over the stream tokens;
        `token_std`, the largest standard deviation of a gate over the stream tokens in those runs; and
        `loss_tail`, the largest relative spread of a per-token run's last four 50-step loss means.
    """
    if len(constant) != len(per_token):
        raise ValueError(
            f"constant and per_token must hold the same runs, got {len(constant)} and {len(per_token)}"
        )
    for c, t in zip(constant, per_token, strict=True):
        if any(c[key] != t[key] for key in ("model", "seed", "gate_init")):
            raise ValueError(
                f"runs out of step: constant {c['model']}, seed {c['seed']}, {c['gate_init']} vs "
                f"per token {t['model']}, seed {t['seed']}, {t['gate_init']}"
            )

    def split(gates):
        return sum(g > -0.01 for g in gates), sum(g < -0.1 for g in gates)

    kda = [
        (c, t)
        for c, t in zip(constant, per_token, strict=True)
        if (c["gate_init"], c["model"]) == ("spread", "KDA")
    ]
    tails = ((max(c) - min(c)) / min(c) for c in (t["loss_every_50"][-4:] for t in per_token))
    return dict(
        runs=len(constant),
        error_change=max(abs(t["mean"] / c["mean"] - 1) for c, t in zip(constant, per_token, strict=True)),
        kda_split=[(split(c["gates"]), split(t["gates_stream_tokens"])) for c, t in kda],
        token_std=max((s for _, t in kda for s in t["gates_token_std"]), default=0.0),
        loss_tail=max(tails),
    )
