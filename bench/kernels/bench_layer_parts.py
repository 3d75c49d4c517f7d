"""The KDA layer's parts around the recurrence on a GPU: PyTorch against the fused Triton kernels.

At the layer of Kimi Linear's size, (B, T) = (1, 8192), hidden 2048, 16 heads of 128, bf16, this times the
forward and backward (`torch.autograd.grad` of the outputs against a fixed random output gradient) of:

    conv          ShortConv (W = 4, over q, k and v: 6144 channels)   vs  fused_short_conv
    l2norm        l2_normalize of q, a slice of the convolution's output  vs  fused_l2_normalize
    gates         kda_gate (or kda_gate_lower_bound) + beta_sigmoid   vs  fused_kda_gates
    o_norm        GatedRMSNorm                                        vs  fused_gated_rms_norm

and one training step of the whole `KDALayer` (forward, backward of sum(y * dy), the gradients of the input
and of every weight) with the parts in PyTorch and in the kernels (the recurrence is `chunk_kda` in both),
with the step's peak memory beyond what was allocated before it. Each row also records the relative
difference of the two outputs and input gradients (bf16: a few 1e-3 expected). The timings are medians of
`bench.common.interleaved` (the two forms take turns).

    python -m bench.kernels.bench_layer_parts --out $OUT/layer_parts.json [--T 8192] [--gates softplus]
"""

import argparse
import os

import torch

from bench.common import interleaved, run_environment, write_result
from kda_edu.layers.kda_layer import GatedRMSNorm, KDAConfig, KDALayer, ShortConv
from kda_edu.ops.gates import beta_sigmoid, kda_gate, kda_gate_lower_bound, l2_normalize

HIDDEN, HEADS, HEAD_DIM, CONV = 2048, 16, 128, 4
DTYPE = torch.bfloat16
GATES = ("softplus", "lower_bound")


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def fwd_bwd(fn, inputs, grad_outputs):
    """A function running fn's forward and the backward for `inputs` (gradients returned, not accumulated)."""

    def run():
        outputs = fn(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return outputs, torch.autograd.grad(outputs, inputs, grad_outputs)

    return run


def part_cases(T: int, gate: str, gen: torch.Generator) -> dict:
    """name -> (PyTorch function, fused function, inputs): the same inputs and parameters for both."""
    from kda_edu.kernels import fused_gated_rms_norm, fused_kda_gates, fused_l2_normalize, fused_short_conv

    def randn(*shape, dtype=DTYPE):
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype).requires_grad_()

    C = 3 * HEADS * HEAD_DIM
    conv = ShortConv(C, CONV).cuda().to(DTYPE)
    norm = GatedRMSNorm(HEAD_DIM, eps=1e-5).cuda().to(DTYPE)
    qkv = randn(1, T, C)
    A_log, dt_bias = randn(HEADS, dtype=torch.float32), randn(HEADS, HEAD_DIM, dtype=torch.float32)

    def q_of(x):
        return x[..., : HEADS * HEAD_DIM].reshape(1, T, HEADS, HEAD_DIM)

    def torch_gates(f, b, A_log, dt_bias):
        if gate == "softplus":
            return kda_gate(f, A_log, dt_bias), beta_sigmoid(b)
        return kda_gate_lower_bound(f, A_log, dt_bias, lower_bound=-5.0), beta_sigmoid(b)

    shape = (1, T, HEADS, HEAD_DIM)
    return {
        "conv": (lambda x: conv(x)[0], lambda x: fused_short_conv(x, conv.weight)[0], [qkv]),
        "l2norm": (lambda x: l2_normalize(q_of(x)), lambda x: fused_l2_normalize(q_of(x)), [qkv]),
        "gates": (
            torch_gates,
            lambda f, b, A_log, dt_bias: fused_kda_gates(f, b, A_log, dt_bias, gate, -5.0),
            [randn(*shape), randn(1, T, HEADS), A_log, dt_bias],
        ),
        "o_norm": (
            norm,
            lambda o, z: fused_gated_rms_norm(o, z, norm.weight, norm.eps),
            [randn(*shape), randn(*shape)],
        ),
    }


def measure_parts(T: int, gate: str) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (reference, fused, inputs) in part_cases(T, gate, gen).items():
        outputs = reference(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        grad_outputs = [torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype) for o in outputs]
        runs = {
            form: fwd_bwd(fn, inputs, grad_outputs) for form, fn in (("torch", reference), ("fused", fused))
        }
        (o_ref, d_ref), (o_fused, d_fused) = runs["torch"](), runs["fused"]()
        times = interleaved(runs)
        rows.append(
            dict(
                part=name,
                gate=gate,
                T=T,
                **{f"{form} fwd+bwd ms": ms for form, ms in times.items()},
                **{"o rel diff": rel(o_fused[0], o_ref[0]), "d input rel diff": rel(d_fused[0], d_ref[0])},
            )
        )
    return rows


def measure_layer(T: int, gate: str) -> dict:
    torch.manual_seed(0)
    config = KDAConfig(num_heads=HEADS, head_dim=HEAD_DIM, conv_size=CONV, gate=gate, backend="auto")
    layer = KDALayer(HIDDEN, config).cuda().to(DTYPE)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, T, HIDDEN, device="cuda", generator=gen).to(DTYPE).requires_grad_()
    dy = torch.randn(1, T, HIDDEN, device="cuda", generator=gen).to(DTYPE)
    assert layer._fused_parts(x), "the layer should fuse its parts on a CUDA GPU in bf16"

    def step(fused: bool):
        def run():
            layer._fused_parts = lambda x: fused  # the instance's choice, over the class's
            x.grad = None
            for p in layer.parameters():
                p.grad = None
            y = layer(x)
            y.backward(dy)
            return y.detach(), x.grad.detach().clone()

        return run

    runs = {"torch parts": step(False), "fused parts": step(True)}
    (y_ref, dx_ref), (y_fused, dx_fused) = runs["torch parts"](), runs["fused parts"]()
    row = dict(part="layer step", gate=gate, T=T, **{"o rel diff": rel(y_fused, y_ref)})
    row["d input rel diff"] = rel(dx_fused, dx_ref)
    row.update({f"{form} fwd+bwd ms": ms for form, ms in interleaved(runs).items()})
    for form, run in runs.items():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        row[f"{form} step peak GiB"] = (torch.cuda.max_memory_allocated() - before) / 2**30
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench/results"), "layer_parts.json"))
    ap.add_argument("--T", type=int, default=8192, help="tokens (B = 1)")
    ap.add_argument("--gates", nargs="+", default=list(GATES), choices=list(GATES))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_layer_parts times the kernels on a CUDA GPU; there is none here")
    result = dict(
        **run_environment(),
        layer=dict(hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM, conv_size=CONV, dtype="bfloat16"),
        rows=[],
    )
    for gate in args.gates:
        for row in [*measure_parts(args.T, gate), measure_layer(args.T, gate)]:
            result["rows"].append(row)
            times = ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k.endswith("ms") or k.endswith("GiB"))
            print(f"{row['part']} ({gate}): {times}; o rel diff {row['o rel diff']:.1e}", flush=True)
            write_result(args.out, result)  # after every row: a call cut short keeps what it measured


if __name__ == "__main__":
    main()
