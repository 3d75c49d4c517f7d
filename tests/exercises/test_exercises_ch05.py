"""Chapter 5's exercise checkers: each accepts the worked solution and rejects a typical wrong answer."""

import math

import pytest
import torch

from kda_edu.exercises import WrongAnswer, ch05


def test_dplr_vectors():
    assert "Correct" in ch05.check_dplr_vectors(ch05.solution_dplr_vectors)
    with pytest.raises(WrongAnswer, match="second vector"):
        ch05.check_dplr_vectors(lambda k, g, beta: (g.exp(), beta * k, k))  # forgot alpha on b
    with pytest.raises(WrongAnswer, match="diagonal"):
        ch05.check_dplr_vectors(lambda k, g, beta: (torch.ones_like(g), beta * k, g.exp() * k))
    with pytest.raises(WrongAnswer, match="shape"):
        ch05.check_dplr_vectors(lambda k, g, beta: (g.exp(), beta * k, (g.exp() * k)[:-1]))


def test_max_safe_steps():
    assert "Correct" in ch05.check_max_safe_steps(ch05.solution_max_safe_steps)
    with pytest.raises(WrongAnswer, match="finfo"):  # float32's range for every dtype
        ch05.check_max_safe_steps(lambda lb, dtype: math.floor(88.7 / -lb))
    with pytest.raises(WrongAnswer, match="overflows"):
        ch05.check_max_safe_steps(lambda lb, dtype: ch05.solution_max_safe_steps(lb, dtype) + 1)
    with pytest.raises(WrongAnswer, match="int"):
        ch05.check_max_safe_steps(lambda lb, dtype: math.log(torch.finfo(dtype).max) / -lb)


def test_half_life_bias():
    assert "Correct" in ch05.check_half_life_bias(ch05.solution_half_life_bias)
    with pytest.raises(WrongAnswer, match="exactly"):  # softplus(z) ~ exp(z): close for long half-lives only
        ch05.check_half_life_bias(lambda h: torch.log(math.log(2) / h))
    with pytest.raises(WrongAnswer, match="negative"):
        ch05.check_half_life_bias(lambda h: torch.full_like(h, -1e4))


def test_two_timescale_gates():
    assert "Correct" in ch05.check_two_timescale_gates(ch05.solution_two_timescale_gates())
    K = 2 * ch05.EXERCISE_TASK["half"]
    with pytest.raises(WrongAnswer, match="best scalar"):  # one decay for every channel
        ch05.check_two_timescale_gates(torch.full((K,), -0.2))
    with pytest.raises(WrongAnswer, match="best scalar"):  # fast and slow halves swapped
        ch05.check_two_timescale_gates(ch05.solution_two_timescale_gates().flip(0))
    with pytest.raises(WrongAnswer, match=r"\[-5, 0\]"):
        ch05.check_two_timescale_gates(torch.full((K,), -6.0))


def test_placeholder_is_not_answered():
    assert ch05.check_dplr_vectors(lambda k, g, beta: None).startswith("Not answered yet")
    assert ch05.check_max_safe_steps(lambda lower_bound, dtype: None).startswith("Not answered yet")
    assert ch05.check_half_life_bias(lambda half_lives: None).startswith("Not answered yet")
    assert ch05.check_two_timescale_gates(None).startswith("Not answered yet")
