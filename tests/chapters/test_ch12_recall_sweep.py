"""Chapter 12's sweep machinery: persistent workers give each run the numbers it gets alone, replace a worker that
failed or died, and the results file records what the invocations cost."""

import json

import pytest
import torch

from kda_edu.chapters.ch12_recall_sweep import SHORT, seed_relation, tier_text, tiers
from kda_edu.training.sweep import PRESETS, RunPool, cost, expected_seconds, run_specs, run_sweep, summarize


def tiny_preset(lengths: list[int], mixers: list[str], steps: int = 6) -> dict:
    """A few steps of chapter 12's CPU model on MQAR with 4 keys (float32, PyTorch backend)."""
    return {
        **PRESETS["quick"],
        "train": {"steps": steps, "batch_size": 8, "warmup": 1, "eval_every": 3, "eval_size": 16},
        "tasks": {"mqar": {"lengths": lengths, "pairs_per_token": 1 / 8, "num_keys": 4, "num_values": 4}},
        "mixers": mixers,
    }


def curves(record: dict) -> torch.Tensor:
    return torch.tensor([[h["train_loss"], h["eval_loss"], h["eval_acc"]] for h in record["history"]])


@pytest.mark.slow
def test_a_run_gives_the_same_numbers_alone_and_after_another_run_in_its_worker():
    """DeltaNet's run trained in a fresh worker, and again in a worker that has just trained a KDA run with
    another seed and rate. Same operations on the same data in float32 on the CPU, one thread: the curves agree
    to 1e-6 relative (a few float32 roundings; in practice they are equal). A leaked random state or thread count
    changes the initialisation or the summation order, and moves these losses by far more: the KDA run's
    curves, another model and seed, differ from DeltaNet's by more than 1e-3."""
    preset = tiny_preset([16], ["deltanet", "kda"])
    target = {"task": "mqar", "seq_len": 16, "mixer": "deltanet", "lr": 2e-3, "seed": 0}
    before = {"task": "mqar", "seq_len": 16, "mixer": "kda", "lr": 5e-3, "seed": 1}
    with RunPool(["cpu"]) as pool:
        pool.submit(preset, target)
        alone = pool.next_results()[0]
    with RunPool(["cpu"]) as pool:
        pool.submit(preset, before)
        first = pool.next_results()[0]
        pool.submit(preset, target)
        after = pool.next_results()[0]
    assert alone.error is None and first.error is None and after.error is None
    assert (after.pid, after.run_index) == (first.pid, 1) and alone.pid != after.pid
    torch.testing.assert_close(curves(after.record), curves(alone.record), rtol=1e-6, atol=0)
    assert after.record["final_loss"] == pytest.approx(alone.record["final_loss"], rel=1e-6)
    assert (curves(first.record) - curves(alone.record)).abs().max() > 1e-3


def test_runs_trained_together_in_one_worker_give_the_numbers_they_give_alone():
    """Two runs of one job train at the same time in one worker (one thread each): each run's curves agree with
    the same run trained alone in a fresh worker, to 1e-6 relative as above."""
    preset = tiny_preset([16], ["deltanet", "kda"])
    specs = [
        {"task": "mqar", "seq_len": 16, "mixer": m, "lr": 2e-3, "seed": s}
        for m, s in (("deltanet", 0), ("kda", 1))
    ]
    with RunPool(["cpu"]) as pool:
        pool.submit(preset, *specs)
        together = pool.next_results()
        alone = []
        for spec in specs:
            pool.submit(preset, spec)
            alone += pool.next_results()
    assert [o.spec for o in together] == specs and all(o.error is None for o in together + alone)
    assert len({o.pid for o in together + alone}) == 1 and [o.run_index for o in alone] == [2, 3]
    for a, b in zip(together, alone, strict=True):
        torch.testing.assert_close(curves(a.record), curves(b.record), rtol=1e-6, atol=0)
    assert pool.busy() == 0 and pool.idle() == 1


