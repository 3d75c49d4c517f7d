"""The memory comparison of chapter 12: every token mixer on every task, at several lengths, seeds and rates.

    python -m kda_edu.chapters.ch12_recall_sweep --preset cpu --out bench/results/recall_cpu.json --workers 2
    python -m kda_edu.chapters.ch12_recall_sweep --preset gpu --out bench/results/recall_gpu.json --workers 16

A preset (`PRESETS`) fixes the model (the same `RecallLM` for every mixer, at equal state size), the training
recipe, the tasks and their lengths, the mixers, the seeds and the learning rates. Every combination is one
run of `kda_edu.training.train.train`. Each finished run is appended to the JSON file at once (with its full task,
model and training configuration, its accuracy curve and its wall time), and a CSV with one row per run is
written beside it; running the same command again skips the runs already in the file, so a sweep can be
split over several invocations (`--max-minutes`).

`summarize` reduces the runs as the Kimi Linear report does: for every task, length and mixer it takes the
learning rate with the best mean final accuracy over the seeds, and reports that rate's mean, min and max.
"""

import argparse
import csv
import json
import os
import platform
import statistics
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

import torch

from kda_edu.layers.mixers import DELTA_RULE_KINDS, KINDS, LABELS, MixerConfig, RecallConfig, TokenMixer
from kda_edu.training.tasks import make_task, task_to_dict
from kda_edu.training.train import GATE_PARAMETERS, TrainConfig, train

# Task parameters besides the length; MQAR's number of pairs grows with the length (`pairs_per_token`).
PRESETS = {
    # The committed CPU sweep (bench/results/recall_cpu.json): short lengths, small model.
    "cpu": {
        "model": {"d_model": 64, "n_layers": 2, "ffn_hidden": 128},
        "mixer": {"num_heads": 2, "head_dim": 16, "chunk_size": 32},
        "train": {"steps": 150, "batch_size": 64, "warmup": 15, "eval_every": 25, "eval_size": 128},
        "tasks": {
            "mqar": {"lengths": [32, 64], "pairs_per_token": 1 / 8, "num_keys": 16, "num_values": 16},
            "palindrome": {"lengths": [16, 32], "num_symbols": 16},
            "stack": {"lengths": [32, 64], "num_stacks": 4, "num_values": 16},
        },
        "mixers": list(KINDS),
        "seeds": [0, 1, 2],
        "lrs": [2e-3, 5e-3],
    },
    # The GPU sweep: the report's model shape (2 layers, 2 heads; head dim 64 here), lengths up to 1024.
    # 180 runs, in parts of `--max-minutes`. The delta-rule mixers run through the Triton kernel: their
    # chunked PyTorch forms launch thousands of small kernels per step, which is what a GPU does worst.
    "gpu": {
        "model": {"d_model": 128, "n_layers": 2, "ffn_hidden": 256},
        "mixer": {
            "num_heads": 2,
            "head_dim": 64,
            "chunk_size": 64,
            "backend": "triton",
            "kernel_dtype": "bfloat16",
        },
        "train": {
            "steps": 1500,
            "batch_size": 64,
            "warmup": 100,
            "eval_every": 100,
            "eval_size": 512,
            "cuda_graph": True,
        },
        "tasks": {
            "mqar": {
                "lengths": [256, 512, 1024],
                "pairs_per_token": 1 / 8,
                "num_keys": 256,
                "num_values": 256,
            },
            "palindrome": {"lengths": [64, 128, 256], "num_symbols": 16},
            "stack": {"lengths": [256, 512, 1024], "num_stacks": 16, "num_values": 16},
        },
        "mixers": list(KINDS),
        "seeds": [0, 1],
        "lrs": [1e-3, 3e-3],
    },
}

# The notebook's live run (under a minute on a CPU): two runs of the CPU sweep (MQAR at T = 32, linear attention
# and DeltaNet, the first seed and rate), so the chapter can compare what it trains with what was committed.
PRESETS["quick"] = {
    **PRESETS["cpu"],
    "tasks": {"mqar": {**PRESETS["cpu"]["tasks"]["mqar"], "lengths": [32]}},
    "mixers": ["linear_attention", "deltanet"],
    "seeds": [0],
    "lrs": [2e-3],
}


