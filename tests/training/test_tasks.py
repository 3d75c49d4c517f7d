"""The task generators: targets checked against plain-Python readings of each task, determinism, errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kda_edu.training.tasks import MQAR, Palindrome, Stack, make_task, task_to_dict


def _check_shapes(task, batch, n):
    for t in (batch.inputs, batch.targets, batch.mask):
        assert t.shape == (n, task.seq_len)
    assert batch.inputs.dtype == batch.targets.dtype == torch.long and batch.mask.dtype == torch.bool
    assert 0 <= int(batch.inputs.min()) and int(batch.inputs.max()) < task.vocab_size
    assert (batch.targets[~batch.mask] == 0).all()


@settings(max_examples=25, deadline=None)
@given(pairs=st.integers(1, 8), extra=st.integers(0, 12), seed=st.integers(0, 10**6))
def test_mqar_targets_are_the_paired_values(pairs, extra, seed):
    task = MQAR(seq_len=4 * pairs + extra, num_pairs=pairs, num_keys=pairs + 3, num_values=5)
    batch = task.sample(3, seed)
    _check_shapes(task, batch, 3)
    for row in range(3):
        x = batch.inputs[row].tolist()
        context = {x[2 * i]: x[2 * i + 1] for i in range(pairs)}
        assert len(context) == pairs and all(1 <= k <= task.num_keys for k in context)  # distinct keys
        assert all(v > task.num_keys for v in context.values())
        scored = batch.mask[row].nonzero().flatten().tolist()
        assert sorted(x[p] for p in scored) == sorted(context)  # every key asked once
        for p in scored:
            assert p >= 2 * pairs
            assert batch.targets[row, p] == context[x[p]] == x[p + 1]  # the value, also shown next
        query_region = set(range(2 * pairs, task.seq_len)) - set(scored) - {p + 1 for p in scored}
        assert all(x[p] == 0 for p in query_region)  # the rest is blank


@settings(max_examples=25, deadline=None)
@given(half=st.integers(1, 12), symbols=st.integers(2, 9), seed=st.integers(0, 10**6))
def test_palindrome_targets_are_the_reversal(half, symbols, seed):
    task = Palindrome(seq_len=2 * half, num_symbols=symbols)
    batch = task.sample(2, seed)
    _check_shapes(task, batch, 2)
    for row in range(2):
        x = batch.inputs[row, :half].tolist()
        assert all(1 <= s <= symbols for s in x) and batch.inputs[row, half] == 0
        reversed_x = x[::-1]
        assert batch.targets[row, half:].tolist() == reversed_x
        assert batch.inputs[row, half + 1 :].tolist() == reversed_x[:-1]  # teacher forcing
        assert batch.mask[row].tolist() == [False] * half + [True] * half


def _simulate_stacks(task: Stack, tokens: list[int]) -> tuple[list[int], list[int]]:
    """Replay PUSH/POP token pairs with Python lists: the positions of the pops and the values they return."""
    stacks = [[] for _ in range(task.num_stacks)]
    positions, answers = [], []
    for t in range(0, len(tokens), 2):
        op, arg = tokens[t], tokens[t + 1]
        assert 1 <= arg <= task.num_values
        if op in [task.push_token(s) for s in range(task.num_stacks)]:
            stacks[op - task.push_token(0)].append(arg)
        else:
            s = op - task.pop_token(0)
            assert 0 <= s < task.num_stacks and stacks[s], "a pop of an empty stack"
            positions.append(t)
            answers.append(stacks[s].pop())
            assert arg == answers[-1]
    return positions, answers


@settings(max_examples=25, deadline=None)
@given(
    ops=st.integers(1, 30),
    stacks=st.integers(1, 5),
    push_prob=st.floats(0.1, 0.9),
    seed=st.integers(0, 10**6),
)
def test_stack_targets_are_the_popped_values(ops, stacks, push_prob, seed):
    task = Stack(seq_len=2 * ops, num_stacks=stacks, num_values=6, push_prob=push_prob)
    batch = task.sample(3, seed)
    _check_shapes(task, batch, 3)
    for row in range(3):
        positions, answers = _simulate_stacks(task, batch.inputs[row].tolist())
        assert batch.mask[row].nonzero().flatten().tolist() == positions
        assert batch.targets[row, positions].tolist() == answers


def test_stack_pops_are_frequent():
    batch = Stack(seq_len=400, num_stacks=2, num_values=8).sample(8, seed=1)
    pops_per_operation = batch.mask.float().sum() / (8 * 200)
    assert 0.4 < pops_per_operation <= 0.5  # push_prob 0.5, fewer pops when every stack is empty


@pytest.mark.parametrize("task", [MQAR(32, 4), Palindrome(20), Stack(24)], ids=lambda t: type(t).__name__)
def test_sampling_is_seeded(task):
    a, b, c = task.sample(4, seed=7), task.sample(4, seed=7), task.sample(4, seed=8)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert torch.equal(a.mask, b.mask) and not torch.equal(a.inputs, c.inputs)
    assert make_task(**task_to_dict(task)) == task


def test_invalid_parameters_are_named():
    with pytest.raises(ValueError, match="4 \\* num_pairs <= seq_len"):
        MQAR(seq_len=30, num_pairs=8)
    with pytest.raises(ValueError, match="num_keys"):
        MQAR(seq_len=64, num_pairs=8, num_keys=4)
    with pytest.raises(ValueError, match="even"):
        Palindrome(seq_len=7)
    with pytest.raises(ValueError, match="push_prob"):
        Stack(seq_len=8, push_prob=1.0)
    with pytest.raises(ValueError, match="task name"):
        make_task("copy", seq_len=8)
    with pytest.raises(ValueError, match="seed"):
        Palindrome(8).sample(2, seed=-1)
