"""The first cell of every chapter notebook, derived from the book's configuration.

The repository's address lives in one place, ``_config.yml`` (``repository.url``); the book's
version lives in ``pyproject.toml``. The Colab set-up cell is generated from both, and a test
checks that every notebook carries exactly this cell.
"""

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SETUP_TAGS = ["colab-setup", "hide-cell"]


def repository_url() -> str:
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    return config["repository"]["url"].rstrip("/")


def book_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def setup_cell_source() -> str:
    """Source of the set-up cell.

    In Colab it clones the repository at the book's version (tag ``v<version>``), installs its
    dependencies, and imports ``kda_edu`` from the clone, so the committed benchmark results under
    ``bench/results`` are there too. Anywhere else it does nothing.
    """
    url, tag = repository_url(), f"v{book_version()}"
    return (
        "# Set-up: in Colab, fetch the book's repository at this version and use its kda_edu;\n"
        "# elsewhere this cell does nothing.\n"
        "import sys\n"
        "\n"
        'if "google.colab" in sys.modules:\n'
        f"    !git clone --quiet --depth 1 --branch {tag} {url} /content/kda-edu\n"
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
