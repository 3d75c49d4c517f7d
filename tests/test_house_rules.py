"""The house rules for what a reader reads (CONTRIBUTING.md, "House rules").

The prose teaches: no build hashes, session or issue numbers, "previous/current build", pointers to
bench/NOTES.md or result-file names in chapter text, the README or the package's docstrings and comments.
Only a code cell whose input is collapsed or removed (tags hide-input, remove-input, remove-cell) may name
the file it reads. The test covers the README, every page of the book and every module of `kda_edu`.
"""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

COVERED = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "book").glob("*.md"))

HIDDEN_TAGS = {"hide-input", "remove-input", "remove-cell"}

# A commit-like hash: 7 to 40 lower-case hex digits with at least one digit and one letter, not a
# colour (#1f77b4), not 0x..., and standing alone (not part of a longer word or number).
_HASH = r"(?<![#\w.])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w])"
PROVENANCE = {
    "build hash": re.compile(_HASH),
    "session number": re.compile(r"\bsessions?\s+#?\d+", re.IGNORECASE),
    "issue number": re.compile(r"\bissues?\s+#?\d+|(?<![\w&])#\d{1,4}\b", re.IGNORECASE),
    "previous/current build": re.compile(r"\b(previous|current|last|earlier)\s+build\b", re.IGNORECASE),
    "pointer to NOTES.md": re.compile(r"\bNOTES(\.md)?\b"),
    "result file": re.compile(r"bench/results\b|[\w./-]+\.json\b"),
}


def _strings_and_comments(code: str) -> str:
    """What a reader reads as words in a line of code: its string literals and its comment."""
    return " ".join(re.findall(r'"[^"]*"|\'[^\']*\'|#.*$', code))


def visible_text(markdown: str) -> list[tuple[int, str]]:
    """The (line number, text) pairs a reader sees: prose, and the strings and comments of code cells
    whose input is not hidden (a variable named acc3000 is not a build hash).

    A MyST code cell opens with a line starting with three backticks and `{code-cell}`; its tags come
    from a `:tags: [...]` option or a `tags: [...]` line of its YAML header.
    """
    lines = markdown.splitlines()
    out, i = [], 0
    in_front_matter = bool(lines) and lines[0].strip() == "---"
    if in_front_matter:
        i = lines.index("---", 1) + 1
    while i < len(lines):
        line = lines[i]
        if line.startswith("```{code-cell}"):
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            cell = lines[i + 1 : j]
            header = [c for c in cell[:12] if re.match(r"\s*:?tags:", c)]
            tags = set(re.findall(r"[\w-]+", header[0].split("tags:", 1)[1])) if header else set()
            if not tags & HIDDEN_TAGS:
                out.extend((n + 1, _strings_and_comments(lines[n])) for n in range(i + 1, j))
            i = j + 1
            continue
        out.append((i + 1, line))
        i += 1
    return out


def provenance(markdown: str) -> list[str]:
    """Every provenance pattern in what a reader sees, as 'line N: kind: match'."""
    found = []
    for number, line in visible_text(markdown):
        for kind, pattern in PROVENANCE.items():
            for match in pattern.finditer(line):
                found.append(f"line {number}: {kind}: {match.group(0)!r}")
    return found


@pytest.mark.parametrize("page", COVERED)
def test_no_provenance_in_what_a_reader_reads(page):
    found = provenance((ROOT / page).read_text())
    assert not found, f"{page}: " + "; ".join(found)


PROSE = """Intro.

Measured on an H200, bf16, (B, T, H) = (1, 8192, 32): 1.2 ms, colour #1f77b4, 0x1f2e3d4c, 1e-12.
The words decade, facade, deadbeef and the numbers 1234567 and 2305.13245 are fine.

```{code-cell} ipython3
:tags: [hide-input]

trained = bench_result("two_timescales_trained.json")  # bench/results/, may be named here
```
"""


def test_detector_passes_clean_prose_and_hidden_cells():
    assert provenance(PROSE) == []


@pytest.mark.parametrize(
    "planted, kind",
    [
        ("as measured in session 12.", "session number"),
        ("timed at commit 4de5d89 on an H200.", "build hash"),
        ("the build 631a0ffe2b1c differs", "build hash"),
        ("see issue 43 for the plan", "issue number"),
        ("faster than the previous build", "previous/current build"),
        ("(bench/NOTES.md, 2026-12-02)", "pointer to NOTES.md"),
        ("read from bench/results/chunk_bench.json", "result file"),
        ("its results are in `two_timescales_trained.json`.", "result file"),
    ],
)
def test_detector_fails_on_planted_provenance(planted, kind):
    found = provenance(PROSE + "\n" + planted + "\n")
    assert any(f": {kind}: " in f for f in found), found


