"""The KDA layer's parts in Triton (`fused_short_conv`, `fused_l2_normalize`, `fused_gated_rms_norm`,
`fused_kda_gates`): outputs and gradients against the PyTorch modules and functions in float64, on awkward
shapes (C, K, D not powers of two, T not a multiple of the blocks, several blocks of rows and of channels),
strided inputs and large finite values; and the layer with its parts in the kernels against the PyTorch layer.

Tolerance: 1e-5 relative to the reference's norm. The kernels compute in float32 from float32 inputs (unit
roundoff 6e-8); every output is a short sum or a norm of a row, so a few hundred roundoffs at most."""

import pytest
import torch

from kda_edu.kernels import fused_gated_rms_norm, fused_kda_gates, fused_l2_normalize, fused_short_conv
from kda_edu.layers.kda_layer import GatedRMSNorm, KDAConfig, KDALayer, ShortConv
from kda_edu.ops.gates import beta_sigmoid, kda_gate, kda_gate_lower_bound, l2_normalize
from kda_edu.ops.varlen import positions_in_sequence

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-5


def close(got: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    got, ref = got.double().cpu(), ref.double().cpu()
    assert torch.isfinite(got).all(), "non-finite values"
    err = (got - ref).norm().item()
    assert err <= tol * ref.norm().item() + 1e-30, (
        f"relative error {err / max(ref.norm().item(), 1e-300):.2e}"
    )


def leaves(*tensors, dtype=torch.float32):
    """Copies of float64 tensors in `dtype` on the test device, each a leaf that requires grad."""
    return [t.detach().to(DEVICE, dtype).requires_grad_() for t in tensors]


def grads(outputs, inputs, seed=1):
    """Gradients of sum(output * fixed random weight) over the outputs, for the inputs."""
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o)).sum() for o in outputs)
    return torch.autograd.grad(loss, inputs)


# ---------------------------------------------------------------------------------------------- short conv


