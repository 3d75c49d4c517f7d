"""What a recall-sweep run pays besides its training steps: one process per run, persistent workers, and
several runs trained at the same time in one worker.

    python -m bench.experiments.recall_run_cost --preset cpu --steps 20 --runs 4                  # this CPU
    python -m bench.experiments.recall_run_cost --preset gpu --steps 150 --runs 3 --cell mqar:256 \
        --mixers kda --budget-s 140                                                               # one H200

Trains the same few runs of a chapter 12 preset (its model and recipe, `--steps` steps instead of the preset's)
through `RunPool` with one worker: "old", a fresh process per run (`runs_per_worker=1`, what the sweep did
before), "new", one worker for all of them, one after another, and "together", one worker training all of them
at the same time (one job: a thread and, on CUDA, a stream per run; its `wall` is the job's). For every run it records the wall time from submission to
result (`wall`) and the training loop's own time (`train`, the run's `seconds`: Triton's first-call work
happens inside it); `wall - train` is the start-up, model building and held-out sampling. The per-run fixed
cost of a fresh process is the difference between the modes. Both modes train the same specs, so the script also
reports the largest relative difference of their held-out losses against "new" (0 expected: same operations,
same data).
On a CUDA machine with the Triton backend the kernels are compiled once first (`warm_up_kernels`, as the
sweep does), and that time is reported too. Triton's cache starts empty (a fresh TRITON_CACHE_DIR unless one is
set), and the compiled kernels in it are counted after the warm-up and after each mode: a count that grows
during a mode means its workers compiled variants the warm-up did not. `--legacy-warm-up` warms up as the sweep
did before (a batch of 2 at 128 tokens), to see what that cost each fresh process.

Writes `recall_run_cost.json` to `--out` (default `$OUT`, else bench/results) and prints a summary.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import write_result
from kda_edu.training.sweep import PRESETS, RunPool, run_specs, warm_up_kernels

LEGACY_WARM_UP = [(2, 128)]  # (batch, length) of the sweep's warm-up before warm_up_shapes


def compiled_kernels() -> int:
    """Compiled kernels (cubin files) in Triton's cache directory."""
    return sum(1 for _ in Path(os.environ["TRITON_CACHE_DIR"]).rglob("*.cubin"))


