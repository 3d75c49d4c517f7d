"""The token mixers of chapter 12: shapes, causality, equal state size, every parameter trained, chunk size."""

import dataclasses

import pytest
import torch

from kda_edu.layers.mixers import KINDS, MixerConfig, TokenMixer
from kda_edu.models.recall import RecallConfig, RecallLM

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the Triton backend's kernels run
# The two backends in float32: 1e-5 under the interpreter (exact float32 products, as the other interpreter
# tests); on a GPU 2e-3, the tolerance test_chunk_bwd.py holds the float32 backward to there.
BACKEND_TOL = 1e-5 if DEVICE == "cpu" else 2e-3


def _twin(layer: TokenMixer, **changes) -> TokenMixer:
    """A new mixer with the layer's weights and its config changed by `changes`."""
    twin = TokenMixer(layer.d_model, dataclasses.replace(layer.config, **changes))
    twin.load_state_dict(layer.state_dict())
    return twin.to(dtype=next(layer.parameters()).dtype, device=next(layer.parameters()).device)


@pytest.mark.parametrize("kind", KINDS)
def test_mixer_is_causal_and_trains_every_parameter(kind):
    torch.manual_seed(0)
    layer = TokenMixer(24, MixerConfig(kind=kind, num_heads=2, head_dim=8, chunk_size=4)).double()
    x = torch.randn(2, 11, 24, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    changed = x.detach().clone()
    changed[:, 6:] = torch.randn(2, 5, 24, dtype=torch.float64)
    torch.testing.assert_close(layer(changed)[:, :6], y[:, :6].detach(), rtol=1e-10, atol=1e-10)
    y.square().sum().backward()
    unused = [n for n, p in layer.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not unused, f"parameters without a gradient: {unused}"


@pytest.mark.parametrize("kind", ["linear_attention", "deltanet", "gated_deltanet", "kda"])
def test_chunk_size_does_not_change_the_output(kind):
    torch.manual_seed(1)
    layer = TokenMixer(16, MixerConfig(kind=kind, num_heads=2, head_dim=8, chunk_size=16)).double()
    x = torch.randn(1, 13, 16, dtype=torch.float64)
    y16 = layer(x)
    torch.testing.assert_close(_twin(layer, chunk_size=3)(x), y16, rtol=1e-10, atol=1e-10)


def test_linear_mixers_have_equal_state_and_near_equal_parameters():
    sizes = {kind: MixerConfig(kind=kind, num_heads=2, head_dim=16).state_size for kind in KINDS}
    assert sizes["attention"] is None
    assert {sizes[k] for k in KINDS if k != "attention"} == {2 * 16 * 16}
    counts = [RecallLM(RecallConfig(mixer=MixerConfig(kind=kind))).num_parameters() for kind in KINDS]
    assert max(counts) / min(counts) < 1.05  # the gates add a few percent at most


def test_recall_lm_logits_and_input_check():
    model = RecallLM(RecallConfig(vocab_size=20, d_model=16, mixer=MixerConfig(num_heads=2, head_dim=8)))
    assert model(torch.randint(0, 20, (3, 9))).shape == (3, 9, 20)
    with pytest.raises(ValueError, match="int64 tensor of shape \\[B, T\\]"):
        model(torch.zeros(3, 9))
    with pytest.raises(ValueError, match="kind"):
        MixerConfig(kind="mamba")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["deltanet", "gated_deltanet", "kda"])
def test_triton_backend_matches_the_chunked_pytorch_forms(kind):
    """The Triton kernel (the interpreter on a CPU) gives the same output and gradients as the PyTorch forms."""
    torch.manual_seed(2)
    torch_cfg = MixerConfig(kind=kind, num_heads=2, head_dim=16, chunk_size=16)
    layer = TokenMixer(32, torch_cfg).to(DEVICE)
    x = torch.randn(2, 70, 32, device=DEVICE)  # T = 70: a full chunk of 64 and a partial one
    grads = {}
    for backend in ("torch", "triton"):
        layer = _twin(layer, backend=backend)
        xb = x.clone().requires_grad_()
        y = layer(xb)
        y.square().sum().backward()
        grads[backend] = [y.detach(), xb.grad] + [p.grad for p in layer.parameters()]
    for a, b in zip(grads["torch"], grads["triton"], strict=True):
        assert (a - b).norm() <= BACKEND_TOL * a.norm(), (kind, ((a - b).norm() / a.norm()).item())


def test_backend_is_checked():
    with pytest.raises(ValueError, match="backend"):
        MixerConfig(backend="cuda")


def test_kernel_dtype_is_checked():
    with pytest.raises(ValueError, match="kernel_dtype must be one of"):
        MixerConfig(backend="triton", kernel_dtype="float64")
    with pytest.raises(ValueError, match="needs backend='triton'"):
        MixerConfig(kernel_dtype="bfloat16")


@pytest.mark.slow
def test_bfloat16_kernel_stays_close_to_float32():
    """kernel_dtype="bfloat16" rounds q, k, v for the kernel and returns the model's dtype."""
    torch.manual_seed(0)
    cfg = MixerConfig("kda", 2, 16, chunk_size=16, backend="triton")
    layer = TokenMixer(32, cfg).to(DEVICE)
    x = torch.randn(2, 70, 32, device=DEVICE, requires_grad=True)
    y32 = layer(x)
    y16 = _twin(layer, kernel_dtype="bfloat16")(x)
    y16.square().sum().backward()
    assert y16.dtype == torch.float32 and bool(x.grad.isfinite().all())
    assert (y16 - y32).norm() <= 1e-2 * y32.norm()


def test_triton_backend_names_a_device_it_cannot_use(monkeypatch):
    """On a machine that compiles the kernels (simulated on a CPU), a CPU model with backend="triton" gets
    a clear error naming the tensor and what to do, not Triton's "cannot be accessed from Triton"."""
    from kda_edu.kernels import _backend

    layer = TokenMixer(32, MixerConfig("kda", 2, 16, chunk_size=16, backend="triton"))
    monkeypatch.setattr(_backend, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="x is on cpu, but the Triton kernels are compiled for the CUDA GPU"):
        layer(torch.randn(1, 5, 32))


def test_kda_mixer_is_the_kda_layer_and_loads_its_old_flat_names():
    """kind="kda" holds a KDALayer (one KDA implementation); a state dict saved when the mixer held the
    parameters itself (flat names, `f_proj.0`/`f_proj.1` for the decay projection) loads into it."""
    from kda_edu.layers.kda_layer import KDALayer

    torch.manual_seed(3)
    layer = TokenMixer(16, MixerConfig("kda", num_heads=2, head_dim=8, chunk_size=4)).double()
    assert isinstance(layer.kda, KDALayer) and layer.kda.config.chunk_size == 4
    renamed = {"f_down.weight": "f_proj.0.weight", "f_up.weight": "f_proj.1.weight"}
    flat = {renamed.get(k[4:], k[4:]): v.clone() for k, v in layer.state_dict().items()}
    assert "q_proj.weight" in flat and "f_proj.0.weight" in flat
    fresh = TokenMixer(16, MixerConfig("kda", num_heads=2, head_dim=8, chunk_size=4)).double()
    fresh.load_state_dict(flat)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    torch.testing.assert_close(fresh(x), layer(x), rtol=1e-12, atol=1e-12)


def test_recall_lm_is_built_from_the_hybrid_models_blocks():
    from kda_edu.models.model import Block

    model = RecallLM(
        RecallConfig(vocab_size=20, d_model=16, n_layers=2, mixer=MixerConfig(num_heads=2, head_dim=8))
    )
    assert all(type(b) is Block and isinstance(b.mixer, TokenMixer) for b in model.blocks)
    ids = torch.randint(0, 20, (2, 7))
    x = model.embed(ids)
    for block in model.blocks:  # the block by hand: x + mixer(norm(x)), then x + ffn(norm(x))
        x = x + block.mixer(block.mixer_norm(x))
        x = x + block.ffn(block.ffn_norm(x))
    torch.testing.assert_close(model(ids), model.norm(x) @ model.embed.weight.T, rtol=1e-6, atol=1e-6)