def conv_case(B, T, C, W, with_window, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(B, T, C, generator=gen, dtype=torch.float64)
    weight = torch.randn(C, W, generator=gen, dtype=torch.float64)
    window = torch.randn(B, W - 1, C, generator=gen, dtype=torch.float64) if with_window else None
    return x, weight, window


def reference_conv(x, weight, window, cu_seqlens=None):
    conv = ShortConv(weight.shape[0], weight.shape[1]).double()
    with torch.no_grad():
        conv.weight.copy_(weight)
    ins = [x.clone().requires_grad_(), conv.weight] + (
        [window.clone().requires_grad_()] if window is not None else []
    )
    y, new_window = conv(ins[0], ins[2] if window is not None else None, cu_seqlens=cu_seqlens)
    return (y, new_window), grads((y, new_window), ins)


@pytest.mark.parametrize("W", [1, 2, 3, 4])
@pytest.mark.parametrize("with_window", [False, True])
def test_short_conv_matches_shortconv_with_gradients(W, with_window):
    x, weight, window = conv_case(2, 37, 13, W, with_window)
    (y_ref, w_ref), g_ref = reference_conv(x, weight, window)
    ins = leaves(x, weight, *([window] if with_window else []))
    y, new_window = fused_short_conv(ins[0], ins[1], ins[2] if with_window else None)
    assert y.dtype == torch.float32 and new_window.shape == (2, W - 1, 13)
    close(y, y_ref)
    close(new_window, w_ref)
    for got, ref in zip(grads((y, new_window), ins), g_ref, strict=True):
        close(got, ref)


def test_short_conv_over_several_blocks_strided_input_and_short_sequences():
    # T + W - 1 = 73 positions: two backward programs (4 blocks of 16 each); C = 130: two channel blocks
    # forward (128 each), three backward (64 each).
    x, weight, window = conv_case(1, 70, 130, 4, True, seed=2)
    (y_ref, _), g_ref = reference_conv(x, weight, window)
    wide = leaves(torch.stack([x, -x], dim=-1).flatten(-2))[0]
    strided = wide[..., ::2]  # not contiguous: every other channel of a wider tensor, x's values
    w32, win32 = leaves(weight, window)
    y, new_window = fused_short_conv(strided, w32, win32)
    close(y, y_ref)
    d_wide, *rest = grads((y, new_window), [wide, w32, win32])
    close(d_wide[..., ::2], g_ref[0])
    assert (d_wide[..., 1::2] == 0).all()
    for got, ref in zip(rest, g_ref[1:], strict=True):
        close(got, ref)
    # T = 2 < W - 1 = 3: the next window holds the end of the old window, then x
    x, weight, window = conv_case(2, 2, 5, 4, True, seed=3)
    (y_ref, w_ref), g_ref = reference_conv(x, weight, window)
    ins = leaves(x, weight, window)
    y, new_window = fused_short_conv(*ins)
    close(y, y_ref)
    close(new_window, w_ref)
    for got, ref in zip(grads((y, new_window), ins), g_ref, strict=True):
        close(got, ref)


def test_short_conv_packed_sequences_do_not_see_each_other():
    cu = [0, 5, 5, 6, 23, 40]  # an empty sequence, one of length 1 (< W - 1)
    x, weight, _ = conv_case(1, 40, 13, 4, False, seed=4)
    (y_ref, _), g_ref = reference_conv(x, weight, None, cu_seqlens=cu)
    ins = leaves(x, weight)
    y, new_window = fused_short_conv(*ins, cu_seqlens=torch.tensor(cu, device=DEVICE))
    close(y, y_ref)
    for got, ref in zip(grads((y, new_window), ins), g_ref, strict=True):
        close(got, ref)
    # the same sequences named by each token's position instead (what the layer passes, lengths checked once)
    y_pos, _ = fused_short_conv(*ins, positions=positions_in_sequence(cu, DEVICE))
    close(y_pos, y_ref)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's NumPy: exp(1e36) = inf
def test_short_conv_large_finite_inputs_stay_finite():
    x, weight, window = conv_case(1, 9, 6, 3, True, scale=1e36, seed=5)
    ins = leaves(x, weight.clamp(-1, 1), window)
    y, _ = fused_short_conv(*ins)
    assert torch.isfinite(y).all()
    for grad in torch.autograd.grad(y.sum(), ins):
        assert torch.isfinite(grad).all()


def test_short_conv_rejects_bad_arguments():
    x = torch.randn(1, 6, 5, device=DEVICE)
    w = torch.randn(5, 3, device=DEVICE)
    with pytest.raises(ValueError, match=r"x must be a torch.Tensor of shape \[B, T, C\]"):
        fused_short_conv(x[0], w)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        fused_short_conv(x.double(), w)
    with pytest.raises(ValueError, match=r"weight must be a torch.Tensor of shape \[C, W\] = \[5, W >= 1\]"):
        fused_short_conv(x, w[:4])
    with pytest.raises(
        ValueError, match=r"window must be a torch.Tensor of shape \[B, W - 1, C\] = \[1, 2, 5\]"
    ):
        fused_short_conv(x, w, torch.zeros(1, 3, 5, device=DEVICE))
    with pytest.raises(ValueError, match="pass window=None with it"):
        fused_short_conv(x, w, torch.zeros(1, 2, 5, device=DEVICE), torch.tensor([0, 6], device=DEVICE))
    with pytest.raises(ValueError, match="must start at 0 and end at T = 6"):
        fused_short_conv(x, w, cu_seqlens=torch.tensor([0, 5], device=DEVICE))
    with pytest.raises(ValueError, match=r"positions must be an int32/int64 tensor \[T\] = \[6\]"):
        fused_short_conv(x, w, positions=torch.arange(5, device=DEVICE))
    with pytest.raises(ValueError, match="pass cu_seqlens or positions, not both"):
        fused_short_conv(x, w, cu_seqlens=torch.tensor([0, 6], device=DEVICE), positions=torch.arange(6))


# --------------------------------------------------------------------------------------------------- norms


def test_l2_normalize_matches_with_gradient_on_strided_rows_and_extreme_values():
    gen = torch.Generator().manual_seed(6)
    qkv = torch.randn(2, 21, 3 * 2 * 20, generator=gen, dtype=torch.float64)
    qkv[0, 3, 40:60] *= 3e37  # a row whose sum of squares overflows float32
    qkv[1, 4, 40:60] = 0.0  # a zero row stays zero
    qkv[1, 5, 44] = 1e30
    wide = leaves(qkv)[0]
    k = wide[..., 40:80].reshape(2, 21, 2, 20)  # a slice of qkv, as the layer's k: read in place
    y = fused_l2_normalize(k)
    y_ref_in = qkv[..., 40:80].reshape(2, 21, 2, 20).requires_grad_()
    y_ref = l2_normalize(y_ref_in)
    assert y.shape == k.shape and y.is_contiguous() and y[1, 4, 0].abs().max() == 0
    close(y, y_ref)
    (d_wide,) = grads((y,), [wide])
    (d_ref,) = grads((y_ref,), [y_ref_in])
    close(d_wide[..., 40:80].reshape(2, 21, 2, 20), d_ref)
    assert (d_wide[..., :40] == 0).all() and (d_wide[..., 80:] == 0).all()


def test_gated_rms_norm_matches_gatedrmsnorm_with_gradients_and_extreme_values():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 13, 2, 11, generator=gen, dtype=torch.float64)
    x[0, 1, 1] *= 3e37  # the mean square overflows float32
    x[2, 2, 0] = 0.0
    z = 3 * torch.randn(3, 13, 2, 11, generator=gen, dtype=torch.float64)
    norm = GatedRMSNorm(11, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(11, generator=gen, dtype=torch.float64))
    ref_ins = [x.clone().requires_grad_(), z.clone().requires_grad_(), norm.weight]
    y_ref = norm(ref_ins[0], ref_ins[1])
    ins = leaves(x.transpose(0, 1), z, norm.weight)  # x strided
    ins[0] = ins[0].transpose(0, 1)
    y = fused_gated_rms_norm(ins[0], ins[1], ins[2], 1e-5)
    close(y, y_ref)
    for got, ref in zip(grads((y,), ins), grads((y_ref,), ref_ins), strict=True):
        close(got, ref)


