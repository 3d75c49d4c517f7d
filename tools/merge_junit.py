"""Merge JUnit reports of one suite run in several device calls into one report.

    python tools/merge_junit.py OUT.xml FIRST.xml LATER.xml [...]

A device call is limited to 10 minutes, so a suite that does not finish in one call is completed in the next
with the tests it did not reach (and any it re-runs after a fix). A test case is keyed by (classname, name);
a later report's case replaces an earlier one's, and cases only a later report has are added. The merged
suite's counts are recomputed from its cases, and a property `merged_from` lists the inputs in order, so the
report says it was assembled. bench/NOTES.md records which build each input ran on.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from pathlib import Path


def _suites(root: ET.Element) -> list[ET.Element]:
    return [root] if root.tag == "testsuite" else list(root.iter("testsuite"))


def merge(paths: list[Path]) -> ET.Element:
    """One <testsuites> element holding the union of the reports' cases, later reports winning."""
    cases: dict[tuple[str, str], ET.Element] = {}
    for path in paths:
        for suite in _suites(ET.parse(path).getroot()):
            for case in suite.iter("testcase"):
                cases[case.get("classname") or "", case.get("name") or ""] = case
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
