"""The build's own checks can fail: a broken chapter breaks `make book`, and the browser check sees
error outputs, tracebacks, and a missing browser.

Each test builds a one-notebook book in a temporary folder with the repository's own `_config.yml`
and Makefile, once with a cell that raises and once with the same notebook fixed, so a pass of the
first cannot come from a build that fails for another reason.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import browser_check  # noqa: E402
import cache_guard  # noqa: E402
import figure_numbers  # noqa: E402
import merge_junit  # noqa: E402
import merge_speed  # noqa: E402

VENV_BIN = Path(sys.executable).parent
HAS_JUPYTER_BOOK = (VENV_BIN / "jupyter-book").exists() and shutil.which("make") is not None


def write_book(where: Path, cell: str) -> None:
    shutil.copy(ROOT / "_config.yml", where / "_config.yml")
    (where / "tools").mkdir(exist_ok=True)
    shutil.copy(ROOT / "tools" / "figure_numbers.py", where / "tools")  # the config's local extension
    (where / "_toc.yml").write_text("format: jb-book\nroot: page\n")
    nb = new_notebook(cells=[new_markdown_cell("# A page"), new_code_cell(cell)])
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nbformat.write(nb, where / "page.ipynb")


def make_book(where: Path) -> subprocess.CompletedProcess:
    venv = VENV_BIN.parent
    return subprocess.run(
        [
            "make",
            "-C",
            str(ROOT),
            "book",
            f"BOOK_ROOT={where}",
            f"VENV={venv}",
            "-o",
            f"{venv}/.kda-edu-installed",
        ]
        + ["-o", "_build/site-assets/.stamp"],
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")},
    )


@pytest.mark.slow
@pytest.mark.skipif(not HAS_JUPYTER_BOOK, reason="needs the book's environment (make book installs it)")
def test_a_failing_cell_fails_make_book(tmp_path):
    write_book(tmp_path, "raise RuntimeError('deliberately broken chapter')")
    broken = make_book(tmp_path)
    assert broken.returncode != 0, broken.stdout[-2000:]
    assert "deliberately broken chapter" in broken.stdout + broken.stderr

    write_book(tmp_path, "print('fixed chapter')")
    fixed = make_book(tmp_path)
    assert fixed.returncode == 0, (fixed.stdout + fixed.stderr)[-3000:]
    assert "fixed chapter" in (tmp_path / "_build/html/page.html").read_text()


def test_cache_guard_empties_the_cache_when_the_inputs_change(tmp_path):
    root = tmp_path / "repo"
    (root / "kda_edu").mkdir(parents=True)
    module = root / "kda_edu" / "ops.py"
    module.write_text("A = 1\n")
    cache = root / "_build" / ".jupyter_cache"
    assert not cache_guard.guard(cache, root)  # a new cache: nothing to throw away
    (cache / "executed.db").write_text("outputs of A = 1")
    assert not cache_guard.guard(cache, root)  # same inputs: the cache is kept
    assert (cache / "executed.db").exists()
    module.write_text("A = 2\n")
    assert cache_guard.guard(cache, root)  # the package changed: the cache goes
    assert not (cache / "executed.db").exists()
    (cache / "executed.db").write_text("outputs of A = 2")
    (root / "kda_edu" / "__pycache__").mkdir()
    (root / "kda_edu" / "__pycache__" / "ops.cpython-311.pyc").write_bytes(b"\0")
    assert not cache_guard.guard(cache, root)  # byte code is not an input


PAGE = """<!DOCTYPE html><html><body>
<div class="cell docutils container"><div class="cell_output docutils container">{good}</div></div>
<div class="cell tag_raises-exception docutils container"><div class="cell_output docutils container">
<div class="output traceback highlight-ipythontb notranslate"><pre>WrongAnswer Traceback (most recent call last)
</pre></div></div></div>
</body></html>"""


@pytest.mark.skipif(
    not (browser_check.find(browser_check.BROWSERS) and browser_check.find(browser_check.DRIVERS)),
    reason="needs Chromium and ChromeDriver (.ci/run installs them)",
)
@pytest.mark.parametrize(
    "output, problem",
    [
        ('<div class="output stream highlight-myst-ansi notranslate"><pre>all fine</pre></div>', None),
        (
            '<div class="output traceback highlight-ipythontb notranslate"><pre>ValueError</pre></div>',
            "error",
        ),
        (
            '<div class="output stream"><pre>Traceback (most recent call last):\n  boom</pre></div>',
            "traceback",
        ),
    ],
)
def test_browser_check_fails_on_errors_outside_expected_ones(tmp_path, output, problem):
    site = tmp_path / "html"
    site.mkdir()
    (site / "index.html").write_text(PAGE.format(good=output))
    report = browser_check.check_site(site, tmp_path / "shots")
    problems = report["pages"]["index.html"]["problems"]
    if problem is None:
        assert problems == []  # the raises-exception cell's traceback is expected
    else:
        assert len(problems) == 1 and problem in problems[0], problems


def test_a_missing_browser_fails_unless_skipped_explicitly(tmp_path, monkeypatch):
    monkeypatch.setattr(browser_check, "find", lambda names: None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(SystemExit, match="--skip-if-no-browser"):
        browser_check.check_site(tmp_path, tmp_path / "shots")
    assert "skipped" in browser_check.check_site(tmp_path, tmp_path / "shots", skip_if_no_browser=True)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(SystemExit, match="in CI this is a failure"):
        browser_check.check_site(tmp_path, tmp_path / "shots", skip_if_no_browser=True)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_passes_the_explicit_skip_to_the_browser_check():
    dry = subprocess.run(
        [
            "make",
            "-n",
            "-C",
            str(ROOT),
            "browser-check",
            "BROWSER_CHECK=skip",
            "-o",
            ".venv/.kda-edu-installed",
        ],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")},
    )
    assert "--skip-if-no-browser" in dry.stdout


def _report(path: Path, cases: list[tuple[str, str, str]]) -> Path:
    """A JUnit file with (classname, name, outcome) cases; outcome is "pass" or "failure"."""
    body = "".join(
        f'<testcase classname="{c}" name="{n}">' + ("<failure/>" if o == "failure" else "") + "</testcase>"
        for c, n, o in cases
    )
    path.write_text(
        f'<testsuites><testsuite name="pytest">{body}<testcase time="0"/></testsuite></testsuites>'
    )
    return path


def test_merged_reports_drop_the_cases_of_a_rerun_file(tmp_path):
    # The first run: notebook A had three cells (the third failed), B two; a module had two tests.
    first = _report(
        tmp_path / "a.xml",
        [
            ("book.A.ipynb", "Cell 0", "pass"),
            ("book.A.ipynb", "Cell 1", "pass"),
            ("book.A.ipynb", "Cell 2", "failure"),
            ("book.B.ipynb", "Cell 0", "pass"),
            ("tests.training.test_x", "test_old", "failure"),
            ("tests.training.test_x.TestY", "test_kept", "pass"),
        ],
    )
    # The re-run: A now has two cells, and the module's test_old was renamed.
    later = _report(
        tmp_path / "b.xml",
        [
            ("book.A.ipynb", "Cell 0", "pass"),
            ("book.A.ipynb", "Cell 1", "pass"),
            ("tests.training.test_x", "test_new", "pass"),
        ],
    )
    suite = merge_junit.merge([first, later]).find("testsuite")
    names = sorted((c.get("classname"), c.get("name")) for c in suite.iter("testcase"))
    assert names == [
        ("book.A.ipynb", "Cell 0"),
        ("book.A.ipynb", "Cell 1"),
        ("book.B.ipynb", "Cell 0"),
        ("tests.training.test_x", "test_new"),
    ]
    assert (suite.get("tests"), suite.get("failures")) == ("4", "0")
    # Merged the other way round, the old failures come back: the order decides, not a filter.
    suite = merge_junit.merge([later, first]).find("testsuite")
    assert (suite.get("tests"), suite.get("failures")) == ("6", "2")


def test_figures_are_numbered_per_chapter():
    """Sphinx numbers figures across the book; the extension renumbers each chapter's 1, 2, ... in page
    order with the chapter's number, leaving pages without one (the introduction, appendices) alone."""

    class Env:
        toc_fignumbers = {
            "book/intro": {"figure": {"fig-intro": (1,)}},
            "book/02_linear_attention": {"figure": {"fig-b": (3,), "fig-a": (2,)}},
            "book/08_chunk_kernel": {"figure": {"fig-late": (31,), "fig-early": (30,)}, "table": {"t": (4,)}},
        }

    changed = figure_numbers.renumber(None, Env)
    assert Env.toc_fignumbers == {
        "book/intro": {"figure": {"fig-intro": (1,)}},
        "book/02_linear_attention": {"figure": {"fig-b": (2, 2), "fig-a": (2, 1)}},
        "book/08_chunk_kernel": {"figure": {"fig-late": (8, 2), "fig-early": (8, 1)}, "table": {"t": (8, 1)}},
    }
    assert changed == ["book/02_linear_attention", "book/08_chunk_kernel"]


