"""Experiment on a GPU: the value block of the passes over the chunks, and bfloat16 w/u products.

Two questions, one process, bf16, K = V = 128, the headline shapes of bench.kernels.bench_kda:

1. Waves. `_chunk_scan_kernel` and the backward's `_states_kernel` / `_dstates_kernel` run one program per
   (value block, sequence x value head), each a chain over all the sequence's chunks, one program per
   multiprocessor (the scan's pipelined tiles take ~130 kB of shared memory). At (1, 8192, 32) a value block of
   32 gives 128 programs, one wave on the H200's 132 multiprocessors; at (8, 4096, 16) it gives 512: four waves
   of 64 chunks, twice the chain of one wave of 128. Wider blocks mean fewer waves and more work per chunk.
   Timed: the whole forward for value blocks 16 .. 128 and 4 or 8 scan warps (`chunk_kda_fwd`'s `bv`,
   `warps_scan`), the prepare kernels alone (`stop_after="prepare"`), and the backward alone
   (`chunk_kda_bwd`, recomputing) for value blocks of its two state passes.
2. `wu_prec="bf16"`: the w/u kernel's products on bfloat16 operands; the prepare kernels alone, and how far o
   moves from the default (relative norm) at each shape and from a float64 loop at a small one.

    source bench/device/env.sh
    python -m bench.experiments.scan_waves --out $OUT/scan_waves.json [--shapes 1,8192,32 8,4096,16]

A variant that fails (to compile, to run) is recorded with its error. The JSON is written after every row.
"""

import argparse
import json

import torch
from triton.testing import do_bench

from bench.common import kda_inputs, run_environment, write_result
from bench.kernels.bench_kda import HEADLINE, D
from kda_edu.kernels.chunk_bwd import chunk_kda_bwd
from kda_edu.kernels.chunk_fwd import chunk_kda_fwd
from kda_edu.ops.kda import kda_recurrent

FWD = [dict()] + [dict(bv=bv, warps_scan=w) for bv in (16, 32, 64, 128) for w in (4, 8)]
BWD = [dict(), dict(bv=32), dict(bv=64), dict(bv=128)]


def ms(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def record(result, path, row):
    result["rows"].append(row)
    print(json.dumps(row), flush=True)
    write_result(path, result)


def attempt(fn):
    try:
        return fn()
    except Exception as e:  # a variant that does not compile or run is a result, not the end of the run
        return f"{type(e).__name__}: {str(e)[:300]}"


def small_error():
    """Relative error of o against a float64 loop at (1, 1024, 4), default and bf16 w/u products."""
    x = kda_inputs(1, 1024, 4, D, seed=1)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    ref = kda_recurrent(*(t.double().cpu() for t in args), scale=D**-0.5)[0]
    out = {}
    for prec in (None, "bf16"):
        o = chunk_kda_fwd(*args, D**-0.5, None, False, wu_prec=prec)[0].double().cpu()
        out[str(prec)] = ((o - ref).abs().max() / ref.abs().max()).item()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="scan_waves.json")
    ap.add_argument("--shapes", nargs="+", default=None, help="B,T,H (default: the four headline shapes)")
    ap.add_argument("--no-bwd", action="store_true")
    args = ap.parse_args()
    shapes = [tuple(int(n) for n in s.split(",")) for s in args.shapes] if args.shapes else HEADLINE
    result = dict(environment=run_environment(), rows=[], small_error=attempt(small_error))
    print("small error", result["small_error"], flush=True)
    for B, T, H in shapes:
        one_shape(result, args.out, B, T, H, bwd=not args.no_bwd and B * T * H <= 2**19)
        torch.cuda.empty_cache()


def one_shape(result, path, B, T, H, bwd):
    x = kda_inputs(B, T, H, D)
    call = (x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5, None, False)
    o_ref = chunk_kda_fwd(*call)[0]

    def fwd(**kw):
        return chunk_kda_fwd(*call, **kw)

    for prec in (None, "bf16"):
        row = dict(shape=(B, T, H), part="prepare", wu_prec=prec)
        row["ms"] = attempt(lambda: ms(lambda: fwd(stop_after="prepare", wu_prec=prec)))  # noqa: B023
        row["forward_ms"] = attempt(lambda: ms(lambda: fwd(wu_prec=prec)))  # noqa: B023
        row["o_rel_to_default"] = attempt(lambda: rel(fwd(wu_prec=prec)[0], o_ref))  # noqa: B023
        record(result, path, row)
    for kw in FWD:
        info = {}
        row = dict(shape=(B, T, H), part="forward", knobs=kw)
        row["ms"] = attempt(lambda: ms(lambda: fwd(**kw)))  # noqa: B023
        row["o_rel_to_default"] = attempt(lambda: rel(fwd(info=info, **kw)[0], o_ref))  # noqa: B023
        row["resources"] = info
        record(result, path, row)
    if not bwd:
        return
    do = torch.randn_like(x["v"])
    bwd_args = (x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5, None, do, None)
    ref = chunk_kda_bwd(*bwd_args)
    for kw in BWD:
        row = dict(shape=(B, T, H), part="backward", knobs=kw)
        row["ms"] = attempt(lambda: ms(lambda: chunk_kda_bwd(*bwd_args, **kw)))  # noqa: B023
        got = attempt(lambda: chunk_kda_bwd(*bwd_args, **kw))  # noqa: B023
        if isinstance(got, tuple):
            row["grad_rel_to_default"] = [rel(a, b) for a, b in zip(got[:5], ref[:5], strict=True)]
        else:
            row["error"] = got
        record(result, path, row)


if __name__ == "__main__":
    main()