@pytest.mark.slow
def test_the_pool_replaces_a_worker_whose_run_failed_or_that_died():
    """A run that raises (MQAR at T = 64 needs 8 keys, the preset has 4) comes back with its traceback and
    retires its worker; the next run gets a fresh process, the one after reuses it until `runs_per_worker`;
    a worker killed during a run comes back as a failed run naming its exit code."""
    preset = tiny_preset([16, 64], ["linear_attention"], steps=2)
    ok, bad = (
        {"task": "mqar", "seq_len": t, "mixer": "linear_attention", "lr": 2e-3, "seed": 0} for t in (16, 64)
    )
    with RunPool(["cpu"], runs_per_worker=2) as pool:
        pool.submit(preset, bad)
        failed = pool.next_results()[0]
        outcomes = []
        for _ in range(3):
            pool.submit(preset, ok)
            outcomes.append(pool.next_results()[0])
        pool.submit(preset, ok)
        pool.slots[0].process.kill()
        died = pool.next_results()[0]
    assert failed.record is None and "num_keys" in failed.error
    assert all(o.error is None for o in outcomes)
    assert [o.run_index for o in outcomes] == [0, 1, 0]
    assert failed.pid != outcomes[0].pid == outcomes[1].pid != outcomes[2].pid
    assert died.record is None and "died during the run (exit code -9)" in died.error and died.spec == ok
    with pytest.raises(ValueError, match="runs_per_worker"):
        RunPool(["cpu"], runs_per_worker=0)


def test_the_sweep_records_its_invocations_and_reports_their_cost(tmp_path, monkeypatch):
    """Each invocation adds its minutes, GPUs and finished runs to the file (here two runs trained together as
    one job); `cost` sums the GPU ones and prices the runs left at their mean. On the CPU no GPU-minutes count."""
    monkeypatch.setitem(
        PRESETS, "tiny", {**tiny_preset([16, 32], ["linear_attention"], steps=2), "lrs": [2e-3, 5e-3]}
    )
    out = tmp_path / "sweep.json"
    monkeypatch.setenv("KDA_EDU_MPS", "1")  # as bench/device/mps.sh sets it when the daemon is up
    data = run_sweep("tiny", out, workers=1, device="cpu", skip=(("mqar", 32),), together=2)
    assert data["invocations"][0]["mps"] is True
    monkeypatch.delenv("KDA_EDU_MPS")
    again = run_sweep("tiny", out, workers=1, device="cpu", skip=(("mqar", 32),))
    assert [(i["runs"], i["mps"]) for i in again["invocations"]] == [(2, True), (0, False)]
    assert {r["invocation"] for r in again["runs"]} == {
        again["invocations"][0]["started"]
    }  # who trained them
    assert len(run_specs(PRESETS["tiny"])) == 4
    assert sorted((r["seq_len"], r["lr"]) for r in data["runs"]) == [(16, 2e-3), (16, 5e-3)]
    assert [(i["runs"], i["gpus"], i["together"]) for i in data["invocations"]] == [(2, 0, 2)]
    assert data["invocations"][0]["minutes"] > 0
    assert cost(data) == {
        "gpu_minutes": 0, "runs": 0, "per_run": None, "untracked": 0, "left": 2, "left_gpu_minutes": None
    }  # fmt: skip
    data["invocations"] = [
        {**data["invocations"][0], "gpus": 2, "minutes": 3.0, "runs": 1},
        {**data["invocations"][0], "gpus": 0, "minutes": 9.0, "runs": 0},
    ]
    data["runs"] = data["runs"] + data["runs"]  # four in the file, one of them from a recorded invocation
    c = cost(data)
    assert (c["gpu_minutes"], c["runs"], c["per_run"], c["untracked"], c["left"]) == (6.0, 1, 6.0, 3, 2)
    assert c["left_gpu_minutes"] == pytest.approx(12.0)


def test_the_kernel_warm_up_launches_the_variants_the_gpu_runs_launch():
    """Triton compiles a kernel once per class of its integer arguments (equal to 1, divisible by 16, other;
    asked of Triton itself here). The kernels' integer arguments are the length T, the heads and head sizes, and
    the number of chunks in the launch, batch x ceil(T / 64). Every launch of a GPU run (its training batch and
    its evaluation slices, at each length) falls in a class the warm-up launches; a warm-up at a batch of 2 and
    128 tokens (what the sweep compiled before) matches none, so each worker compiled its own kernels."""
    libtriton = pytest.importorskip("triton._C.libtriton")
    from triton.backends.compiler import BaseBackend

    from kda_edu.kernels.chunk_common import chunk_layout
    from kda_edu.training.sweep import task_for, warm_up_shapes
    from kda_edu.training.train import EVAL_BATCH

    def variant(batch: int, length: int) -> tuple:
        _, nch, _, _ = chunk_layout(length, batch, chunk=PRESETS["gpu"]["mixer"]["chunk_size"])
        return tuple(
            libtriton.native_specialize_impl(BaseBackend, n, False, True, True) for n in (length, nch)
        )

    preset = PRESETS["gpu"]
    warmed = {variant(b, n) for b, n in warm_up_shapes(preset)}
    launched = set()
    for name, length in {(spec["task"], spec["seq_len"]) for spec in run_specs(preset)}:
        task = task_for(name, length, preset["tasks"][name])
        train_batch = task.sample(preset["train"]["batch_size"], 0).inputs.shape
        held_out = task.sample(preset["train"]["eval_size"], 1).inputs
        slices = [held_out[i : i + EVAL_BATCH].shape for i in range(0, held_out.shape[0], EVAL_BATCH)]
        launched |= {variant(*shape) for shape in [train_batch, *slices]}
    assert launched <= warmed
    assert not launched & {variant(2, 128)}


