"""Chapter 12's exercise checkers accept the worked solutions and reject wrong answers."""

import math

import pytest

from kda_edu.exercises import WrongAnswer, ch12


def _unmasked_accuracy(logits, batch):
    return (logits.argmax(dim=-1) == batch.targets).float().mean().item()


def _cosine_without_warmup(step, lr, warmup, steps, min_lr_ratio):
    return min_lr_ratio * lr + (1 - min_lr_ratio) * lr * 0.5 * (1 + math.cos(math.pi * step / steps))


def _queue_answers(tokens, num_values, num_stacks):  # first in, first out: the wrong memory
    queues = [[] for _ in range(num_stacks)]
    answers = []
    for t in range(0, len(tokens), 2):
        op = tokens[t] - 1 - num_values
        if op < num_stacks:
            queues[op].append(tokens[t + 1])
        else:
            answers.append(queues[op - num_stacks].pop(0))
    return answers


def _best_single_run(runs):
    best = {}
    for r in runs:
        if r["mixer"] not in best or r["final_acc"] > best[r["mixer"]][1]:
            best[r["mixer"]] = (r["lr"], r["final_acc"])
    return {m: lr for m, (lr, _) in best.items()}


CASES = [
    (ch12.check_masked_accuracy, _unmasked_accuracy),
    (ch12.check_schedule, _cosine_without_warmup),
    (ch12.check_stack_answers, _queue_answers),
    (ch12.check_best_rate, _best_single_run),
]


def test_every_checker_has_a_solution():
    assert set(ch12.SOLUTIONS) == {check for check, _ in CASES}


@pytest.mark.parametrize("check, wrong", CASES, ids=lambda x: getattr(x, "__name__", "wrong"))
def test_solution_passes(check, wrong):
    assert check(ch12.SOLUTIONS[check]).startswith("Correct!")


@pytest.mark.parametrize("check, wrong", CASES, ids=lambda x: getattr(x, "__name__", "wrong"))
def test_wrong_answer_is_rejected(check, wrong):
    with pytest.raises(WrongAnswer):
        check(wrong)


def test_reading_the_answer_after_a_pop_is_rejected():
    def peek(tokens, num_values, num_stacks):
        return [tokens[t + 1] for t in range(0, len(tokens), 2) if tokens[t] > num_values + num_stacks]

    with pytest.raises(WrongAnswer):
        ch12.check_stack_answers(peek)
