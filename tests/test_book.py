"""The book's frame: paired notebooks, set-up cells, the table of contents, the environments."""

import json
import re
import sys
import tomllib
from pathlib import Path

import jupytext
import pytest
import torch
import yaml

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


def test_readme_results_are_the_committed_ones():
    """The README's table of headline results is the one tools/readme_results.py builds from the committed
    benchmark files: no number in it is typed by hand."""
    sys.path.insert(0, str(ROOT / "tools"))
    import readme_results

    table = readme_results.table()
    assert table in (ROOT / "README.md").read_text(), (
        "README's results table is stale: run tools/readme_results.py"
    )
    assert table.count("\n| ") >= 7  # at least the seven H200 rows


def test_readme_stays_short_and_lists_every_chapter():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 120
    for nb in NOTEBOOKS:
        assert f"`{nb.stem}`" in readme, nb.stem


def test_time_call_restores_threads():
    from kda_edu.book import time_call

    before = torch.get_num_threads()
    assert time_call(torch.zeros, 3, repeats=1, threads=1) >= 0
    assert torch.get_num_threads() == before


def test_show_source_shows_the_lines_that_matter():
    from kda_edu.book import show_source, time_call

    whole = show_source(time_call).data
    part = show_source(time_call, start="def time_call", stop='"""').data
    assert part.splitlines()[0] == whole.splitlines()[0]  # the same first line: the def
    assert len(part) < len(whole) and part.split("```python\n")[1].startswith("def time_call")
    with pytest.raises(ValueError, match="no line contains"):
        show_source(time_call, start="not in the source")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_figure_cell_displays_only_its_figure(path):
    # myst-nb makes every display output of a cell with figure metadata a figure of that name: a table
    # displayed beside the plot gives the name twice, a warning that fails the strict build.
    notebook = jupytext.read(path)
    for number, cell in enumerate(notebook.cells):
        if cell.cell_type == "code" and "figure" in cell.metadata.get("mystnb", {}):
            assert "display(" not in cell.source, f"{path.name} cell {number}: displays more than its figure"


def test_explore_says_its_controls_need_a_running_notebook(capsys):
    """A slider on a built page cannot redraw; the explorer says so above its controls, in one line."""
    from kda_edu.book import EXPLORE_NOTICE, explore

    seen = []
    widget = explore(lambda n: seen.append(n), n=(1, 8, 1))
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == EXPLORE_NOTICE and "running notebook" in EXPLORE_NOTICE
    widget.children[0].value = 3  # the slider re-runs the function in a live kernel
    assert seen[-1] == 3