@pytest.mark.slow
def test_a_sweep_goes_on_with_more_mixers_and_reruns_runs_of_the_old_build(tmp_path, monkeypatch):
    """A file of a preset that later gained a mixer continues (another learning rate is refused); a run of any
    mixer recorded without `undecayed_gate_parameters` (before the weight-decay fix: for KDA, weight decay took
    in its [H, K] dt_bias; for every mixer, an older build of the GPU path) is pending: `cost` counts it as
    left, the next invocation trains it again, and the new record replaces it while the old one moves to
    "superseded". A run that has the field is kept."""
    monkeypatch.setitem(PRESETS, "tiny", tiny_preset([16], ["kda", "deltanet", "linear_attention"], steps=2))
    out = tmp_path / "sweep.json"
    first = run_sweep("tiny", out, workers=1, device="cpu")
    assert cost(first)["left"] == 0
    by_mixer = {r["mixer"]: r for r in first["runs"]}
    for mixer, marker in (("kda", -1.0), ("deltanet", -2.0)):
        del by_mixer[mixer]["undecayed_gate_parameters"]  # as the GPU sweep's first 78 runs were recorded
        by_mixer[mixer]["final_acc"] = marker  # a marker the re-run cannot reproduce
    by_mixer["linear_attention"]["final_acc"] = -3.0  # recorded with the field: kept as it is
    out.write_text(json.dumps(first))
    assert cost(json.loads(out.read_text()))["left"] == 2

    monkeypatch.setitem(
        PRESETS, "tiny", tiny_preset([16], ["kda", "deltanet", "linear_attention", "decay_only"], steps=2)
    )
    data = run_sweep("tiny", out, workers=1, device="cpu")
    assert sorted(r["mixer"] for r in data["runs"]) == ["decay_only", "deltanet", "kda", "linear_attention"]
    assert all(r["undecayed_gate_parameters"] == ["A_log", "dt_bias"] for r in data["runs"])
    assert sorted(r["final_acc"] for r in data["runs"])[0] == -3.0  # the kept run
    assert all(r["final_acc"] >= 0 for r in data["runs"] if r["mixer"] != "linear_attention")
    assert sorted(r["final_acc"] for r in data["superseded"]) == [-2.0, -1.0]
    assert cost(data)["left"] == 0 and [i["runs"] for i in data["invocations"]] == [3, 3]

    monkeypatch.setitem(PRESETS, "tiny", {**PRESETS["tiny"], "lrs": [1e-3]})
    with pytest.raises(ValueError, match="another preset or configuration"):
        run_sweep("tiny", out, workers=1, device="cpu")


def test_runs_together_with_cuda_graphs_are_refused_before_any_worker_starts():
    """Two threads capturing CUDA graphs at once fail on the GPU (measured on the H200), so a group of runs with
    the GPU preset's graphs is refused with the reason, before a worker process is started."""
    specs = run_specs(PRESETS["gpu"])[:2]
    pool = RunPool(["cuda:0"])
    with pytest.raises(ValueError, match="cannot replay CUDA graphs"):
        pool.submit(PRESETS["gpu"], *specs)
    assert pool.slots[0].process is None and pool.idle() == 1  # nothing was started


