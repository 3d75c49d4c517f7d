"""Input validation: each bad argument, one at a time, raises an error that names it and its expected shape.

Every case runs through `check_kda_inputs` itself and through the three public KDA functions.
"""

import pytest
import torch
from reference_inputs import make_inputs

from kda_edu.ops._checks import check_chunk_size, check_kda_inputs, resolve_scale
from kda_edu.ops.kda import kda_chunked, kda_recurrent, kda_step

B, H, HV, K, V = 2, 2, 4, 5, 6
SPEC = {
    "q": "[B, T, H, K]",
    "k": "[B, T, H, K]",
    "v": "[B, T, HV, V]",
    "g": "[B, T, HV, K]",
    "beta": "[B, T, HV]",
}
SPEC["initial_state"] = "[B, HV, K, V]"


def grow(dim):
    """A mutation that adds one entry along `dim`: the wrong B, T, H, HV, K or V whatever the sizes are."""
    return lambda x: torch.cat([x, x.narrow(dim, 0, 1)], dim=dim)


def set_first(value):
    def mutate(x):
        x = x.clone()
        x.view(-1)[0] = value
        return x

    return mutate


# name: (argument, mutation, exception, extra words the message must contain)
BAD = {
    "q_not_a_tensor": ("q", lambda x: x.tolist(), TypeError, ["torch.Tensor"]),
    "q_rank_3": ("q", lambda x: x[0], ValueError, ["rank 4"]),
    "q_integer": ("q", lambda x: x.long(), TypeError, ["floating"]),
    "k_rank_5": ("k", lambda x: x[..., None], ValueError, ["rank 4"]),
    "k_wrong_B": ("k", grow(0), ValueError, ["(2, "]),
    "k_wrong_T": ("k", grow(1), ValueError, []),
    "k_wrong_H": ("k", grow(2), ValueError, []),
    "k_wrong_K": ("k", grow(3), ValueError, []),
    "k_dtype": ("k", lambda x: x.double(), TypeError, ["dtype"]),
    "k_device": ("k", lambda x: x.to("meta"), ValueError, ["device"]),
    "v_rank_3": ("v", lambda x: x[..., 0], ValueError, ["rank 4"]),
    "v_wrong_B": ("v", grow(0), ValueError, []),
    "v_wrong_T": ("v", grow(1), ValueError, []),
    "v_HV_not_a_multiple_of_H": ("v", grow(2), ValueError, ["multiple of H = 2"]),
    "v_dtype": ("v", lambda x: x.half(), TypeError, ["dtype"]),
    "v_device": ("v", lambda x: x.to("meta"), ValueError, ["device"]),
    "g_rank_3": ("g", lambda x: x[..., 0], ValueError, ["rank 4"]),
    "g_wrong_HV": ("g", grow(2), ValueError, []),
    "g_wrong_K": ("g", grow(3), ValueError, []),
    "g_integer": ("g", lambda x: x.long(), TypeError, ["floating"]),
    "g_device": ("g", lambda x: x.to("meta"), ValueError, ["device"]),
    "g_positive": ("g", set_first(0.5), ValueError, ["<= 0"]),
    "g_nan": ("g", set_first(float("nan")), ValueError, ["not NaN"]),
    "beta_rank_4": ("beta", lambda x: x[..., None], ValueError, ["rank 3"]),
    "beta_wrong_HV": ("beta", grow(2), ValueError, []),
    "beta_integer": ("beta", lambda x: x.long(), TypeError, ["floating"]),
    "beta_device": ("beta", lambda x: x.to("meta"), ValueError, ["device"]),
    "beta_above_1": ("beta", set_first(1.5), ValueError, ["[0, 1]"]),
    "beta_below_0": ("beta", set_first(-0.1), ValueError, ["[0, 1]"]),
    "beta_nan": ("beta", set_first(float("nan")), ValueError, ["not be NaN"]),
    "state_wrong_K": ("initial_state", grow(2), ValueError, []),
    "state_rank_3": ("initial_state", lambda x: x[0], ValueError, ["rank 4"]),
    "state_float64_for_float32_inputs": ("initial_state", lambda x: x.double(), TypeError, ["torch.float32"]),
    "state_half": ("initial_state", lambda x: x.half(), TypeError, ["torch.float32"]),
    "state_device": ("initial_state", lambda x: x.to("meta"), ValueError, ["device"]),
}


