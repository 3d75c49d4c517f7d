"""Pair every chapter's MyST markdown (book/NN_name.md) with its notebook (book/NN_name.ipynb).

For each chapter the more recently modified file of the pair is the source. Its first cell is
replaced by the generated Colab set-up cell (tools/notebook_setup.py), and both files are
written from it: the notebook without outputs, the markdown in MyST format. Run `make sync`
(or `python tools/sync_notebooks.py 03_delta_rule` for one chapter) after editing either file; a test fails when a pair is out of sync.
"""

import sys
from pathlib import Path

import jupytext
from nbformat.v4 import new_code_cell

sys.path.insert(0, str(Path(__file__).resolve().parent))
from notebook_setup import ROOT, SETUP_TAGS, setup_cell_source  # noqa: E402

FORMATS = "ipynb,md:myst"


def sync(stem: Path) -> None:
    md, ipynb = stem.with_suffix(".md"), stem.with_suffix(".ipynb")
    sources = [p for p in (md, ipynb) if p.exists()]
    source = max(sources, key=lambda p: p.stat().st_mtime)
    nb = jupytext.read(source)
    setup = new_code_cell(setup_cell_source(), metadata={"tags": list(SETUP_TAGS)})
    first = nb.cells[0] if nb.cells else None
    if first is not None and "colab-setup" in first.metadata.get("tags", []):
        nb.cells[0] = setup
    else:
        nb.cells.insert(0, setup)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
            # Cells the book collapses (worked solutions) start collapsed in JupyterLab too.
            tags = cell.metadata.get("tags", [])
            hidden = {"source_hidden": "hide-input" in tags, "outputs_hidden": "hide-output" in tags}
            if any(hidden.values()):
                cell.metadata["jupyter"] = {key: True for key, on in hidden.items() if on}
            else:
                cell.metadata.pop("jupyter", None)
        cell.pop("id", None)  # ids would change on every sync; nbformat 4.4 has none
    nb.nbformat_minor = 4
    nb.metadata.setdefault("jupytext", {})["formats"] = FORMATS
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    jupytext.write(nb, md, fmt="md:myst")
    jupytext.write(nb, ipynb)
    print(f"synced {md.relative_to(ROOT)} <-> {ipynb.relative_to(ROOT)} (source: {source.suffix})")


def main() -> None:
    """Sync every chapter, or only those named on the command line (e.g. `03_delta_rule`)."""
    wanted = set(sys.argv[1:])
    stems = sorted(
        {p.with_suffix("") for p in (ROOT / "book").glob("[0-9][0-9]_*.*") if p.suffix in (".md", ".ipynb")}
    )
    for stem in stems:
        if not wanted or stem.name in wanted:
            sync(stem)


if __name__ == "__main__":
    main()
