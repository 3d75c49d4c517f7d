"""Train one run of the GPU recall sweep with an exported earlier build of kda_edu, to find the commit that
changed its outcome (issue 22: Gated DeltaNet's Palindrome runs collapsed on the build of the sweep's first
invocations and do not on the current one; bench/NOTES.md, session 11).

Export the builds first (git-ignored folders `.builds/<commit>/kda_edu`), then run one process per build:

    bash bench/device/export_builds.sh c08120f 2422adb d4c978c
    python bench/experiments/bisect_recall_run.py --build .builds/c08120f --task palindrome --seq-len 128 \\
        --mixer gated_deltanet --lr 1e-3 --out $OUT/bisect_c08120f.json

Each build trains with its own `run_one` and its own "gpu" preset, exactly as that build's sweep did. Builds
before the layout move (d4c978c) keep the sweep in `kda_edu/recall_sweep.py`, later ones in
`kda_edu/chapters/ch12_recall_sweep.py`; both are tried. The script refuses to run if `kda_edu` would not be
imported from the build folder. `--cpu-smoke` trains 3 steps of the build's "quick" preset on the CPU with the
PyTorch backend, to check an export imports and runs before a GPU call.
"""

import argparse
import importlib
import json
import sys
import time
from pathlib import Path


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", type=Path, required=True, help="a folder holding an exported kda_edu")
    ap.add_argument("--task", required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--mixer", required=True)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-smoke", action="store_true", help="3 steps of the 'quick' preset on the CPU")
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
    Path(args.out).write_text(json.dumps(out, indent=1))
    losses = [round(h["eval_loss"], 3) for h in record["history"]]
    print(f"{commit}: final acc {record['final_acc']:.3f}, best {record['best_acc']:.3f}, eval loss {losses}")


if __name__ == "__main__":
    main()