def test_a_speed_run_replaces_only_the_rows_it_timed():
    """A run's rows replace those of the same (case, B, T, H) and carry its commit; the other rows keep theirs;
    the build's tests are recorded; a run on another GPU or without a commit is refused."""
    env = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-12-07"}
    old = {
        **env,
        "rows": [
            {"case": "fwd", "B": 1, "T": 8192, "H": 32, "kda_edu ms": 1.0, "fla ms": 1.2, "commit": "aaa"},
            {"case": "decode", "B": 1, "T": 1, "H": 32, "kda_edu ms": 0.1, "fla ms": 0.14, "commit": "aaa"},
        ],
        "builds": {"aaa": {"cases": ["decode", "fwd"], "note": "kept"}},
    }
    run = {**env, "commit": "bbb", "rows": [{"case": "decode", "B": 1, "T": 1, "H": 32, "kda_edu ms": 0.007}]}
    tests = {"command": "pytest tests/kernels", "passed": 3, "failed": 0, "skipped": 0}
    merged = merge_speed.merge(old, run, tests)
    by_case = {r["case"]: r for r in merged["rows"]}
    assert by_case["fwd"]["commit"] == "aaa" and by_case["fwd"]["kda_edu ms"] == 1.0
    assert by_case["decode"]["commit"] == "bbb" and by_case["decode"]["kda_edu ms"] == 0.007
    assert merged["builds"]["aaa"]["note"] == "kept" and merged["builds"]["bbb"]["gpu_tests"] == tests
    with pytest.raises(ValueError, match="another|on 'NVIDIA H200"):
        merge_speed.merge(old, {**run, "device": "NVIDIA H200"}, None)
    with pytest.raises(ValueError, match="commit"):
        merge_speed.merge(old, {k: v for k, v in run.items() if k != "commit"}, None)
