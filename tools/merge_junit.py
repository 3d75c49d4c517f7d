"""Merge JUnit reports of one suite run in several device calls into one report.

    python tools/merge_junit.py OUT.xml FIRST.xml LATER.xml [...]

A device call is limited to 10 minutes, so a suite that does not finish in one call is completed in the next
with the tests it did not reach (and any it re-runs after a fix). A later report replaces every case of each
source file it ran (a notebook, or a test module), so a cell or test removed since the earlier run does not
stay behind as a stale case; cases of files only the earlier report ran are kept. Cases without a classname
(pytest writes an empty one for some collection events) are dropped. The merged
suite's counts are recomputed from its cases, and a property `merged_from` lists the inputs in order, so the
report says it was assembled.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from pathlib import Path


def _suites(root: ET.Element) -> list[ET.Element]:
    return [root] if root.tag == "testsuite" else list(root.iter("testsuite"))


def source_of(classname: str) -> str:
    """The file a case comes from: the notebook ("book.09_x.ipynb"), or the test module
    ("tests.training.test_probes" for "tests.training.test_probes.TestClass")."""
    if classname.endswith(".ipynb"):
        return classname
    parts = classname.split(".")
    for i, part in enumerate(parts):
        if part.startswith("test_") or part.endswith("_test"):
            return ".".join(parts[: i + 1])
    return classname


def merge(paths: list[Path]) -> ET.Element:
    """One <testsuites> element: for each source file, the cases of the last report that ran it."""
    cases: dict[tuple[str, str], ET.Element] = {}
    for path in paths:
        new = [
            case
            for suite in _suites(ET.parse(path).getroot())
            for case in suite.iter("testcase")
            if case.get("classname")
        ]
        rerun = {source_of(case.get("classname")) for case in new}
        cases = {key: case for key, case in cases.items() if source_of(key[0]) not in rerun}
        for case in new:
            cases[case.get("classname"), case.get("name") or ""] = case
    suite = ET.Element("testsuite", name="pytest")
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", name="merged_from", value=" ".join(p.name for p in paths))
    counts = {"failures": 0, "errors": 0, "skipped": 0}
    total_time = 0.0
    for case in cases.values():
        suite.append(case)
        total_time += float(case.get("time") or 0.0)
        for child in case:
            if child.tag == "failure":
                counts["failures"] += 1
            elif child.tag == "error":
                counts["errors"] += 1
            elif child.tag == "skipped":
                counts["skipped"] += 1
    suite.set("tests", str(len(cases)))
    for key, value in counts.items():
        suite.set(key, str(value))
    suite.set("time", f"{total_time:.3f}")
    root = ET.Element("testsuites")
    root.append(suite)
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "reports", type=Path, nargs="+", help="earliest first; later cases replace earlier ones"
    )
    args = parser.parse_args()
    root = merge(args.reports)
    ET.ElementTree(root).write(args.out, encoding="utf-8", xml_declaration=True)
    suite = root[0]
    print(
        f"{args.out}: {suite.get('tests')} cases, {suite.get('failures')} failures, {suite.get('errors')} errors, "
        f"{suite.get('skipped')} skipped"
    )


if __name__ == "__main__":
    main()
