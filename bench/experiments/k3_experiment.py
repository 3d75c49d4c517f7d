"""Chapter 14's experiment: does each of Kimi K3's additions change the loss of a small hybrid at equal
active parameters, on associative recall (MQAR) and on real text (byte-level Python standard library source)?

Every variant of `kda_edu.chapters.ch14_k3.K3_VARIANTS` is trained from the same seeds, with the same data and steps, on
both tasks; the JSON keeps every run (held-out loss and accuracy, parameters total and active, seconds).

    nice python -m bench.experiments.k3_experiment --task mqar --part 1/2   # the committed CPU runs: four processes
    nice python -m bench.experiments.k3_experiment --task mqar --part 2/2   # (about 15 CPU-minutes together, one thread
    nice python -m bench.experiments.k3_experiment --task text --part 1/2   # each), then
    nice python -m bench.experiments.k3_experiment --task text --part 2/2
    python -m bench.experiments.k3_experiment --merge                       # -> bench/results/k3_cpu_{mqar,text}.json
    python -m bench.experiments.k3_experiment --quick                    # a smoke run
    python -m bench.experiments.k3_experiment --gpu --budget-s 150 --out $OUT/k3_gpu.json   # larger models, one GPU
"""

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from bench.common import write_result
from kda_edu.chapters.ch14_k3 import K3_VARIANTS, TextTask, stdlib_bytes, train_hybrid, variant_config
from kda_edu.layers.ffn import FFNConfig
from kda_edu.layers.kda_layer import KDAConfig
from kda_edu.layers.mla import MLAConfig
from kda_edu.models.model import HybridConfig
from kda_edu.training.tasks import MQAR

# Per task: steps, batch and sequence length; MQAR's pairs and vocabulary.
SIZES = {
    "cpu": {
        "d_model": 48,
        "n_layers": 2,
        "pattern": "KA",
        "seeds": [0, 1, 2],
        "mqar": {"steps": 250, "batch": 32, "seq_len": 32, "num_pairs": 4, "num_keys": 16, "num_values": 16},
        "text": {"steps": 150, "batch": 16, "seq_len": 64},
    },
    "quick": {
        "d_model": 32,
        "n_layers": 2,
        "pattern": "KA",
        "seeds": [0],
        "mqar": {"steps": 20, "batch": 8, "seq_len": 32, "num_pairs": 4, "num_keys": 16, "num_values": 16},
        "text": {"steps": 20, "batch": 8, "seq_len": 32},
    },
    "gpu": {
        "d_model": 128,
        "n_layers": 4,
        "pattern": "KKKA",
        "seeds": [0, 1, 2],
        "mqar": {"steps": 150, "batch": 64, "seq_len": 64, "num_pairs": 8, "num_keys": 32, "num_values": 32},
        "text": {"steps": 150, "batch": 32, "seq_len": 128},
    },
}


