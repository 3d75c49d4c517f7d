"""Exercises of chapter 12 (training on recall tasks): checkers and worked solutions.

Each `check_*` runs the reader's function on a few inputs and compares it with what the library does
(`masked_loss_and_accuracy`, `lr_at`, `Stack.sample`, `summarize`); each `solution_*` is the worked solution
the book shows.
"""

import math
import statistics

import torch

from kda_edu.exercises import WrongAnswer, expect, passed
from kda_edu.training.sweep import summarize
from kda_edu.training.tasks import MQAR, Stack, TaskBatch
from kda_edu.training.train import TrainConfig, lr_at, masked_loss_and_accuracy


def _call(fn, *args):
    try:
        return fn(*args)
    except (TypeError, ValueError, RuntimeError, IndexError, KeyError, ZeroDivisionError) as error:
        raise WrongAnswer(f"your function raised {type(error).__name__}: {error}") from None


# Exercise 1: token accuracy on the scored positions only.


def solution_masked_accuracy(logits: torch.Tensor, batch: TaskBatch) -> float:
    """The fraction of scored positions where the most likely token is the target."""
    predicted = logits.argmax(dim=-1)
    return (predicted[batch.mask] == batch.targets[batch.mask]).float().mean().item()


def check_masked_accuracy(fn) -> str:
    """`fn(logits [n, T, vocab], batch) -> float` must score only the positions in `batch.mask`."""
    task = MQAR(seq_len=32, num_pairs=4, num_keys=8, num_values=8)
    for seed in range(3):
        batch = task.sample(6, seed)
        gen = torch.Generator().manual_seed(seed)
        logits = torch.randn(6, 32, task.vocab_size, generator=gen)
        # Make the answer right at about half of the scored positions, and at every unscored one.
        right = torch.nn.functional.one_hot(batch.targets, task.vocab_size) * 10.0
        coin = torch.rand(6, 32, generator=gen) < 0.5
        logits = logits + right * (coin | ~batch.mask)[..., None]
        expected = masked_loss_and_accuracy(logits, batch)[1].item()
        got = _call(fn, logits, batch)
        expect(isinstance(got, (float, int)) or torch.is_tensor(got), "return a number (a float)")
        expect(
            math.isclose(float(got), expected, abs_tol=1e-6),
            f"seed {seed}: expected accuracy {expected:.4f}, got {float(got):.4f}. Count only the positions "
            "where batch.mask is True: the unscored ones are context, not answers.",
        )
    return passed("Only the scored positions count.")


# Exercise 2: the learning-rate schedule.


