"""Chapter 13's serving helpers: pieces through a cache, live cache bytes, synthetic caches, timing."""

import pytest
import torch

from kda_edu.costs import cache_bytes
from kda_edu.inference import (
    decode_throughput,
    forward_in_pieces,
    max_batch,
    measure_cache_bytes,
    mla_append_seconds,
    synthetic_cache,
)
from kda_edu.kda_layer import KDAConfig
from kda_edu.mla import MLA, MLAConfig
from kda_edu.model import HybridConfig, HybridLM

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


def test_max_batch_and_missing_results(tmp_path):
    per_seq = sum(cache_bytes(CONFIG, 100, dtype_bytes=2).values())
    assert max_batch(CONFIG, 100, 10 * per_seq + 1) == 10


def test_decode_benchmark_smoke(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "smoke.json"
    script = Path(__file__).resolve().parent.parent / "bench" / "bench_decode_throughput.py"
    subprocess.run([sys.executable, str(script), "--smoke", "--steps", "1", "--out", str(out)], check=True)
    result = json.loads(out.read_text())
    assert result["smoke"] and {r["pattern"] for r in result["rows"]} == {"A", "KKKA", "K"}
    assert all(r["tokens_per_s"] > 0 and r["batch"] <= 8 for r in result["rows"])
