"""What a recall-sweep run costs when M runs of one configuration (other seeds and learning rates) are trained
as one batched run (`kda_edu.training.batched.train_batched`) instead of one after another.

    python -m bench.experiments.batched_recall_cost --preset cpu --steps 10 --copies 3                 # a CPU
    python -m bench.experiments.batched_recall_cost --preset gpu --steps 200 --cell mqar:512 \
        --mixer kda --copies 4 16 --separate-runs 4                                                  # a GPU

One process, one device. The runs are those of a learning-rate grid: `--copies` M runs of the preset's model
and recipe (with `--steps` steps) on one task and length, seeds 0, 1, 2, ... and learning rates spread
log-uniformly over [`--lr-min`, `--lr-max`] (cycled when M exceeds `--lrs`). Three ways to train them:

- "separate": `train` on each run, as the sweep trains it (on a GPU preset: the Triton kernels, CUDA graphs);
- "separate_torch": `train` on each run with the batched run's recipe (the delta-rule mixers through their
  PyTorch forms, no CUDA graph): the same numbers as the batched copies, so the pair shows what batching
  alone buys; left out when it is the same recipe as "separate";
- "batched": one `train_batched` of all M, for every M in `--copies`.

Each timing is the wall time of the whole call (building the models, sampling, training, evaluating), after
a short warm-up call of the same mode (the Triton kernels' compilation and the first-call work stay out).
`--separate-runs` times only that many separate runs; the per-run cost is their mean. For every mode the script
writes the seconds and GPU-minutes per run (one GPU held for the wall time, divided by the runs), the final
held-out accuracies, and for "batched" the largest difference of its final held-out losses from the
"separate_torch" (or "separate") runs of the same seeds and rates.

Writes `batched_recall_cost.json` (with `device`) to `--out` (default `$OUT`, else bench/results).
"""

import argparse
import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.common import write_result
from kda_edu.backend import use_triton
from kda_edu.layers.mixers import DELTA_RULE_KINDS
from kda_edu.training.batched import train_batched
from kda_edu.training.sweep import PRESETS, run_setup
from kda_edu.training.train import train


def log_uniform(lo: float, hi: float, n: int) -> list[float]:
    """`n` rates spread evenly in log space from `lo` to `hi` (both included; `lo` alone for n = 1)."""
    if n == 1:
        return [lo]
    return [math.exp(math.log(lo) + i * (math.log(hi) - math.log(lo)) / (n - 1)) for i in range(n)]


def batched_recipe(model_config, train_config, device):
    """The model and training configs a batched run can train: a delta-rule mixer whose backend would run the
    Triton kernels runs its PyTorch form (float32), and no CUDA graph."""
    mixer = model_config.mixer
    if mixer.kind in DELTA_RULE_KINDS and use_triton(mixer.backend, torch.empty(0, device=device)):
        model_config = replace(model_config, mixer=replace(mixer, backend="torch", kernel_dtype="float32"))
    return model_config, replace(train_config, cuda_graph=False)


