"""Checkers for the exercises at the end of each chapter.

One module per chapter (``ch02.py`` for chapter 2, ...). A checker takes the reader's answer (a
number, a tensor or a function), compares it with the right one, and either returns a short
message saying the answer is right or raises ``WrongAnswer`` saying what is off. While the answer
is still the book's placeholder ``None``, the checker only repeats the question
(``not_answered``), so every chapter runs top to bottom before the reader has answered. The tests run
every checker on the worked solution shown in the book and on a wrong answer.

In a notebook every verdict is one line: a checker prints its message once (the returned ``Feedback``
is not echoed again), and a ``WrongAnswer`` shows as ``Not yet: <hint>`` instead of a traceback. The
cell still ends in an error, so a worked solution that stops passing still fails the book's tests.
"""

import importlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class WrongAnswer(AssertionError):
    """The reader's answer does not pass the checker; the message says why."""


class Feedback(str):
    """A checker's verdict: a string, printed once when it is made; a notebook does not display it again."""

    def _ipython_display_(self) -> None:
        pass


def _wrong_answer_in_one_line(shell, etype, value, tb, tb_offset=None) -> None:
    # An error output with a one-line traceback: the reader sees one line, and the cell still counts as failed.
    shell._showtraceback(etype, value, [f"Not yet: {value}"])


def _show_wrong_answers_in_one_line() -> None:
    """Inside IPython (a notebook), show a ``WrongAnswer`` as one line instead of a traceback."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None:
        shell.set_custom_exc((WrongAnswer,), _wrong_answer_in_one_line)


_show_wrong_answers_in_one_line()


def passed(message: str = "") -> str:
    """The message a checker returns (and prints) for a right answer."""
    text = Feedback("Correct!" + (f" {message}" if message else ""))
    print(text)
    return text


def expect(condition: bool, hint: str) -> None:
    """Raise ``WrongAnswer(hint)`` unless ``condition`` holds."""
    if not condition:
        raise WrongAnswer(hint)


LONGEST = 110  # characters of a verdict as the page shows it ("Not yet: " or "Correct! " included): one line


def raised(error: Exception, who: str = "your function") -> WrongAnswer:
    """The verdict for an error the reader's code raised: its type and as much of its message's first line as
    fits on one line of the page (a PyTorch message can run to several lines and hundreds of characters)."""
    head = f"{who} raised {type(error).__name__}: "
    first_line = str(error).split("\n", 1)[0]
    room = LONGEST - len("Not yet: ") - len(head)
    return WrongAnswer(head + (first_line if len(first_line) <= room else first_line[: room - 3] + "..."))


def not_answered(question: str) -> str:
    """What a checker says while the answer is still the placeholder None: the question again."""
    text = Feedback(f"Not answered yet: {question}")
    print(text)
    return text


def as_number(fn, *args) -> float:
    """``float(fn(*args))``, or ``WrongAnswer`` saying the function must return a number."""
    try:
        return float(fn(*args))
    except (TypeError, ValueError) as error:
        raise WrongAnswer(f"your function must return a number for arguments {args}, got: {error}") from None


class OperationLog(TorchDispatchMode):
    """Inside `with OperationLog() as ops:`, record every operation PyTorch runs: `ops.names` (e.g. "mm"),
    `ops.count` of them, `ops.shapes` (the shape of each one's first result), `ops.products` (the result
    shape of every matrix product) and `ops.largest` (the most numbers of any tensor an operation made)."""

    PRODUCTS = {"mm", "bmm", "mv", "addmm", "matmul", "dot", "baddbmm", "addmv"}

    def __init__(self):
        super().__init__()
        self.names, self.shapes, self.products, self.largest = [], [], [], 0

    @property
    def count(self) -> int:
        return len(self.names)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.names.append(name)
        parts = [
            p for p in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(p, torch.Tensor)
        ]
        self.shapes.append(tuple(parts[0].shape) if parts else ())
        if name in self.PRODUCTS and parts:
            self.products.append(tuple(parts[0].shape))
        for part in parts:
            self.largest = max(self.largest, part.numel())
        return out


def call_and_record(fn, *args, shapes: bool = False):
    """`fn(*args)` and the names of the operations it ran (and their result shapes with `shapes=True`); an
    error in the reader's code becomes a one-line WrongAnswer."""
    try:
        with OperationLog() as ops:
            out = fn(*args)
    except (TypeError, ValueError, RuntimeError, IndexError) as error:
        raise raised(error) from None
    return (out, ops.names, ops.shapes) if shapes else (out, ops.names)


def run_refusing(fn, args, targets, advice: str):
    """`fn(*args)` with the functions `targets` names (pairs of a module name or an object, and attribute names)
    replaced by ones that raise `WrongAnswer("your function calls <name>: <advice>")`; a name the reader
    imported before the check (`from torch.autograd import grad`) is found among the function's globals.
    Everything is put back afterwards, whatever happens."""
    saved = []
    for owner, names in targets:
        owner = importlib.import_module(owner) if isinstance(owner, str) else owner
        saved += [(owner, name, getattr(owner, name)) for name in names if hasattr(owner, name)]

    def refuse(label):
        def refused(*_, **__):
            raise WrongAnswer(f"your function calls {label}: {advice}")

        return refused

    labels = {id(f): f"{getattr(o, '__name__', o)}.{name}" for o, name, f in saved}
    for name in getattr(getattr(fn, "__code__", None), "co_names", ()):
        called = labels.get(id(getattr(fn, "__globals__", {}).get(name)))
        expect(called is None, f"your function calls {called}: {advice}")
    try:
        for owner, name, original in saved:
            setattr(owner, name, refuse(labels[id(original)]))
        return fn(*args)
    except (TypeError, ValueError, RuntimeError, IndexError) as error:
        raise raised(error) from None
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
