"""KDA references: the chunked form and the decoding step against the loop, gradients, fla, stress, bad input."""

import pytest
import torch
from fla.ops.kda.naive import naive_recurrent_kda
from hypothesis import example, given, settings
from reference_inputs import (
    EDGE_CASES,
    TOL,
    assert_forms_agree,
    edge_case,
    make_inputs,
    rel_err,
    shapes,
)

from kda_edu.ops.kda import kda_chunked, kda_recurrent, kda_step


def both_forms(x, chunk_size, with_state=True, scale=None):
    """(o, final_state) of kda_recurrent and kda_chunked on the same inputs."""
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    kw = dict(scale=scale, initial_state=x["initial_state"] if with_state else None, output_final_state=True)
    return kda_recurrent(*args, **kw), kda_chunked(*args, **kw, chunk_size=chunk_size)


def assert_kda_forms_agree(case: dict, dtype: torch.dtype) -> None:
    assert_forms_agree(kda_recurrent, kda_chunked, case, dtype, args="q k v g beta")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@settings(max_examples=40, deadline=None)
@given(case=shapes())
# A final state of 5.3e-4 from terms whose sizes add up to 4.0e-2: 1.7e-5 in float32 relative to the state,
# 2.3e-7 relative to the terms (assert_forms_agree measures against the sum of absolute contributions).
@example(case=dict(B=1, T=7, H=1, HV=1, K=1, V=1, chunk_size=3, with_state=False, seed=53))
def test_chunked_equals_recurrent_sweep(case, dtype):
    assert_kda_forms_agree(case, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", EDGE_CASES)
def test_chunked_equals_recurrent_edge_cases(name, dtype):
    for with_state in (False, True):
        assert_kda_forms_agree(edge_case(name, with_state), dtype)


def test_custom_scale_and_bfloat16_output_dtype():
    x = make_inputs(2, 19, 1, 2, 8, 4, dtype=torch.float32, seed=1)
    (o_r, _), (o_c, _) = both_forms(x, 8, scale=0.3)
    assert rel_err(o_c, o_r) <= TOL[torch.float32]
    x16 = {n: t.bfloat16() if n in "qkv" else t for n, t in x.items()}
    (o_r, s_r), (o_c, s_c) = both_forms(x16, 8)
    assert o_r.dtype == o_c.dtype == torch.bfloat16 and s_r.dtype == s_c.dtype == torch.float32
    assert rel_err(o_c, o_r) <= 1e-2


def test_no_final_state_unless_asked():
    x = make_inputs(1, 5, 1, 1, 4, 4)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert kda_recurrent(*args)[1] is None and kda_chunked(*args)[1] is None


def test_steps_replay_the_loop():
    x = make_inputs(2, 7, 1, 2, 6, 5, seed=2)
    o_ref, s_ref = kda_recurrent(**x, output_final_state=True)
    state = x["initial_state"].clone()
    outputs = []
    for t in range(7):
        before = state.clone()
        o_t, new_state = kda_step(*(x[n][:, t : t + 1] for n in ("q", "k", "v", "g", "beta")), state)
        assert torch.equal(state, before), "kda_step must not modify its state argument"
        outputs.append(o_t)
        state = new_state
    assert rel_err(torch.cat(outputs, dim=1), o_ref) <= TOL[torch.float64]
    assert rel_err(state, s_ref) <= TOL[torch.float64]


def test_gradcheck_chunked_all_inputs():
    x = make_inputs(1, 5, 1, 2, 3, 2, seed=3)
    x["g"] = -0.1 - 0.9 * torch.rand_like(x["g"])  # in [-1, -0.1]: finite differences stay <= 0
    x["beta"] = 0.1 + 0.8 * x["beta"]  # in [0.1, 0.9]
    names = ("q", "k", "v", "g", "beta", "initial_state")
    inputs = tuple(x[n].clone().requires_grad_() for n in names)

    def f(q, k, v, g, beta, h0):
        return kda_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=2)

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_chunked_and_recurrent_gradients_agree():
    x = make_inputs(2, 23, 1, 2, 5, 4, seed=4)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    probe = torch.Generator().manual_seed(5)
    w_o = torch.randn(2, 23, 2, 4, generator=probe, dtype=torch.float64)  # a random loss on o and the state
    w_s = torch.randn(2, 2, 5, 4, generator=probe, dtype=torch.float64)
    grads = []
    for fn in (kda_recurrent, kda_chunked):
        leaves = {n: x[n].clone().requires_grad_() for n in names}
        o, s = fn(**leaves, output_final_state=True)
        ((o * w_o).sum() + (s * w_s).sum()).backward()
        grads.append({n: leaves[n].grad for n in names})
    for n in names:
        assert rel_err(grads[1][n], grads[0][n]) <= TOL[torch.float64], n


@pytest.mark.parametrize("with_state", [False, True])
def test_both_forms_match_fla_naive_recurrent_kda(with_state):
    x = make_inputs(2, 45, 2, 4, 16, 8, dtype=torch.float32, seed=6)
    h0 = x["initial_state"] if with_state else None
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    o_fla, s_fla = naive_recurrent_kda(*args, initial_state=h0, output_final_state=True)
    for fn, kw in ((kda_recurrent, {}), (kda_chunked, {"chunk_size": 16})):
        o, s = fn(*args, initial_state=h0, output_final_state=True, **kw)
        assert rel_err(o, o_fla) <= TOL[torch.float32], fn.__name__
        assert rel_err(s, s_fla) <= TOL[torch.float32], fn.__name__


def test_lower_bound_gates_over_4096_steps_stay_finite():
    x = make_inputs(1, 4096, 1, 1, 8, 8, dtype=torch.float32, seed=7)
    x["g"] = torch.full_like(x["g"], -5.0)  # exp(-5 * 64) over one chunk: exp(+320) if factorised
    (o_r, s_r), (o_c, s_c) = both_forms(x, 64)
    assert torch.isfinite(o_c).all() and torch.isfinite(s_c).all()
    assert rel_err(o_c, o_r) <= TOL[torch.float32] and rel_err(s_c, s_r) <= TOL[torch.float32]


@pytest.mark.parametrize("gate", [-5.0, -1000.0])
def test_gradients_finite_under_extreme_gates(gate):
    x = make_inputs(1, 100, 1, 1, 4, 4, seed=8)
    x["g"] = torch.full_like(x["g"], gate)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, s = kda_chunked(**leaves, output_final_state=True, chunk_size=32)
    (o.sum() + s.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in leaves.values())


@pytest.mark.parametrize("fn", [kda_recurrent, kda_chunked])
def test_gate_of_minus_1000_is_a_full_reset(fn):
    x = make_inputs(2, 30, 1, 2, 6, 5, seed=9)
    t0 = 13  # inside the second chunk of 8
    x["g"][:, t0] = -1000.0
    o, s = fn(**x, output_final_state=True)
    after = {n: t[:, t0:] for n, t in x.items() if n != "initial_state"}
    o_fresh, s_fresh = kda_recurrent(**after, output_final_state=True)  # zero initial state
    assert rel_err(o[:, t0:], o_fresh) <= TOL[torch.float64]
    assert rel_err(s, s_fresh) <= TOL[torch.float64]
