"""Context-parallel MLA on gloo processes against the single-process `MLA` layer, in float64.

One set of four processes runs every case (starting processes costs seconds): the cases of 2 and 3 ranks
run on subgroups of it. Compared: the outputs, the gradients of the
inputs (per token, put back in sequence order) and of every parameter (summed over the ranks), for a loss
`<y, dy>` with a random dy. Float64 rounding is about 1e-15; a wrong causal mask, a piece attending over the
wrong rows or a missing gradient path through the gathered latents is of order 1, so the bound is 1e-10.
The sequence lengths are not multiples of 2R, so the pieces differ in length and the shards are padded.
"""

import pytest
import torch
import torch.distributed as dist

from kda_edu.chapters.ch15_context_parallel import run_gloo
from kda_edu.layers.mla import MLA, MLAConfig
from kda_edu.parallel.context_parallel_mla import (
    context_parallel_mla,
    mla_exchange_bytes,
    zigzag_pieces,
    zigzag_positions,
    zigzag_shard,
    zigzag_unshard,
)

TOL = 1e-10
D = 12
CONFIGS = {
    "nope": dict(num_heads=2, kv_rank=6, qk_head_dim=4, v_head_dim=3),
    "rope slot, gate": dict(
        num_heads=3, kv_rank=5, qk_head_dim=4, v_head_dim=4, rope_head_dim=2, output_gate=True
    ),
}
# (world, T, config, mode): T mod 2R is 1, 5 and 3
CASES = [
    (2, 13, "nope", "mha"),
    (2, 13, "rope slot, gate", "mqa"),
    (3, 17, "rope slot, gate", "mha"),
    (3, 17, "nope", "mqa"),
    (4, 19, "rope slot, gate", "mha"),
]


def make_layer(name: str, seed: int) -> MLA:
    torch.manual_seed(seed)
    return MLA(D, MLAConfig(**CONFIGS[name])).double()


def case_inputs(T: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(2, T, D, generator=gen, dtype=torch.float64) for n in ("x", "dy")}


def mla_rank(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """One process's part of every case (for `run_gloo`): its outputs and gradients where the case's
    group holds it, None elsewhere."""
    groups = {w: dist.new_group(list(range(w))) for w in range(2, world + 1)}  # every process, same order
    results = []
    for case in cases:
        if rank >= case["world"]:
            results.append(None)
            continue
        layer = make_layer(case["config"], case["seed"])
        whole = case_inputs(case["T"], case["seed"])
        x = zigzag_shard(whole["x"], rank, case["world"]).requires_grad_()
        y = context_parallel_mla(layer, x, case["T"], mode=case["mode"], group=groups[case["world"]])
        (y * zigzag_shard(whole["dy"], rank, case["world"])).sum().backward()
        params = {n: p.grad for n, p in layer.named_parameters()}
        results.append({"y": y.detach(), "dx": x.grad, "params": params})
    return results


@pytest.fixture(scope="module")
def runs():
    cases = [dict(world=w, T=T, config=c, mode=m, seed=i) for i, (w, T, c, m) in enumerate(CASES)]
    per_process = run_gloo(mla_rank, max(c[0] for c in CASES), cases)
    return [(case, [r[i] for r in per_process[: case["world"]]]) for i, case in enumerate(cases)]


def rel(x, ref):
    return ((x - ref).norm() / ref.norm()).item()


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"R={c[0]}, T={c[1]}, {c[2]}, {c[3]}" for c in CASES])
def test_context_parallel_mla_matches_the_layer(runs, i):
    case, per_rank = runs[i]
    layer = make_layer(case["config"], case["seed"])
    whole = case_inputs(case["T"], case["seed"])
    x = whole["x"].clone().requires_grad_()
    y = layer(x, mode=case["mode"])
    (y * whole["dy"]).sum().backward()
    assert rel(zigzag_unshard([r["y"] for r in per_rank]), y.detach()) <= TOL
    assert rel(zigzag_unshard([r["dx"] for r in per_rank]), x.grad) <= TOL
    for name, p in layer.named_parameters():
        assert rel(sum(r["params"][name] for r in per_rank), p.grad) <= TOL, name


def test_zigzag_pieces_balance_and_round_trip():
    pieces = zigzag_pieces(19, 4)  # 19 = 8 * 2 + 3: the first three pieces hold 3 tokens, the others 2
    assert [b - a for a, b in pieces] == [3, 3, 3, 2, 2, 2, 2, 2] and pieces[-1][1] == 19
    assert zigzag_positions(19, 0, 4).tolist() == [0, 1, 2, 17, 18]  # pieces 0 and 7
    x = torch.arange(2 * 19).view(2, 19, 1)
    assert torch.equal(zigzag_unshard([zigzag_shard(x, r, 4) for r in range(4)]), x)
    # causal work (keys read) per rank: zigzag within a few tokens' worth, contiguous shards far apart
    work = [sum(int(p) + 1 for p in zigzag_positions(64, r, 4)) for r in range(4)]
    contiguous = [sum(range(16 * r + 1, 16 * r + 17)) for r in range(4)]
    assert max(work) - min(work) <= 64 < max(contiguous) - min(contiguous)
    with pytest.raises(ValueError, match="T must"):
        zigzag_pieces(5, 3)


def test_exchange_bytes():
    """T = 19 over 4 ranks: the longest shard is 3 + 2 = 5 rows of w = 7 numbers, 2 bytes each."""
    got = mla_exchange_bytes(19, 4, cache_width=7, batch=2)
    assert got == {
        "forward": 3 * 5 * 2 * 7 * 2,
        "backward": 2 * 3 * 5 * 2 * 7 * 2,
        "total": 9 * 5 * 2 * 7 * 2,
    }
    assert mla_exchange_bytes(19, 1, 7)["total"] == 0
