"""The book's frame: paired notebooks, set-up cells, the table of contents, the environments."""

import json
import re
import sys
import tomllib
from pathlib import Path

import jupytext
import pytest
import yaml

from kda_edu.book import bench_result

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from notebook_setup import chapter_markdown, chapter_notebooks, setup_cell_source  # noqa: E402

NOTEBOOKS = chapter_notebooks()
REQUIRED_SECTIONS = ["Learning goals", "Summary", "Exercises", "References"]


def test_every_chapter_is_a_pair():
    notebooks = {p.stem for p in NOTEBOOKS}
    markdown = {p.stem for p in chapter_markdown()}
    assert notebooks == markdown, f"unpaired: {sorted(notebooks ^ markdown)} (run `make sync`)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_pair_in_sync(path):
    ipynb, md = jupytext.read(path), jupytext.read(path.with_suffix(".md"))
    cells = lambda nb: [(c.cell_type, c.source.strip(), c.metadata.get("tags", [])) for c in nb.cells]
    assert cells(ipynb) == cells(md), f"{path.name} and its .md twin differ (run `make sync`)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, f"{path.name} has outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_first_cell_sets_up_colab(path):
    first = jupytext.read(path).cells[0]
    assert first.cell_type == "code" and first.source == setup_cell_source(), (
        f"{path.name}: the first cell must be the generated Colab set-up cell (run `make sync`)"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_chapter_has_required_sections(path):
    headings = [
        line.lstrip("#").strip()
        for cell in jupytext.read(path).cells
        if cell.cell_type == "markdown"
        for line in cell.source.splitlines()
        if line.startswith("## ")
    ]
    missing = [s for s in REQUIRED_SECTIONS if s not in headings]
    assert not missing, f"{path.name} lacks the sections {missing}"


def test_toc_lists_every_chapter_once():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]] + [ch["file"] for part in toc.get("parts", []) for ch in part["chapters"]]
    assert len(files) == len(set(files))
    listed = sorted(f for f in files if re.match(r"book/\d\d_", f))
    assert listed == [f"book/{p.stem}" for p in NOTEBOOKS]


def _normalise(requirement: str) -> str:
    return re.sub(r"\s+", "", requirement).replace('"', "'").lower()


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + [
        r for extra in project["optional-dependencies"].values() for r in extra
    ]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    listed = [r for r in pip_section if not r.startswith("-e")]
    assert sorted(map(_normalise, listed)) == sorted(map(_normalise, declared))


def test_one_repository_url():
    url = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]
    readme = (ROOT / "README.md").read_text()
    found = set(re.findall(r"https://github\.com/[\w.-]+/kda-edu\b", readme))
    assert found <= {url}, f"README names another repository address: {found - {url}}"


def test_the_chapter_map_names_each_chapters_modules():
    """The introduction's table sends a reader from a chapter to its code: every module it names exists,
    and each row names the modules of that chapter's "The code behind this chapter" line."""
    rows = [
        line
        for line in (ROOT / "book" / "intro.md").read_text().splitlines()
        if re.match(r"\| .*\| \d+\. ", line)
    ]
    assert len(rows) == len(NOTEBOOKS)
    for row in rows:
        number = int(re.search(r"\| (\d+)\. ", row).group(1))
        named = re.findall(r"`(kda_edu/[\w/]+\.py)`", row)
        assert named and all((ROOT / m).is_file() for m in named), row
        chapter = next(p for p in chapter_markdown() if p.stem.startswith(f"{number:02d}_"))
        behind = chapter.read_text().split("The code behind this chapter:", 1)[1].split("\n\n", 1)[0]
        assert all(f"`{m}`" in behind for m in named), (chapter.name, named)


# A number in the README's prose: digits not glued to a letter or a dot before them (so "H200" and
# "h200_forward.json" are not numbers), optionally followed by the "x" of a ratio.
README_NUMBER = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?=x\b|[^\w.]|\.\s|\.$|$)")


