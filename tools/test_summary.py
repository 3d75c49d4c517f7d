"""Print one closing line that adds up every stage of `make test`.

Reads the JUnit XML files pytest wrote (unit tests, the kernels' offline builds, notebooks) and the browser check's JSON
report, and prints a line per stage and a total.
"""

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def junit_counts(path: Path) -> tuple[int, int, int]:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tests = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    return tests - failed - skipped, failed, skipped


def notebook_seconds(path: Path) -> dict[str, float]:
    """Wall time per notebook: the sum of its cells' times (nbval reports one test per cell)."""
    seconds: dict[str, float] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("classname", "?").removesuffix(".ipynb").split(".")[-1]  # "book.01_attention.ipynb"
        seconds[name] = seconds.get(name, 0.0) + float(case.get("time", 0))
    return seconds


def main() -> None:
    reports = Path(sys.argv[1])
    total = [0, 0, 0]
    for name in ("unit", "kernel_builds", "notebooks"):
        passed, failed, skipped = junit_counts(reports / f"{name}.xml")
        print(f"{name}: {passed} passed, {failed} failed, {skipped} skipped")
        total = [total[0] + passed, total[1] + failed, total[2] + skipped]
    times = notebook_seconds(reports / "notebooks.xml")
    print("notebook times: " + ", ".join(f"{name} {sec:.0f} s" for name, sec in sorted(times.items())))
    print(f"notebooks in all: {sum(times.values()) / 60:.1f} min")
    loaded = reports / "loaded.json"  # tools/loaded_chapters.py
    if loaded.exists():
        for r in json.loads(loaded.read_text())["chapters"]:
            print(
                f"beside a busy process: {r['chapter']} {r['wall_s']:.0f} s wall, {r['cpu_s']:.0f} s CPU "
                f"(budget {r['budget_s']} s): {'ok' if r['ok'] else 'FAILED'}"
            )
    browser = json.loads((reports / "browser.json").read_text())
    if "skipped" in browser:
        print(f"browser: skipped ({browser['skipped']})")
    else:
        print(f"browser pages: {browser['passed']} passed, {browser['failed']} failed")
        total = [total[0] + browser["passed"], total[1] + browser["failed"], total[2]]
    print(f"total: {total[0]} passed, {total[1]} failed, {total[2]} skipped")


if __name__ == "__main__":
    main()
