"""Merge one run of `bench.kernels.speed` into the committed table of its GPU, with the GPU tests of the build.

    python tools/merge_speed.py RUN.json [RUN.json ...] --into bench/results/speed_h100.json \
        --tests bench/results/h100_tests/kernels.xml --command "pytest tests/kernels -n 12 (same call)"

A run times some cases of one build on one GPU. The committed table keeps, for every (case, B, T, H), the
row of the latest run that timed it, and each row carries the commit it measured; `builds` records, per
commit, the cases it timed and the GPU tests of that build (counted from the JUnit report, which must come
from the same call or the same warm machine). A run on another GPU than the table's is refused, and so is
a run without a commit: a number must say which code gave it.
"""

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import write_result  # noqa: E402

KEY = ("case", "B", "T", "H")
ENVIRONMENT = ("date", "device", "torch", "triton", "python", "fla", "repeats")


def junit_counts(path: Path) -> dict:
    """passed / failed / skipped of a JUnit report (errors count as failed)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    return {"passed": total - failed - skipped, "failed": failed, "skipped": skipped}


def merge(table: dict, run: dict, tests: dict | None) -> dict:
    """The table with the run's rows in place of those of the same key, and the run's build recorded."""
    commit = run.get("commit")
    if not commit:
        raise ValueError("the run has no 'commit': pass --commit or set KDA_EDU_COMMIT when it runs")
    if table and table.get("device") != run.get("device"):
        raise ValueError(f"the run is on {run.get('device')!r}, the table on {table.get('device')!r}")
    rows = {tuple(r[k] for k in KEY): r for r in table.get("rows", [])}
    for row in run["rows"]:
        rows[tuple(row[k] for k in KEY)] = {**row, "commit": commit}
    builds = dict(table.get("builds", {}))
    build = dict(builds.get(commit, {}))
    build["cases"] = sorted({*build.get("cases", []), *(r["case"] for r in run["rows"])})
    if tests is not None:
        build["gpu_tests"] = tests
    builds[commit] = build
    merged = {**{k: run[k] for k in ENVIRONMENT if k in run}, "rows": list(rows.values()), "builds": builds}
    merged["note"] = "rows carry the commit they measured; builds lists the GPU tests of each"
    return merged


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--into", required=True, type=Path)
    ap.add_argument("--tests", type=Path, help="JUnit report of the build's GPU tests (same call or machine)")
    ap.add_argument("--command", default="", help="how the tests ran, recorded beside their counts")
    args = ap.parse_args()
    table = json.loads(args.into.read_text()) if args.into.exists() else {}
    tests = None
    if args.tests is not None:
        tests = {"command": args.command, **junit_counts(args.tests), "report": str(args.tests)}
    for path in args.runs:
        table = merge(table, json.loads(path.read_text()), tests)
    write_result(args.into, table)
    print(f"{args.into}: {len(table['rows'])} rows, builds {sorted(table['builds'])}")


if __name__ == "__main__":
    main()
