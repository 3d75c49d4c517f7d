"""The stage of `make test` that runs the slowest chapters beside a busy process (tools/loaded_chapters.py)
can fail: a chapter over its budget fails it; the same chapter inside its budget passes."""

import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

ROOT = Path(__file__).resolve().parent.parent


def run_stage(book: Path, cell: str, budget: float) -> tuple[int, dict]:
    nb = new_notebook(cells=[new_code_cell(cell)])
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nbformat.write(nb, book / "00_page.ipynb")
    report = book / "loaded.json"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "loaded_chapters.py"),
            "--book",
            str(book),
            "--budget",
            str(budget),
        ]
        + ["--load", "1", "--report", str(report), "00_page"],
        capture_output=True,
        text=True,
        check=False,
    )
    (chapter,) = json.loads(report.read_text())["chapters"]
    return run.returncode, chapter


@pytest.mark.slow
def test_a_chapter_over_its_budget_fails_the_stage(tmp_path):
    code, chapter = run_stage(tmp_path, "import time\ntime.sleep(3)", budget=1)
    assert code == 1 and chapter["passed"] and not chapter["ok"] and chapter["wall_s"] >= 3
    code, chapter = run_stage(tmp_path, "import time\ntime.sleep(3)", budget=300)
    assert code == 0 and chapter["ok"] and chapter["load"] == 1
