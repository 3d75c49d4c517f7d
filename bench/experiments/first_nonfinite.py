"""Train one run of the recall sweep step by step and find where it first goes non-finite.

DeltaNet on MQAR at 1024 tokens and a rate of 3e-3 had a NaN held-out loss from its first evaluation
(step 200) on, in the GPU sweep. This script trains the same run (the preset's model, data, seeds and
schedule: `build_model`, `make_optimizer`, `lr_at`, `data_seed` of kda_edu.training.train, without the CUDA
graph) one step at a time and records, every step, the loss, the gradient norm before clipping and the
largest parameter magnitude. At the first step where the loss, the gradient norm or a parameter is not
finite it restores the state from before that step, runs it again with hooks, and names:

- the first module (in forward order) whose output holds a non-finite value, if the forward breaks;
- else the first module (in backward order) whose input gradient is non-finite while its output gradient is
  finite, if the backward breaks;
- else the parameters the optimiser step made non-finite.

Writes JSON (`--out`): the spec, the per-step trace, and the finding (or that all `--steps` stayed finite).

    python -m bench.experiments.first_nonfinite --task mqar --seq-len 1024 --mixer deltanet --lr 3e-3 \\
        --steps 200 --device cpu --backend torch --out bench/results/nonfinite_deltanet_mqar1024.json
    python -m bench.experiments.first_nonfinite ... --device cuda            # the sweep's GPU path (bf16 kernel)
"""

import argparse
import copy
import dataclasses
import json
import math
import time

import torch

from bench.common import write_result
from kda_edu.training.sweep import PRESETS, add_spec_arguments, run_setup, spec_from_arguments
from kda_edu.training.train import (
    build_model,
    data_seed,
    lr_at,
    make_optimizer,
    masked_loss_and_accuracy,
)


def finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def first_bad_forward(model, batch) -> tuple[dict | None, torch.Tensor]:
    """The first module, in the order they run, whose output is not finite (None if all are), and the loss."""
    found, handles = [], []
    for name, module in model.named_modules():

        def hook(module, args, output, name=name):
            outs = output if isinstance(output, tuple) else (output,)
            if not found and any(isinstance(o, torch.Tensor) and not finite(o) for o in outs):
                ins = [a for a in args if isinstance(a, torch.Tensor)]
                found.append({"module": name or "(model)", "inputs finite": all(finite(a) for a in ins)})

        handles.append(module.register_forward_hook(hook))
    try:
        loss, _ = masked_loss_and_accuracy(model(batch.inputs), batch)
    finally:
        for h in handles:
            h.remove()
    return (found[0] if found else None), loss


def first_bad_backward(model, loss) -> dict:
    """Leaf modules in backward order: the first whose input gradient is non-finite while its output gradient is
    finite (`created in`: the failure happens inside it), and the first that receives a non-finite output
    gradient (`arrived at`: it came from above, e.g. the loss or the tied output projection, which are no
    modules). Either may be None."""
    found = {"created in": None, "arrived at": None}
    handles = []
    for name, module in model.named_modules():
        if next(module.children(), None) is not None:
            continue  # leaves only: a container's hook would see its first child's failure first

        def hook(module, grad_input, grad_output, name=name):
            out_ok = all(finite(g) for g in grad_output if g is not None)
            in_ok = all(finite(g) for g in grad_input if g is not None)
            if found["arrived at"] is None and not out_ok:
                found["arrived at"] = name
            if found["created in"] is None and out_ok and not in_ok:
                found["created in"] = name

        handles.append(module.register_full_backward_hook(hook))
    try:
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpu", choices=sorted(PRESETS))
    add_spec_arguments(ap)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default=None, help="override the preset's mixer backend (torch / triton)")
    ap.add_argument("--kernel-dtype", default=None, help="override the preset's kernel dtype")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    preset = PRESETS[args.preset]
    spec = spec_from_arguments(args)
    mixer_kw = {}
    if args.backend:
        mixer_kw["backend"] = args.backend
    if args.kernel_dtype:
        mixer_kw["kernel_dtype"] = args.kernel_dtype
    task, model_config, config = run_setup(preset, spec, mixer=mixer_kw, train={"cuda_graph": False})
    device = torch.device(args.device)
    model = build_model(model_config, config.seed).to(device)
    optimizer = make_optimizer(model, config)
    record = {
        "spec": {
            "task": args.task,
            "seq_len": args.seq_len,
            "mixer": args.mixer,
            "lr": args.lr,
            "seed": args.seed,
        },
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model_config": model_config.to_dict(),
        "train_config": dataclasses.asdict(config),
        "trace": [],
        "finding": None,
    }
    t0 = time.perf_counter()
    for step in range(min(args.steps, config.steps)):
        lr = lr_at(step, config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = task.sample(config.batch_size, data_seed(config.seed, step)).to(device)
        saved = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
        loss, _ = masked_loss_and_accuracy(model(batch.inputs), batch)  # train_step's operations, one by one
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        params_ok = all(finite(p) for p in model.parameters())
        row = {
            "step": step,
            "lr": lr,
            "loss": loss.item(),
            "grad_norm": grad_norm.item(),
            "max_abs_param": max(p.detach().abs().max().item() for p in model.parameters()),
        }
        record["trace"].append(row)
        if step % 10 == 0:
            print(
                f"step {step}: loss {row['loss']:.4f}, grad norm {row['grad_norm']:.3g}, max |p| {row['max_abs_param']:.3g}",
                flush=True,
            )
        if math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) and params_ok:
            continue
        # Replay the step from the state before it, with hooks.
        model.load_state_dict(saved[0])
        optimizer.load_state_dict(saved[1])
        optimizer.zero_grad(set_to_none=True)
        bad_forward, loss = first_bad_forward(model, batch)
        finding = {"step": step, "loss finite": finite(loss), "forward": bad_forward}
        if bad_forward is None and finite(loss):
            finding["backward"] = first_bad_backward(model, loss)
            bad_grads = [n for n, p in model.named_parameters() if p.grad is not None and not finite(p.grad)]
            finding["parameters with non-finite gradients"] = bad_grads
            if not bad_grads:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
                optimizer.step()
                finding["parameters made non-finite by the step"] = [
                    n for n, p in model.named_parameters() if not finite(p)
                ]
        record["finding"] = finding
        print("first non-finite:", json.dumps(finding), flush=True)
        break
    record["seconds"] = round(time.perf_counter() - t0, 1)
    write_result(args.out, record)
    if record["finding"] is None:
        print(f"all {len(record['trace'])} steps finite ({record['seconds']} s)")


if __name__ == "__main__":
    main()