def call(fn, x):
    if fn is check_kda_inputs:
        return check_kda_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"])
    if fn is kda_step:
        return kda_step(x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"])
    return fn(**x)


FUNCTIONS = [check_kda_inputs, kda_recurrent, kda_chunked, kda_step]


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", BAD)
def test_bad_argument_is_named_with_its_shape(case, fn):
    arg, mutate, error, words = BAD[case]
    x = make_inputs(B, 1 if fn is kda_step else 3, H, HV, K, V, dtype=torch.float32)
    x[arg] = mutate(x[arg])
    with pytest.raises(error) as info:
        call(fn, x)
    name = "state" if (fn is kda_step and arg == "initial_state") else arg
    message = str(info.value)
    assert message.startswith(name + " "), message
    assert SPEC[arg] in message, message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
def test_valid_inputs_pass(fn):
    x = make_inputs(B, 1 if fn is kda_step else 3, H, HV, K, V, dtype=torch.float32)
    call(fn, x)


def test_check_returns_sizes_and_accepts_float32_gates_with_bfloat16_inputs():
    x = make_inputs(B, 3, H, HV, K, V, dtype=torch.bfloat16)
    x["g"], x["beta"] = x["g"].float(), x["beta"].float()
    assert check_kda_inputs(**x) == (B, 3, H, HV, K, V)


def test_check_values_false_skips_only_the_value_checks():
    x = make_inputs(B, 3, H, HV, K, V)
    x["g"] = x["g"].abs() + 1
    x["beta"] = x["beta"] + 2
    assert check_kda_inputs(**x, check_values=False) == (B, 3, H, HV, K, V)
    with pytest.raises(ValueError, match="beta"):
        check_kda_inputs(x["q"], x["k"], x["v"], None, x["beta"], gate=None)
    with pytest.raises(ValueError, match="k must have shape"):
        check_kda_inputs(x["q"], x["k"][:, :2], x["v"], x["g"], x["beta"], check_values=False)


def test_gate_kinds_and_missing_arguments():
    x = make_inputs(B, 3, H, HV, K, V, gate="head")
    assert check_kda_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], gate="head")[3] == HV
    with pytest.raises(ValueError, match=r"g must have rank 4, shape \[B, T, HV, K\]"):
        check_kda_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"])
    with pytest.raises(TypeError, match=r"g must be a torch.Tensor of shape \[B, T, HV\]"):
        check_kda_inputs(x["q"], x["k"], x["v"], None, x["beta"], gate="head")
    with pytest.raises(TypeError, match="g must be None"):
        check_kda_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], gate=None)
    with pytest.raises(TypeError, match="beta must be None"):
        check_kda_inputs(x["q"], x["k"], x["v"], None, x["beta"], gate=None, with_beta=False)
    with pytest.raises(ValueError, match="gate must be"):
        check_kda_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], gate="token")


def test_empty_dimension_is_rejected():
    x = make_inputs(B, 3, H, HV, K, V)
    with pytest.raises(ValueError, match=r"q must have no empty dimension in \[B, T, H, K\]"):
        kda_recurrent(**{n: t[:, :0] if n != "initial_state" else None for n, t in x.items()})


def test_kda_step_needs_one_step_and_a_state():
    x = make_inputs(B, 2, H, HV, K, V)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with pytest.raises(ValueError, match="T = 1"):
        kda_step(*args, x["initial_state"])
    with pytest.raises(TypeError, match=r"state must be a torch.Tensor of shape \[B, HV, K, V\]"):
        kda_step(*(t[:, :1] for t in args), None)


@pytest.mark.parametrize(
    "scale, error", [(-1.0, ValueError), (0.0, ValueError), (float("nan"), ValueError), ("0.5", TypeError)]
)
def test_bad_scale(scale, error):
    with pytest.raises(error, match="scale"):
        resolve_scale(scale, 16)
    x = make_inputs(1, 2, 1, 1, 4, 4)
    with pytest.raises(error, match="scale"):
        kda_chunked(**x, scale=scale)


@pytest.mark.parametrize("chunk_size, error", [(0, ValueError), (2.0, TypeError), (True, TypeError)])
def test_bad_chunk_size(chunk_size, error):
    with pytest.raises(error, match="chunk_size"):
        check_chunk_size(chunk_size)
    x = make_inputs(1, 2, 1, 1, 4, 4)
    with pytest.raises(error, match="chunk_size"):
        kda_chunked(**x, chunk_size=chunk_size)


@pytest.mark.parametrize(
    "dtype, bad, shown",
    [
        (torch.float32, 1.0000001, "1.0000001]"),
        (torch.float32, -1e-8, "[-1e-08,"),
        (torch.float64, 1 + 2**-52, "1.0000000000000002]"),
        (torch.bfloat16, 1.0078125, "1.0078125]"),
    ],
)
def test_beta_message_shows_the_value_that_breaks_the_range(dtype, bad, shown):
    """`:.4g` printed the float32 just above 1 as 1 ("got values in [0.2, 1]"): the message must show it."""
    x = make_inputs(B, 3, H, HV, K, V, dtype=torch.float32)
    beta = x["beta"].to(dtype).clamp(0.25, 0.75)
    beta[0, 1, 2] = bad
    x["beta"] = beta
    with pytest.raises(ValueError, match="must lie in") as info:
        check_kda_inputs(x["q"].to(dtype), x["k"].to(dtype), x["v"].to(dtype), x["g"], beta)
    assert shown in str(info.value)


def test_value_checks_run_on_the_cpu_and_elsewhere_only_in_debug_mode(monkeypatch):
    from kda_edu.ops._checks import value_checks_enabled

    monkeypatch.delenv("KDA_EDU_DEBUG", raising=False)
    assert value_checks_enabled(torch.device("cpu"))
    assert not value_checks_enabled(torch.device("meta"))  # stands for a GPU: a check would synchronise
    monkeypatch.setenv("KDA_EDU_DEBUG", "1")
    assert value_checks_enabled(torch.device("meta"))
    monkeypatch.setenv("KDA_EDU_DEBUG", "0")
    assert not value_checks_enabled(torch.device("meta"))
