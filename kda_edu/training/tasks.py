"""Synthetic memory tasks for chapter 12: multi-query associative recall (MQAR), Palindrome and Stack.

Each task is a small frozen dataclass with a `vocab_size` and a `sample(n, seed)` method that returns a
`TaskBatch` of `n` sequences: `inputs [n, T]` (what the model reads), `targets [n, T]` (what it should predict
at each position) and `mask [n, T]` (the positions that are scored). Only the positions whose answer follows
from earlier tokens are scored; everything else is context. The same `(n, seed)` always gives the same batch.

Token 0 is a blank (filler, or the separator of Palindrome) in every task. The tasks, and what each asks of a
memory:

- `MQAR`: `num_pairs` key-value pairs `k_1 v_1 ... k_P v_P`, then a query region in which each key appears
  once more, in a random order and at random places among blanks, followed by its value. At every query key
  the model must output the value that was paired with it. A pure *associative* memory test: the number of
  pairs to hold at once is P, the distance between write and read is up to T.
- `Palindrome`: L random symbols, a separator, then the same symbols in reverse order. At the separator and
  after it the model must output the next symbol of the reversal. Every symbol must be kept *with its
  position*: the last one written is read first, the first one written is read last, after T steps.
- `Stack`: `num_stacks` independent stacks; the sequence is pairs of tokens `PUSH_s x` (push x onto stack s)
  and `POP_s y` (y is the value popped). At every `POP_s` the model must output the top of stack s. The
  memory must be *overwritable*: a pop exposes the value below, so the answer for a key changes over time.
"""

from dataclasses import asdict, dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class TaskBatch:
    """A batch of task sequences.

    Attributes:
        inputs: token ids the model reads `[n, T]`, int64.
        targets: the token the model should output at each position `[n, T]`, int64 (0 where not scored).
        mask: which positions are scored `[n, T]`, bool.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor

    def to(self, device: str | torch.device) -> "TaskBatch":
        """The same batch on `device`. To a CUDA device the copy goes through pinned memory and does not make
        the CPU wait for the GPU's earlier work (a copy from ordinary memory would)."""
        if torch.device(device).type != "cuda" or self.inputs.is_cuda:
            return TaskBatch(self.inputs.to(device), self.targets.to(device), self.mask.to(device))
        return TaskBatch(
            *(t.pin_memory().to(device, non_blocking=True) for t in (self.inputs, self.targets, self.mask))
        )


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _generator(seed: int) -> torch.Generator:
    _check_int("seed", seed, 0)
    return torch.Generator().manual_seed(seed)


@dataclass(frozen=True)
class MQAR:
    """Multi-query associative recall.

    Tokens: 0 blank, keys `1 .. num_keys`, values `num_keys + 1 .. num_keys + num_values`.

        inputs   k_1 v_1 k_2 v_2 ... k_P v_P | 0 0 k_3 v_3 0 k_1 v_1 0 ...
        targets  (not scored)                |       v_3       v_1
        mask     False ...                   |       True      True

    The P keys of a sequence are distinct; values are drawn with replacement. The query region (the last
    `T - 2P` positions) holds every key once, in a random order, each at a random place and followed by its
    value (so the sequence reads like text where a key is always followed by its value).

    Attributes:
        seq_len: T.
        num_pairs: P, with `4 P <= T` (room for the pairs and one query per pair).
        num_keys: size of the key vocabulary, >= P.
        num_values: size of the value vocabulary.
    """

    seq_len: int
    num_pairs: int
    num_keys: int = 64
    num_values: int = 64

    def __post_init__(self):
        _check_int("MQAR.seq_len", self.seq_len, 4)
        _check_int("MQAR.num_pairs", self.num_pairs, 1)
        _check_int("MQAR.num_values", self.num_values, 1)
        _check_int("MQAR.num_keys", self.num_keys, self.num_pairs)
        if 4 * self.num_pairs > self.seq_len:
            raise ValueError(
                f"MQAR needs 4 * num_pairs <= seq_len (pairs, then one query and answer per pair), "
                f"got num_pairs = {self.num_pairs}, seq_len = {self.seq_len}"
            )

    @property
    def vocab_size(self) -> int:
        return 1 + self.num_keys + self.num_values

    def sample(self, n: int, seed: int) -> TaskBatch:
        """`n` sequences drawn with `torch.Generator().manual_seed(seed)`."""
        _check_int("n", n, 1)
        gen = _generator(seed)
        T, P = self.seq_len, self.num_pairs
        keys = torch.rand(n, self.num_keys, generator=gen).argsort(dim=1)[:, :P] + 1  # distinct per row
        values = torch.randint(0, self.num_values, (n, P), generator=gen) + 1 + self.num_keys
        inputs = torch.zeros(n, T, dtype=torch.long)
        inputs[:, 0 : 2 * P : 2], inputs[:, 1 : 2 * P : 2] = keys, values

        # Place P query slots of two tokens (key, value) in the R = T - 2P positions of the query region:
        # choose the P slot starts among R - P "free" positions, then shift the j-th chosen one by j, which
        # spreads them out without overlap.
        R = T - 2 * P
        starts = torch.rand(n, R - P, generator=gen).argsort(dim=1)[:, :P].sort(dim=1).values
        starts = 2 * P + starts + torch.arange(P)  # [n, P], increasing, gaps >= 2
        order = torch.rand(n, P, generator=gen).argsort(dim=1)  # which pair each query asks for
        q_keys, q_values = keys.gather(1, order), values.gather(1, order)
        inputs.scatter_(1, starts, q_keys)
        inputs.scatter_(1, starts + 1, q_values)
        targets = torch.zeros(n, T, dtype=torch.long).scatter_(1, starts, q_values)
        mask = torch.zeros(n, T, dtype=torch.bool).scatter_(1, starts, True)
        return TaskBatch(inputs, targets, mask)