def readme_passage(start: str, end: str) -> str:
    """The README's text from `start` up to `end`, its line breaks and indentation folded into spaces."""
    text = " ".join((ROOT / "README.md").read_text().split())
    assert start in text and end in text.split(start, 1)[1], f"the README no longer has {start!r} ... {end!r}"
    return start + text.split(start, 1)[1].split(end, 1)[0]


def test_readme_kernel_timings_are_the_committed_ones():
    """The README's status quotes the H200 timings of chunk_kda, ours and fla's, at one shape: every number
    of that passage, in order, is the committed JSON's value printed to two decimals (ratios recomputed from
    the JSON), and the passage cites each file it reads. It once quoted fla's forward as 1.00 ms where
    h200_forward.json holds 1.116 ms."""
    passage = readme_passage("That accuracy made the kernels slower", "Issue 20")
    prec = bench_result("h200_precision_cost.json")
    forward = bench_result("h200_forward.json")
    fwd_bwd = bench_result("h200_fwd_bwd.json")
    shape = (1, 8192, 32)
    now, before = (
        next(r for r in prec["rows"] if r["build"] == build and (r["B"], r["T"], r["H"]) == shape)
        for build in ("main_trial", "product_ac2d2d2")
    )
    head = next(r for r in forward["headline"] if (r["B"], r["T"], r["H"]) == shape)
    assert head["K"] == head["V"]  # the README writes "K = V = 128"
    ours_fwd, fla_fwd = (head["methods"][m]["ms"] for m in ("kda_edu chunk_kda", "fla chunk_kda"))
    step_row = next(r for r in fwd_bwd["rows"] if (r["B"], r["T"], r["H"]) == shape)
    fla_step = step_row["fla chunk_kda fwd+bwd ms"]
    expected = [str(n) for n in (*shape, head["K"])] + [
        f"{v:.2f}"
        for v in (
            now["fwd_ms"],
            now["fwd_bwd_ms"],
            now["fwd_ms"] / before["fwd_ms"],
            now["fwd_bwd_ms"] / before["fwd_bwd_ms"],
            before["fwd_ms"],
            before["fwd_bwd_ms"],
            fla_fwd,
            ours_fwd,
            ours_fwd / fla_fwd,
            fla_step,
            now["fwd_bwd_ms"],
            now["fwd_bwd_ms"] / fla_step,
        )
    ]
    # a chapter's number is no measurement
    measured = README_NUMBER.findall(re.sub(r"chapter \d+", "", passage))
    assert measured == expected, passage
    for name in ("h200_precision_cost.json", "h200_forward.json", "h200_fwd_bwd.json"):
        assert name in passage, name


def test_readme_same_run_timings_are_the_committed_ones():
    """The README's latest same-run comparison with fla: its numbers, in order, are each headline shape's
    forward times (ours, fla's, the ratio) in h200_forward_split.json, then the forward + backward at every
    shape of h200_fwd_bwd_split.json (ours, fla's, the ratio; times and ratios to three decimals, shapes as
    written), the peak and the memory held after the forward at its memory shape (ours, fla's; two decimals),
    and the old prepare's forward in h200_prepare_split_rows.json; both files are of the build the passage
    names."""
    passage = readme_passage("The latest run timed both in one call", "were dropped")
    fwd = bench_result("h200_forward_split.json")
    bwd = bench_result("h200_fwd_bwd_split.json")
    assert fwd["build"] == bwd["build"] and f"build {fwd['build']}" in passage
    expected = []

    def timed(ours, fla, shape):
        return [f"{ours:.3f}", f"{fla:.3f}", f"{ours / fla:.3f}", *map(str, shape)]

    for row in fwd["headline"]:
        ours, fla = (row["methods"][m]["ms"] for m in ("kda_edu chunk_kda", "fla chunk_kda"))
        expected += timed(ours, fla, (row["B"], row["T"], row["H"]))
    for row in bwd["rows"]:
        expected += timed(
            row["kda_edu chunk_kda fwd+bwd ms"],
            row["fla chunk_kda fwd+bwd ms"],
            (row["B"], row["T"], row["H"]),
        )
    (mem,) = [r for r in bwd["rows"] if "fla chunk_kda peak GiB" in r]
    expected += [
        f"{mem[f'{m} {what} GiB']:.2f}"
        for what in ("peak", "held after forward")
        for m in ("kda_edu chunk_kda", "fla chunk_kda")
    ]
    old = bench_result("h200_prepare_split_rows.json")["rows"][0]["old"][0]["fwd_ms"]
    expected.append(f"{old:.2f}")
    words = re.sub(r"build \w+|[\w/.]+\.(?:json|md)", "", passage)  # the build's name and the file names
    assert re.findall(r"\d+(?:\.\d+)?", words) == expected, passage


