"""Every `kda_edu.x.y` that the package's docstrings and comments name resolves to a module or an attribute:
a reader who follows a reference finds it, and a renamed or moved function leaves no stale pointer behind."""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = re.compile(r"\bkda_edu(?:\.[A-Za-z_]\w*)+")


def references() -> dict[str, list[str]]:
    """{dotted name: ["path:line", ...]} for every dotted kda_edu name in kda_edu/**/*.py."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "kda_edu").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in REFERENCE.findall(line):
                found.setdefault(name.rstrip("."), []).append(f"{path.relative_to(ROOT)}:{number}")
    return found


def resolves(name: str) -> bool:
    """Whether `name` is a module, or an attribute path below the longest importable module prefix."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_named_reference_resolves():
    stale = {name: where for name, where in references().items() if not resolves(name)}
    assert not stale, "names that no longer exist: " + "; ".join(
        f"{n} ({', '.join(w)})" for n, w in stale.items()
    )


@pytest.mark.parametrize("name", ["kda_edu.ops.kda.kda_chunked", "kda_edu.kernels.chunk_fwd.prepare_chunks"])
def test_the_resolver_finds_real_names(name):
    assert resolves(name)


@pytest.mark.parametrize("name", ["kda_edu.kernels._backend.use_triton", "kda_edu.ops.kda.no_such_function"])
def test_the_resolver_rejects_stale_names(name):
    assert not resolves(name)
