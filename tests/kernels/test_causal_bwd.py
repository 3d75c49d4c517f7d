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
from causal_checks import BAD, causal_errors, causal_errors_per_head, make, rejected, spoil

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


# Two bad values per run, one in each of two heads that share nothing (H = HV = 2), each head checked against
# its own clean prefix (`causal_errors_per_head`): (T, [(input, step, value, channel) per head], seed). The three
# runs put a bad value in every input, every kind of bad value, and a step at each place a chunk has: the first
# step, mid-chunk (first and second chunk), the first step of the second chunk, the last step (a reset: g = -inf).
SWEEP = {
    "first_step_k_mid_beta": (40, [("k", 1, "-inf", 0), ("beta", 20, "nan", 0)], 0),
    "mid_v_mid_g": (70, [("v", 67, "inf", 2), ("g", 37, "nan", 9)], 1),
    "chunk_start_q_last_step_reset": (70, [("q", 64, "nan", 11), ("g", 69, "-inf", 5)], 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", SWEEP.values(), ids=SWEEP.keys())
@pytest.mark.parametrize("path", PATHS)
def test_bad_values_sweep(path, case):
    """NaN, inf or -inf in q, k, v, g or beta (`SWEEP`): causal, or refused by chunk_kda's check (any bad beta,
    a NaN or +inf gate; fused_recurrent_kda and check_inputs=False never look, so their kernels meet these
    too). A refused head is checked for the refusal alone and then runs clean beside the other head."""
    T, placed, seed = case
    x = make(T, H=2, HV=2, seed=seed, device=DEVICE)
    bads = []
    for head, (name, t, value, channel) in enumerate(placed):
        if path == "chunk_kda" and rejected(name, BAD[value]):
            with pytest.raises(ValueError, match=f"^{name} of shape"):
                chunk_kda(**spoil(x, name, t, BAD[value], head, channel))
                raise_value_errors()  # on a GPU the verdict arrives after the call
            bads.append((name, t, None, channel))
        else:
            bads.append((name, t, BAD[value], channel))
    for head, errors in enumerate(causal_errors_per_head(PATHS[path], x, bads)):
        assert max(errors.values()) <= TOL, (head, placed[head], errors)


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
