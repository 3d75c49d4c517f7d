"""Rules of the package's layout that every module must keep (CONTRIBUTING.md, "Where code goes").

- No module imports another module's private names (`from kda_edu.x import _y`): what two modules share is
  public in one of them.
- kda_edu's Triton kernels are built with `kda_edu.kernels._backend.jit`, which picks the interpreter per
  kernel on a machine without a GPU; a plain `@triton.jit` kernel in the package would fail there when
  Triton was imported first.
- Every committed file of `bench/results/` is named where something reads or cites it: the book, the package,
  the tools, the tests, `docs/` (the kernel design's sources), the top-level documents or a README under
  `bench/`. A benchmark script names the file it writes, so a script under `bench/` does not count. A name
  built at run time (`f"k3_cpu_{name}.json"`, `speed_<gpu>.json`) counts as the pattern it spells.
"""

import ast
import fnmatch
import re
import subprocess
from pathlib import Path

import kda_edu

PACKAGE = Path(kda_edu.__file__).resolve().parent
MODULES = sorted(PACKAGE.rglob("*.py"))
ROOT = PACKAGE.parent
RESULTS = ROOT / "bench" / "results"
READERS = ["book/*.md", "kda_edu/**/*.py", "tools/*", "tests/**/*.py", "docs/*.md", "*.md", "bench/**/*.md"]
# A result-file name with a placeholder, `{expression}` of an f-string or `<word>` of a usage line.
_PLACEHOLDER = r"\{[^{}\s]*\}|<\w+>"
BUILT_NAME = re.compile(rf"[\w./-]*(?:{_PLACEHOLDER})(?:[\w./-]|{_PLACEHOLDER})*\.(?:json|csv|xml|pt)\b")


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


def committed_results() -> list[str]:
    """The committed files of bench/results/, as paths relative to it (outside a git checkout: those on disk)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "bench/results"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file())
    return sorted(Path(p).relative_to("bench/results").as_posix() for p in listed.split("\0") if p)


def reader_text() -> str:
    """Everything that may read or cite a result file, this test excepted (its own examples name none)."""
    this = Path(__file__).resolve()
    paths = {p for pattern in READERS for p in ROOT.glob(pattern) if p.is_file() and p.resolve() != this}
    return "\n".join(p.read_text(errors="replace") for p in sorted(paths))


def built_name_patterns(text: str) -> list[str]:
    """Glob patterns of the result names `text` builds at run time, each with a literal start of at least three
    characters (so `{name}.json` alone matches nothing)."""
    patterns = []
    for name in BUILT_NAME.findall(text):
        glob = re.sub(_PLACEHOLDER, "*", name.rsplit("bench/results/", 1)[-1])
        if len(glob.split("*", 1)[0].rsplit("/", 1)[-1]) >= 3:
            patterns.append(glob)
    return patterns


def unread_results(files: list[str], text: str) -> list[str]:
    """The files (paths relative to bench/results/) that `text` names neither literally nor by a built pattern.
    A literal name starts a word or follows `bench/results/`: `h200_tests/unit.xml` is not `unit.xml`."""
    patterns = built_name_patterns(text)
    return [
        f
        for f in files
        if not re.search(rf"(?:(?<=bench/results/)|(?<![\w./-])){re.escape(f)}(?!\w)", text)
        and not any(fnmatch.fnmatchcase(f, p) for p in patterns)
    ]


def test_the_reader_check_finds_literal_and_built_names():
    files = [
        "h200_forward.json",
        "k3_cpu_mqar.json",
        "speed_h100.json",
        "h200_tests/unit.xml",
        "probe_seed1.json",
    ]
    text = (
        'bench_result("h200_forward.json")\n'
        'results = {name: bench_result(f"k3_cpu_{name}.json") for name in ("mqar", "text")}\n'
        "python -m bench.kernels.speed --out bench/results/speed_<gpu>.json\n"
        "The GPU reports are `bench/results/h200_tests/unit.xml`; a probe's `{seed}.json` and `xprobe_seed1.json`\n"
    )
    assert unread_results(files, text) == ["probe_seed1.json"]
    assert unread_results(["unit.xml"], text) == ["unit.xml"]  # a file at the top is not one in a subfolder


def test_every_committed_result_is_read_or_cited():
    files = committed_results()
    assert "h200_forward.json" in files and len(files) > 20, files
    unread = unread_results(files, reader_text())
    assert not unread, (
        "bench/results/ files that nothing in book/, kda_edu/, tools/, tests/, docs/ or the documentation names "
        "(git rm them, or cite them in docs/kernel-design.md's sources):\n" + "\n".join(unread)
    )
