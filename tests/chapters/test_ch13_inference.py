"""Chapter 13's serving helpers: pieces through a cache, live cache bytes, synthetic caches, timing."""

import pytest
import torch

from kda_edu.chapters.ch13_inference import (
    batch_one_rows,
    count_ops,
    decode_step_bytes,
    decode_step_seconds,
    decode_throughput,
    forward_in_pieces,
    largest_batch_rows,
    max_batch,
    measure_cache_bytes,
    mla_append_seconds,
    synthetic_cache,
    weight_bytes,
)
from kda_edu.layers.kda_layer import KDAConfig
from kda_edu.layers.mla import MLA, MLACache, MLAConfig
from kda_edu.models.costs import cache_bytes
from kda_edu.models.model import HybridConfig, HybridLM

CONFIG = HybridConfig(
    vocab_size=40,
    d_model=16,
    n_layers=4,
    kda=KDAConfig(num_heads=2, head_dim=8, chunk_size=8),
    mla=MLAConfig(num_heads=2, kv_rank=12, qk_head_dim=8, v_head_dim=8),
)


def test_pieces_equal_one_forward_pass():
    torch.manual_seed(0)
    model = HybridLM(CONFIG).double().eval()
    ids = torch.randint(0, 40, (2, 30))
    with torch.no_grad():
        full = model(ids)
    assert torch.allclose(forward_in_pieces(model, ids, [11, 1, 1, 16, 1]), full, atol=1e-10)
    with pytest.raises(ValueError, match="sum to T = 30"):
        forward_in_pieces(model, ids, [10, 10])


def test_measured_bytes_match_the_formula_and_the_synthetic_cache():
    rows = measure_cache_bytes(CONFIG, [5, 20], batch=2, piece=7)
    for row in rows:
        formula = cache_bytes(CONFIG, row["context_len"], batch_size=2)
        assert {k: row[k] for k in ("kda", "mla")} == formula
        model = HybridLM(CONFIG)
        assert synthetic_cache(model, 2, row["context_len"]).nbytes_by_kind() == formula


def test_decode_throughput_and_append_timing_run():
    rows = decode_throughput(CONFIG, batch=2, context_lens=[4, 16], steps=1)
    assert [r["context_len"] for r in rows] == [4, 16] and all(r["tokens_per_s"] > 0 for r in rows)
    layer = MLA(16, CONFIG.mla)
    assert mla_append_seconds(layer, 20, 3, "mqa", repeats=1) > 0


