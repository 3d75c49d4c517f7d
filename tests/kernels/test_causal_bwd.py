"""The Triton backward stays causal under bad values (tests/causal_checks.py), and refuses second derivatives.

A NaN or inf at step t must leave the outputs before t, and for a loss on them the gradients of every earlier
step and of the initial state, those of the clean prefix (here: the float64 loop on the prefix, so the
tolerance is float32's). The kernels once let a bad key, value or query through products with zero
coefficients (0 * NaN = NaN), and the reverse cumulative sum that makes dg carried a NaN of step t to every
earlier step of its chunk.
"""

import math

import pytest
import torch
from causal_checks import BAD, bad_steps, causal_errors, make, rejected, spoil
from hypothesis import given, settings

from kda_edu.kernels import chunk_kda, fused_recurrent_kda, raise_value_errors
from kda_edu.ops.kda import kda_chunked

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels' device

TOL = (
    1e-4  # float32 gradients against the float64 loop, as tests/kernels/test_numerics.py's GRAD_TOL on a CPU
)
PATHS = {
    "chunk_kda": chunk_kda,
    "chunk_kda_unchecked": lambda **x: chunk_kda(**x, check_inputs=False),
    "fused_recurrent_kda": fused_recurrent_kda,
}


@pytest.mark.parametrize("path", ["chunk_kda", "fused_recurrent_kda"])
@pytest.mark.parametrize("name", ["k", "v"])
def test_a_bad_key_or_value_leaves_its_chunk_causal(path, name):
    """NaN at step 70 of 128 (row 6 of the second chunk), loss on o[:, :70]: steps 64-69 of dq, dk, dg and
    dbeta (a bad key) or dg (a bad value) were NaN."""
    x = make(128, H=1, HV=1, device=DEVICE)
    errors = causal_errors(PATHS[path], x, name, 70, math.nan)
    assert max(errors.values()) <= TOL, errors


@pytest.mark.parametrize("path", ["chunk_kda", "fused_recurrent_kda"])
def test_a_bad_query_leaves_earlier_gradients_exact(path):
    """NaN in q at step 40 (the first chunk's third block), loss on o[:, :40]: dk, dv, dg, dbeta and dh0 of
    every earlier step were NaN (the backward of o_t's read of the state)."""
    x = make(50, device=DEVICE)
    errors = causal_errors(PATHS[path], x, "q", 40, math.nan)
    assert max(errors.values()) <= TOL, errors


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=6, deadline=None)
@given(case=bad_steps(40, 90))
def test_bad_values_sweep(path, case):
    """NaN, inf or -inf at a random step of q, k, v, g or beta: causal, or refused by chunk_kda's check (any
    bad beta, a NaN or +inf gate; fused_recurrent_kda and check_inputs=False never look)."""
    T, name, t, value, head, channel, seed = case
    x = make(T, seed=seed, device=DEVICE)
    if path == "chunk_kda" and rejected(name, BAD[value]):
        with pytest.raises(ValueError, match=f"^{name} of shape"):
            chunk_kda(**spoil(x, name, t, BAD[value], head, channel))
            raise_value_errors()  # on a GPU the verdict arrives after the call
        return
    errors = causal_errors(PATHS[path], x, name, t, BAD[value], head, channel)
    assert max(errors.values()) <= TOL, errors


def gradient_penalty(fn):
    """grad(o.square().sum(), q, create_graph=True), then (o.sum() + gq.square().sum()).backward(): the
    gradient of k."""
    x = make(20, H=1, HV=1, device=DEVICE)
    x.pop("initial_state")
    x = {n: a.requires_grad_() for n, a in x.items()}
    o = fn(**x)[0]
    (gq,) = torch.autograd.grad(o.square().sum(), x["q"], create_graph=True)
    (o.sum() + gq.square().sum()).backward()
    return x["k"].grad


@pytest.mark.parametrize("fn", [chunk_kda, fused_recurrent_kda], ids=lambda f: f.__name__)
def test_second_derivatives_are_refused(fn):
    """The kernels' backward is not differentiable: a gradient penalty once returned a silently wrong key
    gradient (4.33 where kda_chunked gives 23.11); now it raises and points to kda_chunked."""
    with pytest.raises(RuntimeError, match=f"{fn.__name__}.*not differentiable.*kda_chunked"):
        gradient_penalty(fn)
    assert bool(torch.isfinite(gradient_penalty(kda_chunked)).all())
