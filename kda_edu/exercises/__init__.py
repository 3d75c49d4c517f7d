"""Checkers for the exercises at the end of each chapter.

One module per chapter (``ch02.py`` for chapter 2, ...). A checker takes the reader's answer (a
number, a tensor or a function), compares it with the right one, and either returns a short
message saying the answer is right or raises ``WrongAnswer`` saying what is off. While the answer
is still the book's placeholder ``None``, the checker only repeats the question
(``not_answered``), so every chapter runs top to bottom before the reader has answered. The tests run
every checker on the worked solution shown in the book and on a wrong answer.
"""


class WrongAnswer(AssertionError):
    """The reader's answer does not pass the checker; the message says why."""


def passed(message: str = "") -> str:
    """The message a checker returns (and prints) for a right answer."""
    text = "Correct!" + (f" {message}" if message else "")
    print(text)
    return text


def expect(condition: bool, hint: str) -> None:
    """Raise ``WrongAnswer(hint)`` unless ``condition`` holds."""
    if not condition:
        raise WrongAnswer(hint)


def not_answered(question: str) -> str:
    """What a checker says while the answer is still the placeholder None: the question again."""
    text = f"Not answered yet: {question}"
    print(text)
    return text


def as_number(fn, *args) -> float:
    """``float(fn(*args))``, or ``WrongAnswer`` saying the function must return a number."""
    try:
        return float(fn(*args))
    except (TypeError, ValueError) as error:
        raise WrongAnswer(f"your function must return a number for arguments {args}, got: {error}") from None