def test_norms_keep_low_precision_dtypes():
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 7, 2, 24, generator=gen, dtype=torch.float64)
    z = torch.randn(2, 7, 2, 24, generator=gen, dtype=torch.float64)
    w = torch.rand(24, generator=gen, dtype=torch.float64)
    norm = GatedRMSNorm(24, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(w)
    for dtype in (torch.bfloat16, torch.float16):  # bf16 roundoff 3.9e-3, float16 4.9e-4: input and output
        y = fused_l2_normalize(x.to(DEVICE, dtype))
        assert y.dtype == dtype
        close(y, l2_normalize(x), tol=1e-2)
        y = fused_gated_rms_norm(x.to(DEVICE, dtype), z.to(DEVICE, dtype), w.to(DEVICE, torch.float32), 1e-5)
        assert y.dtype == dtype
        close(y, norm(x, z), tol=1e-2)


def test_norms_reject_bad_arguments():
    x = torch.randn(2, 3, 8, device=DEVICE)
    with pytest.raises(TypeError, match=r"x \[\.\.\., K\] must be float32, bfloat16 or float16"):
        fused_l2_normalize(x.double())
    with pytest.raises(ValueError, match="eps must be a number > 0"):
        fused_l2_normalize(x, eps=0.0)
    with pytest.raises(ValueError, match=r"x must be a torch.Tensor of shape \[\.\.\., K\]"):
        fused_l2_normalize(torch.tensor(1.0))
    w = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match=r"gate must have x's shape \(2, 3, 8\)"):
        fused_gated_rms_norm(x, x[:1], w, 1e-5)
    with pytest.raises(ValueError, match=r"weight must have shape \[D\] = \[8\]"):
        fused_gated_rms_norm(x, x, w[:7], 1e-5)
    with pytest.raises(ValueError, match="eps must be a number > 0"):
        fused_gated_rms_norm(x, x, w, -1.0)
    leaf = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="not differentiable: second derivatives"):
        torch.autograd.grad(fused_l2_normalize(leaf).square().sum(), leaf, create_graph=True)


# --------------------------------------------------------------------------------------------------- gates


