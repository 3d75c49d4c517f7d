"""Run the book's slowest chapters under nbval beside a busy process, and check each finishes inside its budget.

Readers run the notebooks on machines that are never idle. This stage of `make test` starts `--load`
processes that spin on a core each (by default one: on CI's two cores, half the machine), runs each chapter
below exactly as the notebooks stage does (nbval, 180 s per cell), and fails when a chapter fails or its wall
time exceeds its budget. It prints each chapter's wall time and CPU time (the pytest process and the kernel
it started), so a slowdown shows whether the chapter waited (wall grows, CPU does not) or burned CPU (both
grow: threads spinning while they wait for each other, say).

Each chapter's budget is the book's: three minutes on a 2-core CPU (CONTRIBUTING.md), here held beside the
busy process too. The chapters below are the slowest under such a load. Before the book's CPU runs used one
PyTorch thread (`kda_edu.device`), PyTorch's two OpenMP threads spun and waited for each other at every small
operation beside the busy process, and chapters 12 and 14 ran past nbval's 180 s in a single cell.

    python tools/loaded_chapters.py                      # every chapter in BUDGETS, one spinning process
    python tools/loaded_chapters.py --load 0 12_training # one chapter, no added load
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Wall-clock budget per chapter, in seconds, beside one spinning process on a 2-core machine.
BUDGETS = dict.fromkeys(["06_chunkwise", "10_kda_layer", "11_hybrid", "12_training", "14_kimi_k3"], 180)

NBVAL = ["--nbval-lax", "--nbval-current-env", "--nbval-cell-timeout=180", "-p", "no:cacheprovider", "-q"]


def start_load(n: int) -> list[subprocess.Popen]:
    """`n` processes that each keep one core busy until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop_load(spinners: list[subprocess.Popen]) -> None:
    for p in spinners:
        p.kill()
        p.wait()


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_chapter(book: Path, stem: str, extra: list[str]) -> dict:
    """Run <book>/<stem>.ipynb under nbval; its wall and CPU seconds and whether it passed."""
    notebook = book / f"{stem}.ipynb"
    if not notebook.exists():
        raise SystemExit(f"no notebook {notebook}")
    cpu0, wall0 = children_cpu(), time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *NBVAL, *extra, str(notebook)], cwd=ROOT, check=False
    )
    return {
        "chapter": stem,
        "wall_s": round(time.perf_counter() - wall0, 1),
        "cpu_s": round(children_cpu() - cpu0, 1),
        "passed": run.returncode == 0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chapters", nargs="*", help="notebook stems (default: every chapter in BUDGETS)")
    parser.add_argument(
        "--load", type=int, default=1, help="processes spinning beside the chapters (default 1)"
    )
    parser.add_argument("--junit-dir", type=Path, help="write each chapter's nbval JUnit XML here")
    parser.add_argument("--report", type=Path, help="write the measurements as JSON here")
    parser.add_argument("--budget", type=float, help="seconds for every chapter instead of BUDGETS'")
    parser.add_argument(
        "--book", type=Path, default=ROOT / "book", help="the notebooks' folder (default book/)"
    )
    args = parser.parse_args()
    chapters = args.chapters or list(BUDGETS)
    budgets = dict.fromkeys(chapters, args.budget) if args.budget is not None else BUDGETS
    unknown = [c for c in chapters if c not in budgets]
    if unknown:
        raise SystemExit(f"no budget for {unknown}; chapters with one: {sorted(BUDGETS)} (or pass --budget)")
    if args.junit_dir:
        args.junit_dir.mkdir(parents=True, exist_ok=True)
    results, spinners = [], start_load(args.load)
    try:
        for stem in chapters:
            extra = [f"--junitxml={args.junit_dir / f'loaded_{stem}.xml'}"] if args.junit_dir else []
            result = run_chapter(args.book.resolve(), stem, extra)
            result["budget_s"], result["load"] = budgets[stem], args.load
            result["ok"] = result["passed"] and result["wall_s"] <= budgets[stem]
            results.append(result)
            print(
                f"{stem}: {result['wall_s']:.0f} s wall, {result['cpu_s']:.0f} s CPU beside {args.load} spinning "
                f"process(es) (budget {budgets[stem]:g} s): {'ok' if result['ok'] else 'FAILED'}",
                flush=True,
            )
    finally:
        stop_load(spinners)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps({"load_average": os.getloadavg(), "chapters": results}, indent=1))
    failed = [r["chapter"] for r in results if not r["ok"]]
    if failed:
        print(f"over budget or failing beside a busy process: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
