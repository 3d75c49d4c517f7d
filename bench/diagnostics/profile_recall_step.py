"""Where a training step of the GPU recall preset spends its time, per mixer (chapter 12).

    python -m bench.diagnostics.profile_recall_step --task mqar --seq-len 1024 [--kernel-dtypes float32,bfloat16] [--trace]

For every mixer of the preset (and, for the delta-rule mixers, every kernel dtype asked for) it builds the
preset's model and optimizer and reports, in milliseconds per step:
  sample   the task's batch, drawn on the CPU (as the training loop does);
  forward, backward, optimizer   each phase alone, with a device synchronisation after it;
  loop     the real training loop (`kda_edu.training.train.train`, 40 steps, no evaluation), per step;
  graph loop   the same with `cuda_graph=True` (3 ordinary steps, then one graph replayed).
`--trace` adds PyTorch's profiler table (top operations by device time) for each configuration.
Prints a table and writes JSON to `--out` when given. Not a test: a measurement to decide the preset's settings by.
"""

import argparse
import time
from dataclasses import replace

import torch

from bench.common import write_result
from kda_edu.layers.mixers import DELTA_RULE_KINDS, MixerConfig
from kda_edu.models.recall import RecallConfig, RecallLM
from kda_edu.training.sweep import PRESETS, task_for
from kda_edu.training.train import TrainConfig, make_optimizer, masked_loss_and_accuracy, train


def _timed(fn, repeats: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats * 1e3


def profile(task_name: str, seq_len: int, mixer: MixerConfig, preset: dict, trace: bool) -> dict:
    task = task_for(task_name, seq_len, preset["tasks"][task_name])
    config = RecallConfig(vocab_size=task.vocab_size, mixer=mixer, **preset["model"])
    model = RecallLM(config).cuda()
    train_config = TrainConfig(lr=1e-3, seed=0, **preset["train"])
    opt = make_optimizer(model, train_config)
    B = train_config.batch_size
    batch = task.sample(B, 1).to("cuda")
    state = {}

    def forward():
        state["loss"] = masked_loss_and_accuracy(model(batch.inputs), batch)[0]

    def backward():
        forward()
        opt.zero_grad(set_to_none=True)
        state["loss"].backward()

    def step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), train_config.grad_clip)
        opt.step()

    for _ in range(3):  # compile kernels, warm the allocator
        backward()
        step()
    row = {"sample": round(_timed(lambda: task.sample(B, 2), 3), 2)}
    row["forward"] = round(_timed(forward, 10), 2)
    row["backward"] = round(_timed(backward, 10) - row["forward"], 2)
    row["optimizer"] = round(_timed(step, 10), 2)
    for graph in (False, True):
        short = replace(train_config, steps=40, warmup=4, eval_every=10**6, eval_size=8, cuda_graph=graph)
        torch.cuda.synchronize()
        try:
            result = train(task, config, short, device="cuda", progress=False)
        except Exception as e:  # noqa: BLE001 - a failed capture is reported, not fatal
            print(f"train(cuda_graph={graph}) failed: {e!r}"[:400], flush=True)
            row["graph loop" if graph else "loop"] = float("nan")
            continue
        torch.cuda.synchronize()
        row["graph loop" if graph else "loop"] = round(result.seconds / short.steps * 1e3, 2)
    if trace:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                backward()
                step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="mqar")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--mixers", default="linear_attention,deltanet,gated_deltanet,kda,attention")
    parser.add_argument("--kernel-dtypes", default="float32,bfloat16")
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    preset = PRESETS["gpu"]
    rows = []
    print(
        f"{args.task} T={args.seq_len}, batch {preset['train']['batch_size']}, {torch.cuda.get_device_name(0)}"
    )
    print(
        f"{'mixer':<16}{'kernel':<10}{'sample':>8}{'forward':>9}{'backward':>9}{'optim':>8}{'loop':>8}  (ms)"
    )
    for kind in args.mixers.split(","):
        dtypes = args.kernel_dtypes.split(",") if kind in DELTA_RULE_KINDS else ["float32"]
        for dtype in dtypes:
            mixer = MixerConfig(kind=kind, **{**preset["mixer"], "kernel_dtype": dtype})
            row = {"task": args.task, "seq_len": args.seq_len, "mixer": kind, "kernel_dtype": dtype}
            row.update(profile(args.task, args.seq_len, mixer, preset, args.trace))
            rows.append(row)
            print(f"{kind:<16}{dtype:<10}{row['sample']:>8}{row['forward']:>9}{row['backward']:>9}"
                  f"{row['optimizer']:>8}{row['loop']:>8}{row['graph loop']:>8}", flush=True)  # fmt: skip
    if args.out:
        write_result(args.out, {"device": torch.cuda.get_device_name(0), "rows": rows})


if __name__ == "__main__":
    main()
