"""Chapter 6's exercise checkers accept the worked solutions and reject wrong answers."""

import pytest
import torch
from exercise_checks import checker_tests

from kda_edu.exercises import WrongAnswer, ch06

CASES = [
    # (checker, worked solution, a wrong answer)
    (ch06.check_wy, ch06.solution_wy, lambda k, beta: beta[:, None] * k),
    (
        ch06.check_unit_lower_inverse,
        ch06.solution_unit_lower_inverse,
        lambda A: torch.eye(A.shape[0], dtype=A.dtype) - A,
    ),
    (
        ch06.check_compose_diagonal,
        ch06.solution_compose_diagonal,
        lambda later, earlier: (later[0] * earlier[0], later[1] + earlier[1]),
    ),
    (
        ch06.check_block_inverse,
        ch06.solution_block_inverse,
        lambda A, block: torch.block_diag(
            *(
                ch06.solution_unit_lower_inverse(A[i : i + block, i : i + block])
                for i in range(0, A.shape[0], block)
            )
        ),
    ),
    (
        ch06.check_chunked_delta_rule,
        ch06.solution_chunked_delta_rule,
        lambda q, k, v, beta, C: _without_intra_chunk_terms(q, k, v, beta, C),
    ),
]


def _without_intra_chunk_terms(q, k, v, beta, C):
    # wrong: each chunk's values are corrected by the entering state only, as if A were zero
    S, o = k.new_zeros(k.shape[1], v.shape[1]), torch.empty_like(v)
    for start in range(0, k.shape[0], C):
        rows = slice(start, start + C)
        U = beta[rows, None] * (v[rows] - k[rows] @ S)
        o[rows] = q[rows] @ S + (q[rows] @ k[rows].T).tril() @ U
        S = S + k[rows].T @ U
    return o, S


test_solution_passes, test_wrong_answer_is_rejected = checker_tests(CASES)


def test_bad_return_values_are_named():
    with pytest.raises(WrongAnswer, match="shape"):
        ch06.check_wy(lambda k, beta: k.T)
    with pytest.raises(WrongAnswer, match="raised"):
        ch06.check_unit_lower_inverse(lambda A: A @ torch.ones(3))


def _eye_plus(A):
    return torch.eye(A.shape[0], dtype=A.dtype) + A


def _row_by_row(A):
    # forward substitution: right, but one product per row
    X = torch.eye(A.shape[0], dtype=A.dtype)
    for i in range(A.shape[0]):
        X[i] = X[i] - A[i, :i] @ X[:i]
    return X


@pytest.mark.parametrize(
    "shortcut, message",
    [
        (lambda A: torch.linalg.inv(_eye_plus(A)), "through linalg_inv"),
        (
            lambda A: torch.linalg.solve_triangular(
                _eye_plus(A), torch.eye(A.shape[0], dtype=A.dtype), upper=False
            ),
            "through linalg_solve_triangular",
        ),
        (_row_by_row, "matrix products"),
    ],
    ids=["inv", "solve_triangular", "row_by_row"],
)
def test_squaring_exercise_rejects_the_shortcuts(shortcut, message):
    with pytest.raises(WrongAnswer, match=message):
        ch06.check_unit_lower_inverse(shortcut)


@pytest.mark.parametrize(
    "shortcut, message",
    [
        (lambda A, block: torch.linalg.inv(_eye_plus(A)), "through linalg_inv"),
        (
            lambda A, block: ch06.solution_unit_lower_inverse(A),
            "rows at once",
        ),  # the whole matrix by squaring
    ],
    ids=["inv", "whole_matrix"],
)
def test_block_exercise_rejects_the_shortcuts(shortcut, message):
    with pytest.raises(WrongAnswer, match=message):
        ch06.check_block_inverse(shortcut)


def _token_loop(q, k, v, beta, C):
    # right, but one step per token: C plays no part
    S, rows = q.new_zeros(k.shape[1], v.shape[1]), []
    for t in range(q.shape[0]):
        S = S + beta[t] * torch.outer(k[t], v[t] - S.T @ k[t])
        rows.append(S.T @ q[t])
    return torch.stack(rows), S


def _calls_the_library(q, k, v, beta, C):
    from kda_edu.ops.delta_rule import delta_rule_chunked

    o, S = delta_rule_chunked(
        q[None, :, None],
        k[None, :, None],
        v[None, :, None],
        beta[None, :, None],
        scale=1.0,
        chunk_size=C,
        output_final_state=True,
    )
    return o[0, :, 0], S[0, 0]


def _calls_the_chapter_listing(q, k, v, beta, C):
    from kda_edu.chapters.ch06_chunkwise import chunked_kda

    K = k.shape[-1]
    return chunked_kda(q * K**0.5, k, v, torch.zeros_like(k), beta, C)  # KDA with no decay, unscaled


@pytest.mark.parametrize(
    "shortcut, message",
    [
        (_token_loop, "not chunked"),
        (_calls_the_library, "delta_rule_chunked"),
        (_calls_the_chapter_listing, "chunked_kda"),
    ],
    ids=["token_loop", "library", "chapter_listing"],
)
def test_capstone_rejects_the_shortcuts(shortcut, message):
    with pytest.raises(WrongAnswer, match=message):
        ch06.check_chunked_delta_rule(shortcut)


def test_capstone_leaves_the_library_intact():
    from kda_edu.ops import delta_rule

    original = delta_rule.delta_rule_chunked
    with pytest.raises(WrongAnswer):
        ch06.check_chunked_delta_rule(_calls_the_library)
    assert delta_rule.delta_rule_chunked is original