def timed(fn, device: str):
    """`(fn(), wall seconds)`, the device synchronised before and after."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cell", default=None, metavar="TASK:LEN", help="default: the preset's first")
    parser.add_argument("--mixer", default=None, help="default: the preset's first")
    parser.add_argument("--copies", type=int, nargs="+", default=[4], help="M of the batched runs")
    parser.add_argument(
        "--separate-runs", type=int, default=None, help="separate runs timed (default: max M)"
    )
    parser.add_argument("--lr-min", type=float, default=1e-4)
    parser.add_argument("--lr-max", type=float, default=3e-3)
    parser.add_argument("--lrs", type=int, default=5, help="rates in the grid")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args(argv)
    if min(args.copies) < 1:
        parser.error(f"--copies must be >= 1, got {args.copies}")

    preset = PRESETS[args.preset]
    preset = {**preset, "train": {**preset["train"], "steps": args.steps}}
    preset["train"]["warmup"] = min(preset["train"]["warmup"], args.steps // 4)
    preset["train"]["eval_every"] = max(1, args.steps // 2)
    first_task = next(iter(preset["tasks"]))
    task_name, seq_len = (
        (args.cell.split(":")[0], int(args.cell.split(":")[1]))
        if args.cell
        else (first_task, preset["tasks"][first_task]["lengths"][0])
    )
    mixer = args.mixer or preset["mixers"][0]
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    grid = log_uniform(args.lr_min, args.lr_max, args.lrs)
    M_max = max(args.copies)
    specs = [
        {"task": task_name, "seq_len": seq_len, "mixer": mixer, "lr": grid[i % len(grid)], "seed": i}
        for i in range(M_max)
    ]
    setups = [run_setup(preset, spec) for spec in specs]
    task, model_config = setups[0][:2]
    configs = [c for _, _, c in setups]
    torch_model, _ = batched_recipe(model_config, configs[0], device)
    torch_configs = [batched_recipe(model_config, c, device)[1] for c in configs]
    n_separate = min(args.separate_runs or M_max, M_max)
    result = {
        "device": torch.cuda.get_device_name(0) if device != "cpu" else "CPU",
        "torch": torch.__version__,
        "preset": args.preset,
        "task": task_name,
        "seq_len": seq_len,
        "mixer": mixer,
        "steps": args.steps,
        "specs": specs,
        "model_config": model_config.to_dict(),
        "batched_model_config": torch_model.to_dict(),
        "modes": {},
    }
    print(
        f"{args.preset} {task_name} T={seq_len} {mixer}, {args.steps} steps, on {result['device']}",
        flush=True,
    )

    def record(name: str, runs: int, wall: float, results) -> dict:
        row = {
            "runs": runs,
            "wall": wall,
            "seconds_per_run": wall / runs,
            "gpu_minutes_per_run": wall / runs / 60 if device != "cpu" else None,
            "final_acc": [r.final_accuracy for r in results],
            "final_loss": [r.history[-1]["eval_loss"] for r in results],
        }
        if device != "cpu":
            row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        print(f"  {name}: {wall:.2f} s for {runs} runs, {wall / runs:.3f} s per run", flush=True)
        return row

    short = [replace(c, steps=2, warmup=0, eval_every=2) for c in torch_configs]
    modes = [("separate", model_config, configs)]
    if (torch_model, torch_configs) != (model_config, configs):
        modes.append(("separate_torch", torch_model, torch_configs))
    for name, model, cfgs in modes:
        warm = replace(cfgs[0], steps=4, warmup=0, eval_every=4)  # CUDA graphs need 3 ordinary steps first
        timed(lambda model=model, warm=warm: train(task, model, warm, device=device, progress=False), device)
        results, wall = timed(
            lambda model=model, cfgs=cfgs: [
                train(task, model, c, device=device, progress=False) for c in cfgs[:n_separate]
            ],
            device,
        )
        result["modes"][name] = record(name, n_separate, wall, results)
        write_result(Path(args.out) / "batched_recall_cost.json", result)
    reference = result["modes"][modes[-1][0]]["final_loss"]
    for M in args.copies:
        cfgs = torch_configs[:M]
        timed(lambda M=M: train_batched(task, torch_model, short[:M], device=device), device)
        results, wall = timed(lambda cfgs=cfgs: train_batched(task, torch_model, cfgs, device=device), device)
        row = record(f"batched M={M}", M, wall, results)
        pairs = list(zip(row["final_loss"], reference, strict=False))  # the runs timed both ways
        row["max_final_loss_diff_vs_separate"] = max((abs(a - b) for a, b in pairs), default=None)
        result["modes"][f"batched_{M}"] = row
        write_result(Path(args.out) / "batched_recall_cost.json", result)
    summary = {name: row["seconds_per_run"] for name, row in result["modes"].items()}
    result["seconds_per_run"] = summary
    write_result(Path(args.out) / "batched_recall_cost.json", result)
    print(json.dumps(summary, indent=1))
    print(f"wrote {Path(args.out) / 'batched_recall_cost.json'}")


if __name__ == "__main__":
    main()
