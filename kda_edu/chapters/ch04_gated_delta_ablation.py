"""The 2 x 2 ablation behind Gated DeltaNet: decay (yes / no) times the delta rule (yes / no).

All four models are `kda_edu.ops.recurrence.general_recurrence` with one decay per head:

    model                                   decay g      delta rule (erase S^T k before writing)
    linear attention (chapter 2)            0            no
    decay only (RetNet, Mamba-2, GLA)       a constant   no:  S = a S + k v^T
    DeltaNet (chapter 3)                    0            yes
    Gated DeltaNet (chapter 4)              a constant   yes

(GLA's decay is per channel, like KDA's; with one decay per head it is the Mamba-2 / RetNet case.) Each
decaying model is run with every constant gate of a grid at once (one value head per gate), and the best gate
of the grid is reported, so the decay models are compared at their best constant rate, never at a rate chosen
for another model.

Two tasks, both scored with `kda_edu.ops.online_regression.relative_squared_error` (answering zero scores 1):

- `rewrite_task`: chapter 3's stream (`overwrite_stream`): one key rewritten with fresh values between random
  filler pairs; the error is that of reading the key at the end of the last block.
- `document_task`: chapter 4's stream (`kda_edu.chapters.ch04_recall.document_stream`): pairs of an old document, then pairs
  of the current one, read from the final state with noisy queries.
"""

import torch

from kda_edu.chapters.ch04_recall import document_stream
from kda_edu.ops.online_regression import overwrite_stream, relative_squared_error
from kda_edu.ops.recurrence import general_recurrence

GRID = [0.0, -0.003, -0.01, -0.02, -0.05, -0.1, -0.2, -0.5]  # the constant log decays tried by default

MODELS = {
    "linear attention": dict(decay=False, delta_rule=False),
    "decay only (Mamba-2, RetNet)": dict(decay=True, delta_rule=False),
    "DeltaNet": dict(decay=False, delta_rule=True),
    "Gated DeltaNet": dict(decay=True, delta_rule=True),
}


def run_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: list[float], delta_rule: bool, beta: float = 1.0
) -> torch.Tensor:
    """Outputs `[B, T, G, V]` of one model per constant log decay in `gates` (value head i decays by gates[i]).

    q, k `[B, T, 1, K]`, v `[B, T, 1, V]`; scale 1 (queries are keys); beta the write strength of every step.
    """
    B, T, _, V = v.shape
    G = len(gates)
    g = torch.tensor(gates, dtype=v.dtype, device=v.device)[None, None, :, None].expand(B, T, G, 1)
    b = torch.full((B, T, G), float(beta), dtype=v.dtype, device=v.device)
    return general_recurrence(q, k, v.expand(B, T, G, V), g, b, delta_rule=delta_rule, scale=1.0)[0]


def rewrite_task(
    n_rewrites: int = 16, fillers: int = 8, dim: int = 32, batch: int = 64, seed: int = 0, device="cpu"
):
    """Chapter 3's rewrite stream as `(q, k, v, target, steps)`: the read at the end of the last block.

    The stream is drawn on the CPU (the same numbers on every machine) and moved to `device`.
    """
    q, k, v, latest = (x.to(device) for x in overwrite_stream(n_rewrites, fillers, dim, batch, seed))
    T = q.shape[1]
    return q, k, v, latest, [T - 1]


def document_task(
    n_old: int = 128,
    n_new: int = 8,
    dim: int = 32,
    batch: int = 64,
    query_noise: float = 0.5,
    seed: int = 0,
    device="cpu",
):
    """Chapter 4's document stream as `(q, k, v, target, steps)`: the final state is read with noisy queries.

    q is each pair of the current document's key plus `query_noise` times a random unit vector, renormalised;
    q and target are `[B, n_new, 1, dim]`; steps is None (read the final state, see `ablation`). Drawn on the
    CPU and moved to `device`, as `rewrite_task`.
    """
    k, v = document_stream(n_old, n_new, dim, batch=batch, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    noise = torch.randn(batch, n_new, 1, dim, generator=gen)
    noise = noise / noise.norm(dim=-1, keepdim=True)
    q = k[:, n_old:] + query_noise * noise
    q = q / q.norm(dim=-1, keepdim=True)
    return q.to(device), k.to(device), v.to(device), v[:, n_old:].to(device), None


def ablation(task: tuple, grid: list[float]) -> dict[str, dict]:
    """Run the four models of `MODELS` on one task and report each one's error at its best gate of `grid`.

    Args:
        task: `(q, k, v, target, steps)` from `rewrite_task` or `document_task`. With `steps`, the outputs at
            those steps are compared with `target` there; with None, the final state is read with q
            `[B, Q, 1, K]` and compared with target `[B, Q, 1, V]`.
        grid: log decays (each <= 0) tried by the decaying models; the others use g = 0.

    Returns:
        `{model: {"error": best error, "g": its gate, "errors": [error per gate]}}`.
    """
    if any(g > 0 for g in grid):
        raise ValueError(f"grid must hold log decays <= 0, got {grid}")
    q, k, v, target, steps = task
    out = {}
    for name, spec in MODELS.items():
        gates = list(grid) if spec["decay"] else [0.0]
        if steps is None:
            B, T, _, V = v.shape
            G = len(gates)
            g = torch.tensor(gates, dtype=v.dtype, device=v.device)[None, None, :, None].expand(B, T, G, 1)
            _, S = general_recurrence(
                k,
                k,
                v.expand(B, T, G, V),
                g,
                torch.ones(B, T, G, dtype=v.dtype, device=v.device),
                delta_rule=spec["delta_rule"],
                scale=1.0,
                output_final_state=True,
            )
            read = torch.einsum("bqk,bgkv->bqgv", q[:, :, 0], S)  # [B, Q, G, V]
            read = read.transpose(1, 2)  # [B, G, Q, V]
            errors = relative_squared_error(read, target.transpose(1, 2).expand_as(read))
        else:
            o = run_heads(q, k, v, gates, spec["delta_rule"])  # [B, T, G, V]
            sel = o[:, steps].transpose(1, 2)  # [B, G, S, V]
            errors = relative_squared_error(sel, target[:, steps].transpose(1, 2).expand_as(sel))
        best = int(errors.argmin())
        out[name] = dict(error=errors[best].item(), g=gates[best], errors=errors.tolist())
    return out
