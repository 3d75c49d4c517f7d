"""Rules of the package's layout that every module must keep (CONTRIBUTING.md, "Where code goes").

- No module imports another module's private names (`from kda_edu.x import _y`): what two modules share is
  public in one of them.
- kda_edu's Triton kernels are built with `kda_edu.kernels._backend.jit`, which picks the interpreter per
  kernel on a machine without a GPU; a plain `@triton.jit` kernel in the package would fail there when
  Triton was imported first.
"""

import ast
from pathlib import Path

import kda_edu

PACKAGE = Path(kda_edu.__file__).resolve().parent
MODULES = sorted(PACKAGE.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path):
    """(line, module, name) of every `from kda_edu... import name` in the file, relative imports resolved."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base) if node.level else node.module
            if module and module.split(".")[0] == "kda_edu":
                for alias in node.names:
                    yield node.lineno, module, alias.name


def test_the_scan_finds_the_package():
    assert len(MODULES) > 40 and any(p.name == "chunk.py" for p in MODULES)


def test_no_module_imports_another_modules_private_names():
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: from {module} import {name}"
        for path in MODULES
        for line, module, name in imported_names(path)
        if name.startswith("_") and not name.startswith("__") and module != module_name(path)
    ]
    assert not offenders, "private names imported across modules:\n" + "\n".join(offenders)


def test_kernels_are_built_with_kda_edus_jit():
    offenders = []
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                for deco in node.decorator_list:
                    target = deco.func if isinstance(deco, ast.Call) else deco
                    if ast.unparse(target) == "triton.jit":
                        offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}")
    assert not offenders, "use `from kda_edu.kernels._backend import jit` and `@jit`:\n" + "\n".join(
        offenders
    )