def test_readme_gpu_test_counts_are_the_committed_reports():
    """The README's count of the H200 test runs is that of the committed JUnit reports: cells of the chapters
    (every chapter among them), the chapters run with a forced dtype and their cells, and the unit suite's
    cases by outcome. It once kept the counts of an earlier merge (587 cells, 1 unit failure)."""
    import xml.etree.ElementTree as ET

    passage = readme_passage("On the H200 (", "- The GPU run")

    def suite(name):
        root = ET.parse(ROOT / "bench" / "results" / "h200_tests" / name).getroot()
        (s,) = root.iter("testsuite")
        counts = {k: int(s.get(k)) for k in ("tests", "failures", "errors", "skipped")}
        notebooks = {tc.get("classname").split(".")[1] for tc in s.iter("testcase")}
        return counts, notebooks

    cells, chapters = suite("notebooks.xml")
    assert chapters == {p.stem for p in NOTEBOOKS}  # "every chapter"
    assert cells["failures"] == cells["errors"] == cells["skipped"] == 0  # "passes"
    forced = [suite(f"notebooks_{dtype}.xml") for dtype in ("float16", "float32")]
    assert forced[0][1] == forced[1][1] and all(c["tests"] == forced[0][0]["tests"] for c, _ in forced)
    assert all(c["failures"] == c["errors"] == 0 for c, _ in forced)
    unit, _ = suite("unit.xml")
    passed = unit["tests"] - unit["failures"] - unit["errors"] - unit["skipped"]
    expected = [cells["tests"]] * 2 + sorted(int(n[:2]) for n in forced[0][1]) + [forced[0][0]["tests"]] * 2
    expected += [unit["tests"], passed, unit["skipped"], unit["failures"] + unit["errors"]]
    assert README_NUMBER.findall(passage) == [str(n) for n in expected], passage
    for name in ("notebooks.xml", "notebooks_float16.xml", "notebooks_float32.xml", "unit.xml"):
        assert name in passage, name


def test_readme_recall_sweep_counts_are_the_committed_file():
    """The README's count of the GPU recall sweep is that of bench/results/recall_gpu.json: the runs in it, the
    runs of the preset and the GPU-minutes its invocations recorded; it says "complete" only when no run is
    missing or pending a re-run. It once said 108 runs, then 177 with 39 pending."""
    from kda_edu.chapters.ch12_recall_sweep import PRESETS, cost, needs_rerun, run_specs

    passage = readme_passage("- The GPU run of the recall-task comparison (chapter 12)", "- What is left")
    data = bench_result("recall_gpu.json")
    complete = len(data["runs"]) == len(run_specs(PRESETS["gpu"])) and not any(map(needs_rerun, data["runs"]))
    assert ("is complete" in passage) == complete, passage
    expected = [12, len(data["runs"]), len(run_specs(PRESETS["gpu"])), round(cost(data)["gpu_minutes"])]
    assert README_NUMBER.findall(passage) == [str(n) for n in expected], passage
