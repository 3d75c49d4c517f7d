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
