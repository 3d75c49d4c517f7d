"""Train one recall run of the GPU sweep for longer, or with larger heads, in parts that fit the device calls.

Chapter 12 asks what makes KDA and Gated DeltaNet fail MQAR at 1024 tokens where the Kimi Linear report has them
solve it: its runs train up to 20,000 steps with heads of 128, the sweep's 1500 steps with heads of 64. This
script trains the sweep's run (`--task`, `--seq-len`, `--mixer`, `--lr`, `--seed`, preset "gpu") with one or
more of those settings changed: `--steps` (the schedule is stretched with them, as the report's longer runs
are), `--head-dim` (the state grows with its square; the model width stays). A run longer than a device call
(600 s) is trained in segments of `--segment` steps: after each evaluation the run is saved to `--checkpoint`
(a .safetensors file: weights, AdamW's state, the history), and the next invocation continues from it, so
the result is the run an uninterrupted training would give (same batches, same schedule; the step's CUDA
graph is recorded again after a resume). The script stops before `--deadline-minutes`, judging from the
segments it has timed, and writes --out (JSON) after every segment: the configuration, the history so far,
`steps_done` and `finished`.

    python -m bench.experiments.long_recall_run --task mqar --seq-len 1024 --mixer kda --lr 1e-3 --steps 6000 \\
        --checkpoint .ckpt/kda_mqar1024_x4.safetensors --deadline-minutes 8 --out $OUT/long_kda_mqar1024_x4.json

Carry the checkpoint's folder (git-ignored) to the next call and run the same command again to continue.
`--cpu-smoke` trains the same way on the CPU with the PyTorch form and no CUDA graph (a check of the segments
and the resume, not of the run).
"""

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open

from bench.common import write_result
from kda_edu.training.sweep import PRESETS, add_spec_arguments, run_setup, spec_from_arguments
from kda_edu.training.train import train


def checkpoint_step(path: Path) -> int:
    """The number of steps a training checkpoint (kda_edu.training.train.save_training_checkpoint) has done."""
    with safe_open(str(path), framework="pt") as f:
        return int(f.metadata()["step"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_spec_arguments(ap)
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: the preset's)")
    ap.add_argument("--head-dim", type=int, default=None, help="head dimension (default: the preset's)")
    ap.add_argument("--segment", type=int, default=500, help="steps per segment (a multiple of eval_every)")
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument(
        "--deadline-minutes", type=float, default=None, help="start no segment that would end later"
    )
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="the PyTorch form on the CPU, without CUDA graphs"
    )
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    t_start = time.perf_counter()

    preset = PRESETS["gpu"]
    spec = spec_from_arguments(args)
    mixer = {} if args.head_dim is None else {"head_dim": args.head_dim}
    train_change = {} if args.steps is None else {"steps": args.steps}
    device = "cuda"
    if args.cpu_smoke:
        mixer |= {"backend": "torch", "kernel_dtype": "float32"}
        train_change |= {"cuda_graph": False}
        device = "cpu"
    task, model_config, config = run_setup(preset, spec, mixer=mixer, train=train_change)
    if args.segment <= 0 or args.segment % config.eval_every:
        raise SystemExit(
            f"--segment {args.segment} must be a positive multiple of eval_every ({config.eval_every})"
        )
    args.checkpoint.parent.mkdir(parents=True, exist_ok=True)

    record = {
        **spec,
        "steps": config.steps,
        "head_dim": model_config.mixer.head_dim,
        "state_size": model_config.mixer.state_size,
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "model_config": model_config.to_dict(),
        "train_config": asdict(config),
        "segments": [],
    }
    if args.out.exists():  # an earlier invocation's segments
        old = json.loads(args.out.read_text())
        if (old["model_config"], old["train_config"]) != (record["model_config"], record["train_config"]):
            raise SystemExit(f"{args.out} holds another run")
        record["segments"] = old["segments"]

    while True:
        resume = args.checkpoint.exists()
        seg_times = [s["seconds"] for s in record["segments"]]
        if args.deadline_minutes is not None and seg_times:
            left = 60 * args.deadline_minutes - (time.perf_counter() - t_start)
            if max(seg_times) * 1.15 + 20 > left:
                print(
                    f"stopping: {left:.0f} s left, a segment takes up to {max(seg_times):.0f} s", flush=True
                )
                break
        t0 = time.perf_counter()
        # train() resumes from the checkpoint's step, and stop_after counts steps in all: start from where
        # the checkpoint stands (it is written at every evaluation, so it may be ahead of --out's record).
        done = checkpoint_step(args.checkpoint) if resume else 0
        if done >= config.steps:
            break
        stop = min(done + args.segment, config.steps)
        result = train(
            task, model_config, config, device=device, checkpoint=args.checkpoint, resume=resume,
            stop_after=stop, progress=False,
        )  # fmt: skip
        steps_done = result.history[-1]["step"]
        record["segments"].append({"steps_done": steps_done, "seconds": round(time.perf_counter() - t0, 1)})
        record["history"] = result.history
        record["steps_done"] = steps_done
        record["finished"] = steps_done >= config.steps
        record["final_acc"] = result.history[-1]["eval_acc"]
        write_result(args.out, record)
        print(
            f"{spec} steps {steps_done}/{config.steps}: held-out acc {record['final_acc']:.3f}, "
            f"loss {result.history[-1]['eval_loss']:.3f} ({record['segments'][-1]['seconds']:.0f} s)",
            flush=True,
        )
        if record["finished"]:
            break


if __name__ == "__main__":
    main()
