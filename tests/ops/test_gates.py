"""Gates: the decay parametrisations, the beta sigmoid and L2 normalisation."""

import math

import pytest
import torch
from reference_inputs import TOL, make_inputs, rel_err

from kda_edu.ops.gates import beta_sigmoid, kda_gate, kda_gate_lower_bound, l2_normalize
from kda_edu.ops.kda import kda_chunked, kda_recurrent

B, T, HV, K = 2, 7, 3, 4


def gate_inputs(per_channel: bool, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = 4 * torch.randn(B, T, HV, *((K,) if per_channel else ()), generator=gen, dtype=torch.float64)
    A_log = torch.randn(HV, generator=gen, dtype=torch.float64)
    dt_bias = torch.randn(*x.shape[2:], generator=gen, dtype=torch.float64)
    return x.to(dtype), A_log, dt_bias


@pytest.mark.parametrize("per_channel", [True, False])
def test_kda_gate_formula(per_channel):
    x, A_log, dt_bias = gate_inputs(per_channel)
    g = kda_gate(x, A_log, dt_bias)
    for h in range(HV):
        expected = -math.exp(A_log[h]) * torch.log1p(torch.exp(x[:, :, h] + dt_bias[h]))
        assert rel_err(g[:, :, h], expected) <= 1e-12
    assert g.shape == x.shape and (g <= 0).all()
    assert torch.equal(kda_gate(x, A_log), kda_gate(x, A_log, torch.zeros_like(dt_bias)))


@pytest.mark.parametrize("per_channel", [True, False])
def test_lower_bound_gate_formula_and_range(per_channel):
    x, A_log, dt_bias = gate_inputs(per_channel)
    g = kda_gate_lower_bound(x, A_log, dt_bias, lower_bound=-5.0)
    for h in range(HV):
        expected = -5.0 * torch.sigmoid(math.exp(A_log[h]) * (x[:, :, h] + dt_bias[h]))
        assert rel_err(g[:, :, h], expected) <= 1e-12
    assert (g >= -5.0).all() and (g <= 0).all()
    extreme = kda_gate_lower_bound(torch.tensor([[[1e4, -1e4]]]), torch.zeros(2), lower_bound=-3.0)
    assert extreme.tolist() == [[[-3.0, 0.0]]]


def test_gates_compute_in_float32_for_half_inputs():
    x, A_log, dt_bias = gate_inputs(True, dtype=torch.bfloat16)
    assert kda_gate(x, A_log.float(), dt_bias.float()).dtype == torch.float32
    assert kda_gate_lower_bound(x, A_log.float()).dtype == torch.float32
    assert kda_gate(x.double(), A_log, dt_bias).dtype == torch.float64


def test_bounded_gates_drive_kda_over_a_long_sequence():
    x = make_inputs(1, 1024, 1, 2, 8, 8, dtype=torch.float32, seed=1)
    logits = 20 * torch.randn(1, 1024, 2, 8)  # saturates the sigmoid: many steps sit at the bound
    x["g"] = kda_gate_lower_bound(logits, torch.zeros(2), lower_bound=-5.0)
    o_r, _ = kda_recurrent(**x)
    o_c, _ = kda_chunked(**x)
    assert torch.isfinite(o_c).all() and rel_err(o_c, o_r) <= TOL[torch.float32]


def test_beta_sigmoid():
    x = torch.randn(B, T, HV, dtype=torch.float64) * 5
    beta = beta_sigmoid(x)
    assert rel_err(beta, 1 / (1 + torch.exp(-x))) <= 1e-15
    assert beta.dtype == x.dtype and ((beta > 0) & (beta < 1)).all()
    assert beta_sigmoid(x.bfloat16()).dtype == torch.bfloat16


def test_l2_normalize():
    x = torch.randn(B, T, 2, K, dtype=torch.float64)
    x[0, 0, 0] = 0
    y = l2_normalize(x)
    norms = y.norm(dim=-1)
    assert torch.equal(y[0, 0, 0], torch.zeros(K, dtype=torch.float64))
    # eps under the root makes the norm |x| / sqrt(|x|^2 + eps): just below 1, by more for short vectors.
    expected = x[1:].norm(dim=-1) / torch.sqrt((x[1:] ** 2).sum(-1) + 1e-6)
    assert (norms[1:] - expected).abs().max() < 1e-12 and (norms <= 1).all()
    assert rel_err(y[1], x[1] / torch.sqrt((x[1] ** 2).sum(-1, keepdim=True) + 1e-6)) <= 1e-15
    assert l2_normalize(x.half()).dtype == torch.float16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("norm", [1e20, 1e30, 1e38, 1e300, 1e-20, 1e-38])
def test_l2_normalize_of_huge_and_tiny_vectors(norm, dtype):
    """A norm past ~1.8e19 used to overflow the float32 sum of squares, and rsqrt(inf) = 0 gave a zero
    vector (NaN at 1e38). Huge vectors come out of unit length; tiny ones are x / sqrt(|x|^2 + eps)."""
    direction = torch.tensor([3.0, 0.0, -4.0, 0.0], dtype=torch.float64) / 5
    x = (direction * norm).to(dtype)
    if not torch.isfinite(x).all() or not (x != 0).any():
        pytest.skip(f"{norm} is outside {dtype}'s range")
    peak = x.double().abs().max()  # the reference scales too: 1e300 ** 2 overflows float64
    want = (x.double() / peak) / torch.sqrt(((x.double() / peak) ** 2).sum() + 1e-6 / peak**2)
    y = l2_normalize(x)
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=0)