def test_append_timing_pins_and_restores_the_thread_count():
    """threads=1 runs the timing on one thread (checked from inside the layer) and leaves the setting as it was."""
    layer = MLA(16, CONFIG.mla)
    seen = []
    layer.register_forward_pre_hook(lambda module, args: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert mla_append_seconds(layer, 20, 3, "mqa", repeats=2, threads=1) > 0
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_max_batch_counts_caches_and_the_step():
    per_seq = sum(cache_bytes(CONFIG, 100, dtype_bytes=2).values())
    assert max_batch(CONFIG, 100, 10 * per_seq + 1, include_step=False) == 10
    # with the step: the largest batch whose caches and temporaries fit
    for budget in (1e5, 3e5, 1e6, 2**30):
        fit = max_batch(CONFIG, 100, budget)

        def needed(b):
            caches = sum(cache_bytes(CONFIG, 100, b, dtype_bytes=2).values())
            return caches + decode_step_bytes(CONFIG, 100, b)

        assert needed(fit) <= budget < needed(fit + 1)
        assert fit <= max_batch(CONFIG, 100, budget, include_step=False)
    assert max_batch(CONFIG, 100, 10) == 0


def test_decode_step_bytes_of_an_mla_decoding_step():
    """Kimi-like attention layers in bf16 at S = 4096 and batch 256: the largest temporary is the appended
    cache of one layer (256 x 4097 x 512 x 2 bytes, 1 GiB), not 32 float32 copies of it (64 GiB)."""
    config = HybridConfig(
        vocab_size=32000,
        d_model=2304,
        n_layers=8,
        layer_pattern="A",
        mla=MLAConfig(num_heads=32, kv_rank=512, qk_head_dim=128, v_head_dim=128),
    )
    step = decode_step_bytes(config, 4096, batch_size=256)
    assert 256 * 4097 * 512 * 2 <= step < 1.2 * 2**30
    assert decode_step_bytes(config, 65536, 256) > decode_step_bytes(config, 4096, 256)


def test_decode_step_seconds_stops_after_max_seconds():
    torch.manual_seed(0)
    model = HybridLM(CONFIG).eval()
    cache = synthetic_cache(model, 2, 30)
    calls = []
    real = model._logits
    model._logits = lambda *a: calls.append(1) or real(*a)
    assert decode_step_seconds(model, cache, steps=5, warmup=3, max_seconds=0.0) > 0
    assert len(calls) == 2  # one warm-up run, then one timed run
    assert all(c.seq_len == 30 for c in cache.layers if isinstance(c, MLACache))


def test_largest_batch_rows_leave_out_skipped_rows():
    rows = [
        {"pattern": "A", "context_len": 8, "batch": 1, "tokens_per_s": 1.0},
        {"pattern": "A", "context_len": 8, "batch": 4, "skipped": "out of memory"},
        {"pattern": "A", "context_len": 4, "batch": 2, "tokens_per_s": 2.0},
        {"pattern": "K", "context_len": 4, "batch": 9, "tokens_per_s": 3.0},
    ]
    picked = largest_batch_rows({"rows": rows}, "A")
    assert [(r["context_len"], r["batch"]) for r in picked] == [(4, 2), (8, 1)]


def test_batch_one_rows_are_ordered_and_leave_out_skipped_rows():
    rows = [
        {"pattern": "A", "context_len": 8, "batch": 1, "tokens_per_s": 1.0},
        {"pattern": "A", "context_len": 8, "batch": 4, "tokens_per_s": 3.0},
        {"pattern": "A", "context_len": 4, "batch": 1, "tokens_per_s": 2.0},
        {"pattern": "A", "context_len": 16, "batch": 1, "skipped": "time limit"},
        {"pattern": "K", "context_len": 4, "batch": 1, "tokens_per_s": 3.0},
    ]
    picked = batch_one_rows({"rows": rows}, "A")
    assert [(r["context_len"], r["tokens_per_s"]) for r in picked] == [(4, 2.0), (8, 1.0)]


def test_weight_bytes_count_the_parameters_without_allocating_them():
    torch.manual_seed(0)
    for tie in (True, False):
        config = HybridConfig.from_dict({**CONFIG.to_dict(), "tie_embeddings": tie})
        numbers = sum(p.numel() for p in HybridLM(config).parameters())
        assert weight_bytes(config) == 2 * numbers and weight_bytes(config, dtype_bytes=4) == 4 * numbers


def test_count_ops_counts_dispatched_operations():
    x = torch.ones(3)
    assert count_ops(lambda: None) == 0
    assert count_ops(lambda: x + 1) == 1
    assert count_ops(lambda: (x * 2).sum()) == 2
    layer = MLA(16, CONFIG.mla)
    assert count_ops(lambda: layer(torch.randn(1, 1, 16), cache=layer.new_cache())) > 5


def test_chunked_context_attention_equals_full_expansion_in_a_bounded_workspace():
    from kda_edu.chapters.ch13_inference import chunked_context_attention, largest_tensor_bytes
    from kda_edu.ops.attention import causal_attention

    torch.manual_seed(0)
    cfg = MLAConfig(num_heads=2, kv_rank=12, qk_head_dim=8, v_head_dim=6, rope_head_dim=4)
    layer = MLA(16, cfg).double()

    def expanded(q, rows):
        T = rows.shape[1]
        k = layer.k_up(rows[..., :12]).view(1, T, 2, 8)
        k = torch.cat([k, rows[:, :, None, 12:].expand(1, T, 2, 4)], dim=-1)
        return causal_attention(q, k, layer.v_up(rows[..., :12]).view(1, T, 2, 6), scale=12**-0.5)

    with torch.no_grad():
        for total, n, chunk in ((70, 5, 16), (40, 40, 7), (33, 1, 64)):  # append, prefill, one chunk
            rows, q = (
                torch.randn(1, total, 16, dtype=torch.float64),
                torch.randn(1, n, 2, 12, dtype=torch.float64),
            )
            got = chunked_context_attention(layer, q, rows, chunk)
            torch.testing.assert_close(got, expanded(q, rows), rtol=1e-12, atol=1e-12)
    small, large = (torch.randn(1, T, 16, dtype=torch.float64) for T in (64, 256))
    q = torch.randn(1, 4, 2, 12, dtype=torch.float64)
    chunked = [
        largest_tensor_bytes(lambda r=r: chunked_context_attention(layer, q, r, 16)) for r in (small, large)
    ]
    full = [largest_tensor_bytes(lambda r=r: expanded(q, r)) for r in (small, large)]
    assert chunked[0] == chunked[1] and full[1] == 4 * full[0] > chunked[1]  # bounded vs grows with S
    with pytest.raises(ValueError, match="chunk must be an int >= 1"):
        chunked_context_attention(layer, q, small, 0)
    with pytest.raises(ValueError, match="q must be"):
        chunked_context_attention(layer, q[..., :5], small, 8)


def test_causal_cost_counts_the_visible_keys():
    from kda_edu.chapters.ch13_inference import mla_causal_token_cost
    from kda_edu.models.costs import mla_token_cost

    cfg = MLAConfig(num_heads=2, kv_rank=12, qk_head_dim=8, v_head_dim=8, rope_head_dim=4)
    per_key = mla_token_cost(cfg, 16, 2, "mha", appended=1).parts["attention"] / 2
    for S, n in ((0, 10), (100, 1), (100, 7)):
        causal = mla_causal_token_cost(cfg, 16, S + n, n)
        keys = sum(S + i + 1 for i in range(n))  # token i sees the history and itself
        assert causal.parts["attention"] * n == pytest.approx(per_key * keys, rel=1e-12)
        dense = mla_token_cost(cfg, 16, S + n, "mha", appended=n)
        assert causal.parts["expand"] == dense.parts["expand"] and causal.bytes == dense.bytes
