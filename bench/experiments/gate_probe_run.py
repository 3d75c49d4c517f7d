"""Train one run of the recall sweep and probe its gate gradients against float64 at every evaluation.

Chapter 12 asks why Gated DeltaNet's Palindrome runs collapsed on the GPU path and not on the CPU. One suspect is
gate gradients dominated by rounding when a head's gate is strongly negative (Adam gives a noisy tiny
gradient a full step). This script trains the sweep's run (preset "gpu" settings, or "cpu") in segments of
`eval_every` steps, resuming from a checkpoint each time (`kda_edu.training.train.train` with `stop_after`),
and after every segment runs `kda_edu.training.probes.gate_gradient_probe` on one fixed batch: per layer and
head, the gate's values and the error of the run's gate gradients against a float64 copy of the model. The
held-out accuracy of the same evaluation sits beside it, so the step where the collapse starts can be read
against the gradient error of each head.

    python -m bench.experiments.gate_probe_run --task palindrome --seq-len 128 --mixer gated_deltanet --lr 1e-3 \\
        --out $OUT/gate_probe_gdn_palindrome128.json            # on the GPU: the sweep's run (a few minutes)
    python -m bench.experiments.gate_probe_run --preset cpu --device cpu --task mqar --seq-len 64 \\
        --mixer gated_deltanet --lr 1e-3 --steps 40 --out /tmp/probe.json   # a smoke test on a CPU
"""

import argparse
import dataclasses
import os
import tempfile
import time

import torch

from bench.common import write_result
from kda_edu.training.probes import gate_gradient_probe
from kda_edu.training.sweep import PRESETS, add_spec_arguments, run_setup, spec_from_arguments
from kda_edu.training.train import train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpu", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda")
    add_spec_arguments(ap, mixer="gated_deltanet")
    ap.add_argument("--steps", type=int, default=None, help="fewer steps than the preset")
    ap.add_argument("--probe-batch", type=int, default=16, help="sequences in the probed batch")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    preset = PRESETS[args.preset]
    spec = spec_from_arguments(args)
    train_kw = {"steps": args.steps} if args.steps else {}
    if torch.device(args.device).type != "cuda":
        train_kw["cuda_graph"] = False
    task, model_config, config = run_setup(preset, spec, train=train_kw)
    probe_batch = task.sample(args.probe_batch, seed=10**6 + args.seed).to(
        args.device
    )  # outside the training data

    record = {
        "spec": {
            "task": args.task,
            "seq_len": args.seq_len,
            "mixer": args.mixer,
            "lr": args.lr,
            "seed": args.seed,
        },
        "device": torch.cuda.get_device_name(0) if torch.device(args.device).type == "cuda" else "cpu",
        "model_config": model_config.to_dict(),
        "train_config": dataclasses.asdict(config),
        "probes": [],
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = os.path.join(tmp, "run.safetensors")
        done = 0
        while done < config.steps:
            stop = min(done + config.eval_every, config.steps)
            result = train(
                task,
                model_config,
                config,
                device=args.device,
                checkpoint=checkpoint,
                resume=done > 0,
                stop_after=stop,
                progress=False,
            )
            done = stop
            last = result.history[-1]
            rows = gate_gradient_probe(result.model, probe_batch)
            record["probes"].append(
                {"step": done, "eval_acc": last["eval_acc"], "eval_loss": last["eval_loss"], "heads": rows}
            )
            worst = max(rows, key=lambda r: r["A_log rel error"])
            print(
                f"step {done:5d}: acc {last['eval_acc']:.3f}, loss {last['eval_loss']:.3f}; worst A_log gradient "
                f"error {worst['A_log rel error']:.2e} ({worst['layer']} head {worst['head']}, mean gate "
                f"{worst['g_mean']:.2f}, min {worst['g_min']:.2f})",
                flush=True,
            )
            record["seconds"] = round(time.perf_counter() - t0, 1)
            write_result(args.out, record)  # after every segment: a run cut short keeps its probes


if __name__ == "__main__":
    main()
