"""Sweep chunk_kda's launch knobs on a GPU, timing each kernel, to choose the defaults.

For each headline shape: the prepare kernel alone under each warps choice, then the whole forward
under each scan choice (value block, warps, pipeline stages); the scan's time is the difference. Registers
and spills of every compiled variant are printed too. Results go to a JSON file; bench/NOTES.md keeps the
conclusions.

    python bench/tune_chunk.py --out tune.json
"""

import argparse
import itertools
import json

import torch
from bench_kda import HEADLINE, D, make_inputs
from triton.testing import do_bench

from kda_edu.triton.chunk import _chunk_kda_fwd


def timed(rows, shape, call, **kw):
    """Median time of one forward (or its prepare kernel) with these knobs; appends a row."""
    info = {}
    _chunk_kda_fwd(*call, info=info, **kw)
    ms = do_bench(lambda: _chunk_kda_fwd(*call, **kw), warmup=25, rep=100, return_mode="median")
    rows.append(dict(shape=shape, knobs=kw, ms=ms, resources=info))
    print(f"{shape} {kw}: {ms:.3f} ms {info}", flush=True)
    return ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune.json")
    ap.add_argument("--shapes", type=int, default=3, help="how many headline shapes to sweep")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--scan-warps", type=int, nargs="+", default=[4, 8])
    args = ap.parse_args()
    rows = []
    for B, T, H in HEADLINE[: args.shapes]:
        x = make_inputs(B, T, H)
        call = (x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5, None, False)
        best = None
        for warps in (4, 8):
            knobs = dict(warps_prepare=warps)
            ms = timed(rows, (B, T, H), call, prepare_only=True, **knobs)
            if best is None or ms < best[0]:
                best = (ms, knobs)
        for bv, warps, stages in itertools.product((16, 32, 64), args.scan_warps, args.stages):
            total = timed(rows, (B, T, H), call, bv=bv, warps_scan=warps, stages=stages, **best[1])
            rows[-1]["scan_ms"] = total - best[0]
        del x, call
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
