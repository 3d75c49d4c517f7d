"""Chapter 15's model of a whole hybrid stack's prefill time over n ranks, and its gloo harness's MLA cases."""

import pytest
import torch

from kda_edu.chapters.ch15_context_parallel import (
    Link,
    RankCosts,
    gather_case,
    gather_mla_case,
    hybrid_stack_seconds,
    run_gloo,
    shard_cases,
)
from kda_edu.layers.mla import MLA, MLAConfig

COSTS = RankCosts(kda_pass=1.0, kda_fold=0.1, kda_correct=0.2, mla=3.0)
SLOW = Link("1 kB/s, 10 ms", bandwidth=1e3, latency=0.01)


def test_stack_time_counted_by_hand():
    """n = 4, 8 layers (6 KDA, 2 MLA). A KDA map is 1 head x 2 x (2 + 2) float32 = 32 bytes: 3 messages of
    0.01 + 0.032 s per layer. T = 16 cuts into 8 pieces of 2, shards of 4 rows of 3 bf16 numbers = 24
    bytes: 3 messages, 0.03 + 0.072 s per layer."""
    got = hybrid_stack_seconds(4, COSTS, SLOW, T=16, H=1, K=2, V=2, cache_width=3, layers=8)
    assert got["kda"]["compute"] == pytest.approx(6 * 1.3)
    assert got["kda"]["communication"] == pytest.approx(6 * 3 * 0.042)
    assert got["mla"]["communication"] == pytest.approx(2 * (0.03 + 0.072))
    assert got["total"] == pytest.approx(6 * (1.3 + 0.126) + 2 * (3 + 0.102))
    assert got["bytes"] == 6 * 3 * 32 + 2 * 3 * 24


def test_one_rank_has_no_fold_and_no_messages():
    got = hybrid_stack_seconds(1, COSTS, SLOW, T=16, H=1, K=2, V=2, cache_width=3, layers=4)
    assert got["communication"] == 0 and got["bytes"] == 0
    assert got["total"] == pytest.approx(3 * 1.0 + 3.0)


def test_layers_must_fill_whole_groups():
    with pytest.raises(ValueError, match="layers"):
        hybrid_stack_seconds(2, COSTS, SLOW, T=16, H=1, K=2, V=2, cache_width=3, layers=6)


def test_mla_cases_run_beside_kda_cases_and_match_one_process():
    """`shard_cases` runs an MLA case (it holds a `layer`) and a KDA case in one set of two gloo processes;
    `gather_mla_case` puts the MLA results back in sequence order. Compared in float64 with the layer in one
    process: outputs, input gradients and every parameter's gradient (summed over the ranks). T = 11 is not
    a multiple of 2R = 4, so the shards are padded; a wrong zigzag order, a dropped gradient path or a rank
    whose parameter share is lost is of order 1, rounding 1e-15."""
    torch.manual_seed(0)
    layer = MLA(8, MLAConfig(num_heads=2, kv_rank=4, qk_head_dim=3, v_head_dim=2, rope_head_dim=2)).double()
    x, dy = torch.randn(2, 1, 11, 8, dtype=torch.float64)
    kda = {n: torch.randn(1, 6, 1, *s, dtype=torch.float64) for n, s in dict(q=(4,), k=(4,), v=(3,)).items()}
    kda.update(g=-torch.rand(1, 6, 1, 4, dtype=torch.float64), beta=torch.rand(1, 6, 1, dtype=torch.float64))
    kda_case = dict(kda, lengths=[2, 4], scheme="scan", kernel="reference")
    per_rank = run_gloo(shard_cases, 2, [dict(layer=layer, x=x, dy=dy), kda_case])
    got = gather_mla_case([r[0] for r in per_rank])
    xs = x.clone().requires_grad_()
    y = layer(xs, mode="mha")
    (y * dy).sum().backward()
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(got["y"], y.detach()) < 1e-10 and rel(got["dx"], xs.grad) < 1e-10
    for name, p in layer.named_parameters():
        assert rel(got["params"][name], p.grad) < 1e-10, name
    assert gather_case([r[1] for r in per_rank])["o"].shape == (1, 6, 1, 3)  # the KDA case ran beside it
