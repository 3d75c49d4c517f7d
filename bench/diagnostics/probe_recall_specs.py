"""Find which pending runs of the GPU recall sweep fail, cheaply: a few training steps of each.

    python bench/diagnostics/probe_recall_specs.py --out bench/results/recall_gpu.json --next 16 [--steps 12]

Takes the next `--next` runs the sweep would start (those not yet in `--out`), keeps one per (task, length,
mixer, learning rate), and trains each for `--steps` steps (CUDA graph after the usual three ordinary steps,
two evaluations), every one in a fresh process, one after another, so a crash (an illegal memory access
breaks the whole CUDA context) is pinned to its run. Prints OK or the traceback per run. Written after the
second GPU slot of the sweep stopped on an illegal memory access in one of its workers (bench/NOTES.md).
"""

import argparse
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

import torch

from kda_edu.chapters.ch12_recall_sweep import PRESETS, load_results, run_key, run_specs, task_for
from kda_edu.layers.mixers import MixerConfig, RecallConfig
from kda_edu.training.train import TrainConfig, train


def probe(preset: dict, spec: dict, steps: int) -> str:
    task = task_for(spec["task"], spec["seq_len"], preset["tasks"][spec["task"]])
    mixer = MixerConfig(kind=spec["mixer"], **preset["mixer"])
    model = RecallConfig(vocab_size=task.vocab_size, mixer=mixer, **preset["model"])
    config = TrainConfig(lr=spec["lr"], seed=spec["seed"], **preset["train"])
    config = replace(config, steps=steps, warmup=2, eval_every=max(steps // 2, 1))
    t0 = time.perf_counter()
    result = train(task, model, config, device="cuda", progress=False)
    torch.cuda.synchronize()
    return f"eval loss {result.history[-1]['eval_loss']:.3f}, {time.perf_counter() - t0:.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpu")
    parser.add_argument("--out", default="bench/results/recall_gpu.json")
    parser.add_argument("--next", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    done = {run_key(r) for r in load_results(args.out)["runs"]}
    todo = [s for s in run_specs(preset) if run_key(s) not in done][: args.next]
    seen, specs = set(), []
    for spec in todo:
        key = (spec["task"], spec["seq_len"], spec["mixer"], spec["lr"])
        if key not in seen:
            seen.add(key)
            specs.append(spec)
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx, max_tasks_per_child=1) as pool:
        for spec in specs:
            try:
                print("OK    ", spec, pool.submit(probe, preset, spec, args.steps).result(), flush=True)
            except Exception as error:  # noqa: BLE001 - the point is to report it
                print("FAILED", spec, "".join(traceback.format_exception(error)), flush=True)


if __name__ == "__main__":
    main()
