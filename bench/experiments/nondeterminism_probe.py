"""Where the GPU training step is not repeatable: the same step, computed several times, compared tensor by tensor.

One recall run, trained twice with the same code, seed and batches on the H200, was seen to end
far apart (KDA, MQAR 256: 0.195 to 0.908), that `torch.use_deterministic_algorithms(True)` makes two runs
identical, and that cuBLAS's fixed workspace alone does not. This script names the operation:
it builds the sweep's model for one run (`--task`, `--seq-len`, `--mixer`, preset "gpu", through the sweep's
Triton path in bf16), takes one batch, and computes the forward and the backward `--repeats` times from the same
weights. Every module's output (forward hooks) and every parameter's gradient is compared with the first
repeat; the report lists, in execution order, the first module whose output differs and the parameters whose
gradients differ, with the largest difference. `--deterministic` switches torch's deterministic algorithms
on, as a control: nothing should differ then.

    python -m bench.experiments.nondeterminism_probe --task mqar --seq-len 256 --mixer kda --out $OUT/nondet.json
"""

import argparse
import os

import torch

from bench.common import write_result
from kda_edu.training.sweep import PRESETS, add_spec_arguments, run_setup, spec_from_arguments
from kda_edu.training.train import build_model, data_seed, masked_loss_and_accuracy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_spec_arguments(ap)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.deterministic:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True, warn_only=True)
    spec = spec_from_arguments(args)
    mixer = (
        {} if args.device == "cuda" else {"backend": "torch", "kernel_dtype": "float32"}
    )  # a CPU smoke run
    task, model_config, config = run_setup(PRESETS["gpu"], spec, mixer=mixer)
    model = build_model(model_config, config.seed).to(args.device)
    batch = task.sample(config.batch_size, data_seed(config.seed, 0)).to(args.device)

    outputs: dict[str, torch.Tensor] = {}
    order: list[str] = []

    def hook(name):
        def record(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            if isinstance(out, torch.Tensor):
                if name not in outputs:
                    order.append(name)
                outputs[name] = out.detach().float().clone()

        return record

    for name, module in model.named_modules():
        if name:
            module.register_forward_hook(hook(name))

    repeats = []
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=True)
        outputs.clear()
        logits = model(batch.inputs)
        loss, _ = masked_loss_and_accuracy(logits, batch)
        loss.backward()
        grads = {
            n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None
        }
        repeats.append(({k: v.clone() for k, v in outputs.items()}, grads, loss.item()))

    first_out, first_grad, first_loss = repeats[0]
    report = {
        "spec": spec,
        "deterministic": args.deterministic,
        "repeats": args.repeats,
        "losses": [],
        "outputs": {},
        "grads": {},
    }
    for outs, grads, loss_value in repeats:
        report["losses"].append(loss_value)
        for name in order:
            diff = (outs[name] - first_out[name]).abs().max().item()
            report["outputs"][name] = max(report["outputs"].get(name, 0.0), diff)
        for name, g in grads.items():
            diff = (g - first_grad[name]).abs().max().item()
            report["grads"][name] = max(report["grads"].get(name, 0.0), diff)
    report["module_order"] = order
    report["first_differing_output"] = next((n for n in order if report["outputs"][n] > 0), None)
    report["differing_grads"] = sorted(
        (n for n, d in report["grads"].items() if d > 0), key=lambda n: -report["grads"][n]
    )
    write_result(args.out, report)
    print(f"losses {report['losses']}")
    print(f"first module whose output differs: {report['first_differing_output']}")
    for n in report["differing_grads"][:12]:
        print(f"  grad {n}: max difference {report['grads'][n]:.3e}")


if __name__ == "__main__":
    main()
