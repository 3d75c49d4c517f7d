"""The first cell of every chapter notebook, derived from the book's configuration.

The repository's address and branch live in one place, ``_config.yml`` (``repository.url`` and
``repository.branch``). The Colab set-up cell is generated from them, and a test checks that every
notebook carries exactly this cell.
"""

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
# remove-cell: the set-up only matters in Colab, so the rendered book leaves it out altogether.
SETUP_TAGS = ["colab-setup", "remove-cell"]


def _repository() -> dict:
    return yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]


def repository_url() -> str:
    return _repository()["url"].rstrip("/")


def repository_branch() -> str:
    """The branch the book's launch buttons open notebooks from."""
    return _repository()["branch"]


def setup_cell_source() -> str:
    """Source of the set-up cell.

    In Colab it clones the branch the launch button opened the notebook from (``repository.branch``), so
    the notebook and the ``kda_edu`` it imports are the same revision; installs the package's
    dependencies; and imports ``kda_edu`` from the clone, so the committed benchmark results under
    ``bench/results`` are there too. Anywhere else it does nothing.
    """
    url, branch = repository_url(), repository_branch()
    return (
        "# Set-up: in Colab, fetch the book's repository (this notebook's branch) and use its kda_edu;\n"
        "# elsewhere this cell does nothing.\n"
        "import sys\n"
        "\n"
        'if "google.colab" in sys.modules:\n'
        f"    !git clone --quiet --depth 1 --branch {branch} {url} /content/kda-edu\n"
        "    %pip install --quiet /content/kda-edu\n"
        '    sys.path.insert(0, "/content/kda-edu")\n'
        "    %cd /content/kda-edu/book"
    )


def chapter_notebooks() -> list[Path]:
    """The chapter notebooks, ``book/NN_name.ipynb``, in order."""
    return sorted(p for p in (ROOT / "book").glob("*.ipynb") if re.match(r"\d\d_", p.name))


def chapter_markdown() -> list[Path]:
    """The MyST twins of the chapter notebooks, ``book/NN_name.md``, in order."""
    return sorted(p for p in (ROOT / "book").glob("*.md") if re.match(r"\d\d_", p.name))