@pytest.mark.slow
def test_a_deadline_starts_the_longest_runs_first_and_only_runs_that_fit(tmp_path, monkeypatch):
    """With `deadline_minutes`, the runs start longest first by the file's own timings, and a run expected to
    end after the deadline stays pending (a device call that stops at its limit loses the runs still going).
    Here the recorded length-32 runs are made to look an hour long: with a one-minute deadline only the
    length-16 runs of the second seed start; with an unbounded one, the length-32 runs start first."""
    monkeypatch.setitem(PRESETS, "tiny", tiny_preset([16, 32], ["linear_attention"], steps=2))
    out = tmp_path / "sweep.json"
    first = run_sweep("tiny", out, workers=1, device="cpu")
    for r in first["runs"]:
        if r["seq_len"] == 32:
            r["seconds"] = 3600.0
    out.write_text(json.dumps(first))
    assert (
        expected_seconds({"task": "mqar", "seq_len": 32, "mixer": "linear_attention"}, first["runs"]) > 3600
    )
    assert (
        expected_seconds({"task": "mqar", "seq_len": 32, "mixer": "kda"}, first["runs"]) > 3600
    )  # same cell
    assert expected_seconds({"task": "mqar", "seq_len": 64, "mixer": "kda"}, first["runs"]) is None

    monkeypatch.setitem(PRESETS, "tiny", {**PRESETS["tiny"], "seeds": [0, 1]})
    data = run_sweep("tiny", out, workers=1, device="cpu", deadline_minutes=1.0)
    new = [r for r in data["runs"] if r["seed"] == 1]
    assert [r["seq_len"] for r in new] == [16]  # the hour-long cell stayed pending
    assert cost(data)["left"] == 1

    data = run_sweep("tiny", out, workers=1, device="cpu", deadline_minutes=600.0)
    assert [r["seq_len"] for r in data["runs"] if r["seed"] == 1] == [16, 32]
    monkeypatch.setitem(PRESETS, "tiny", {**PRESETS["tiny"], "seeds": [0, 1, 2]})
    data = run_sweep("tiny", out, workers=1, device="cpu", deadline_minutes=600.0)
    assert [r["seq_len"] for r in data["runs"] if r["seed"] == 2] == [32, 16]  # longest first


def test_the_experiments_name_a_run_by_the_same_options():
    """add_spec_arguments / spec_from_arguments: the options of bench/experiments' scripts give the spec that
    run_setup and the results files use; --mixer is required unless a default is given."""
    import argparse

    from kda_edu.training.sweep import add_spec_arguments, spec_from_arguments

    ap = argparse.ArgumentParser()
    add_spec_arguments(ap)
    args = ap.parse_args(["--task", "mqar", "--seq-len", "256", "--mixer", "kda", "--lr", "1e-3"])
    assert spec_from_arguments(args) == {
        "task": "mqar",
        "seq_len": 256,
        "mixer": "kda",
        "lr": 1e-3,
        "seed": 0,
    }
    with pytest.raises(SystemExit):
        ap.parse_args(["--task", "mqar", "--seq-len", "256", "--lr", "1e-3"])
    ap = argparse.ArgumentParser()
    add_spec_arguments(ap, mixer="gated_deltanet")
    args = ap.parse_args(["--task", "palindrome", "--seq-len", "128", "--lr", "1e-3", "--seed", "1"])
    assert spec_from_arguments(args)["mixer"] == "gated_deltanet" and spec_from_arguments(args)["seed"] == 1


def runs_of(cell: dict[str, list[float]]) -> list[dict]:
    """Records of one task and length: {mixer: [final accuracy of seed 0, seed 1, ...]} at one rate."""
    return [
        {"task": "mqar", "seq_len": 256, "mixer": m, "lr": 1e-3, "seed": s, "final_acc": a}
        for m, accs in cell.items()
        for s, a in enumerate(accs)
    ]


def test_tiers_split_only_where_every_seed_above_beats_every_seed_below():
    summary = summarize(
        runs_of(
            {
                "deltanet": [0.99, 0.98],
                "kda": [0.97, 0.99],
                "linear_attention": [0.5, 0.6],
                "attention": [0.1, 0.2],
            }
        )
    )
    assert tiers(summary, "mqar", 256) == [["deltanet", "kda"], ["linear_attention"], ["attention"]]
    assert seed_relation(summary, "mqar", 256, "deltanet", "kda") == "~"
    assert seed_relation(summary, "mqar", 256, "kda", "linear_attention") == ">"
    assert seed_relation(summary, "mqar", 256, "attention", "linear_attention") == "<"
    # A mixer whose seeds disagree completely overlaps everything between them: one tier, not a false order.
    summary = summarize(runs_of({"deltanet": [0.99, 0.99], "attention": [1.0, 0.1], "kda": [0.5, 0.4]}))
    assert tiers(summary, "mqar", 256) == [["deltanet", "attention", "kda"]]
    assert seed_relation(summary, "mqar", 256, "deltanet", "kda") == ">"  # the pair is still ordered
    assert tier_text([["deltanet"], ["kda", "attention"]]) == "DeltaNet > KDA ~ softmax attention"
    assert tier_text([["deltanet"], ["kda", "attention"]], SHORT) == "DeltaNet > KDA ~ softmax"
