"""Chapter 5's two-timescale task with learned keys: does gradient descent find per-channel decay's split?

Trains `kda_edu.chapters.ch05_two_timescales.LearnedMemory` (one Gated DeltaNet head, two Gated DeltaNet heads, one KDA head,
all with K x V numbers of state) on episodes whose key basis is rotated, so the model must learn keys that
put facts and scratch items on different channels, from two starts of the gates: all in softplus's flat
tail ("flat", g = -0.0025) and spread log-uniformly over rates 0.005 to 1 ("spread", as Mamba spreads its
step sizes). The gates are learned constants, or with --per-token computed from each token's input key
(`g_t = -softplus(W_g x_t + theta)`, `W_g` started at zero). Writes bench/results/two_timescales_trained.json
(two_timescales_trained_per_token.json with --per-token; in $OUT when OUT is set, or at --out) with every
run's held-out errors, its gates at the start and the end, and its training loss every 50 steps.

Run: python -m bench.experiments.two_timescales_trained [--steps 600] [--seeds 3] [--per-token]  (CPU, about
20 minutes of CPU time at the defaults, one process per run).
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
    name, seed, steps, gate_init, per_token = args
    torch.set_num_threads(1)
    heads, per_channel = MODELS[name]
    t0 = time.perf_counter()
    r = train_learned_memory(
        heads, per_channel, seed=seed, steps=steps, gate_init=gate_init, per_token=per_token
    )
    loss = r.pop("loss")
    r["loss_every_50"] = [sum(loss[i : i + 50]) / len(loss[i : i + 50]) for i in range(0, len(loss), 50)]
    return dict(model=name, seed=seed, gate_init=gate_init, seconds=time.perf_counter() - t0, **r)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--inits", nargs="+", default=["flat", "spread"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--per-token", action="store_true", help="gates computed from each token's key")
    parser.add_argument("--out", type=Path, default=None, help="the result file (default: see the docstring)")
    a = parser.parse_args()
    jobs = [
        (name, seed, a.steps, init, a.per_token)
        for init in a.inits
        for name in MODELS
        for seed in range(a.seeds)
    ]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(a.workers) as pool:
        runs = list(pool.map(run, jobs))
    name = "two_timescales_trained_per_token.json" if a.per_token else "two_timescales_trained.json"
    out = a.out or Path(os.environ.get("OUT", "bench/results")) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    result = dict(steps=a.steps, runs=runs)
    if a.per_token:  # the constant-gate file keeps its original layout
        grid = dict(models=list(MODELS), inits=a.inits, seeds=list(range(a.seeds)), workers=a.workers)
        result = dict(
            gates="per token", steps=a.steps, grid=grid, wall_seconds=time.perf_counter() - t0, runs=runs
        )
    write_result(out, result)
    for r in runs:
        print(
            f"{r['gate_init']:6} {r['model']:13} seed {r['seed']}: facts {r['fact']:.3f} recent {r['recent']:.3f} mean {r['mean']:.3f}"
        )
    print("wrote", out)


if __name__ == "__main__":
    main()
