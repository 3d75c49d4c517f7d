"""Exercises of chapter 6 (the chunkwise algorithm): checkers and worked solutions.

Each `check_*` takes the reader's function, runs it on a few random inputs and compares it with the product
of transitions, a triangular solve or a sequential loop; each `solution_*` is the worked solution the book
shows.
"""

import math

import torch
import torch.nn.functional as F

from kda_edu.exercises import OperationLog, expect, passed, raised, run_refusing
from kda_edu.ops.chunkwise import parallel_scan, transition_product


def _tensor(fn, shape, *args) -> torch.Tensor:
    try:
        out = fn(*args)
    except (TypeError, ValueError, RuntimeError, IndexError) as error:
        raise raised(error) from None
    expect(
        isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(shape),
        f"your function must return a tensor of shape {tuple(shape)}, got "
        f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}",
    )
    return out


def _solver_used(ops: OperationLog) -> str | None:
    """The name of a linear-algebra routine (inverse, solve, factorisation) among the recorded operations."""
    banned = ("linalg_", "inverse", "triangular_solve", "cholesky", "lu_unpack", "_lu_with_info", "_solve")
    return next((n for n in ops.names if n.startswith(banned) or any(b in n for b in banned[1:])), None)


def _keys(n: int, K: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    k = F.normalize(torch.randn(n, K, generator=gen, dtype=torch.float64), dim=-1)
    return k, torch.rand(n, generator=gen, dtype=torch.float64)


# Exercise 1: the WY representation of a product of delta-rule transitions.


def solution_wy(k: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """W `[n, K]` with `(I - beta_n k_n k_n^T) ... (I - beta_1 k_1 k_1^T) = I - k^T W`.

    Multiplying the product so far, `I - sum_{j<i} k_j w_j^T`, by `I - beta_i k_i k_i^T` on the left adds
    one term `k_i w_i^T` with `w_i = beta_i (k_i - sum_{j<i} (k_i . k_j) w_j)`: each row needs only the rows
    before it (forward substitution).
    """
    W = torch.zeros_like(k)
    for i in range(k.shape[0]):
        W[i] = beta[i] * (k[i] - (k[:i] @ k[i]) @ W[:i])
    return W


def check_wy(wy) -> str:
    """`wy(k, beta)`: W `[n, K]` such that the product of the n transitions `I - beta_i k_i k_i^T` is `I - k^T W`."""
    gen = torch.Generator().manual_seed(61)
    for n, K in ((1, 4), (5, 8), (16, 32), (40, 24)):
        k, beta = _keys(n, K, gen)
        W = _tensor(wy, (n, K), k.clone(), beta.clone())
        product = transition_product(k, torch.zeros_like(k), beta)
        got = torch.eye(K, dtype=k.dtype) - k.T @ W
        error = (got - product).abs().max().item()
        if n > 1 and error > 1e-9:
            naive = torch.eye(K, dtype=k.dtype) - k.T @ (beta[:, None] * k)
            expect(
                not torch.allclose(got, naive, atol=1e-9),
                "W = Diag(beta) k holds for n = 1 only. Hint: multiply by I - beta_2 k_2 k_2^T, collect "
                "k_2 (...)^T.",
            )
        expect(
            error < 1e-9,
            f"for n = {n}, K = {K}, I - k^T W is off by {error:.3g}. Hint: apply the transitions in order, "
            "step 1 first.",
        )
    return passed("The product of n transitions is the identity minus a rank-n matrix, k^T W.")


# Exercise 2: the inverse of a unit lower-triangular matrix in log2(C) matrix products.


def solution_unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """`(I + A)^-1` for strictly lower-triangular A `[C, C]`, by repeated squaring.

    A is nilpotent (`A^C = 0`), so `(I + A)^-1 = I - A + A^2 - ... = (I - A)(I + A^2)(I + A^4)...`, a
    product of ceil(log2 C) factors, each needing one squaring: every power beyond C - 1 vanishes.
    """
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    power = -A
    inverse = eye + power
    for _ in range(max(A.shape[-1] - 1, 1).bit_length() - 1):
        power = power @ power
        inverse = inverse + inverse @ power
    return inverse


def check_unit_lower_inverse(inverse) -> str:
    """`inverse(A)`: `(I + A)^-1` for a strictly lower-triangular `[C, C]` matrix A."""
    gen = torch.Generator().manual_seed(62)
    for C in (2, 3, 16, 33, 64):
        k, beta = _keys(C, 16, gen)
        A = (beta[:, None] * (k @ k.T)).tril(-1)
        with OperationLog() as ops:
            got = _tensor(inverse, (C, C), A.clone())
        eye = torch.eye(C, dtype=A.dtype)
        expected = torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True)
        error = (got - expected).abs().max().item()
        expect(
            error < 1e-9,
            f"C = {C}: inverse off by {error:.3g}. "
            "Hint: A^C = 0, so (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...",
        )
        solver = _solver_used(ops)
        expect(solver is None, f"right inverse, but through {solver}: build it from matrix products only.")
        rounds = math.ceil(math.log2(C))
        expect(
            len(ops.products) <= 2 * rounds + 2 and len(ops.names) <= 10 * rounds + 20,
            f"right inverse, but C = {C} took {len(ops.products)} matrix products and {len(ops.names)} "
            f"operations; {rounds} rounds of 2 suffice.",
        )
    return passed("log2(C) squarings invert a C x C unit lower-triangular matrix: no row-by-row loop.")


# Exercise 3: a scan that is cheap, for a diagonal transition.


def solution_compose_diagonal(later, earlier):
    """Compose `S -> Diag(a1) S + X1`, then `S -> Diag(a2) S + X2`: `(a2 * a1, a2 * X1 + X2)`.

    Diagonal transitions stay diagonal under composition, so a composition costs O(K V), like one step.
    """
    (a2, X2), (a1, X1) = later, earlier
    return a2 * a1, a2[..., None] * X1 + X2


def check_compose_diagonal(compose) -> str:
    """`compose(later, earlier)`: the composition of two maps `S -> Diag(a) S + X`, each `(a [n, K], X [n, K, V])`."""
    gen = torch.Generator().manual_seed(63)
    for T in (1, 2, 7, 37):
        a = torch.rand(T, 6, generator=gen, dtype=torch.float64)
        X = torch.randn(T, 6, 5, generator=gen, dtype=torch.float64)
        S, expected = torch.zeros(6, 5, dtype=torch.float64), []
        for t in range(T):
            S = a[t, :, None] * S + X[t]
            expected.append(S)
        try:
            _, states = parallel_scan((a, X), compose)
        except (TypeError, ValueError, RuntimeError, IndexError) as error:
            raise raised(error, "parallel_scan with your compose") from None
        error = (states - torch.stack(expected)).abs().max().item()
        expect(
            error < 1e-10,
            f"T = {T}: scan off by {error:.3g}. Hint: expand Diag(a2) (Diag(a1) S + X1) + X2 and read off a "
            "and X.",
        )
    return passed("With diagonal transitions a scan costs O(T K V), the same as the loop.")


# Exercise 4: the inverse built from small diagonal blocks, as the Triton kernel builds it.


def solution_block_inverse(A: torch.Tensor, block: int) -> torch.Tensor:
    """`(I + A)^-1` for strictly lower-triangular A `[C, C]`, one block row of `block` rows at a time.

    Block row a of `(I + A) X = I` reads `(I + A_aa) X_a + A_a,<a X_<a = E_a` (E_a: rows of the identity), so
    `X_a = (I + A_aa)^-1 (E_a - A_a,<a X_<a)`: only the small diagonal blocks are ever inverted.
    """
    C = A.shape[-1]
    eye = torch.eye(C, dtype=A.dtype, device=A.device)
    X = torch.zeros_like(A)
    for start in range(0, C, block):
        rows = slice(start, min(start + block, C))
        inner = solution_unit_lower_inverse(A[rows, rows])
        X[rows] = inner @ (eye[rows] - A[rows, :start] @ X[:start])
    return X


def check_block_inverse(inverse) -> str:
    """`inverse(A, block)`: `(I + A)^-1` for strictly lower-triangular A `[C, C]`, from `block x block` pieces."""
    gen = torch.Generator().manual_seed(64)
    for C, block in ((16, 16), (64, 16), (48, 16), (64, 8), (40, 16)):
        k, beta = _keys(C, 16, gen)
        A = (beta[:, None] * (k @ k.T)).tril(-1)
        with OperationLog() as ops:
            got = _tensor(inverse, (C, C), A.clone(), block)
        eye = torch.eye(C, dtype=A.dtype)
        expected = torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True)
        error = (got - expected).abs().max().item()
        expect(
            error < 1e-9,
            f"C = {C}, block {block}: off by {error:.3g}. Hint: use the rows above, "
            "X_a = (I + A_aa)^-1 (E_a - A_a,<a X_<a).",
        )
        solver = _solver_used(ops)
        expect(
            solver is None, f"right inverse, but through {solver}: invert the diagonal blocks by products."
        )
        tall = [shape for shape in ops.products if shape and shape[0] > block]
        expect(
            not tall,
            f"right inverse, but a product made {tall[0][0] if tall else 0} rows at once; go one block row "
            f"of {block} rows at a time.",
        )
    return passed(
        "Only the diagonal blocks are inverted; the rest is matrix products, block row by block row."
    )


