"""Train one run of the GPU recall sweep with an exported earlier build of kda_edu, to find the commit that
changed its outcome (chapter 12: Gated DeltaNet's Palindrome runs collapsed on the build of the sweep's first
invocations and do not on later ones).

Export the builds first (git-ignored folders `.builds/<commit>/kda_edu`), then run one process per build:

    bash bench/device/export_builds.sh <commit> [<commit> ...]
    python -m bench.experiments.bisect_recall_run --build .builds/<commit> --task palindrome --seq-len 128 \\
        --mixer gated_deltanet --lr 1e-3 --out $OUT/bisect_<commit>.json

Each build trains with its own `run_one` and its own "gpu" preset, exactly as that build's sweep did. Builds
before the layout move (d4c978c) keep the sweep in `kda_edu/recall_sweep.py`, later ones in
`kda_edu/chapters/ch12_recall_sweep.py`; both are tried. The script refuses to run if `kda_edu` would not be
imported from the build folder. `--cpu-smoke` trains 3 steps of the build's "quick" preset on the CPU with the
PyTorch backend, to check an export imports and runs before a GPU call.

`--watch` looks for the run's first non-finite value with global hooks, so that it works with any build's own
training loop (DeltaNet MQAR 1024 at 3e-3 had a NaN held-out loss on an early build). It switches the CUDA
graph off (hooks run only while a graph is captured, and their checks read values back to the host) and trains `--watch-steps` steps. It records the
first event of each kind, with the optimiser step it happened at:

- "forward": the first module whose output holds a non-finite value (in the order modules finish), whether
  its inputs were finite, and whether it ran in training or in evaluation;
- "backward": the first module whose input gradient is non-finite while its output gradient is finite;
- "gradient": the first step whose parameter gradients, as the optimiser receives them, are not finite;
- "parameter": the first step after which a parameter is not finite.
"""

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.optim.optimizer as optimizer_hooks

from bench.common import write_result


def load_build(build: Path):
    """Put `build` first on the path and import its sweep module; return (module, commit)."""
    build = build.resolve()
    if not (build / "kda_edu" / "__init__.py").is_file():
        raise SystemExit(f"--build {build}: no kda_edu package there (run bench/device/export_builds.sh)")
    sys.path.insert(0, str(build))
    # An editable install of the current kda_edu (`pip install -e`, as `make` does) answers imports through its
    # own finder before sys.path is searched; drop it, or the build folder would never be used.
    sys.meta_path = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
    for name in ("kda_edu.chapters.ch12_recall_sweep", "kda_edu.recall_sweep"):
        try:
            module = importlib.import_module(name)
            break
        except ModuleNotFoundError as err:
            if not (err.name or "").startswith("kda_edu"):
                raise
    else:
        raise SystemExit(
            f"--build {build}: neither kda_edu.chapters.ch12_recall_sweep nor kda_edu.recall_sweep"
        )
    if not Path(module.__file__).resolve().is_relative_to(build):
        raise SystemExit(f"imported {module.__file__}, not the build in {build}")
    commit_file = build / "COMMIT"
    commit = commit_file.read_text().strip() if commit_file.exists() else build.name
    return module, commit


def finite(x) -> bool:
    return not isinstance(x, torch.Tensor) or not x.is_floating_point() or bool(torch.isfinite(x).all())


