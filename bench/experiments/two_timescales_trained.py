"""Chapter 5's two-timescale task with learned keys: does gradient descent find per-channel decay's split?

Trains `kda_edu.chapters.ch05_two_timescales.LearnedMemory` (one Gated DeltaNet head, two Gated DeltaNet heads, one KDA head,
all with K x V numbers of state) on episodes whose key basis is rotated, so the model must learn keys that
put facts and scratch items on different channels. Writes bench/results/two_timescales_trained.json (or
$OUT/two_timescales_trained.json when OUT is set) with every run's held-out errors and learned gates.

Run: python -m bench.experiments.two_timescales_trained [--steps 200] [--seeds 3]  (CPU, about 100 s of
CPU time at the defaults, one process per run).
"""

import argparse
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from bench.common import write_result
from kda_edu.chapters.ch05_two_timescales import train_learned_memory

MODELS = {"GDN, 1 head": (1, False), "GDN, 2 heads": (2, False), "KDA": (1, True)}


def run(args):
    name, seed, steps = args
    torch.set_num_threads(1)
    heads, per_channel = MODELS[name]
    t0 = time.perf_counter()
    r = train_learned_memory(heads, per_channel, seed=seed, steps=steps)
    r.pop("loss")
    return dict(model=name, seed=seed, seconds=time.perf_counter() - t0, **r)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    a = parser.parse_args()
    jobs = [(name, seed, a.steps) for name in MODELS for seed in range(a.seeds)]
    with ProcessPoolExecutor(a.workers) as pool:
        runs = list(pool.map(run, jobs))
    out = Path(os.environ.get("OUT", "bench/results")) / "two_timescales_trained.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, dict(steps=a.steps, runs=runs))
    for r in runs:
        print(
            f"{r['model']:13} seed {r['seed']}: facts {r['fact']:.3f} recent {r['recent']:.3f} mean {r['mean']:.3f}"
        )
    print("wrote", out)


if __name__ == "__main__":
    main()
