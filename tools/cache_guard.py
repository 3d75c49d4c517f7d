"""Throw the notebooks' execution cache away when what the notebooks import has changed.

Jupyter Book caches each notebook's outputs keyed on the notebook's code cells alone, so a change
to `kda_edu` (or to the committed results the chapters read, or to the pinned dependencies) would
re-execute no chapter and the book would show outputs of an older package. This script hashes
everything a chapter's outputs depend on besides its own cells, stores the hash beside the
cache, and deletes the cache when the hash differs.

    python tools/cache_guard.py CACHE_DIR      # before `jupyter-book build`
"""

import hashlib
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What a chapter's outputs depend on besides its own cells.
INPUTS = ["kda_edu/**/*.py", "bench/results/**/*", "pyproject.toml"]
STAMP = "kda-edu-inputs.sha256"


def fingerprint(root: Path = ROOT) -> str:
    digest = hashlib.sha256()
    files = sorted({p for pattern in INPUTS for p in root.glob(pattern) if p.is_file()})
    for path in files:
        if "__pycache__" in path.parts:
            continue
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def guard(cache: Path, root: Path = ROOT) -> bool:
    """Delete ``cache`` if it was filled from other inputs; return True if it was deleted."""
    stamp = cache / STAMP
    now = fingerprint(root)
    stale = cache.exists() and (not stamp.exists() or stamp.read_text().strip() != now)
    if stale:
        shutil.rmtree(cache)
    cache.mkdir(parents=True, exist_ok=True)
    stamp.write_text(now + "\n")
    return stale


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tools/cache_guard.py CACHE_DIR")
    cache = Path(sys.argv[1])
    if guard(cache):
        print(f"cache_guard: kda_edu, bench/results or pyproject.toml changed; emptied {cache}")


if __name__ == "__main__":
    main()
