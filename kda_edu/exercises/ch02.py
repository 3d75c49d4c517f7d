"""Exercises of chapter 2: linear attention, attention as an RNN.

Each `check_*` takes the reader's answer and compares it with an independent float64 computation (the sums of
the definition, a plain loop); `None` (the placeholder in the book) only prints what is asked. The worked
solutions are the `solution_*` functions, shown in the book's collapsed cells. `OperationLog` and
`run_refusing`, which enforce an exercise's constraints (no [T, T] tensor, no loop over tokens, no library
shortcut), serve chapter 3's checkers too.
"""

import torch
import torch.nn.functional as F

from kda_edu.exercises import OperationLog, WrongAnswer, expect, not_answered, passed, run_refusing
from kda_edu.ops.linear_attention import linear_attention_recurrent


def _numbers(state) -> int | None:
    """How many numbers a state holds: the elements of its tensors (nested in tuples, lists or dicts), or None
    when it holds anything else (a Python list of numbers, an object)."""
    if isinstance(state, torch.Tensor):
        return state.numel()
    if isinstance(state, dict):
        state = list(state.values())
    if isinstance(state, (tuple, list)):
        counts = [_numbers(part) for part in state]
        return None if None in counts else sum(counts)
    return None


# Exercise 1: linear attention with its denominator, as an RNN cell.


