"""bench.common: the KDA inputs every benchmark times, the run's environment, interleaved timing, result files."""

import json
import subprocess

import pytest
import torch

from bench import common


def test_kda_inputs_have_the_conventions_shapes_and_distribution():
    x = common.kda_inputs(2, 33, 2, 16, 8, 4, seed=3, dtype=torch.float32, device="cpu")
    assert {n: tuple(t.shape) for n, t in x.items()} == {
        "q": (2, 33, 2, 16),
        "k": (2, 33, 2, 16),
        "v": (2, 33, 4, 8),
        "g": (2, 33, 4, 16),
        "beta": (2, 33, 4),
    }
    assert torch.allclose(x["q"].norm(dim=-1), torch.ones(2, 33, 2)) and torch.allclose(
        x["k"].norm(dim=-1), torch.ones(2, 33, 2)
    )
    assert x["g"].dtype == torch.float32 and bool(((x["g"] > -5) & (x["g"] < 0)).all())
    assert bool(((x["beta"] > 0) & (x["beta"] < 1)).all())


def test_kda_inputs_default_to_bf16_with_a_float32_gate_and_repeat_per_seed():
    a, b = (common.kda_inputs(1, 8, 2, 16, device="cpu", seed=1) for _ in "ab")
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert {n: t.dtype for n, t in a.items()} == {
        "q": torch.bfloat16,
        "k": torch.bfloat16,
        "v": torch.bfloat16,
        "g": torch.float32,
        "beta": torch.bfloat16,
    }
    other = common.kda_inputs(1, 8, 2, 16, device="cpu", seed=2)
    assert not torch.equal(a["v"], other["v"])


def test_kda_inputs_draw_from_a_given_generator_and_can_require_grad():
    gen = torch.Generator().manual_seed(0)
    x = common.kda_inputs(1, 4, 1, 8, generator=gen, device="cpu", requires_grad=True)
    assert all(t.is_leaf and t.requires_grad for t in x.values())
    same = common.kda_inputs(1, 4, 1, 8, seed=0, device="cpu")
    assert all(torch.equal(x[n].detach(), same[n]) for n in x)  # a fresh generator seeded 0 draws the same
    assert not torch.equal(
        torch.randn(3, generator=gen), torch.randn(3, generator=torch.Generator().manual_seed(0))
    )


def test_kda_inputs_refuse_value_heads_that_are_no_multiple_of_the_heads():
    with pytest.raises(ValueError, match="HV must be a multiple of H"):
        common.kda_inputs(1, 4, 2, 8, HV=3, device="cpu")


def test_write_result_writes_json_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "sub" / "r.json"
    common.write_result(path, {"rows": [1, 2]})
    assert json.loads(path.read_text()) == {"rows": [1, 2]}
    assert sorted(p.name for p in path.parent.iterdir()) == ["r.json"]


def test_write_result_keeps_the_old_file_when_the_data_cannot_be_written(tmp_path):
    path = tmp_path / "r.json"
    common.write_result(str(path), {"rows": [1]})
    with pytest.raises(TypeError):
        common.write_result(path, {"rows": [object()]})
    assert json.loads(path.read_text()) == {"rows": [1]}


def test_run_environment_records_the_checkouts_commit_or_unknown(monkeypatch):
    env = common.run_environment()
    assert {"date", "device", "torch", "triton", "python", "commit"} <= set(env)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=common.ROOT, capture_output=True, text=True)
    assert env["commit"] == (head.stdout.strip() if head.returncode == 0 else "unknown")

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(common.subprocess, "run", no_git)
    assert common.run_environment()["commit"] == "unknown"


def test_interleaved_takes_turns_and_keeps_the_median_round(monkeypatch):
    import triton.testing

    calls = []
    times = iter([3.0, 10.0, 1.0, 30.0, 2.0, 20.0])

    def do_bench(fn, **kwargs):
        calls.append(fn())
        return next(times)

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    t = common.interleaved({"a": lambda: "a", "b": lambda: "b"}, repeats=3)
    assert calls == ["a", "b"] * 3 and t == {"a": 2.0, "b": 20.0}
