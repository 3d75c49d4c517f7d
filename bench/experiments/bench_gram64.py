"""Issue 20 experiment: the 64-row gram kernel (bench/experiments/gram64.py) beside the current forward, on the H200.

Times the current `chunk_kda_fwd` and `chunk_kda_fwd64` under a few (key columns per step, warps) settings at one
shape, with their kernels' times, registers and spills and their error at a small shape against the float64 loop
(bench_prepare_split.py's `forward_rows`).

    python bench/experiments/bench_gram64.py --out $OUT/h200_gram64.json
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))
sys.path.insert(0, os.path.dirname(__file__))

from bench_kda import make_inputs, run_environment  # noqa: E402
from bench_prepare_split import forward_rows  # noqa: E402
from gram64 import chunk_kda_fwd64  # noqa: E402

from kda_edu.kernels.chunk import chunk_kda_fwd  # noqa: E402

VARIANTS = [{}, dict(kc=16), dict(warps_prepare=(8, 1, 4)), dict(kc=16, warps_prepare=(8, 1, 4))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1,8192,32")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    B, T, H = (int(s) for s in args.shape.split(","))
    x = make_inputs(B, T, H)
    small = make_inputs(1, 1024, 4, seed=1)
    res = dict(**run_environment(), B=B, T=T, H=H)
    res["current"] = forward_rows(x, chunk_kda_fwd, "current", [{}], small)
    res["gram64"] = forward_rows(x, chunk_kda_fwd64, "gram64", VARIANTS, small)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
