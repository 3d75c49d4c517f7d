"""Gated DeltaNet: the chunked form equals the loop; it is KDA with one decay per head; extreme gates."""

import pytest
import torch
from hypothesis import given, settings
from reference_inputs import (
    EDGE_CASES,
    TOL,
    assert_forms_agree,
    edge_case,
    make_inputs,
    rel_err,
    shapes,
)

from kda_edu.ops.delta_rule import delta_rule_recurrent
from kda_edu.ops.gated_delta import gated_delta_chunked, gated_delta_recurrent
from kda_edu.ops.kda import kda_chunked, kda_recurrent


def assert_model_forms_agree(case: dict, dtype: torch.dtype) -> None:
    assert_forms_agree(
        gated_delta_recurrent, gated_delta_chunked, case, dtype, args="q k v g beta", gate="head"
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@settings(max_examples=40, deadline=None)
@given(case=shapes())
def test_chunked_equals_recurrent_sweep(case, dtype):
    assert_model_forms_agree(case, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", EDGE_CASES)
def test_chunked_equals_recurrent_edge_cases(name, dtype):
    for with_state in (False, True):
        assert_model_forms_agree(edge_case(name, with_state), dtype)


@pytest.mark.parametrize(
    "forms",
    [(gated_delta_recurrent, kda_recurrent), (gated_delta_chunked, kda_chunked)],
    ids=["recurrent", "chunked"],
)
def test_gated_deltanet_is_kda_with_one_decay_per_head(forms):
    gdn_fn, kda_fn = forms
    x = make_inputs(2, 21, 2, 4, 6, 5, gate="head", seed=6)
    o_g, s_g = gdn_fn(**x, output_final_state=True)
    o_k, s_k = kda_fn(**{**x, "g": x["g"][..., None].expand(-1, -1, -1, 6)}, output_final_state=True)
    assert rel_err(o_g, o_k) <= TOL[torch.float64] and rel_err(s_g, s_k) <= TOL[torch.float64]


def test_zero_gate_is_deltanet():
    x = make_inputs(2, 17, 1, 2, 4, 4, gate="head", seed=7)
    o_g, _ = gated_delta_chunked(**{**x, "g": torch.zeros_like(x["g"])}, chunk_size=8)
    o_d, _ = delta_rule_recurrent(x["q"], x["k"], x["v"], x["beta"], initial_state=x["initial_state"])
    assert rel_err(o_g, o_d) <= TOL[torch.float64]


def test_lower_bound_gates_over_4096_steps_stay_finite():
    x = make_inputs(1, 4096, 1, 2, 8, 8, dtype=torch.float32, gate="head", seed=8)
    x["g"] = torch.full_like(x["g"], -5.0)
    o_r, s_r = gated_delta_recurrent(**x, output_final_state=True)
    o_c, s_c = gated_delta_chunked(**x, output_final_state=True)
    assert torch.isfinite(o_c).all() and torch.isfinite(s_c).all()
    assert rel_err(o_c, o_r) <= TOL[torch.float32] and rel_err(s_c, s_r) <= TOL[torch.float32]


@pytest.mark.parametrize("fn", [gated_delta_recurrent, gated_delta_chunked])
def test_gate_of_minus_1000_is_a_full_reset(fn):
    x = make_inputs(2, 30, 1, 2, 6, 5, gate="head", seed=9)
    t0 = 13
    x["g"][:, t0] = -1000.0
    o, s = fn(**x, output_final_state=True)
    o_fresh, s_fresh = gated_delta_recurrent(
        **{n: t[:, t0:] for n, t in x.items() if n != "initial_state"}, output_final_state=True
    )
    assert rel_err(o[:, t0:], o_fresh) <= TOL[torch.float64] and rel_err(s, s_fresh) <= TOL[torch.float64]


def test_bad_inputs():
    x = make_inputs(2, 3, 2, 4, 6, 5, gate="channel")
    args = (x["q"], x["k"], x["v"])
    with pytest.raises(ValueError, match=r"g must have rank 3, shape \[B, T, HV\]"):
        gated_delta_recurrent(*args, x["g"], x["beta"])
    with pytest.raises(ValueError, match=r"g of shape \[B, T, HV\] must be <= 0"):
        gated_delta_chunked(*args, -x["g"][..., 0], x["beta"])
