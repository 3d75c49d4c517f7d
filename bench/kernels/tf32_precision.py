"""What each `input_precision` of a float32 `tl.dot` costs in accuracy and time, on the current CUDA GPU.

For chapter 7's warm-up kernels (`batched_matmul` and `chunked_linear_attention` of `kda_edu.chapters.ch07_primer`),
at each precision "tf32", "tf32x3" and "ieee": the relative error of the whole result against float64
(Frobenius norms), the largest elementwise error over the size `primer.dot_error_bound` measures it against,
that bound, and the `triton.testing.do_bench` median time. Needs a GPU; runs in well under a minute.

    python -m bench.kernels.tf32_precision --out bench/results/h200_tf32.json
"""

import argparse
import os
from pathlib import Path

import torch

import kda_edu.kernels  # noqa: F401  (before triton)
from bench.common import write_result
from kda_edu.chapters import ch07_primer as primer
from kda_edu.ops.linear_attention import linear_attention_parallel

PRECISIONS = ("tf32", "tf32x3", "ieee")


def measure(run, exact, size, bound):
    from triton.testing import do_bench

    out = run().double()
    return {
        "rel_error": ((out - exact).norm() / exact.norm()).item(),
        "max_error_over_size": ((out - exact).abs() / size).max().item(),
        "bound": bound,
        "ms": do_bench(run, return_mode="median"),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "h200_tf32.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(8, 1024, 1024, device="cuda", generator=gen)
    b = torch.randn(8, 1024, 1024, device="cuda", generator=gen)
    exact, size = a.double() @ b.double(), a.double().abs() @ b.double().abs()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": None}
    import triton

    result["triton"] = triton.__version__
    result["batched_matmul"] = {
        p: measure(
            lambda p=p: primer.batched_matmul(a, b, block=(64, 64, 32), input_precision=p),
            exact,
            size,
            primer.dot_error_bound(p, depth=1024),
        )
        for p in PRECISIONS
    }
    result["batched_matmul"]["shape"] = [8, 1024, 1024, 1024]
    T = 4096
    q, k = (torch.randn(2, T, 2, 32, device="cuda", generator=gen) for _ in range(2))
    v = torch.randn(2, T, 2, 16, device="cuda", generator=gen)
    o_exact = linear_attention_parallel(q.double(), k.double(), v.double())
    o_size = linear_attention_parallel(q.double().abs(), k.double().abs(), v.double().abs())
    result["chunked_linear_attention"] = {
        p: measure(
            lambda p=p: primer.chunked_linear_attention(q, k, v, chunk=16, input_precision=p),
            o_exact,
            o_size,
            primer.dot_error_bound(p, depth=T + 2 * 32 + 16, roundings=4),
        )
        for p in PRECISIONS
    }
    result["chunked_linear_attention"]["shape"] = [2, T, 2, 32, 16]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(Path(args.out), result)
    for kernel in ("batched_matmul", "chunked_linear_attention"):
        for p in PRECISIONS:
            r = result[kernel][p]
            print(
                f"{kernel:25s} {p:7s} rel error {r['rel_error']:.1e}, max/size {r['max_error_over_size']:.1e} "
                f"(bound {r['bound']:.1e}), {r['ms']:.3f} ms"
            )
    print("wrote", args.out)


if __name__ == "__main__":
    main()
