"""Chapter 9's exercise checkers accept the worked solutions and reject wrong answers."""

import pytest
import torch
from exercise_checks import checker_tests

from kda_edu.exercises import WrongAnswer, ch09

CASES = [
    # (checker, worked solution, a wrong answer)
    (ch09.check_dg_from_dgc, ch09.solution_dg_from_dgc, lambda dgc, C: dgc.flip(1).cumsum(1).flip(1)),
    (ch09.check_dg_from_dgc, ch09.solution_dg_from_dgc, lambda dgc, C: dgc.cumsum(1)),
    (
        ch09.check_solve_backward,
        ch09.solution_solve_backward,
        lambda A, u, du: (-(du @ u.T).tril(-1), du),
    ),
]


test_solution_passes, test_wrong_answer_is_rejected = checker_tests(CASES)


def test_bad_return_values_are_named():
    with pytest.raises(WrongAnswer, match="shape"):
        ch09.check_dg_from_dgc(lambda dgc, C: dgc[:, :1])
    with pytest.raises(WrongAnswer, match="pair"):
        ch09.check_solve_backward(lambda A, u, du: torch.zeros(1))


def _forgets_w(qg, kd, gl, w, Aqk, dO, dht):  # drops -w^T dU: the state's path through U = u - w S0
    out = [dht]
    for n in reversed(range(qg.shape[0])):
        out.insert(0, qg[n].T @ dO[n] + gl[n][:, None] * out[0])
    return torch.stack(out)


def _forward_order(qg, kd, gl, w, Aqk, dO, dht):  # the right step, but the chunks taken first to last
    out, dS = [], dht
    for n in range(qg.shape[0]):
        dU = Aqk[n].T @ dO[n] + kd[n] @ dS
        dS = qg[n].T @ dO[n] + gl[n][:, None] * dS - w[n].T @ dU
        out.append(dS)
    return torch.stack([*out, dht])


def _through_autograd(qg, kd, gl, w, Aqk, dO, dht):  # the shortcut the checker forbids
    S0 = torch.zeros_like(dht, requires_grad=True)
    return torch.autograd.grad((S0 * dht).sum(), S0)[0].expand(qg.shape[0] + 1, *dht.shape)


def test_state_gradient_exercise():
    assert ch09.check_state_gradients(ch09.solution_state_gradients).startswith("Correct!")
    with pytest.raises(WrongAnswer, match="relative error"):
        ch09.check_state_gradients(_forgets_w)
    with pytest.raises(WrongAnswer, match="last to first|relative error"):
        ch09.check_state_gradients(_forward_order)
    with pytest.raises(WrongAnswer, match="calls autograd"):
        ch09.check_state_gradients(_through_autograd)
    with pytest.raises(WrongAnswer, match="shape"):
        ch09.check_state_gradients(lambda *args: args[-1])