def solution_normalised_step(state, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """One token of `o_t = sum_s (q_t . k_s) v_s / sum_s (q_t . k_s)` (s <= t), with a state of fixed size.

    The numerator is chapter 2's regrouping, `S_t^T q_t` with `S_t = sum_s k_s v_s^T`; the denominator
    regroups the same way, `q_t . z_t` with `z_t = sum_s k_s`. The state is the pair `(S, z)`:
    `d_k d_v + d_k` numbers whatever t.
    """
    S, z = state if state is not None else (q.new_zeros(k.shape[0], v.shape[0]), q.new_zeros(k.shape[0]))
    S, z = S + torch.outer(k, v), z + k
    return S.T @ q / (z @ q), (S, z)


def check_normalised_step(step) -> str:
    """`step(state, q [d_k], k [d_k], v [d_v]) -> (o [d_v], state)`: normalised linear attention, one token.

    The state is None before the first token. Checked against the sums of the definition, with a state that
    must not grow with t (at most `(d_k + 1)(d_v + 1)` numbers) and two sequences run interleaved.
    """
    T, d_k, d_v = 24, 5, 3
    g = torch.Generator().manual_seed(21)
    # positive queries and keys (feature maps >= 0), so that no denominator comes near zero
    q, k = (0.1 + torch.rand(2, T, d_k, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, T, d_v, generator=g, dtype=torch.float64)
    scores = (q @ k.transpose(1, 2)).tril()  # [2, T, T]: q_t . k_s for s <= t
    right = scores @ v / scores.sum(-1, keepdim=True)
    states, outputs, sizes = [None, None], [[], []], []
    for t in range(T):
        for seq in (0, 1):  # two sequences, token by token, interleaved
            try:
                result = step(states[seq], q[seq, t], k[seq, t], v[seq, t])
            except (TypeError, ValueError, RuntimeError, IndexError) as error:
                raise WrongAnswer(f"your step raised {type(error).__name__}: {error}") from None
            if result is None:
                return not_answered("make step return the pair (o, state); the state is None at first.")
            expect(
                isinstance(result, tuple) and len(result) == 2, "your step must return a pair (o, new state)"
            )
            o, states[seq] = result
            expect(
                isinstance(o, torch.Tensor) and o.shape == (d_v,),
                f"o must be a [d_v] = [{d_v}] vector, got {getattr(o, 'shape', type(o).__name__)}",
            )
            outputs[seq].append(o)
        sizes.append(_numbers(states[0]))
    expect(
        None not in sizes,
        "keep the state in tensors (a tensor, or a tuple of tensors): the checker counts their numbers",
    )
    largest = (d_k + 1) * (d_v + 1)
    expect(
        sizes[-1] == sizes[3] and sizes[-1] <= largest,
        f"your state holds {sizes[3]} numbers after 4 tokens, {sizes[-1]} after {T}: keep it fixed, "
        f"<= {largest}",
    )
    error = (torch.stack([torch.stack(o) for o in outputs]) - right).abs().max().item()
    expect(
        error < 1e-10,
        f"your outputs differ from the definition by up to {error:.3g}. Hint: regroup the denominator too.",
    )
    return passed(f"A state of {sizes[-1]} numbers whatever t: S = sum k v^T and z = sum k.")


# Exercise 2: reading a blurred memory exactly.


def solution_dual_queries(k: torch.Tensor) -> torch.Tensor:
    """n queries `[n, d_k]` such that reading `S = K^T V` with query j returns `v_j`, for any values V.

    `S^T q_j = V^T (K q_j)` equals `v_j = V^T e_j` for every V only if `K q_j = e_j`: stacked, `K Q^T = I`.
    For n <= d_k linearly independent keys, `Q^T = K^+ = K^T (K K^T)^-1` solves it: the rows of Q are the
    dual basis of the keys. The crosstalk of chapter 2 was in the read, not lost in the write. With n > d_k
    keys, `K Q^T` has rank at most d_k < n and cannot be the n x n identity: no read undoes the crosstalk.
    """
    return torch.linalg.pinv(k).T


def check_dual_queries(dual) -> str:
    """`dual(k [n, d_k]) -> Q [n, d_k]`: queries that read every value back exactly from `S = sum_i k_i v_i^T`."""
    g = torch.Generator().manual_seed(22)
    for n, d_k in ((3, 8), (8, 8), (12, 16)):
        shared = F.normalize(torch.randn(d_k, generator=g, dtype=torch.float64), dim=0)
        noise = torch.randn(n, d_k, generator=g, dtype=torch.float64) / d_k**0.5
        k = F.normalize(0.8 * shared + 0.6 * noise, dim=-1)  # unit keys with overlaps of about 0.6
        try:
            Q = dual(k.clone())
        except (TypeError, ValueError, RuntimeError, IndexError) as error:
            raise WrongAnswer(f"your function raised {type(error).__name__}: {error}") from None
        if Q is None:
            return not_answered("return an [n, d_k] tensor of queries, one per stored key.")
        expect(
            isinstance(Q, torch.Tensor) and Q.shape == (n, d_k),
            f"expected {n} queries of dimension {d_k}, got {getattr(Q, 'shape', type(Q).__name__)}",
        )
        Q = Q.double()
        for _ in range(3):
            v = torch.randn(n, 5, generator=g, dtype=torch.float64)
            S = linear_attention_recurrent(
                k[None, :, None], k[None, :, None], v[None, :, None], output_final_state=True
            )[1][0, 0]
            error = ((Q @ S - v).norm() / v.norm()).item()
            expect(
                error < 1e-8,
                f"n = {n} keys in d_k = {d_k}: reading with your queries is off by {error:.3g} (relative). "
                "Hint: S^T q = V^T (K q).",
            )
    return passed("Q K^T = I: the dual basis of the keys undoes the crosstalk while n <= d_k.")


# Exercise 3: linear attention with a decay, chunk by chunk.


def solution_decayed_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: float, C: int):
    """`S_t = a S_{t-1} + k_t v_t^T`, `o_t = S_t^T q_t` (S_0 = 0), chunk by chunk: returns `(o [T, V], S_T)`.

    Unrolled, `o_t = sum_{s <= t} a^(t-s) (q_t . k_s) v_s`. In a chunk whose rows are i = 0..L-1, entering
    with state S: `o_i = a^(i+1) S^T q_i + sum_{j <= i} a^(i-j) (q_i . k_j) v_j`, and the state leaving it is
    `a^L S + sum_j a^(L-1-j) k_j v_j^T`. Only exponents of at most C appear, so nothing under- or overflows.
    """
    T, K = k.shape
    S, out = k.new_zeros(K, v.shape[1]), []
    for start in range(0, T, C):
        Qc, Kc, Vc = q[start : start + C], k[start : start + C], v[start : start + C]
        i = torch.arange(Kc.shape[0], dtype=k.dtype, device=k.device)
        L = len(i)
        decay = torch.where(i[:, None] >= i, a ** (i[:, None] - i).clamp(min=0), 0.0)  # [L, L]
        out.append((a ** (i + 1))[:, None] * (Qc @ S) + (decay * (Qc @ Kc.T)) @ Vc)
        S = a**L * S + (Kc * (a ** (L - 1 - i))[:, None]).T @ Vc
    return torch.cat(out), S


def _decayed_loop(q, k, v, a):
    S, o = k.new_zeros(k.shape[1], v.shape[1]), torch.empty_like(v)
    for t in range(k.shape[0]):
        S = a * S + torch.outer(k[t], v[t])
        o[t] = S.T @ q[t]
    return o, S


# The functions that would answer exercise 3 without building the chunks: refused while it is checked.
_LIBRARY = (
    (
        "kda_edu.ops.linear_attention",
        ("linear_attention_chunked", "linear_attention_parallel", "linear_attention_recurrent"),
    ),
    ("kda_edu.ops.recurrence", ("general_recurrence",)),
)


def _chunked_outputs(fn, q, k, v, a, C):
    out = run_refusing(fn, (q.clone(), k.clone(), v.clone(), a, C), _LIBRARY, "build the chunks yourself")
    if out is None:
        return None
    (T, K), V = k.shape, v.shape[1]
    expect(
        isinstance(out, tuple) and len(out) == 2 and all(isinstance(x, torch.Tensor) for x in out),
        "your function must return a pair (o [T, V], final state [K, V])",
    )
    expect(
        tuple(out[0].shape) == (T, V) and tuple(out[1].shape) == (K, V),
        f"expected o {(T, V)} and a state {(K, V)}, got {tuple(out[0].shape)} and {tuple(out[1].shape)}",
    )
    return out


def check_decayed_chunked(chunked) -> str:
    """`chunked(q, k, v, a, C) -> (o, S_T)`: `S_t = a S_{t-1} + k_t v_t^T`, `o_t = S_t^T q_t`, chunk by chunk.

    Compared with the float64 loop (long sequences and strong decay included); refused: this package's
    linear-attention functions, any tensor a quarter the size of a [T, T] matrix, and a loop over tokens.
    """
    g = torch.Generator().manual_seed(23)

    def inputs(T, K=6, V=5):
        return tuple(torch.randn(T, d, generator=g, dtype=torch.float64) for d in (K, K, V))

    # the last case: a^-T overflows float64, so rescaling q_t by a^t and k_s by a^-s over the whole sequence fails
    for T, a, C in (
        (1, 0.5, 4),
        (37, 0.9, 8),
        (64, 1.0, 16),
        (50, 0.7, 64),
        (333, 0.97, 32),
        (1200, 0.5, 32),
    ):
        q, k, v = inputs(T)
        out = _chunked_outputs(chunked, q, k, v, a, C)
        if out is None:
            return not_answered("return the pair (o, S_T), computed chunk by chunk.")
        o_ref, S_ref = _decayed_loop(q, k, v, a)
        o_err = ((out[0] - o_ref).norm() / o_ref.norm()).item()
        S_err = ((out[1] - S_ref).norm() / S_ref.norm()).item()
        expect(
            o_err < 1e-9 and S_err < 1e-9,
            f"T = {T}, a = {a}, C = {C}: outputs off by {o_err:.2g}, final state by {S_err:.2g} (relative). "
            "Unroll the loop.",
        )
    counts = {}
    for C in (16, 64):  # four chunks each
        with OperationLog() as ops:
            _chunked_outputs(chunked, *inputs(4 * C, 4, 4), 0.9, C)
        counts[C] = ops.count
    expect(
        counts[64] <= 1.5 * counts[16] + 8,
        f"right, but not chunked: 4 chunks of 64 ran {counts[64]} operations, 4 of 16 ran {counts[16]}",
    )
    T = 1024
    with OperationLog() as ops:
        _chunked_outputs(chunked, *inputs(T, 4, 4), 0.9, 16)
    expect(
        ops.largest < T * T // 4,
        f"right, but a tensor of {ops.largest} numbers at T = {T}: keep the work inside chunks of C x C",
    )
    return passed("Decay a^(i-j) inside a chunk, a^(i+1) on the state read, a^C between chunks.")