def base_config(vocab_size: int, d_model: int, n_layers: int, pattern: str) -> HybridConfig:
    """The baseline: a KDA/MLA hybrid with an 8-expert top-2 MoE and one shared expert."""
    heads = 2
    return HybridConfig(
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=n_layers,
        layer_pattern=pattern,
        kda=KDAConfig(num_heads=heads, head_dim=d_model // heads, chunk_size=16),
        mla=MLAConfig(
            num_heads=heads, kv_rank=d_model // 2, qk_head_dim=d_model // heads, v_head_dim=d_model // heads
        ),
        ffn=FFNConfig(num_experts=8, top_k=2, expert_hidden=d_model, num_shared=1),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--task", choices=["mqar", "text", "all"], default="all")
    parser.add_argument("--part", default="1/1", help="i/n: run the i-th of n equal shares of the variants")
    parser.add_argument(
        "--merge", action="store_true", help="join the parts of the CPU runs, one file per task"
    )
    parser.add_argument(
        "--budget-s", type=float, default=0.0, help="start no new run after this many seconds"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.merge:
        merge()
        return
    part, parts = (int(x) for x in args.part.split("/"))
    variants = [v for i, v in enumerate(K3_VARIANTS) if i * parts // len(K3_VARIANTS) == part - 1]
    mode = "gpu" if args.gpu else "quick" if args.quick else "cpu"
    size = SIZES[mode]
    device = torch.device("cuda" if args.gpu else "cpu")
    if not args.gpu:
        torch.set_num_threads(1)  # tiny matrices: one thread is as fast, and leaves the other cores alone
    suffix = ("" if args.task == "all" else f"_{args.task}") + ("" if parts == 1 else f"_part{part}")
    out = Path(args.out or f"bench/results/k3_{mode}{suffix}.json")

    text = TextTask(stdlib_bytes(2_000_000), seq_len=size["text"]["seq_len"])
    m = size["mqar"]
    mqar = MQAR(
        seq_len=m["seq_len"], num_pairs=m["num_pairs"], num_keys=m["num_keys"], num_values=m["num_values"]
    )
    tasks = {"mqar": (mqar, None, m), "stdlib text": (text, text.heldout(64), size["text"])}
    if args.task != "all":
        tasks = {name: spec for name, spec in tasks.items() if name.endswith(args.task)}
    runs = []
    start, cpu_start = time.perf_counter(), time.process_time()
    # Seeds outermost, so a run stopped by --budget-s still has every variant of every task for its seeds.
    jobs = [(seed, name, variant) for seed in size["seeds"] for name in tasks for variant in variants]
    for seed, task_name, variant in jobs:
        if args.budget_s and time.perf_counter() - start > args.budget_s:
            print(f"stopping: {args.budget_s} s budget spent after {len(runs)} of {len(jobs)} runs")
            break
        task, held, t = tasks[task_name]
        config = variant_config(
            variant, base_config(task.vocab_size, size["d_model"], size["n_layers"], size["pattern"])
        )
        r = train_hybrid(
            config, task, t["steps"], seed, batch_size=t["batch"], eval_batch=held, device=device
        )
        runs.append({"task": task_name, "variant": variant, "seed": seed, **r})
        print(
            f"{task_name:12s} {variant:20s} seed {seed}: eval loss {r['eval_loss']:.4f} "
            f"acc {r['eval_acc']:.3f} active {r['parameters']['active']} ({r['seconds']:.1f} s)",
            flush=True,
        )
        write(out, mode, size, start, cpu_start, device, runs)
    print(f"wrote {out}: {len(runs)} runs, {time.perf_counter() - start:.0f} s")


def write(out: Path, mode: str, size: dict, start: float, cpu_start: float, device, runs: list) -> None:
    """Write the runs so far (after every run, so an interrupted sweep keeps what it finished)."""
    result = {
        "mode": mode,
        "sizes": size,
        "base_config": base_config(256, size["d_model"], size["n_layers"], size["pattern"]).to_dict(),
        "text": {
            "source": "Python standard library *.py (sysconfig stdlib), first 2,000,000 bytes",
            "holdout": 0.1,
        },
        "machine": f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads, {device}",
        "total_seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu_start,
        "runs": runs,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, result)


def merge() -> None:
    """Join `k3_cpu_{task}_part*.json` into `k3_cpu_{task}.json` (runs concatenated, CPU seconds summed) and
    remove the parts."""
    results = Path("bench/results")
    for task in ("mqar", "text"):
        parts = sorted(results.glob(f"k3_cpu_{task}_part*.json"))
        if not parts:
            continue
        loaded = [json.loads(p.read_text()) for p in parts]
        merged = {**loaded[0], "runs": [run for r in loaded for run in r["runs"]]}
        merged["cpu_seconds"] = sum(r["cpu_seconds"] for r in loaded)
        merged["total_seconds"] = max(r["total_seconds"] for r in loaded)
        merged["parts"] = len(loaded)
        write_result((results / f"k3_cpu_{task}.json"), merged)
        for p in parts:
            p.unlink()
        print(f"merged {len(parts)} parts into bench/results/k3_cpu_{task}.json ({len(merged['runs'])} runs)")


if __name__ == "__main__":
    main()
