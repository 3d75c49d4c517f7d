"""Checkers for the exercises at the end of each chapter.

One module per chapter (``ch02.py`` for chapter 2, ...). A checker takes the reader's answer (a
number, a tensor or a function), compares it with the right one, and either returns a short
message saying the answer is right or raises ``WrongAnswer`` saying what is off. The tests run
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