def test_detector_reads_visible_code_cells():
    cell = '```{code-cell} ipython3\nacc3000 = bench_result("a.json")  # session 12\n```\n'
    kinds = {f.split(": ")[1] for f in provenance(cell)}
    assert kinds == {"result file", "session number"}, kinds
    hidden = cell.replace("ipython3\n", "ipython3\n:tags: [remove-input]\n\n")
    assert provenance(hidden) == []
    yaml_header = cell.replace("ipython3\n", "ipython3\n---\ntags: [hide-input]\n---\n")
    assert provenance(yaml_header) == []


def test_exercise_feedback_is_one_line(capsys):
    from kda_edu.exercises import WrongAnswer, _wrong_answer_in_one_line, ch04

    verdict = ch04.check_repeated_read(lambda g, beta: None)
    verdict._ipython_display_()  # a notebook's echo of the returned verdict shows nothing ...
    assert capsys.readouterr().out == verdict + "\n"  # ... so the line appears once
    shown = []

    class Shell:
        def _showtraceback(self, etype, value, stb):
            shown.append(stb)

    try:
        ch04.check_repeated_read(lambda g, beta: beta)
    except WrongAnswer as error:
        _wrong_answer_in_one_line(Shell(), WrongAnswer, error, error.__traceback__)
    assert len(shown) == 1 and len(shown[0]) == 1 and shown[0][0].startswith("Not yet: "), shown


def test_exercise_feedback_lexes_as_the_book_renders_it():
    # The strict build renders an error output with the lexer _config.yml names; a token it cannot lex is a
    # warning there, hence a failed build. Pygments' IPython-traceback lexer (the default) failed on hints with
    # backquotes; the text lexer takes any line.
    import yaml
    from pygments.lexers import get_lexer_by_name
    from pygments.token import Error

    from kda_edu.exercises import WrongAnswer, _wrong_answer_in_one_line

    shown = []

    class Shell:
        def _showtraceback(self, etype, value, stb):
            shown.extend(stb)

    hint = WrongAnswer("do masked loads give `other=0.0`? (see `tl.load`; $x$ must be finite!)")
    _wrong_answer_in_one_line(Shell(), WrongAnswer, hint, None)
    name = yaml.safe_load((ROOT / "_config.yml").read_text())["sphinx"]["config"]["nb_render_error_lexer"]
    assert [value for token, value in get_lexer_by_name(name).get_tokens(shown[0]) if token is Error] == []
    ipython = get_lexer_by_name("ipythontb")  # the default, which this line would break
    assert [value for token, value in ipython.get_tokens(shown[0]) if token is Error] != []


# In the package a file may be named (config.json is a checkpoint's part, not a measurement); a committed
# result is not.
PACKAGE_PROVENANCE = {**PROVENANCE, "result file": re.compile(r"bench/results/[\w./-]+")}


def docstrings_and_comments(source: str) -> list[tuple[int, str]]:
    """The (line number, text) pairs of a module's docstrings (module, classes, functions) and comments."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = node.body[0] if node.body else None
            if (
                isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)
            ):
                out += [(doc.lineno + i, line) for i, line in enumerate(doc.value.value.splitlines())]
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            out.append((token.start[0], token.string))
    return out


def package_provenance(source: str) -> list[str]:
    return [
        f"line {n}: {kind}: {m.group(0)!r}"
        for n, line in docstrings_and_comments(source)
        for kind, pattern in PACKAGE_PROVENANCE.items()
        for m in pattern.finditer(line)
    ]


@pytest.mark.parametrize("module", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "kda_edu").rglob("*.py")))
def test_no_provenance_in_the_package(module):
    found = package_provenance((ROOT / module).read_text())
    assert not found, f"{module}: " + "; ".join(found)


@pytest.mark.parametrize(
    "planted",
    [
        'def f():\n    """Faster since session 15."""\n',
        "x = 1  # measured at build 4de5d89\n",
        '"""Timings in bench/results/h200_forward.json."""\n',
        "# see bench/NOTES.md\n",
    ],
)
def test_package_detector_fails_on_planted_provenance(planted):
    assert package_provenance(planted)


def test_package_detector_reads_only_docstrings_and_comments():
    assert (
        package_provenance('name = "session 12"\nload("bench/results/a.json")\n"""config.json beside it"""\n')
        == []
    )
