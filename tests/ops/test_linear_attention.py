"""Linear attention: parallel, recurrent and chunked forms agree; the recurrence is the KDA loop without the delta rule."""

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

from kda_edu.ops.kda import kda_recurrent
from kda_edu.ops.linear_attention import (
    linear_attention_chunked,
    linear_attention_parallel,
    linear_attention_recurrent,
)
from kda_edu.ops.recurrence import general_recurrence


def assert_three_forms_agree(case: dict, dtype: torch.dtype) -> None:
    x, x64 = assert_forms_agree(
        linear_attention_recurrent, linear_attention_chunked, case, dtype, args="q k v"
    )
    o_p = linear_attention_parallel(x["q"], x["k"], x["v"])
    assert rel_err(o_p, linear_attention_recurrent(x64["q"], x64["k"], x64["v"])[0]) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@settings(max_examples=40, deadline=None)
@given(case=shapes())
def test_three_forms_agree_sweep(case, dtype):
    assert_three_forms_agree(case, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", EDGE_CASES)
def test_three_forms_agree_edge_cases(name, dtype):
    for with_state in (False, True):
        assert_three_forms_agree(edge_case(name, with_state), dtype)


def test_parallel_form_is_attention_without_softmax():
    x = make_inputs(2, 9, 1, 2, 4, 3, seed=1)
    q, k, v = x["q"], x["k"], x["v"]
    o = linear_attention_parallel(q, k, v, scale=0.7)
    for t in range(9):
        for j in range(2):
            expected = torch.einsum(
                "bs,bsv->bv", 0.7 * torch.einsum("bk,bsk->bs", q[:, t, 0], k[:, : t + 1, 0]), v[:, : t + 1, j]
            )
            assert rel_err(o[:, t, j], expected) <= TOL[torch.float64]


def test_recurrence_is_the_kda_loop_with_the_delta_rule_off():
    x = make_inputs(2, 13, 1, 2, 5, 4, seed=2)
    q, k, v, h0 = x["q"], x["k"], x["v"], x["initial_state"]
    B, T, HV = 2, 13, 2
    o, s = linear_attention_recurrent(q, k, v, initial_state=h0, output_final_state=True)
    o_g, s_g = general_recurrence(
        q,
        k,
        v,
        torch.zeros(B, T, HV, 5, dtype=q.dtype),
        torch.ones(B, T, HV, dtype=q.dtype),
        delta_rule=False,
        scale=5**-0.5,
        initial_state=h0,
        output_final_state=True,
    )
    assert rel_err(o, o_g) <= TOL[torch.float64] and rel_err(s, s_g) <= TOL[torch.float64]
    # With the delta rule on, the same inputs (g = 0, beta = 1) give a different model: the one KDA runs.
    o_kda, _ = kda_recurrent(
        q,
        k,
        v,
        torch.zeros(B, T, HV, 5, dtype=q.dtype),
        torch.ones(B, T, HV, dtype=q.dtype),
        initial_state=h0,
    )
    assert rel_err(o_kda, o) > 1e-2


def test_bad_inputs():
    x = make_inputs(2, 3, 2, 4, 6, 5)
    with pytest.raises(ValueError, match=r"k must have shape \[B, T, H, K\]"):
        linear_attention_parallel(x["q"], x["k"][:, :2], x["v"])
    with pytest.raises(ValueError, match=r"initial_state must have shape \[B, HV, K, V\]"):
        linear_attention_recurrent(x["q"], x["k"], x["v"], initial_state=x["initial_state"][:, :2])
    with pytest.raises(ValueError, match="chunk_size"):
        linear_attention_chunked(x["q"], x["k"], x["v"], chunk_size=0)
