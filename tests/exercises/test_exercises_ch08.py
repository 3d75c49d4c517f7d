"""Chapter 8's exercise checkers accept the worked solutions and reject wrong answers."""

import math

import pytest
import triton
import triton.language as tl
from exercise_checks import checker_tests

from kda_edu.exercises import WrongAnswer, ch08


def bytes_counting_intermediates_once(K, V, C, in_bytes, mid_bytes):
    return in_bytes * (2 * K + V + 1) + 4 * K + mid_bytes * (3 * K + V + C) + 4 * K / C + in_bytes * V


@triton.jit
def scan_without_decay(w, u, qg, kd, aqk, gl, o, NT, C: tl.constexpr, D: tl.constexpr):
    rows = tl.arange(0, C)
    c = tl.arange(0, D)
    S = tl.zeros([D, D], dtype=tl.float32)
    for n in range(NT):
        r = (n * C + rows)[:, None]
        U = tl.load(u + r * D + c[None, :]) - tl.dot(
            tl.load(w + r * D + c[None, :]), S, input_precision="ieee"
        )
        o_n = tl.dot(tl.load(qg + r * D + c[None, :]), S, input_precision="ieee")
        o_n += tl.dot(tl.load(aqk + r * C + rows[None, :]), U, input_precision="ieee")
        tl.store(o + r * D + c[None, :], o_n)
        S += tl.dot(tl.trans(tl.load(kd + r * D + c[None, :])), U, input_precision="ieee")


def crossover_linear_in_T(T, t_a, t_b):
    for i in range(len(T) - 1):
        d0, d1 = t_a[i] - t_b[i], t_a[i + 1] - t_b[i + 1]
        if d0 > 0 >= d1:
            return T[i] + (T[i + 1] - T[i]) * d0 / (d0 - d1)
    return None


CASES = [
    (ch08.check_design_bytes, ch08.solution_design_bytes, bytes_counting_intermediates_once),
    (ch08.check_scan_kernel, ch08.solution_scan_kernel, scan_without_decay),
    (ch08.check_crossover, ch08.solution_crossover, crossover_linear_in_T),
]


test_solution_passes, test_wrong_answer_is_rejected = checker_tests(CASES)


def test_design_bytes_at_the_benchmark_shape():
    # 1282 B of inputs, 1160 B written and read back, 256 B of output: about 3.8 kB per token and head.
    assert math.isclose(ch08.solution_design_bytes(128, 128, 64, 2, 2), 1282 + 2 * 1160 + 256)


def test_design_bytes_rejects_counting_the_l2_reread():
    def with_reread(K, V, C, in_bytes, mid_bytes):
        return ch08.solution_design_bytes(K, V, C, in_bytes, mid_bytes) + in_bytes * K + 4 * K

    with pytest.raises(WrongAnswer, match="L2"):
        ch08.check_design_bytes(with_reread)


def test_crossover_never_and_named_errors():
    assert ch08.solution_crossover([1, 2, 4], [1, 2, 4], [0.5, 1, 2]) is None
    with pytest.raises(WrongAnswer, match="raised"):
        ch08.check_crossover(lambda T, a, b: T[10])
