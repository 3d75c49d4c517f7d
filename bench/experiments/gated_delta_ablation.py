"""The 2 x 2 ablation (decay x delta rule) of chapter 4 over several seeds, on chapter 3's rewrite task and
chapter 4's document task (`kda_edu.chapters.ch04_gated_delta_ablation`).

Writes bench/results/gated_delta_ablation.json (or $OUT/gated_delta_ablation.json when OUT is set): for every
task, seed and model, the error at the model's best gate of the grid and that gate.

Run: python -m bench.experiments.gated_delta_ablation [--seeds 5] [--batch 64]  (CPU, about a minute of CPU
time per seed at the defaults).
"""

import argparse
import os
from pathlib import Path

from bench.common import write_result
from kda_edu.chapters.ch04_gated_delta_ablation import GRID, ablation, document_task, rewrite_task


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    a = parser.parse_args()
    tasks = {"rewrite": rewrite_task, "document": document_task}
    results = {name: [] for name in tasks}
    for seed in range(a.seeds):
        for name, make in tasks.items():
            r = ablation(make(batch=a.batch, seed=seed), GRID)
            results[name].append({m: dict(error=d["error"], g=d["g"]) for m, d in r.items()})
            print(seed, name, {m: round(d["error"], 3) for m, d in r.items()}, flush=True)
    out = Path(os.environ.get("OUT", "bench/results")) / "gated_delta_ablation.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, dict(grid=GRID, batch=a.batch, results=results))
    print("wrote", out)


if __name__ == "__main__":
    main()
