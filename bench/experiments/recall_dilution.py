"""Why softmax attention learns MQAR slowly at long lengths: length or number of pairs? (CPU, chapter 12)

In the GPU sweep MQAR's number of pairs grows with the length (P = T / 8), so the two are confounded. This
script separates them with the CPU sweep's model and recipe (kda_edu.training.sweep.PRESETS["cpu"], run
longer):

- length at a fixed number of pairs: P = 8, T = 32, 64, 128 (the extra tokens are blanks in the query region);
- pairs at a fixed length: T = 128, P = 4, 8, 16, 32.

Softmax attention with no positional encoding starts out spreading each query over every earlier token; if
that dilution is what slows it, its accuracy after a fixed number of steps falls with T at fixed P and barely
moves with P at fixed T. A fixed-size state (DeltaNet, the control) should show the opposite: crowding by P.

    python -m bench.experiments.recall_dilution --out bench/results/recall_dilution_cpu.json [--workers 2]

About 45 CPU-minutes in all (one thread per run); results are written after every run, and runs already in
--out are skipped, so an interrupted run can be continued.
"""

import argparse
import json
import os
import platform
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from datetime import UTC, datetime

import torch

from bench.common import write_result
from kda_edu.layers.mixers import MixerConfig
from kda_edu.models.recall import RecallConfig
from kda_edu.training.sweep import PRESETS
from kda_edu.training.tasks import MQAR, task_to_dict
from kda_edu.training.train import TrainConfig, train

BASE = PRESETS["cpu"]
STEPS = 400
LR = 2e-3
KEYS = VALUES = 64
FIXED_PAIRS, LENGTHS = 8, (32, 64, 128)
FIXED_LENGTH, PAIRS = 128, (4, 8, 16, 32)
SEEDS = {"attention": (0, 1, 2, 3, 4), "deltanet": (0,)}


def specs() -> list[dict]:
    points = sorted({(T, FIXED_PAIRS) for T in LENGTHS} | {(FIXED_LENGTH, P) for P in PAIRS})
    return [
        {"mixer": m, "seq_len": T, "num_pairs": P, "seed": s}
        for m, seeds in SEEDS.items()
        for s in seeds
        for T, P in points
    ]


def key(spec: dict) -> tuple:
    return (spec["mixer"], spec["seq_len"], spec["num_pairs"], spec["seed"])


def run(spec: dict) -> dict:
    torch.set_num_threads(1)
    task = MQAR(seq_len=spec["seq_len"], num_pairs=spec["num_pairs"], num_keys=KEYS, num_values=VALUES)
    mixer = MixerConfig(kind=spec["mixer"], **BASE["mixer"])
    model = RecallConfig(vocab_size=task.vocab_size, mixer=mixer, **BASE["model"])
    recipe = TrainConfig(**{**BASE["train"], "steps": STEPS}, lr=LR, seed=spec["seed"])
    result = train(task, model, recipe, device="cpu", progress=False)
    return {
        **spec,
        "final_acc": result.final_accuracy,
        "seconds": round(result.seconds, 2),
        "task_config": task_to_dict(task),
        "model_config": model.to_dict(),
        "train_config": asdict(recipe),
        "history": result.history,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    data = {"runs": []}
    if os.path.exists(args.out):
        with open(args.out) as f:
            data = json.load(f)
    done = {key(r) for r in data["runs"]}
    todo = [s for s in specs() if key(s) not in done]
    data["config"] = {
        "model": BASE["model"],
        "mixer": BASE["mixer"],
        "train": {**BASE["train"], "steps": STEPS, "lr": LR},
        "mqar": {"num_keys": KEYS, "num_values": VALUES},
        "length_at_fixed_pairs": {"num_pairs": FIXED_PAIRS, "lengths": list(LENGTHS)},
        "pairs_at_fixed_length": {"seq_len": FIXED_LENGTH, "num_pairs": list(PAIRS)},
        "seeds": {m: list(s) for m, s in SEEDS.items()},
    }
    data["environment"] = {
        "date": datetime.now(UTC).date().isoformat(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
    }
    begin = time.time()
    with ProcessPoolExecutor(args.workers) as pool:
        for future in as_completed([pool.submit(run, s) for s in todo]):
            r = future.result()
            data["runs"] = sorted([*data["runs"], r], key=key)
            write_result(args.out, data)
            print(
                f"{time.time() - begin:6.0f} s  {key(r)}  acc {r['final_acc']:.3f}  ({r['seconds']:.0f} s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