# Exercise 5 (capstone): the chunked forward of the delta rule, from the WY equations.


def solution_chunked_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, C: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule `S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T`, `o_t = S_t^T q_t`, from `S_0 = 0`,
    computed chunk by chunk: q, k `[T, K]`, v `[T, V]`, beta `[T]`; returns `(o [T, V], S_T [K, V])`.

    Per chunk (no decay, so every exponential of the chapter's equations is 1):
        A = StrictTril(Diag(beta) K K^T),  u = (I + A)^-1 Diag(beta) V,  w = (I + A)^-1 Diag(beta) K,
        U = u - w S,  O = Q S + Tril(Q K^T) U,  S <- S + K^T U.
    """
    T, K = k.shape
    S = k.new_zeros(K, v.shape[1])
    o = torch.empty_like(v)
    for start in range(0, T, C):
        Q, Kc, Vc, b = (
            q[start : start + C],
            k[start : start + C],
            v[start : start + C],
            beta[start : start + C],
        )
        eye = torch.eye(Kc.shape[0], dtype=k.dtype, device=k.device)
        unit_lower = eye + (b[:, None] * (Kc @ Kc.T)).tril(-1)
        u = torch.linalg.solve_triangular(unit_lower, b[:, None] * Vc, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(unit_lower, b[:, None] * Kc, upper=False, unitriangular=True)
        U = u - w @ S
        o[start : start + C] = Q @ S + (Q @ Kc.T).tril() @ U
        S = S + Kc.T @ U
    return o, S


def _delta_rule_loop(q, k, v, beta):
    """The checker's reference, the package's loop (`delta_rule_recurrent`) for one head, unscaled, called
    outside the refusal: `(o [T, V], S_T [K, V])`."""
    from kda_edu.ops.delta_rule import delta_rule_recurrent

    o, S = delta_rule_recurrent(
        *(x[None, :, None] for x in (q, k, v, beta)), scale=1.0, output_final_state=True
    )
    return o[0, :, 0], S[0, 0]


# The package's own delta-rule and chunked forms: the capstone is to be built from tensor operations, not by
# calling the implementation the chapter shows. Refused while it is checked.
_LIBRARY = (
    ("kda_edu.ops.delta_rule", ("delta_rule_recurrent", "delta_rule_chunked")),
    ("kda_edu.ops.kda", ("kda_recurrent", "kda_chunked")),
    ("kda_edu.ops.gated_delta", ("gated_delta_recurrent", "gated_delta_chunked")),
    ("kda_edu.ops.chunkwise", ("kda_chunked_matmul", "kda_scan", "ut_transform", "forward_substitution")),
    ("kda_edu.ops._chunks", ("state_passing",)),
    ("kda_edu.ops.recurrence", ("general_recurrence",)),
    ("kda_edu.chapters.ch06_chunkwise", ("chunked_kda",)),  # with g = 0 it is the answer
)


def _run_chunked(fn, q, k, v, beta, C):
    T, V = v.shape
    args = (q.clone(), k.clone(), v.clone(), beta.clone(), C)
    out = run_refusing(fn, args, _LIBRARY, "use tensor operations")
    expect(
        isinstance(out, tuple) and len(out) == 2 and all(isinstance(x, torch.Tensor) for x in out),
        "your function must return a pair (o [T, V], final state [K, V])",
    )
    o, S = out
    expect(
        tuple(o.shape) == (T, V) and tuple(S.shape) == (k.shape[1], V),
        f"expected o {(T, V)} and a final state {(k.shape[1], V)}, got {tuple(o.shape)} and {tuple(S.shape)}",
    )
    return o, S


def check_chunked_delta_rule(chunked) -> str:
    """`chunked(q, k, v, beta, C)`: the delta rule's outputs and final state, computed chunk by chunk."""
    gen = torch.Generator().manual_seed(65)
    for T, K, V, C in ((1, 4, 3, 4), (16, 8, 8, 16), (37, 8, 5, 16), (64, 16, 12, 8), (50, 6, 6, 64)):
        q = torch.randn(T, K, generator=gen, dtype=torch.float64)
        k, beta = _keys(T, K, gen)
        v = torch.randn(T, V, generator=gen, dtype=torch.float64)
        o, S = _run_chunked(chunked, q, k, v, beta, C)
        o_ref, S_ref = _delta_rule_loop(q, k, v, beta)
        o_err, S_err = (o - o_ref).abs().max().item(), (S - S_ref).abs().max().item()
        expect(
            o_err < 1e-9,
            f"T = {T}, C = {C}: o off by {o_err:.3g}. Hint: A has j < i, Tril(Q K^T) j <= i; U uses the "
            "entering S.",
        )
        expect(
            S_err < 1e-9,
            f"T = {T}, C = {C}: o right, final state off by {S_err:.3g}: S += K^T U after every chunk, the "
            "last too.",
        )
    # A chunked form runs a fixed amount of work per chunk, whatever C is: four chunks of 64 must not dispatch
    # many more operations than four chunks of 16 (a loop over tokens or rows would dispatch four times as many).
    counts = {}
    for C in (16, 64):
        T, K, V = 4 * C, 8, 8
        q = torch.randn(T, K, generator=gen, dtype=torch.float64)
        k, beta = _keys(T, K, gen)
        v = torch.randn(T, V, generator=gen, dtype=torch.float64)
        with OperationLog() as ops:
            _run_chunked(chunked, q, k, v, beta, C)
        counts[C] = len(ops.names)
    expect(
        counts[64] <= 1.5 * counts[16] + 8,
        f"right answers, but not chunked: 4 chunks of 64 ran {counts[64]} operations, 4 of 16 ran "
        f"{counts[16]}.",
    )
    return passed("The chunked delta rule matches the loop, with a fixed number of operations per chunk.")
