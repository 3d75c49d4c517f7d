"""Train one run of the GPU recall sweep under variants of its settings, to see which setting changes the outcome.

Written after Gated DeltaNet's Palindrome runs collapsed in an early GPU sweep: the
same run with the PyTorch backend on the CPU did not. Each variant differs from the sweep's run (preset "gpu")
in one setting:

    preset         exactly the sweep's run (Triton kernel, bf16 kernel inputs, CUDA graph)
    no_graph       without the CUDA graph
    fp32_kernel    the Triton kernel with float32 inputs (its exact-float32 path)
    torch_backend  the PyTorch chunked form on the GPU (float32, no graph)
    cpu_torch      the PyTorch chunked form on the CPU (float32, no graph)
    decayed_dt_bias  the weight-decay rule of the sweep's first runs: dt_bias decayed, A_log spared
    steps_x4       four times the steps (6000), the schedule stretched with them
    deterministic  the preset with torch.use_deterministic_algorithms(warn_only=True) and cuBLAS's fixed
                   workspace: its log names every operation without a deterministic implementation
    cublas_fixed   the preset with cuBLAS's fixed workspace only (CUBLAS_WORKSPACE_CONFIG=:4096:8)

decayed_dt_bias and steps_x4 were added for KDA's MQAR results, which fell when the fix stopped weight decay from reaching
its [H, K] dt_bias (chapter 12).

Every variant runs in its own process (at the same time, on a GPU); the results, with each variant's full
configuration and held-out history, are merged into --out (JSON), so variants can be added call by call.
`--repeat N` trains each variant N times (keys "preset", "preset#2", ...): the same seed and code, so any
spread between them is the GPU path's run-to-run nondeterminism (the deterministic variant is its control).

    python -m bench.experiments.ablate_recall_run --task palindrome --seq-len 128 --mixer gated_deltanet --lr 1e-3 \\
        --variants preset no_graph fp32_kernel torch_backend --out $OUT/ablate_gdn_palindrome128.json
"""

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict

import torch

import kda_edu.training.train as train_module
from bench.common import write_result
from kda_edu.training.sweep import PRESETS, add_spec_arguments, run_setup, spec_from_arguments
from kda_edu.training.train import train

# The parameters the weight-decay rule of the sweep's first runs spared: every vector, so A_log but not KDA's
# [H, K] dt_bias (make_optimizer decays a tensor of two or more dimensions unless its name is listed).
OLD_RULE = ("A_log",)
SPARED_NOW = train_module.GATE_PARAMETERS

VARIANTS = {  # name: (changes to the preset's mixer, changes to its training, device[, spared parameters])
    "preset": ({}, {}, "cuda"),
    "decayed_dt_bias": ({}, {}, "cuda", OLD_RULE),
    "steps_x4": ({}, {"steps": 4 * 1500}, "cuda"),
    "no_graph": ({}, {"cuda_graph": False}, "cuda"),
    "fp32_kernel": ({"kernel_dtype": "float32"}, {}, "cuda"),
    "torch_backend": ({"backend": "torch", "kernel_dtype": "float32"}, {"cuda_graph": False}, "cuda"),
    "cpu_torch": ({"backend": "torch", "kernel_dtype": "float32"}, {"cuda_graph": False}, "cpu"),
    "deterministic": ({}, {}, "cuda"),
    "cublas_fixed": ({}, {}, "cuda"),
}


def run_variant(spec: dict, variant: str, steps: int | None, threads: int) -> dict:
    torch.set_num_threads(threads)
    if variant in (
        "deterministic",
        "cublas_fixed",
    ):  # before this process's first cuBLAS call (a fresh worker)
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    if variant == "deterministic":
        torch.use_deterministic_algorithms(True, warn_only=True)
    preset = PRESETS["gpu"]
    mixer_change, train_change, device, *spared = VARIANTS[variant]
    # The rule is a module constant of the worker process, which may train another variant next: set it for
    # every variant.
    train_module.GATE_PARAMETERS = spared[0] if spared else SPARED_NOW
    train_kw = dict(train_change) | ({"steps": steps} if steps else {})
    task, model, config = run_setup(preset, spec, mixer=mixer_change, train=train_kw)
    t0 = time.perf_counter()
    result = train(task, model, config, device=device, progress=False)
    return {
        **spec,
        "variant": variant,
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "final_acc": result.final_accuracy,
        "best_acc": max(h["eval_acc"] for h in result.history),
        "seconds": round(time.perf_counter() - t0, 1),
        "undecayed_gate_parameters": list(train_module.GATE_PARAMETERS),
        "model_config": model.to_dict(),
        "train_config": asdict(config),
        "history": result.history,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_spec_arguments(ap)
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), required=True)
    ap.add_argument("--steps", type=int, default=None, help="fewer steps than the preset (a smoke test)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per variant")
    ap.add_argument("--repeat", type=int, default=1, help="train each variant this many times")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    spec = spec_from_arguments(args)
    data = {"spec": spec, "runs": {}}
    if os.path.exists(args.out):
        with open(args.out) as f:
            data = json.load(f)
        if data["spec"] != spec:
            raise ValueError(f"{args.out} holds another run: {data['spec']}")
    ctx = torch.multiprocessing.get_context("spawn")
    keys = [(v, v if i == 0 else f"{v}#{i + 1}") for v in args.variants for i in range(args.repeat)]
    with ProcessPoolExecutor(max_workers=len(keys), mp_context=ctx) as pool:
        futures = {key: pool.submit(run_variant, spec, v, args.steps, args.threads) for v, key in keys}
        for variant, future in futures.items():
            record = future.result()
            data["runs"][variant] = record
            losses = [round(h["eval_loss"], 3) for h in record["history"]]
            print(f"{variant}: final acc {record['final_acc']:.3f}, eval loss {losses}", flush=True)
    write_result(args.out, data)


if __name__ == "__main__":
    main()