def watch_nonfinite(events: dict, capture: Path | None = None) -> list:
    """Install global module and optimiser hooks that fill `events` (kind -> first record); see the doc.
    With `capture`, the first module whose inputs are finite and whose output is not ("source") is saved there
    (torch.save): its parameters and the first batch row of its inputs whose output went non-finite, to
    replay offline. Returns the hooks' handles (`.remove()` each to take them off)."""
    names: dict[int, str] = {}
    params: dict[int, str] = {}
    step = {"n": 0}

    def name_of(module) -> str:
        return names.get(id(module), type(module).__name__)

    def pre(module, args):
        if id(module) not in names:  # the first module to start is the model: name everything below it
            names.update({id(m): n or "(model)" for n, m in module.named_modules()})
            params.update({id(p): n for n, p in module.named_parameters()})

    def forward(module, args, output):
        if "source" in events:
            return
        outs = output if isinstance(output, tuple) else (output,)
        if all(finite(o) for o in outs):
            return
        inputs_finite = all(finite(a) for a in args)
        record = {
            "step": step["n"],
            "module": name_of(module),
            "class": type(module).__name__,
            "inputs finite": inputs_finite,
            "training": module.training,
        }
        events.setdefault("forward", record)
        if inputs_finite:
            events["source"] = record
            if capture is not None:
                out = outs[0]
                rows = (~torch.isfinite(out)).flatten(1).any(1).nonzero().flatten().tolist()
                record["bad batch rows"] = len(rows)
                b = rows[0]
                torch.save(
                    {
                        "record": record,
                        "args": [
                            a[b : b + 1].detach().cpu() if isinstance(a, torch.Tensor) else a for a in args
                        ],
                        "state": {k: v.detach().cpu() for k, v in module.state_dict().items()},
                        "output": out[b : b + 1].detach().cpu(),
                    },
                    capture,
                )

    def backward(module, grad_input, grad_output):
        if "backward" in events:
            return
        if all(finite(g) for g in grad_output if g is not None) and not all(
            finite(g) for g in grad_input if g is not None
        ):
            events["backward"] = {
                "step": step["n"],
                "module": name_of(module),
                "class": type(module).__name__,
            }

    def record_bad(kind, optimizer, tensor_of):
        """events[kind] at the first step where tensor_of(p) is not finite for some parameter p."""
        if kind in events:
            return
        bad = [
            params.get(id(p), str(tuple(p.shape)))
            for group in optimizer.param_groups
            for p in group["params"]
            if not finite(tensor_of(p))
        ]
        if bad:
            events[kind] = {"step": step["n"], "parameters": bad[:20], "count": len(bad)}

    def before_step(optimizer, args, kwargs):
        record_bad("gradient", optimizer, lambda p: p.grad)  # finite() passes a missing gradient (None)

    def after_step(optimizer, args, kwargs):
        record_bad("parameter", optimizer, lambda p: p)
        step["n"] += 1

    return [
        torch.nn.modules.module.register_module_forward_pre_hook(pre),
        torch.nn.modules.module.register_module_forward_hook(forward),
        torch.nn.modules.module.register_module_full_backward_hook(backward),
        optimizer_hooks.register_optimizer_step_pre_hook(before_step),
        optimizer_hooks.register_optimizer_step_post_hook(after_step),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", type=Path, required=True, help="a folder holding an exported kda_edu")
    ap.add_argument("--task", required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--mixer", required=True)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-smoke", action="store_true", help="3 steps of the 'quick' preset on the CPU")
    ap.add_argument("--watch", action="store_true", help="find the first non-finite value (no CUDA graph)")
    ap.add_argument("--watch-steps", type=int, default=400, help="steps to train with --watch")
    ap.add_argument(
        "--capture", type=Path, default=None, help="with --watch: save the source module's inputs"
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    sweep, commit = load_build(args.build)
    spec = {"task": args.task, "seq_len": args.seq_len, "mixer": args.mixer, "lr": args.lr, "seed": args.seed}
    if args.cpu_smoke:
        quick = sweep.PRESETS["quick"]
        task_params = sweep.PRESETS["gpu"]["tasks"][args.task]
        preset = {
            **quick,
            "tasks": {args.task: task_params},
            "train": {**quick["train"], "steps": 3, "eval_every": 3, "eval_size": 8},
        }
        device = "cpu"
    else:
        preset, device = sweep.PRESETS["gpu"], "cuda"
    events: dict = {}
    if args.watch:
        train = {**preset["train"], "cuda_graph": False}
        train["steps"] = min(train["steps"], args.watch_steps)
        train["eval_every"] = min(train["eval_every"], train["steps"])
        preset = {**preset, "train": train}
        watch_nonfinite(events, args.capture)
    start = time.perf_counter()
    record = sweep.run_one(preset, spec, device)
    out = {
        "commit": commit,
        "module": sweep.__name__,
        "module_file": sweep.__file__,
        "spec": spec,
        "device": device,
        "seconds": round(time.perf_counter() - start, 1),
        "run": record,
    }
    if args.watch:
        out["watch"] = {"steps": preset["train"]["steps"], "cuda_graph": False, "first non-finite": events}
    write_result(Path(args.out), out)
    losses = [round(h["eval_loss"], 3) for h in record["history"]]
    print(f"{commit}: final acc {record['final_acc']:.3f}, best {record['best_acc']:.3f}, eval loss {losses}")
    if args.watch:
        print("first non-finite:", json.dumps(events))


if __name__ == "__main__":
    main()