def task_for(name: str, seq_len: int, params: dict):
    """The task `name` at length `seq_len` with a preset's parameters (MQAR: `pairs_per_token * seq_len`
    pairs)."""
    params = {k: v for k, v in params.items() if k != "lengths"}
    if name == "mqar":
        params["num_pairs"] = max(1, round(params.pop("pairs_per_token") * seq_len))
    return make_task(name, seq_len=seq_len, **params)


def run_specs(preset: dict) -> list[dict]:
    """Every run of a preset: task, length, mixer, learning rate and seed, in a fixed order, seeds outermost
    (a sweep cut short has every cell at the first seeds rather than some cells at every seed)."""
    specs = []
    for seed in preset["seeds"]:
        for name, params in preset["tasks"].items():
            for seq_len in params["lengths"]:
                for lr in preset["lrs"]:
                    for mixer in preset["mixers"]:
                        specs.append(
                            {"task": name, "seq_len": seq_len, "mixer": mixer, "lr": lr, "seed": seed}
                        )
    return specs


def run_key(spec: dict) -> tuple:
    return (spec["task"], spec["seq_len"], spec["mixer"], spec["lr"], spec["seed"])


def run_one(preset: dict, spec: dict, device: str = "cpu", threads: int | None = None) -> dict:
    """Train one run of a preset and return its record (configs, accuracy curve, wall time)."""
    if threads is not None:
        torch.set_num_threads(threads)
    task = task_for(spec["task"], spec["seq_len"], preset["tasks"][spec["task"]])
    mixer = MixerConfig(kind=spec["mixer"], **preset["mixer"])
    model_config = RecallConfig(vocab_size=task.vocab_size, mixer=mixer, **preset["model"])
    train_config = TrainConfig(lr=spec["lr"], seed=spec["seed"], **preset["train"])
    result = train(task, model_config, train_config, device=device, progress=False)
    return {
        **spec,
        "final_acc": result.final_accuracy,
        "best_acc": max(h["eval_acc"] for h in result.history),
        "final_loss": result.history[-1]["eval_loss"],
        "seconds": round(result.seconds, 2),
        "num_parameters": result.model.num_parameters(),
        "state_size": mixer.state_size,
        "device": str(device),
        "task_config": task_to_dict(task),
        "model_config": model_config.to_dict(),
        "train_config": asdict(train_config),
        # Left out of AdamW's weight decay whatever their shape (runs without this field decayed KDA's
        # [H, K] dt_bias: the GPU sweep's first 78 runs).
        "undecayed_gate_parameters": list(GATE_PARAMETERS),
        "history": result.history,
    }


def warm_up_kernels(preset: dict) -> None:
    """Compile the Triton kernels the preset's delta-rule mixers use, once, in this process: they land in
    Triton's on-disk cache, so the worker processes load them instead of each compiling its own copy."""
    t0 = time.perf_counter()
    for kind in DELTA_RULE_KINDS:
        mixer = TokenMixer(preset["model"]["d_model"], MixerConfig(kind=kind, **preset["mixer"])).cuda()
        x = torch.randn(2, 128, preset["model"]["d_model"], device="cuda", requires_grad=True)
        mixer(x).sum().backward()  # the forward inside autograd launches the same kernels as without it
    torch.cuda.synchronize()
    print(f"Triton kernels compiled in {time.perf_counter() - t0:.0f} s", flush=True)


def load_results(path: str | os.PathLike) -> dict:
    """The JSON written by `run_sweep`."""
    return json.loads(Path(path).read_text())


