"""bench.kernels.bench_decode_throughput: its smoke run on the CPU and a point that runs out of memory."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from bench.kernels import bench_decode_throughput as bench

ROOT = Path(__file__).resolve().parents[2]


def test_decode_benchmark_smoke(tmp_path):
    out = tmp_path / "smoke.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.kernels.bench_decode_throughput",
            "--smoke",
            "--steps",
            "1",
            "--out",
            str(out),
        ],
        check=True,
        cwd=ROOT,
    )
    result = json.loads(out.read_text())
    assert result["smoke"] and {r["pattern"] for r in result["rows"]} == {"A", "KKKA", "K"}
    assert all(r["tokens_per_s"] > 0 and r["batch"] <= 8 for r in result["rows"])
    assert all(r["estimated_bytes"] >= r["cache_bytes"] for r in result["rows"])


def test_decode_benchmark_skips_a_point_that_runs_out_of_memory(tmp_path, monkeypatch):
    """One point running out of memory is recorded as skipped; the others are still measured."""
    real = bench.decode_row

    def decode_row(model, batch, context_len, **kwargs):
        if batch > 1 and context_len == 64 and model.config.layer_pattern == "A":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.02 GiB. GPU 0 ...")
        return real(model, batch, context_len, **kwargs)

    monkeypatch.setattr(bench, "decode_row", decode_row)
    out = tmp_path / "oom.json"
    monkeypatch.setattr(sys, "argv", ["bench", "--smoke", "--steps", "1", "--out", str(out)])
    bench.main()
    rows = json.loads(out.read_text())["rows"]
    skipped = [r for r in rows if "skipped" in r]
    assert [(r["pattern"], r["context_len"]) for r in skipped] == [("A", 64)]
    assert skipped[0]["skipped"].startswith("out of memory: CUDA out of memory. Tried to allocate 64.02 GiB")
    assert len(rows) == 12 and all(r["tokens_per_s"] > 0 for r in rows if "skipped" not in r)

    monkeypatch.setattr(sys, "argv", ["bench", "--smoke", "--time-limit-s", "0", "--out", str(out)])
    bench.main()
    assert all(r["skipped"].startswith("time limit") for r in json.loads(out.read_text())["rows"])
