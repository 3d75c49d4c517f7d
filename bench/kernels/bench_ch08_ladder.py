"""Chapter 8's ladder on a GPU: every version of the chunked KDA forward, checked, then timed side by side.

For each entry of `kda_edu.chapters.ch08_chunk_kernel.LADDER` (v0 first; blocks16, the production kernels with
chapter 8's 16 x 16-block gram kernel launched in place of chunk.py's; chunk_kda, the production kernels, last):
  1. check it against the float64 loop `kda_edu.ops.kda.kda_recurrent` on a small awkward shape
     (B = 2, T = 200: a partial last chunk; H = 2, HV = 4; K = V = 128; an initial state), in float32 and in
     bfloat16. Bounds on the relative error of o and of the final state: float32 1e-4 (the products inside
     a chunk are exact float32, but the GPU sums in another order than the loop, over T = 200 steps);
     bfloat16 1e-2 (o is rounded to bfloat16, unit roundoff 3.9e-3, and the products take TF32 operands,
     unit roundoff 4.9e-4; the reference runs on the same rounded inputs). A version that fails is not timed.
  2. time its launcher with `triton.testing.do_bench` (median) at (B, T, H) = (1, 8192, 32) and (8, 4096, 16),
     bfloat16, K = V = 128, on the inputs of bench/kernels/bench_kda.py (HV = H, gates in [-5, 0] in float32).
Writes `$OUT/h200_ch08_ladder.json` (or --out) and prints a table; each step records its `change` (LADDER's
text), its errors and the registers of its compiled kernels (`info=`), each shape the median ms per step.
About a minute or two on an H200, most of it compiling (the timed calls are bounded by do_bench's 100 ms
budget each).

    OUT=bench/results python -m bench.kernels.bench_ch08_ladder
"""

import argparse
import os
import sys
import time

import torch
from triton.testing import do_bench

from bench.common import (  # the forward benchmark's inputs: the times compare
    kda_inputs,
    run_environment,
    write_result,
)
from kda_edu.chapters.ch08_chunk_kernel import LADDER
from kda_edu.ops.kda import kda_recurrent

SHAPES = [(1, 8192, 32), (8, 4096, 16)]
CHECK_SHAPE = dict(B=2, T=200, H=2, HV=4, K=128, V=128)
TOL = {"float32": 1e-4, "bfloat16": 1e-2}


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def check(launcher, dtype_name):
    """Relative errors of o and of the final state against the float64 loop, on CHECK_SHAPE."""
    s = CHECK_SHAPE
    gen = torch.Generator(device="cuda").manual_seed(1)
    dt = getattr(torch, dtype_name)
    q = torch.randn(s["B"], s["T"], s["H"], s["K"], device="cuda", generator=gen).to(dt)
    k = torch.nn.functional.normalize(
        torch.randn(s["B"], s["T"], s["H"], s["K"], device="cuda", generator=gen), dim=-1
    ).to(dt)
    v = torch.randn(s["B"], s["T"], s["HV"], s["V"], device="cuda", generator=gen).to(dt)
    g = -5.0 * torch.rand(s["B"], s["T"], s["HV"], s["K"], device="cuda", generator=gen)
    beta = torch.rand(s["B"], s["T"], s["HV"], device="cuda", generator=gen)
    h0 = torch.randn(s["B"], s["HV"], s["K"], s["V"], device="cuda", generator=gen)
    o, ht = launcher(q, k, v, g, beta, s["K"] ** -0.5, h0, True)
    o_ref, ht_ref = kda_recurrent(
        *(x.double() for x in (q, k, v, g, beta)), initial_state=h0.double(), output_final_state=True
    )
    return {"o": rel(o, o_ref), "final_state": rel(ht, ht_ref)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT", "bench/results"), "h200_ch08_ladder.json")
    )
    args = ap.parse_args()
    result = dict(
        **run_environment(),
        dtype="bfloat16",
        K=128,
        V=128,
        inputs="bench/common.py kda_inputs: HV = H, bf16 q, k, v, beta; g in [-5, 0] float32",
        check_shape=CHECK_SHAPE,
        tolerance=TOL,
        steps=[],
        shapes=[],
    )
    passed = []
    start = time.perf_counter()
    for name, (launcher, change) in LADDER.items():
        step = dict(name=name, change=change, resources={})
        try:  # a version that fails to compile or to run is recorded, and the others still run
            step["errors"] = errors = {dt: check(launcher, dt) for dt in TOL}
            step["passed"] = all(e <= TOL[dt] for dt, errs in errors.items() for e in errs.values())
            if step["passed"]:
                x = kda_inputs(1, 1024, 4)  # registers and spills of the kernels compiled for K = V = 128
                launcher(
                    *(x[n] for n in ("q", "k", "v", "g", "beta")),
                    128**-0.5,
                    None,
                    False,
                    info=step["resources"],
                )
                passed.append(name)
        except Exception as e:  # noqa: BLE001 (any failure of a version is its result)
            step["passed"], step["failure"] = False, f"{type(e).__name__}: {e}"[:2000]
        result["steps"].append(step)
        print(
            f"{name}: {step.get('errors', step.get('failure'))} -> {'passed' if step['passed'] else 'FAILED, not timed'}; "
            f"{step['resources']} ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    for B, T, H in SHAPES:
        x = kda_inputs(B, T, H)
        call = [x[n] for n in ("q", "k", "v", "g", "beta")] + [128**-0.5, None, False]
        row = dict(B=B, T=T, H=H, ms={}, first_call_s={})
        for name in passed:
            launcher = LADDER[name][0]
            start = time.perf_counter()  # the first call at this shape: compiling (a new T) and one run
            launcher(*call)
            torch.cuda.synchronize()
            row["first_call_s"][name] = round(time.perf_counter() - start, 2)
            print(f"  {name} first call at B={B} T={T} H={H}: {row['first_call_s'][name]} s", flush=True)
            row["ms"][name] = do_bench(lambda f=launcher, a=call: f(*a), return_mode="median")
        result["shapes"].append(row)
        print(
            f"B={B} T={T} H={H}: " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in row["ms"].items()), flush=True
        )
        del x, call
        torch.cuda.empty_cache()
        write_result(args.out, result)  # after every shape: a call cut short keeps what it measured
        print(f"wrote {args.out}")
    if len(passed) < len(LADDER):
        sys.exit(1)


if __name__ == "__main__":
    main()