def _write(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    columns = ["task", "seq_len", "mixer", "lr", "seed", "final_acc", "best_acc", "final_loss", "seconds",
               "num_parameters", "state_size", "device"]  # fmt: skip
    with open(path.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(data["runs"])


def run_sweep(
    preset_name: str,
    out: str | os.PathLike,
    *,
    workers: int = 1,
    max_minutes: float | None = None,
    device: str | None = None,
    skip: tuple[tuple[str, int], ...] = (),
) -> dict:
    """Run (or continue) the sweep of `PRESETS[preset_name]`, writing `out` (.json) and its .csv twin.

    Args:
        preset_name: a key of `PRESETS`.
        out: the JSON file; runs already in it (for the same preset) are skipped. A preset whose only change
            is more seeds continues the file.
        workers: runs trained at the same time, in separate processes with one CPU thread each (on a CUDA
            machine spread round-robin over its GPUs).
        max_minutes: start no new run after this many minutes (the finished runs are saved; rerun to go on).
        device: "cpu" or "cuda"; None picks CUDA when available.
        skip: (task, length) cells to leave out of this invocation (they stay pending for the next one).

    Returns:
        The results dict as written.
    """
    preset = PRESETS[preset_name]
    out = Path(out)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device != "cuda" and preset["train"].get("cuda_graph"):
        # Every run would fail at its first step; say so once instead (a CUDA set-up gone wrong, usually).
        raise ValueError(
            f"preset {preset_name!r} replays CUDA graphs and needs a CUDA device, got {device!r}"
        )
    data = {"preset": preset_name, "config": preset, "runs": []}
    if out.exists():
        data = load_results(out)
        same = {k: v for k, v in json.loads(json.dumps(preset)).items() if k != "seeds"}
        if data["preset"] != preset_name or {k: v for k, v in data["config"].items() if k != "seeds"} != same:
            raise ValueError(f"{out} holds another preset or configuration; pass another --out")
        data["config"] = preset  # more seeds may be added to a finished sweep
    data["environment"] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if device == "cuda" else f"CPU ({platform.machine()})",
        "workers": workers,
        "updated": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    done = {run_key(r) for r in data["runs"]}
    todo = [s for s in run_specs(preset) if run_key(s) not in done and (s["task"], s["seq_len"]) not in skip]
    print(
        f"{preset_name}: {len(done)} runs done, {len(todo)} to go, {workers} worker(s) on {device}",
        flush=True,
    )
    start = time.perf_counter()
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    if todo and device == "cuda" and preset["mixer"].get("backend") == "triton":
        warm_up_kernels(preset)

    def place(i: int) -> str:
        return f"cuda:{i % gpus}" if gpus else "cpu"

    # One fresh process per run (max_tasks_per_child=1): a run that breaks its CUDA context (an illegal memory
    # access, say) cannot take later runs down with it. A run that fails is reported with its traceback and
    # listed under "failed" in the file; the others go on, and the next invocation tries it again.
    with ProcessPoolExecutor(
        max_workers=workers, mp_context=torch.multiprocessing.get_context("spawn"), max_tasks_per_child=1
    ) as pool:
        pending, submitted = {}, 0
        while todo or pending:
            out_of_time = max_minutes is not None and time.perf_counter() - start > 60 * max_minutes
            while todo and len(pending) < workers and not out_of_time:
                threads = 1  # per process; on a GPU the CPU only launches kernels and samples tasks
                spec, where = todo.pop(0), place(submitted)
                pending[pool.submit(run_one, preset, spec, where, threads)] = (spec, where)
                submitted += 1
            if not pending:
                break
            finished = next(as_completed(pending))
            spec, where = pending.pop(finished)
            data["failed"] = [f for f in data.get("failed", []) if run_key(f) != run_key(spec)]
            try:
                record = finished.result()
            except Exception as error:  # noqa: BLE001 - recorded, and retried by the next invocation
                text = "".join(traceback.format_exception(error))
                print(f"FAILED {spec} on {where}:\n{text}", flush=True)
                data["failed"].append({**spec, "error": text[-2000:]})
                _write(out, data)
                continue
            data["runs"].append(record)
            _write(out, data)
            print(
                f"[{len(data['runs'])}/{len(data['runs']) + len(todo) + len(pending)}] {record['task']} "
                f"T={record['seq_len']} {record['mixer']} lr={record['lr']} seed={record['seed']}: "
                f"acc {record['final_acc']:.3f} ({record['seconds']:.0f} s)",
                flush=True,
            )
    _write(out, data)
    return data


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (task, length, mixer): the best learning rate (highest mean final accuracy over the
    seeds) and that rate's `mean`, `min`, `max` and per-seed `accs` (and `n_seeds`)."""
    groups: dict[tuple, dict[float, list[float]]] = {}
    for r in runs:
        groups.setdefault((r["task"], r["seq_len"], r["mixer"]), {}).setdefault(r["lr"], []).append(
            r["final_acc"]
        )
    rows = []
    for (task, seq_len, mixer), by_lr in groups.items():
        lr, accs = max(by_lr.items(), key=lambda item: statistics.fmean(item[1]))
        rows.append(
            {
                "task": task,
                "seq_len": seq_len,
                "mixer": mixer,
                "best_lr": lr,
                "mean": statistics.fmean(accs),
                "min": min(accs),
                "max": max(accs),
                "n_seeds": len(accs),
                "accs": accs,
            }
        )
    order = {k: i for i, k in enumerate(KINDS)}
    return sorted(rows, key=lambda r: (r["task"], r["seq_len"], order.get(r["mixer"], len(order))))


def ordering(summary: list[dict], task: str, seq_len: int) -> list[str]:
    """The mixers of one task and length, best mean accuracy first."""
    rows = [r for r in summary if r["task"] == task and r["seq_len"] == seq_len]
    return [r["mixer"] for r in sorted(rows, key=lambda r: -r["mean"])]


def accuracy_curve(
    runs: list[dict], task: str, seq_len: int, mixer: str, lr: float
) -> dict[str, list[float]]:
    """Held-out accuracy against step for one cell and rate, over its seeds: `step`, `mean`, `min`, `max`."""
    curves = [
        [h["eval_acc"] for h in r["history"]]
        for r in runs
        if (r["task"], r["seq_len"], r["mixer"], r["lr"]) == (task, seq_len, mixer, lr)
    ]
    if not curves:
        raise ValueError(f"no runs for {task} T={seq_len} {mixer} lr={lr}")
    steps = [h["step"] for h in next(r for r in runs if r["task"] == task)["history"]]
    by_step = list(zip(*curves, strict=True))
    return {
        "step": steps,
        "mean": [statistics.fmean(a) for a in by_step],
        "min": [min(a) for a in by_step],
        "max": [max(a) for a in by_step],
    }


def markdown_table(summary: list[dict]) -> str:
    """The summary as a Markdown table: one row per task and length, one column per mixer, cells
    `mean [min, max]` of the final accuracy at the best rate."""
    mixers = [k for k in KINDS if any(r["mixer"] == k for r in summary)]
    cells = {(r["task"], r["seq_len"], r["mixer"]): r for r in summary}
    lines = [
        "| task | T | " + " | ".join(LABELS[m] for m in mixers) + " |",
        "|---|---|" + "---|" * len(mixers),
    ]
    for task, seq_len in dict.fromkeys((r["task"], r["seq_len"]) for r in summary):
        row = [f"{task}", f"{seq_len}"]
        for m in mixers:
            r = cells.get((task, seq_len, m))
            row.append("" if r is None else f"{r['mean']:.2f} [{r['min']:.2f}, {r['max']:.2f}]")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--out", required=True, help="the results JSON (a .csv is written beside it)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--max-minutes", type=float, default=None)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument(
        "--skip", nargs="+", default=[], metavar="TASK:LEN", help="cells to leave for a later invocation"
    )
    parser.add_argument("--dry-run", action="store_true", help="list the runs and exit")
    args = parser.parse_args(argv)
    skip = tuple((cell.split(":")[0], int(cell.split(":")[1])) for cell in args.skip)
    if args.dry_run:
        specs = run_specs(PRESETS[args.preset])
        print(f"{len(specs)} runs")
        for s in specs:
            print(s)
        return
    data = run_sweep(
        args.preset,
        args.out,
        workers=args.workers,
        max_minutes=args.max_minutes,
        device=args.device,
        skip=skip,
    )
    for row in summarize(data["runs"]):
        print(
            f"{row['task']:>10} T={row['seq_len']:<5} {row['mixer']:>16} lr={row['best_lr']:<7g} "
            f"acc {row['mean']:.3f} [{row['min']:.3f}, {row['max']:.3f}]"
        )


if __name__ == "__main__":
    main()
