"""The whole KDA layer on a GPU: kda_edu's `KimiDeltaAttention` against fla's, with the same weights.

The kernel benchmarks (bench_kda.py, bench_kda_bwd.py) time the operator on prepared inputs. A layer does more
around it: the projections, the short convolutions, the gate (fla can fuse it into the kernel:
`use_gate_in_kernel`), the q/k L2 norm and beta's sigmoid (fused in fla's kernels, separate PyTorch ops in
ours), the gated output norm. This script builds fla's layer (`fla.layers.kda.KimiDeltaAttention`, mode "chunk",
bf16), copies its weights into ours (`kda_edu.layers.fla_compat.KimiDeltaAttention.from_fla_state_dict`), and:
  1. checks that the two layers agree: the relative error of the output and of the input's gradient,
     bounded by 3e-2 (bf16 everywhere, unit roundoff 3.9e-3, through two projections, a norm and the operator);
  2. times the forward and one training step (forward, then backward of sum(o * do) for a fixed random do,
     gradients of the input and of every weight) with `triton.testing.do_bench` (median), and the peak memory
     of one step beyond what was allocated before it.
Layer: hidden 2048, 16 heads of 128 (Kimi Linear's head size), the softplus gate and the lower-bound gate
(-5, fla's `safe_gate`). fla autotunes its kernels at every new shape (80-95 s on an H200): one shape per
call is the default.

    python -m bench.kernels.bench_kda_layer --out $OUT/h200_kda_layer.json [--shapes 1,8192 8,4096]
"""

import argparse
import os

import torch
from triton.testing import do_bench

from bench.common import run_environment, write_result
from kda_edu.layers.fla_compat import KimiDeltaAttention

os.environ.setdefault("FLA_FLASH_KDA", "0")  # fla's Triton path (FlashKDA is a forward-only inference kernel)
HIDDEN, HEADS, HEAD_DIM = 2048, 16, 128
GATES = {"softplus": {}, "lower_bound": {"lower_bound": -5.0, "safe_gate": True}}
TOL = 3e-2


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def layers(gate: str):
    """fla's layer and ours, bf16 on the GPU, with the same weights."""
    from fla.layers.kda import KimiDeltaAttention as FlaKDA

    kwargs = dict(hidden_size=HIDDEN, head_dim=HEAD_DIM, num_heads=HEADS, **GATES[gate])
    torch.manual_seed(0)
    theirs = FlaKDA(mode="chunk", **kwargs).cuda().to(torch.bfloat16)
    ours = KimiDeltaAttention.from_fla_state_dict(theirs.state_dict(), **kwargs)
    return theirs, ours


def step(layer, x, do):
    """One training step's work: forward, backward; the gradients are dropped again."""
    x.grad = None
    for p in layer.parameters():
        p.grad = None
    o = layer(x)[0]
    o.backward(do)
    return o


def measure(gate: str, B: int, T: int) -> dict:
    theirs, ours = layers(gate)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(B, T, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    do = torch.randn(B, T, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    row = {"gate": gate, "B": B, "T": T}
    outs, grads = {}, {}
    for name, layer in (("fla", theirs), ("kda_edu", ours)):
        outs[name] = step(layer, x, do).detach()
        grads[name] = x.grad.detach().clone()
    row["o rel diff"], row["dx rel diff"] = (
        rel(outs["kda_edu"], outs["fla"]),
        rel(grads["kda_edu"], grads["fla"]),
    )
    row["agree"] = row["o rel diff"] < TOL and row["dx rel diff"] < TOL
    for name, layer in (("fla", theirs), ("kda_edu", ours)):
        with torch.no_grad():
            row[f"{name} fwd ms"] = do_bench(lambda layer=layer, x=x: layer(x), return_mode="median")
        row[f"{name} fwd+bwd ms"] = do_bench(
            lambda layer=layer, x=x, do=do: step(layer, x, do), return_mode="median"
        )
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(layer, x, do)
        torch.cuda.synchronize()
        row[f"{name} step peak GiB"] = (torch.cuda.max_memory_allocated() - before) / 2**30
    del theirs, ours, x, do
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT", "bench/results"), "h200_kda_layer.json")
    )
    ap.add_argument("--shapes", nargs="+", default=["1,8192"], help="B,T pairs")
    ap.add_argument("--gates", nargs="+", default=list(GATES), choices=list(GATES))
    args = ap.parse_args()
    result = dict(
        **run_environment(),
        layer=dict(hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM, dtype="bfloat16"),
        tolerance=TOL,
        rows=[],
    )
    try:
        import fla

        result["fla"] = fla.__version__
    except ImportError:
        raise SystemExit("fla (flash-linear-attention) is needed: source bench/device/env.sh first") from None
    for shape in args.shapes:
        B, T = (int(s) for s in shape.split(","))
        for gate in args.gates:
            row = measure(gate, B, T)
            result["rows"].append(row)
            print(
                f"{gate} B={B} T={T}: o {row['o rel diff']:.1e}, dx {row['dx rel diff']:.1e}; fwd ours "
                f"{row['kda_edu fwd ms']:.3f} ms, fla {row['fla fwd ms']:.3f}; fwd+bwd ours "
                f"{row['kda_edu fwd+bwd ms']:.3f}, fla {row['fla fwd+bwd ms']:.3f}; peak ours "
                f"{row['kda_edu step peak GiB']:.2f} GiB, fla {row['fla step peak GiB']:.2f}",
                flush=True,
            )
            write_result(args.out, result)  # after every row: a call cut short keeps what it measured
    if not all(r["agree"] for r in result["rows"]):
        raise SystemExit("the layers disagree beyond the tolerance: see the rows' rel diffs")


if __name__ == "__main__":
    main()
