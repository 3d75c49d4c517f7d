"""The split prepare: the current kda_edu beside an older build and fla, in one process.

At each shape (`bench.common.kda_inputs`, bf16, K = V = 128) it times with `triton.testing.do_bench` (median):
  * the forward of this checkout's kda_edu with its default knobs and with each of `VARIANTS` (prepare kernels'
    warps and key columns), and its prepare kernels alone (`chunk_kda_fwd(..., stop_after="prepare")`);
  * the forward and its prepare alone of an older build, imported as `kda_edu_old` from `--old` (a copy of
    that build's kda_edu with the package renamed, so that both load in one process), when given;
  * fla's chunk_kda forward (FLASH_KDA off, as in every comparison here);
  * forward + backward of this checkout and of fla (bench_kda_bwd.py's step: backward of sum(o * do));
  * CUDA time per kernel of one forward and one backward of this checkout (torch profiler).
Registers and spills of each prepare kernel come from the launcher's `info`.

    python -m bench.kernels.bench_prepare_split --old .builds/old --out $OUT/h200_prepare_split.json
"""

import argparse
import importlib
import json
import os
import sys

import torch
from triton.testing import do_bench

from bench.common import kda_inputs, run_environment, write_result
from bench.kernels.bench_kda_bwd import kernel_times, per_kernel_us
from bench.kernels.bench_kda_bwd import make_inputs as make_grad_inputs
from kda_edu.kernels import chunk_kda
from kda_edu.kernels.chunk_fwd import chunk_kda_fwd

os.environ.setdefault("FLA_FLASH_KDA", "0")
D = 128
# Knobs of the prepare kernels tried beside the default: warps of (gram, inverse, w/u) and key columns per step.
# The launcher's knobs of the prepare kernels tried beside its defaults (the design variants once timed with
# this script are gone from the code; docs/kernel-design.md has their outcome).
VARIANTS = [dict(kc=16), dict(kc=64), dict(warps_prepare=(4, 1, 8))]


def ms(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def kernel_us(fn):
    """CUDA time per kernel of one call of fn (torch profiler), microseconds."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return per_kernel_us(prof, 40)


def max_error(fwd, kw, small):
    """Largest |o - o_ref| over o_ref's largest |entry|, o_ref the float64 recurrence, at the small shape."""
    from kda_edu.ops.kda import kda_recurrent

    names = ("q", "k", "v", "g", "beta")
    ref = kda_recurrent(*(small[n].double() for n in names))[0]
    o = fwd(*(small[n] for n in names), D**-0.5, None, False, **kw)[0]
    return ((o.double() - ref).abs().max() / ref.abs().max()).item()


def forward_rows(x, fwd, label, variants, small):
    """Forward and prepare-alone times of one build's `chunk_kda_fwd` for each knob set, its kernels' times,
    and its error at a small shape against the float64 recurrence."""
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5, None, False)
    rows = []
    for kw in variants:
        info = {}
        fwd(*args, info=info, **kw)
        rows.append(
            dict(
                build=label,
                knobs={k: list(v) if isinstance(v, tuple) else v for k, v in kw.items()},
                fwd_ms=ms(lambda kw=kw: fwd(*args, **kw)),
                prepare_ms=ms(lambda kw=kw: fwd(*args, stop_after="prepare", **kw)),
                resources=info,
                kernels_us=kernel_us(lambda kw=kw: fwd(*args, **kw)),
                rel_max_error_small=max_error(fwd, kw, small),
            )
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def fwd_bwd(B, T, H, fla_chunk_kda):
    """Forward + backward of this checkout and of fla, and this checkout's time per kernel."""
    x, do = make_grad_inputs(B, T, H)
    names = ("q", "k", "v", "g", "beta")
    out = {}

    def step(fn):
        fn(*(x[n] for n in names)).backward(do)

    methods = {
        "current": lambda *a: chunk_kda(*a, check_inputs=False)[0],
        "fla": lambda *a: fla_chunk_kda(*a, use_qk_l2norm_in_kernel=False)[0],
    }
    for name, fn in methods.items():
        step(fn)
        for t in x.values():
            t.grad = None
        out[f"{name} fwd+bwd ms"] = do_bench(
            lambda fn=fn: step(fn), grad_to_none=list(x.values()), return_mode="median"
        )
        print(name, "fwd+bwd", out[f"{name} fwd+bwd ms"], flush=True)
    out["current kernels us"] = kernel_times(x, do)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["1,8192,32"])
    ap.add_argument("--old", help="folder holding kda_edu_old (an older build, renamed)")
    ap.add_argument("--no-variants", action="store_true")
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    old_fwd = None
    if args.old:
        sys.path.insert(0, args.old)
        old_fwd = importlib.import_module("kda_edu_old.kernels.chunk").chunk_kda_fwd
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    res = dict(**run_environment(), rows=[])
    for shape in args.shapes:
        B, T, H = (int(s) for s in shape.split(","))
        x = kda_inputs(B, T, H)
        row = dict(B=B, T=T, H=H)
        small = kda_inputs(1, 1024, 4, seed=1)
        row["small shape for the error"] = [1, 1024, 4]
        variants = [{}] + ([] if args.no_variants else VARIANTS)
        row["current"] = forward_rows(x, chunk_kda_fwd, "current", variants, small)
        if old_fwd is not None:
            row["old"] = forward_rows(x, old_fwd, "old", [{}], small)
        fla = lambda x=x: fla_chunk_kda(
            x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=False
        )  # noqa: E731
        fla()  # autotune
        row["fla fwd ms"] = ms(fla)
        print("fla fwd", row["fla fwd ms"], flush=True)
        del x
        if not args.no_backward:
            row.update(fwd_bwd(B, T, H, fla_chunk_kda))
        res["rows"].append(row)
        write_result(args.out, res)
        torch.cuda.empty_cache()
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
