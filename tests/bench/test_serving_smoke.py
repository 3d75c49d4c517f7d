"""The GPU serving benchmarks run end to end at tiny sizes on the CPU (`--smoke`) and write the fields that
chapter 13 reads, so that their first GPU run does not fail on a typo."""

import json
import runpy
import sys
from pathlib import Path

import pytest


def run_smoke(script: str, out: Path, monkeypatch) -> dict:
    monkeypatch.setattr(sys, "argv", [script, "--smoke", "--out", str(out)])
    runpy.run_module(f"bench.kernels.{script.removesuffix('.py')}", run_name="__main__")
    return json.loads(next(out.glob("*.json")).read_text())


def test_decode_serving_smoke(tmp_path, monkeypatch):
    result = run_smoke("bench_decode_serving.py", tmp_path, monkeypatch)
    timed = [row for row in result["rows"] if "step_s" in row]
    assert {row["pattern"] for row in timed} == {"A", "KKKA", "K"} and {row["batch"] for row in timed} == {
        1,
        3,
    }
    for row in timed:
        assert row["step_s"] > 0 and row["tokens_per_s"] == pytest.approx(row["batch"] / row["step_s"])
        assert row["bound_step_s"] > 0 and row["achieved_bytes_per_s"] > 0
    assert result["overhead"]["graph_step_s"] > 0 and result["copy_bandwidth_bytes_per_s"] > 0


def test_append_prefill_smoke(tmp_path, monkeypatch):
    result = run_smoke("bench_append_prefill.py", tmp_path, monkeypatch)
    assert {row["mode"] for row in result["rows"]} == {"mha", "mqa", "kda", "kda prefill", "mla prefill"}
    for row in result["rows"]:
        assert {"n", "S", "mode", "ms", "peak_bytes"} <= set(row) and row["ms"] > 0
        assert row["model_flops"] > 0 and row["model_bound_ms"] > 0