def solution_schedule(step: int, lr: float, warmup: int, steps: int, min_lr_ratio: float) -> float:
    """Linear warm-up to lr over `warmup` steps, then a cosine from lr to `min_lr_ratio * lr` at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min((step - warmup) / max(steps - 1 - warmup, 1), 1.0)
    floor = min_lr_ratio * lr
    return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def check_schedule(fn) -> str:
    """`fn(step, lr, warmup, steps, min_lr_ratio)` must equal `kda_edu.training.train.lr_at` at every step."""
    for steps, lr, warmup, ratio in ((100, 1e-3, 10, 0.1), (37, 3e-3, 5, 0.0), (20, 1.0, 1, 0.5)):
        config = TrainConfig(steps=steps, lr=lr, warmup=warmup, min_lr_ratio=ratio)
        for step in range(steps):
            got, expected = _call(fn, step, lr, warmup, steps, ratio), lr_at(step, config)
            expect(
                math.isclose(float(got), expected, rel_tol=1e-9, abs_tol=1e-12),
                f"steps={steps}, warmup={warmup}, min_lr_ratio={ratio}: at step {step} expected {expected:.6g}, "
                f"got {float(got):.6g}. Warm-up reaches lr at step warmup - 1; the cosine reaches the floor at "
                "step steps - 1.",
            )
    return passed("Warm-up, then a half cosine down to the floor.")


# Exercise 3: the answers of the Stack task, by simulation.


def solution_stack_answers(tokens: list[int], num_values: int, num_stacks: int) -> list[int]:
    """The values returned by the pops of one Stack sequence, in order (the token after each pop is hidden)."""
    stacks = [[] for _ in range(num_stacks)]
    answers = []
    for t in range(0, len(tokens), 2):
        op = tokens[t] - 1 - num_values  # 0..S-1 push, S..2S-1 pop
        if op < num_stacks:
            stacks[op].append(tokens[t + 1])
        else:
            answers.append(stacks[op - num_stacks].pop())
    return answers


def check_stack_answers(fn) -> str:
    """`fn(tokens, num_values, num_stacks) -> list[int]` must return the targets of every pop. The token after
    each pop (the popped value, which the model sees only after answering) is replaced by 0."""
    for S, nv, seed in ((1, 5, 0), (3, 7, 1), (5, 4, 2)):
        task = Stack(seq_len=60, num_stacks=S, num_values=nv)
        batch = task.sample(4, seed)
        for row in range(4):
            expected = batch.targets[row][batch.mask[row]].tolist()
            hidden = batch.inputs[row].clone()
            hidden[1:][batch.mask[row][:-1]] = 0  # the answers, shown after each pop, are hidden
            got = _call(fn, hidden.tolist(), nv, S)
            expect(
                list(got) == expected,
                f"{S} stacks, {nv} values: expected {expected}, got {list(got)}. Tokens come in pairs "
                f"(operation, value); PUSH_s is 1 + num_values + s and POP_s is 1 + num_values + num_stacks + s.",
            )
    return passed("Last in, first out, one list per stack.")


# Exercise 4: the best learning rate per model, as the report chooses it.


def solution_best_rate(runs: list[dict]) -> dict[str, float]:
    """For each mixer, the learning rate with the highest mean final accuracy over the seeds."""
    by_mixer: dict[str, dict[float, list[float]]] = {}
    for r in runs:
        by_mixer.setdefault(r["mixer"], {}).setdefault(r["lr"], []).append(r["final_acc"])
    return {m: max(by_lr, key=lambda lr: statistics.fmean(by_lr[lr])) for m, by_lr in by_mixer.items()}


def check_best_rate(fn) -> str:
    """`fn(runs) -> {mixer: lr}` for the runs of one task and length must agree with `summarize`."""
    gen = torch.Generator().manual_seed(12)
    runs = [
        {
            "task": "mqar",
            "seq_len": 8,
            "mixer": m,
            "lr": lr,
            "seed": s,
            "final_acc": torch.rand(1, generator=gen).item(),
        }
        for m in ("kda", "deltanet", "attention")
        for lr in (1e-3, 3e-3, 1e-2)
        for s in range(3)
    ]
    # A trap: the single best run of "kda" is at another rate than its best mean.
    runs.append({"task": "mqar", "seq_len": 8, "mixer": "kda", "lr": 0.03, "seed": 0, "final_acc": 1.0})
    runs.append({"task": "mqar", "seq_len": 8, "mixer": "kda", "lr": 0.03, "seed": 1, "final_acc": 0.0})
    runs.append({"task": "mqar", "seq_len": 8, "mixer": "kda", "lr": 0.03, "seed": 2, "final_acc": 0.0})
    expected = {row["mixer"]: row["best_lr"] for row in summarize(runs)}
    got = _call(fn, runs)
    expect(isinstance(got, dict), f"return a dict {{mixer: lr}}, got {type(got).__name__}")
    expect(
        got == expected,
        f"expected {expected}, got {got}. Average over the seeds first, then pick the rate with the best "
        "mean: one lucky seed does not make a rate the best.",
    )
    return passed("The best mean over seeds, per model.")


SOLUTIONS = {
    check_masked_accuracy: solution_masked_accuracy,
    check_schedule: solution_schedule,
    check_stack_answers: solution_stack_answers,
    check_best_rate: solution_best_rate,
}
