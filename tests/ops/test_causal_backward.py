"""The PyTorch references stay causal under bad values, forward and backward (tests/causal_checks.py).

A NaN or inf at step t must leave the outputs before t, and for a loss on them the gradients of every earlier
step and of the initial state, exactly those of the clean prefix. The forwards always were; the backwards
multiplied a NaN query (both forms) or key (the loop) by the zero gradient of the outputs the loss does not
use, and 0 * NaN = NaN reached every earlier step.
"""

import math

import pytest
import torch
from causal_checks import BAD, bad_steps, causal_errors, make, rejected, spoil
from hypothesis import given, settings

from kda_edu.ops.kda import kda_chunked, kda_recurrent

FORMS = {"kda_recurrent": kda_recurrent, "kda_chunked": kda_chunked}
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_a_bad_step_leaves_earlier_gradients_exact(name, form, dtype):
    """NaN at step 13 (mid-chunk for chunk_size 8): every output and gradient before it is the clean prefix's."""
    x = make(20, K=4, V=4, dtype=dtype)
    kw = dict(chunk_size=8) if form == "kda_chunked" else {}
    errors = causal_errors(FORMS[form], x, name, 13, math.nan, **kw)
    assert max(errors.values()) <= TOL[dtype], errors


@pytest.mark.parametrize("form", FORMS)
@settings(max_examples=40, deadline=None)
@given(case=bad_steps(2, 30))
def test_bad_values_sweep(form, case):
    """NaN, inf or -inf at a random step of q, k, v, g or beta: causal, or (g, beta) refused by the check."""
    T, name, t, value, head, channel, seed = case
    x = make(T, K=4, V=4, seed=seed, dtype=torch.float64)
    kw = dict(chunk_size=8) if form == "kda_chunked" else {}
    if rejected(name, BAD[value]):
        with pytest.raises(ValueError, match=f"^{name} of shape"):
            FORMS[form](**spoil(x, name, t, BAD[value], head, channel), **kw)
        return
    errors = causal_errors(FORMS[form], x, name, t, BAD[value], head, channel, **kw)
    assert max(errors.values()) <= TOL[torch.float64], errors


def test_what_a_bad_value_spoils():
    """As kda_chunked's docstring says: a NaN value spoils that value column from its step on in the loop,
    every column in the chunked form; a NaN key spoils everything from its step on in both; a NaN query only
    its own output."""
    x = make(20, H=1, HV=1, K=4, V=4, dtype=torch.float64)
    x.pop("initial_state")
    t = 13
    for name, loop_cols in (("v", [2]), ("k", [0, 1, 2, 3]), ("q", [0, 1, 2, 3])):
        y = spoil(x, name, t, math.nan, channel=2)
        for fn, cols in ((kda_recurrent, loop_cols), (kda_chunked, [0, 1, 2, 3])):
            o, h = fn(**y, output_final_state=True)
            bad = ~torch.isfinite(o[0, :, 0])  # [T, V]
            assert not bad[:t].any()
            assert bad[t, cols].all() and int(bad[t].sum()) == len(cols), (name, fn.__name__)
            if name == "q":
                assert not bad[t + 1 :].any() and bool(torch.isfinite(h).all())
            else:
                assert bool(bad[t + 1 :, cols].all()) and int(bad[t + 1 :].sum()) == len(cols) * (19 - t)
                assert int((~torch.isfinite(h[0, 0])).any(0).sum()) == len(cols)
