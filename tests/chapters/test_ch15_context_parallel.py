"""Chapter 15's model of a whole hybrid stack's prefill time over n ranks."""

import pytest

from kda_edu.chapters.ch15_context_parallel import Link, RankCosts, hybrid_stack_seconds

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
