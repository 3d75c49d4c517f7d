"""DeltaNet: the chunked (WY / UT transform) form equals the loop; DeltaNet is KDA with g = 0."""

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

from kda_edu.ops.delta_rule import delta_rule_chunked, delta_rule_recurrent
from kda_edu.ops.kda import kda_chunked, kda_recurrent


def assert_model_forms_agree(case: dict, dtype: torch.dtype) -> None:
    assert_forms_agree(delta_rule_recurrent, delta_rule_chunked, case, dtype, args="q k v beta")


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


def test_recurrence_is_the_textbook_update():
    """S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, written out in float64 per head."""
    x = make_inputs(1, 15, 1, 2, 4, 3, seed=5)
    q, k, v, beta, S = x["q"][0], x["k"][0], x["v"][0], x["beta"][0], x["initial_state"][0].clone()
    o = torch.zeros(15, 2, 3, dtype=torch.float64)
    for t in range(15):
        for j in range(2):
            kt = k[t, 0, :, None]
            S[j] = (torch.eye(4, dtype=torch.float64) - beta[t, j] * kt @ kt.T) @ S[j] + beta[t, j] * kt @ v[
                t, j, None, :
            ]
            o[t, j] = S[j].T @ (q[t, 0] * 4**-0.5)
    o_ref, s_ref = delta_rule_recurrent(
        x["q"], x["k"], x["v"], x["beta"], initial_state=x["initial_state"], output_final_state=True
    )
    assert rel_err(o_ref[0], o) <= TOL[torch.float64] and rel_err(s_ref[0], S) <= TOL[torch.float64]


@pytest.mark.parametrize(
    "forms",
    [(delta_rule_recurrent, kda_recurrent), (delta_rule_chunked, kda_chunked)],
    ids=["recurrent", "chunked"],
)
def test_deltanet_is_kda_without_decay(forms):
    delta_fn, kda_fn = forms
    x = make_inputs(2, 21, 2, 4, 6, 5, seed=6)
    o_d, s_d = delta_fn(
        x["q"], x["k"], x["v"], x["beta"], initial_state=x["initial_state"], output_final_state=True
    )
    o_k, s_k = kda_fn(**{**x, "g": torch.zeros_like(x["g"])}, output_final_state=True)
    assert rel_err(o_d, o_k) <= TOL[torch.float64] and rel_err(s_d, s_k) <= TOL[torch.float64]


def test_wy_representation_of_one_chunk():
    """With v = 0 a chunk maps S_0 to (I - b_C k_C k_C^T) ... (I - b_1 k_1 k_1^T) S_0."""
    x = make_inputs(1, 8, 1, 1, 5, 5, seed=7)
    S0 = torch.eye(5, dtype=torch.float64)[None, None]
    _, S = delta_rule_chunked(
        x["q"],
        x["k"],
        torch.zeros_like(x["v"]),
        x["beta"],
        initial_state=S0,
        output_final_state=True,
        chunk_size=8,
    )
    P = torch.eye(5, dtype=torch.float64)
    for t in range(8):
        kt = x["k"][0, t, 0, :, None]
        P = (torch.eye(5, dtype=torch.float64) - x["beta"][0, t, 0] * kt @ kt.T) @ P
    assert rel_err(S[0, 0], P) <= TOL[torch.float64]


def test_bad_inputs():
    x = make_inputs(2, 3, 2, 4, 6, 5)
    with pytest.raises(ValueError, match=r"beta must have shape \[B, T, HV\]"):
        delta_rule_recurrent(x["q"], x["k"], x["v"], x["beta"][:, :, :2])
    with pytest.raises(ValueError, match=r"beta of shape \[B, T, HV\] must lie in \[0, 1\]"):
        delta_rule_chunked(x["q"], x["k"], x["v"], x["beta"] + 1)
    with pytest.raises(TypeError, match=r"beta must be a torch.Tensor of shape \[B, T, HV\]"):
        delta_rule_chunked(x["q"], x["k"], x["v"], None)