@dataclass(frozen=True)
class Palindrome:
    """Repeat a random sequence in reverse order.

    Tokens: 0 separator, symbols `1 .. num_symbols`. With L = T / 2 and the full sequence
    `s = x_1 ... x_L 0 x_L ... x_1` (length T + 1), `inputs = s[:-1]` and `targets = s[1:]`; the scored
    positions are the separator and the L - 1 reversed symbols after it (the last L positions).

        inputs   x_1 x_2 x_3 0   x_3 x_2
        targets  .   .   .   x_3 x_2 x_1
        mask     F   F   F   T   T   T

    Attributes:
        seq_len: T, even.
        num_symbols: size of the symbol vocabulary.
    """

    seq_len: int
    num_symbols: int = 16

    def __post_init__(self):
        _check_int("Palindrome.seq_len", self.seq_len, 2)
        _check_int("Palindrome.num_symbols", self.num_symbols, 2)
        if self.seq_len % 2:
            raise ValueError(f"Palindrome.seq_len must be even, got {self.seq_len}")

    @property
    def vocab_size(self) -> int:
        return 1 + self.num_symbols

    def sample(self, n: int, seed: int) -> TaskBatch:
        """`n` sequences drawn with `torch.Generator().manual_seed(seed)`."""
        _check_int("n", n, 1)
        gen = _generator(seed)
        L = self.seq_len // 2
        x = torch.randint(1, self.num_symbols + 1, (n, L), generator=gen)
        full = torch.cat([x, torch.zeros(n, 1, dtype=torch.long), x.flip(1)], dim=1)  # [n, 2L + 1]
        mask = torch.zeros(n, 2 * L, dtype=torch.bool)
        mask[:, L:] = True
        targets = full[:, 1:].masked_fill(~mask, 0)
        return TaskBatch(full[:, :-1].contiguous(), targets, mask)