def gate_case(B, T, HV, K, seed, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    f = scale * torch.randn(B, T, HV, K, generator=gen, dtype=torch.float64)
    b = scale * torch.randn(B, T, HV, generator=gen, dtype=torch.float64)
    A_log = torch.randn(HV, generator=gen, dtype=torch.float64)
    dt_bias = 3 * torch.randn(HV, K, generator=gen, dtype=torch.float64) - 4  # softplus near 1e-3 and below
    return f, b, A_log, dt_bias


@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
@pytest.mark.parametrize("HV, K", [(3, 20), (3, 50)])  # 60 columns, and 150: a head across two blocks
def test_gates_match_the_references_with_gradients(gate, HV, K):
    f, b, A_log, dt_bias = gate_case(2, 19, HV, K, seed=9)  # 38 tokens: three row blocks of 16
    ref_ins = [t.clone().requires_grad_() for t in (f, b, A_log, dt_bias)]
    if gate == "softplus":
        g_ref = kda_gate(ref_ins[0], ref_ins[2], ref_ins[3])
    else:
        g_ref = kda_gate_lower_bound(ref_ins[0], ref_ins[2], ref_ins[3], lower_bound=-3.0)
    beta_ref = beta_sigmoid(ref_ins[1])
    ins = leaves(f, b, A_log, dt_bias)
    g, beta = fused_kda_gates(*ins, gate=gate, lower_bound=-3.0)
    assert g.dtype == torch.float32 and beta.dtype == torch.float32
    close(g, g_ref)
    close(beta, beta_ref)
    for got, ref in zip(grads((g, beta), ins), grads((g_ref, beta_ref), ref_ins), strict=True):
        close(got, ref)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
def test_gates_stay_finite_for_large_inputs_and_keep_betas_dtype(gate):
    f, b, A_log, dt_bias = gate_case(1, 5, 2, 8, seed=10, scale=1e30)
    ins = leaves(f, b) + leaves(A_log.clamp(max=2), dt_bias)
    ins[1] = ins[1].detach().bfloat16().requires_grad_()
    g, beta = fused_kda_gates(*ins, gate=gate)
    assert g.dtype == torch.float32 and beta.dtype == torch.bfloat16
    assert torch.isfinite(g).all() and (g <= 0).all() and torch.isfinite(beta).all()
    for grad in torch.autograd.grad(g.sum() + beta.float().sum(), ins):
        assert torch.isfinite(grad).all()


def test_gates_reject_bad_arguments():
    f, b, A_log, dt_bias = (t.float().to(DEVICE) for t in gate_case(1, 3, 2, 4, seed=11))
    with pytest.raises(ValueError, match=r"f must be a torch.Tensor of shape \[B, T, HV, K\]"):
        fused_kda_gates(f[0], b, A_log, dt_bias)
    with pytest.raises(ValueError, match=r"b must be a torch.Tensor of shape \[B, T, HV\] = \[1, 3, 2\]"):
        fused_kda_gates(f, b[..., :1], A_log, dt_bias)
    with pytest.raises(ValueError, match=r"dt_bias must be a torch.Tensor of shape \[HV, K\] = \[2, 4\]"):
        fused_kda_gates(f, b, A_log, dt_bias.t())
    with pytest.raises(TypeError, match="A_log must be float32, bfloat16 or float16"):
        fused_kda_gates(f, b, A_log.double(), dt_bias)
    with pytest.raises(ValueError, match="gate must be 'softplus' or 'lower_bound'"):
        fused_kda_gates(f, b, A_log, dt_bias, gate="sigmoid")
    with pytest.raises(ValueError, match="lower_bound must be finite and < 0"):
        fused_kda_gates(f, b, A_log, dt_bias, gate="lower_bound", lower_bound=0.0)


# --------------------------------------------------------------------------------------------------- layer


@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
def test_layer_with_fused_parts_matches_the_pytorch_layer(gate, monkeypatch):
    """The recurrence stays in PyTorch (backend="torch", fast on a CPU) while the parts around it are forced
    into the kernels: the output, the input's gradient and every parameter's gradient agree with the PyTorch
    layer in float32, over two calls sharing a cache (the second convolution starts from the first's window)
    and over packed sequences."""
    import kda_edu.kernels as kernels

    names = ("fused_short_conv", "fused_l2_normalize", "fused_kda_gates", "fused_gated_rms_norm")
    calls = []
    for name in names:
        real = getattr(kernels, name)
        monkeypatch.setattr(
            kernels, name, lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw)
        )
    cu = torch.tensor([0, 7, 9, 20], device=DEVICE)
    results = {}
    for fused in (False, True):
        monkeypatch.setattr(KDALayer, "_fused_parts", lambda self, x, fused=fused: fused)
        torch.manual_seed(12)
        cfg = KDAConfig(num_heads=2, head_dim=12, v_head_dim=10, gate=gate, chunk_size=8, backend="torch")
        layer = KDALayer(24, cfg).to(DEVICE)
        x = torch.randn(1, 20, 24, device=DEVICE, requires_grad=True)
        cache = layer.new_cache()
        y = torch.cat([layer(x[:, :11], cache=cache), layer(x[:, 11:], cache=cache)], dim=1)
        y_packed = layer(x, cu_seqlens=cu)
        (y.square().sum() + y_packed.square().sum()).backward()
        results[fused] = [y, y_packed, x.grad] + [p.grad for p in layer.parameters()]
    assert (
        sorted(set(calls)) == sorted(names) and len(calls) == 3 * 5
    )  # three calls, q and k normalised apart
    for got, ref in zip(results[True], results[False], strict=True):
        close(got, ref)


def test_layer_fuses_its_parts_where_the_recurrence_runs_in_the_kernels():
    layer = KDALayer(16, KDAConfig(num_heads=2, head_dim=8, backend="triton"))
    x = torch.randn(1, 3, 16)
    assert layer._fused_parts(x) and not layer._fused_parts(x.double())  # float64: the PyTorch modules
    assert not KDALayer(16, KDAConfig(num_heads=2, head_dim=8, backend="torch"))._fused_parts(x)
