"""Time chunk_kda's backward under its launch knobs on a GPU (one shape), beside fla, to choose defaults.

Times forward + backward (as bench/kernels/bench_kda_bwd.py does) for each (lk_block, lk_warps) and pipeline depth
(lk_stages) of `_local_k_kernel` and each (lv_block, lv_warps) of `_local_v_kernel`, the others at their
defaults; the defaults are timed first and last (a drift check). Results to JSON after every variant, so a run
stopped by `--minutes` or a time limit keeps what it measured. docs/kernel-design.md keeps the conclusions.

    python -m bench.kernels.tune_bwd --out tune_bwd.json [--minutes 6]
"""

import argparse
import itertools
import json
import time as clock
from unittest import mock

from triton.testing import do_bench

from bench.common import write_result
from bench.kernels.bench_kda_bwd import METHODS, make_inputs, step
from kda_edu.kernels import chunk_bwd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune_bwd.json")
    ap.add_argument("--shape", type=int, nargs=3, default=[1, 8192, 32])
    ap.add_argument("--minutes", type=float, default=None, help="start no new variant after this long")
    ap.add_argument(
        "--knobs",
        type=str,
        default=None,
        help="a JSON list of knob dicts to time instead of the sweep, e.g. '[{}, {\"lk_block\": 64}]'",
    )
    args = ap.parse_args()
    x, do = make_inputs(*args.shape)
    rows = []
    start = clock.perf_counter()

    def time(name, fn, kw=None):
        try:
            step(fn, x, do)  # compile
            ms = do_bench(lambda: step(fn, x, do), grad_to_none=list(x.values()), return_mode="median")
        except Exception as e:  # noqa: BLE001 - a variant that does not compile (shared memory, say) is recorded
            rows.append(dict(name=name, knobs=kw, error=repr(e)[:300]))
            print(f"{name}: {e!r:.200}", flush=True)
        else:
            rows.append(dict(name=name, knobs=kw, ms=ms))
            print(f"{name}: {ms:.3f} ms", flush=True)
        for t in x.values():
            t.grad = None
        write_result(args.out, dict(shape=args.shape, rows=rows))

    time("fla chunk_kda", METHODS["fla chunk_kda"])
    original = chunk_bwd.chunk_kda_bwd
    # The defaults (lk 32 / 4 warps, lv 64 / 8 warps), then variants around them, local_k (the longest
    # kernel) first, then the defaults again.
    knobs = [{}]
    knobs += [
        dict(lk_block=b, lk_warps=w)
        for b, w in itertools.product((16, 32, 64), (2, 4, 8))
        if (b, w) != (32, 4)
    ]
    knobs += [dict(lk_stages=s) for s in (1, 2, 4)]
    knobs += [dict(lv_block=b, lv_warps=w) for b, w in ((32, 4), (32, 8), (64, 4), (128, 8), (128, 4))]
    knobs += [{}]
    knobs = json.loads(args.knobs) if args.knobs is not None else knobs
    for kw in knobs:
        if args.minutes is not None and clock.perf_counter() - start > 60 * args.minutes:
            print("out of time", flush=True)
            break

        def bwd(*a, kw=kw, **more):
            return original(*a, **kw, **more)

        with mock.patch.object(chunk_bwd, "chunk_kda_bwd", bwd):
            time(f"kda_edu {kw or 'defaults'}", METHODS["kda_edu chunk_kda"], kw)


if __name__ == "__main__":
    main()