@dataclass(frozen=True)
class Stack:
    """Several independent stacks, driven by PUSH and POP operations.

    Tokens: 0 blank (unused in the sequences), values `1 .. num_values`, then `PUSH_s` for s = 0..S-1, then
    `POP_s`. The T / 2 operations are token pairs: `PUSH_s x` pushes x onto stack s; `POP_s y` pops stack s,
    where y (the popped value, shown to the model as the next input) is what the model must predict at the
    `POP_s` position.

        inputs   PUSH_0 5  PUSH_1 7  PUSH_0 2  POP_0 2  POP_0 5
        targets  .      .  .      .  .      .  2     .  5     .
        mask     F      F  F      F  F      F  T     F  T     F

    Each operation is a push with probability `push_prob` (onto a uniformly chosen stack), else a pop of a
    uniformly chosen non-empty stack; a pop when all stacks are empty becomes a push.

    Attributes:
        seq_len: T, even.
        num_stacks: S.
        num_values: size of the value vocabulary.
        push_prob: probability that an operation is a push, in (0, 1).
    """

    seq_len: int
    num_stacks: int = 4
    num_values: int = 16
    push_prob: float = 0.5

    def __post_init__(self):
        _check_int("Stack.seq_len", self.seq_len, 2)
        _check_int("Stack.num_stacks", self.num_stacks, 1)
        _check_int("Stack.num_values", self.num_values, 1)
        if self.seq_len % 2:
            raise ValueError(f"Stack.seq_len must be even, got {self.seq_len}")
        if not 0 < self.push_prob < 1:
            raise ValueError(f"Stack.push_prob must lie in (0, 1), got {self.push_prob}")

    @property
    def vocab_size(self) -> int:
        return 1 + self.num_values + 2 * self.num_stacks

    def push_token(self, s: int | np.ndarray) -> int | np.ndarray:
        """The token id of `PUSH_s` (elementwise for an array of stack indices)."""
        return 1 + self.num_values + s

    def pop_token(self, s: int | np.ndarray) -> int | np.ndarray:
        """The token id of `POP_s` (elementwise for an array of stack indices)."""
        return 1 + self.num_values + self.num_stacks + s

    def sample(self, n: int, seed: int) -> TaskBatch:
        """`n` sequences drawn with `torch.Generator().manual_seed(seed)`.

        The random numbers of each operation are drawn first, in the order the simulation uses them; the
        stacks are then simulated for the whole batch at once, one operation at a time, in NumPy (whose
        small-array operations cost a fraction of PyTorch's, which matters at T = 1024 on every step)."""
        _check_int("n", n, 1)
        gen = _generator(seed)
        S, n_ops = self.num_stacks, self.seq_len // 2
        draws = [
            (
                torch.rand(n, generator=gen),
                torch.randint(0, S, (n,), generator=gen),
                torch.randint(1, self.num_values + 1, (n,), generator=gen),
                torch.rand(n, S, generator=gen),
            )
            for _ in range(n_ops)
        ]
        coin, push_stack, value, scores = (torch.stack(d).numpy() for d in zip(*draws, strict=True))

        # Which stack each operation uses and whether it pushes depends only on the depths, not on the values.
        rows = np.arange(n)
        depth = np.zeros((n, S), dtype=np.int64)
        stack = np.zeros((n_ops, n), dtype=np.int64)
        push = np.zeros((n_ops, n), dtype=bool)
        level = np.zeros((n_ops, n), dtype=np.int64)  # depth of the element pushed or popped (1 = bottom)
        for t in range(n_ops):
            nonempty = depth > 0
            # A uniformly chosen non-empty stack: the argmax of random scores over the non-empty ones.
            pop_stack = np.where(nonempty, scores[t], -1.0).argmax(axis=1)
            push[t] = (coin[t] < self.push_prob) | ~nonempty.any(axis=1)
            stack[t] = np.where(push[t], push_stack[t], pop_stack)
            d = depth[rows, stack[t]]
            level[t] = np.where(push[t], d + 1, d)
            depth[rows, stack[t]] = np.where(push[t], d + 1, d - 1)

        # A pop returns the value of the last push onto the same stack at the same level. Sorted by (row,
        # stack, level, time), the operations of one (row, stack, level) alternate push, pop, push, pop, ...,
        # so each pop's push is the operation just before it.
        t_idx, r_idx = np.meshgrid(np.arange(n_ops), rows, indexing="ij")
        order = np.lexsort((t_idx.ravel(), level.ravel(), stack.ravel(), r_idx.ravel()))
        pushed = value.ravel()[order]
        popped = np.empty_like(pushed)
        popped[1:] = pushed[:-1]
        arg = np.empty_like(pushed)
        arg[order] = np.where(push.ravel()[order], pushed, popped)
        ops = np.where(push, self.push_token(stack), self.pop_token(stack)).T  # [n, n_ops]
        args, pops = arg.reshape(n_ops, n).T, ~push.T
        inputs = torch.from_numpy(np.stack([ops, args], axis=2).reshape(n, self.seq_len))
        mask = torch.from_numpy(np.stack([pops, np.zeros_like(pops)], axis=2).reshape(n, self.seq_len))
        targets = torch.zeros_like(inputs)
        targets[:, :-1] = inputs[:, 1:]
        return TaskBatch(inputs, targets.masked_fill(~mask, 0), mask)


TASKS = {"mqar": MQAR, "palindrome": Palindrome, "stack": Stack}


def make_task(name: str, **params) -> MQAR | Palindrome | Stack:
    """Build a task by name (`"mqar"`, `"palindrome"`, `"stack"`) from its dataclass fields."""
    if name not in TASKS:
        raise ValueError(f"task name must be one of {sorted(TASKS)}, got {name!r}")
    return TASKS[name](**params)


def task_to_dict(task: MQAR | Palindrome | Stack) -> dict:
    """`{"name": ..., **fields}` (JSON-ready); `make_task(**task_to_dict(task)) == task`."""
    name = {cls: key for key, cls in TASKS.items()}[type(task)]
    return {"name": name, **asdict(task)}