def test_l2_normalize_of_ordinary_vectors_is_the_plain_formula_bit_for_bit():
    """The rescaling by a power of two changes no rounding: x * rsqrt(sum(x^2) + eps), exactly."""
    gen = torch.Generator().manual_seed(0)
    for scale in (1e-12, 1e-3, 1.0, 7.0, 1e6, 1e15):
        x = scale * torch.randn(3, 5, 2, 16, generator=gen)
        assert torch.equal(l2_normalize(x), x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6))


BAD = {
    "x_not_a_tensor": (lambda x, a, d: ([1.0], a, d), TypeError, "x must be a torch.Tensor of shape"),
    "x_rank_2": (lambda x, a, d: (x[0, 0], a, d), ValueError, "x must have rank 4 ([B, T, HV, K])"),
    "x_integer": (
        lambda x, a, d: (x.long(), a, d),
        TypeError,
        "x of shape [B, T, HV, ...] must have a floating",
    ),
    "A_log_per_channel": (lambda x, a, d: (x, d, d), ValueError, "A_log must have shape [HV] = (3,)"),
    "A_log_not_a_tensor": (
        lambda x, a, d: (x, 1.0, d),
        TypeError,
        "A_log must be a torch.Tensor of shape [HV]",
    ),
    "dt_bias_per_head": (lambda x, a, d: (x, a, a), ValueError, "dt_bias must have shape [HV, K] = (3, 4)"),
    "dt_bias_device": (
        lambda x, a, d: (x, a, d.to("meta")),
        ValueError,
        "dt_bias must be on the same device",
    ),
    "dt_bias_integer": (lambda x, a, d: (x, a, d.long()), TypeError, "dt_bias of shape [HV, K] must have"),
}


@pytest.mark.parametrize("gate", [kda_gate, kda_gate_lower_bound], ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", BAD)
def test_gate_bad_inputs(case, gate):
    mutate, error, message = BAD[case]
    with pytest.raises(error) as info:
        gate(*mutate(*gate_inputs(True)))
    assert message in str(info.value)


@pytest.mark.parametrize(
    "bound, error", [(0.0, ValueError), (2.0, ValueError), (-math.inf, ValueError), ("a", TypeError)]
)
def test_lower_bound_must_be_negative_and_finite(bound, error):
    with pytest.raises(error, match="lower_bound"):
        kda_gate_lower_bound(*gate_inputs(True), lower_bound=bound)


def test_beta_and_l2_bad_inputs():
    with pytest.raises(ValueError, match=r"x must have rank 3, shape \[B, T, HV\]"):
        beta_sigmoid(torch.zeros(2, 3))
    with pytest.raises(TypeError, match=r"x of shape \[B, T, HV\] must have a floating dtype"):
        beta_sigmoid(torch.zeros(2, 3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"shape \[\.\.\., K\]"):
        l2_normalize(torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"x of shape \[\.\.\., K\] must have a floating dtype"):
        l2_normalize(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="eps"):
        l2_normalize(torch.zeros(3), eps=0.0)
