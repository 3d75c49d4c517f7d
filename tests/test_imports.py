"""The package's imports go one way: each floor imports only the floors below it, lazy imports (inside
functions) included, and no two modules import each other, directly or around a loop.

    backend < ops < kernels < parallel < layers < models < training < book, plotting, device
            < chapters < exercises

`kda_edu/__init__.py` (the public API) may import any floor of the library; nothing imports it except the
book's own helpers.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = [
    {"backend"},
    {"ops"},
    {"kernels"},
    {"parallel"},
    {"layers"},
    {"models"},
    {"training"},
    {"book", "plotting", "device"},
    {"chapters"},
    {"exercises"},
]


def floor(module: str) -> int:
    """The floor of a module `kda_edu.x[.y...]`; the package root (`kda_edu`) is above everything."""
    parts = module.split(".")
    if len(parts) == 1:
        return len(FLOORS)
    return next(i for i, names in enumerate(FLOORS) if parts[1] in names)


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def imports(source: str, module: str) -> set[str]:
    """Every kda_edu module that `source` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing module's package
                base = module.split(".")[: -node.level]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("kda_edu"):  # `from package import x`: x may be a submodule
                folder = ROOT.joinpath(*target.split("."))
                for a in node.names:
                    sub = folder / a.name
                    found.add(
                        f"{target}.{a.name}" if sub.with_suffix(".py").exists() or sub.is_dir() else target
                    )
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("kda_edu")}
    return found


def graph() -> dict[str, set[str]]:
    return {
        module_name(p): imports(p.read_text(), module_name(p))
        for p in sorted((ROOT / "kda_edu").rglob("*.py"))
    }


def violations(edges: dict[str, set[str]]) -> list[str]:
    """Imports of a higher floor, and import cycles, as readable strings."""
    found = []
    for a, targets in edges.items():
        for b in targets:
            if a != "kda_edu" and b == "kda_edu" and floor(a) < floor("kda_edu.book"):
                found.append(f"{a} imports the package root")
            elif floor(b) > floor(a) and b != "kda_edu":
                found.append(f"{a} (floor {floor(a)}) imports {b} (floor {floor(b)})")
    # cycles: a depth-first search over modules (packages resolve to their __init__)
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(edges.get(m, ())):
            if n not in edges:
                continue
            if state.get(n) == 1:
                found.append("cycle: " + " -> ".join([*path[path.index(n) :], n]))
            elif n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    return found


def test_imports_go_one_way():
    assert violations(graph()) == []


@pytest.mark.parametrize(
    "planted, expected",
    [
        (
            {"kda_edu.ops.x": {"kda_edu.layers.y"}, "kda_edu.layers.y": set()},
            "kda_edu.ops.x (floor 1) imports",
        ),
        (
            {"kda_edu.ops.a": {"kda_edu.ops.b"}, "kda_edu.ops.b": {"kda_edu.ops.a"}},
            "cycle: kda_edu.ops.a -> kda_edu.ops.b",
        ),
    ],
)
def test_a_planted_violation_is_found(planted, expected):
    assert any(v.startswith(expected) for v in violations(planted))


def test_lazy_imports_count():
    source = "def f():\n    from kda_edu.models.model import HybridLM\n"
    assert imports(source, "kda_edu.layers.z") == {"kda_edu.models.model"}
