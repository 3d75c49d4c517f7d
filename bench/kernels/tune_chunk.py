"""Sweep chunk_kda's forward designs and launch knobs on a GPU, timing each kernel, to choose the defaults.

For each headline shape: the three prepare kernels alone (`stop_after` stops the launcher after them) and the whole
forward under each (key columns per step, warps) choice, the scan's time being the difference; optionally the
scan's own knobs; fla's chunk_kda at the same shape in the same run for scale. Registers and
spills of every compiled variant are recorded too. Results go to a JSON file; docs/kernel-design.md keeps the
conclusions.

    python -m bench.kernels.tune_chunk --out tune.json [--shapes 1]
"""

import argparse
import itertools

import torch
from triton.testing import do_bench

from bench.common import kda_inputs, write_result
from bench.kernels.bench_kda import HEADLINE, D
from kda_edu.kernels.chunk_fwd import chunk_kda_fwd


def timed(rows, shape, call, **kw):
    """Median time of the forward (up to `stop_after`) with these knobs; appends a row."""
    info = {}
    chunk_kda_fwd(*call, info=info, **kw)
    ms = do_bench(lambda: chunk_kda_fwd(*call, **kw), warmup=25, rep=100, return_mode="median")
    rows.append(dict(shape=shape, knobs=kw, ms=ms, resources=info))
    print(f"{shape} {kw}: {ms:.3f} ms {info}", flush=True)
    return ms


def fla_time(x):
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except ImportError as e:
        return f"fla not importable: {e}"
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    return do_bench(lambda: fla_chunk_kda(*args, scale=D**-0.5), warmup=25, rep=100, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune.json")
    ap.add_argument("--shapes", type=int, default=3, help="how many headline shapes to sweep")
    ap.add_argument("--kc", type=int, nargs="+", default=[16, 32, 64], help="key columns per pass step")
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--scan", action="store_true", help="also sweep the scan's value block / warps / stages")
    args = ap.parse_args()
    rows = []
    for B, T, H in HEADLINE[: args.shapes]:
        x = kda_inputs(B, T, H, D)
        call = (x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5, None, False)
        ms = fla_time(x)
        rows.append(dict(shape=(B, T, H), method="fla chunk_kda", ms=ms))
        print(f"{(B, T, H)} fla chunk_kda: {ms}", flush=True)
        for kc, warps in itertools.product(args.kc, args.warps):
            kw = dict(kc=kc, warps_prepare=(warps, 1, warps))  # gram, inverse, w/u
            t_prep = timed(rows, (B, T, H), call, stop_after="prepare", **kw)
            total = timed(rows, (B, T, H), call, **kw)
            rows[-1].update(prepare_ms=t_prep, scan_ms=total - t_prep)
        if args.scan:
            for bv, warps, stages in itertools.product((16, 32, 64), (4, 8), (2, 3)):
                timed(rows, (B, T, H), call, bv=bv, warps_scan=warps, stages=stages)
        del x, call
        torch.cuda.empty_cache()
    write_result(args.out, rows)


if __name__ == "__main__":
    main()