def preset_with_steps(name: str, steps: int) -> dict:
    """`PRESETS[name]` training `steps` steps, evaluated twice (half-way and at the end)."""
    preset = PRESETS[name]
    train = {**preset["train"], "steps": steps, "warmup": min(preset["train"]["warmup"], steps // 4)}
    train["eval_every"] = max(1, steps // 2)
    return {**preset, "train": train}


def time_mode(preset: dict, specs: list[dict], device: str, runs_per_worker, budget_end: float) -> list[dict]:
    """Train `specs` one after another on one worker; one row per finished run."""
    rows = []
    with RunPool([device], threads=1, runs_per_worker=runs_per_worker) as pool:
        for spec in specs:
            if time.perf_counter() > budget_end:
                break
            pool.submit(preset, spec)
            (outcome,) = pool.next_results()
            if outcome.error is not None:
                raise RuntimeError(f"run {spec} failed:\n{outcome.error}")
            rows.append(row(outcome))
            print(
                f"  {spec['mixer']} lr={spec['lr']} seed={spec['seed']}: wall {outcome.wall:.2f} s, "
                f"train {outcome.record['seconds']:.2f} s (run {outcome.run_index + 1} of pid {outcome.pid})",
                flush=True,
            )
    return rows


def time_together(preset: dict, specs: list[dict], device: str) -> list[dict]:
    """Train `specs` at the same time as one job of one worker; one row per run."""
    with RunPool([device], threads=1) as pool:
        pool.submit(preset, *specs)
        outcomes = pool.next_results()
    for o in outcomes:
        if o.error is not None:
            raise RuntimeError(f"run {o.spec} failed:\n{o.error}")
        print(
            f"  {o.spec['mixer']} lr={o.spec['lr']} seed={o.spec['seed']}: train {o.record['seconds']:.2f} s"
        )
    print(f"  job wall {outcomes[0].wall:.2f} s", flush=True)
    return [row(o) for o in outcomes]


def row(outcome) -> dict:
    return {
        **outcome.spec,
        "wall": outcome.wall,
        "train": outcome.record["seconds"],
        "run_index": outcome.run_index,
        "pid": outcome.pid,
        "eval_loss": [h["eval_loss"] for h in outcome.record["history"]],
    }


def mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs", type=int, default=4, help="runs per mode")
    parser.add_argument("--cell", default=None, metavar="TASK:LEN", help="default: the preset's first")
    parser.add_argument("--mixers", nargs="+", default=None, help="default: the preset's first")
    parser.add_argument("--budget-s", type=float, default=None, help="start no run after this many seconds")
    parser.add_argument("--legacy-warm-up", action="store_true", help="warm up at a batch of 2, 128 tokens")
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["old", "new", "together"],
        choices=["old", "new", "together"],
        help="in this order",
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args(argv)

    t_start = time.perf_counter()
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton_cache_"))  # workers inherit it
    budget_end = t_start + args.budget_s if args.budget_s else float("inf")
    preset = preset_with_steps(args.preset, args.steps)
    specs = run_specs(preset)
    task, seq_len = (args.cell.split(":")[0], int(args.cell.split(":")[1])) if args.cell else (None, None)
    task = task or specs[0]["task"]
    seq_len = seq_len or specs[0]["seq_len"]
    mixers = args.mixers or [specs[0]["mixer"]]
    chosen = [s for s in specs if (s["task"], s["seq_len"]) == (task, seq_len) and s["mixer"] in mixers]
    chosen = chosen[: args.runs]
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and preset["train"].get("cuda_graph"):
        sys.exit(f"preset {args.preset!r} replays CUDA graphs: run it on a CUDA machine")
    result = {
        "preset": args.preset,
        "steps": args.steps,
        "device": torch.cuda.get_device_name(0) if device != "cpu" else "CPU",
        "torch": torch.__version__,
        "specs": chosen,
    }
    print(
        f"{len(chosen)} runs of {args.preset} ({task} T={seq_len}, {mixers}, {args.steps} steps) on {device}"
    )
    if device != "cpu" and preset["mixer"].get("backend") == "triton":
        t0 = time.perf_counter()
        warm_up_kernels(preset, LEGACY_WARM_UP if args.legacy_warm_up else None)
        result["compile_seconds"] = time.perf_counter() - t0
    result["legacy_warm_up"] = args.legacy_warm_up
    result["compiled_kernels"] = {"after_warm_up": compiled_kernels()}

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for mode in args.modes:
        print(mode, flush=True)
        t0 = time.perf_counter()
        if time.perf_counter() > budget_end:
            break
        if mode == "together":
            rows = time_together(preset, chosen, device)
        else:
            rows = time_mode(preset, chosen, device, {"old": 1, "new": None}[mode], budget_end)
        result[mode] = {"rows": rows, "total_wall": time.perf_counter() - t0}
        result["compiled_kernels"][f"after_{mode}"] = compiled_kernels()
        write_result((out / "recall_run_cost.json"), result)

    old, new, together = (result.get(m, {"rows": []})["rows"] for m in ("old", "new", "together"))
    later = [r for r in new if r["run_index"] > 0]
    summary = {
        "old_wall_per_run": mean([r["wall"] for r in old]),
        "old_train_per_run": mean([r["train"] for r in old]),
        "new_wall_per_run": mean([r["wall"] for r in new]),
        "new_first_wall": new[0]["wall"] if new else None,
        "new_later_wall_per_run": mean([r["wall"] for r in later]),
        "new_later_train_per_run": mean([r["train"] for r in later]),
        # Outside the training loop (start-up, building, sampling the held-out set, handing the record back):
        # less sensitive than the wall time to a busy machine slowing the steps.
        "old_outside_train_per_run": mean([r["wall"] - r["train"] for r in old]),
        "new_later_outside_train_per_run": mean([r["wall"] - r["train"] for r in later]),
    }
    if old and later:
        summary["fixed_cost_per_fresh_process"] = (
            summary["old_outside_train_per_run"] - summary["new_later_outside_train_per_run"]
        )
        summary["first_steps_extra_in_a_fresh_process"] = (
            summary["old_train_per_run"] - summary["new_later_train_per_run"]
        )
    if together:
        summary["together_job_wall"] = together[0]["wall"]
        summary["together_wall_per_run"] = together[0]["wall"] / len(together)
        summary["together_train_per_run"] = mean([r["train"] for r in together])
        summary["new_total_wall"] = result.get("new", {}).get("total_wall")
    for other_name, other in (("old", old), ("together", together)):
        pairs = [
            (a, b)
            for a in other
            for b in new
            if (a["mixer"], a["lr"], a["seed"]) == (b["mixer"], b["lr"], b["seed"])
        ]
        summary[f"max_rel_eval_loss_diff_{other_name}_vs_new"] = max(
            (
                abs(x - y) / abs(x)
                for a, b in pairs
                for x, y in zip(a["eval_loss"], b["eval_loss"], strict=True)
            ),
            default=None,
        )
    result["summary"] = summary
    result["seconds"] = time.perf_counter() - t_start
    write_result((out / "recall_run_cost.json"), result)
    print(json.dumps({**summary, "compiled_kernels": result["compiled_kernels"]}, indent=1))
    print(f"wrote {out / 'recall_run_cost.json'} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
