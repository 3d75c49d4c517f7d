"""Time chunk_kda's backward under its launch knobs on a GPU (one shape), beside fla, to choose defaults.

Times forward + backward (as bench/bench_kda_bwd.py does) for each (lk_block, lk_warps) of `_local_k_kernel`
and each (lv_block, lv_warps) of `_local_v_kernel`, the others at their defaults; results to JSON.
bench/NOTES.md keeps the conclusions.

    python bench/tune_bwd.py --out tune_bwd.json
"""

import argparse
import itertools
import json
from unittest import mock

from bench_kda_bwd import METHODS, make_inputs, step
from triton.testing import do_bench

from kda_edu.triton import chunk_bwd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune_bwd.json")
    ap.add_argument("--shape", type=int, nargs=3, default=[1, 8192, 32])
    args = ap.parse_args()
    x, do = make_inputs(*args.shape)
    rows = []

    def time(name, fn):
        step(fn, x, do)  # compile
        ms = do_bench(lambda: step(fn, x, do), grad_to_none=list(x.values()), return_mode="median")
        rows.append(dict(name=name, ms=ms))
        print(f"{name}: {ms:.3f} ms", flush=True)

    time("fla chunk_kda", METHODS["fla chunk_kda"])
    original = chunk_bwd._chunk_kda_bwd
    # Around the defaults (lk 32 / 4 warps, lv 64 / 8 warps; session 3's sweep chose them): eight variants.
    knobs = [dict(lk_block=b, lk_warps=w) for b, w in itertools.product((32, 64), (2, 4))]
    knobs += [dict(lv_block=b, lv_warps=w) for b, w in itertools.product((32, 64), (4, 8))]
    for kw in knobs:

        def bwd(*a, kw=kw, **more):
            return original(*a, **kw, **more)

        with mock.patch.object(chunk_bwd, "_chunk_kda_bwd", bwd):
            time(f"kda_edu {kw}", METHODS["kda_edu chunk_kda"])
    with open(args.out, "w") as f:
        json.dump(dict(shape=args.shape, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
