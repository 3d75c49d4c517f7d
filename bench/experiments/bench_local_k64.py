"""Issue 20 experiment on the H200: `_local_k64_kernel` (bench/experiments/local_k64.py) beside `_local_k_kernel`.

At each shape (bf16, K = V = 128, inputs and training step as bench/kernels/bench_kda_bwd.py makes them:
forward, then backward of sum(o * do)), for each variant of VARIANTS: the step's median time
(`triton.testing.do_bench`), the local_k kernel's own time in one backward (torch profiler, its name cut to 60
characters as `per_kernel_us` does), its registers, spills and shared memory as compiled here, and how far each
of the step's gradients (q, k, v, g, beta) is from the current kernel's with the launcher's defaults
(relative norm of the difference). A variant is (kernel, launcher knobs, extra constexprs): the launcher's
`lk_block` key channels and `lk_warps` warps per program, `lk_stages` pipeline stages, and the new kernel's
SPLIT16. A variant that fails (to compile, to run) is recorded with its error, not fatal. The JSON is written
after every variant.

    source bench/device/env.sh
    python bench/experiments/bench_local_k64.py --out $OUT/local_k64.json [--shapes 1,8192,32] [--variants k64-32x4 ...]
"""

import argparse
import functools
import json
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from bench_kda import run_environment  # noqa: E402
from bench_kda_bwd import METHODS, NAMES, make_inputs, per_kernel_us, step  # noqa: E402
from local_k64 import _local_k64_kernel  # noqa: E402
from local_k_sub import LocalKSub, local_k_sub  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kda_edu.kernels import chunk_bwd  # noqa: E402

SHAPES = [(1, 8192, 32), (8, 4096, 16)]
CURRENT = chunk_bwd._local_k_kernel
LAUNCHER = chunk_bwd.chunk_kda_bwd
VARIANTS = {  # name: (kernel, launcher knobs, extra constexprs of the kernel)
    "current": (CURRENT, {}, {}),
    "current-64x4": (CURRENT, dict(lk_block=64), {}),
    "k64-32x4": (_local_k64_kernel, dict(lk_block=32, lk_warps=4), {}),
    "k64-32x8": (_local_k64_kernel, dict(lk_block=32, lk_warps=8), {}),
    "k64-64x4": (_local_k64_kernel, dict(lk_block=64, lk_warps=4), {}),
    "k64-64x8": (_local_k64_kernel, dict(lk_block=64, lk_warps=8), {}),
    "k64-32x4-1stage": (_local_k64_kernel, dict(lk_block=32, lk_warps=4, lk_stages=1), {}),
    "k64-32x4-tf32": (_local_k64_kernel, dict(lk_block=32, lk_warps=4), dict(SPLIT16=False)),
    "k64-32x8-tf32": (_local_k64_kernel, dict(lk_block=32, lk_warps=8), dict(SPLIT16=False)),
    "k64-64x8-tf32": (_local_k64_kernel, dict(lk_block=64, lk_warps=8), dict(SPLIT16=False)),
    "sub-32x2": (local_k_sub, dict(lk_block=32, lk_warps=2), {}),
    "sub-32x4": (local_k_sub, dict(lk_block=32, lk_warps=4), {}),
    "sub-64x4": (local_k_sub, dict(lk_block=64, lk_warps=4), {}),
    "sub-32x4-r128": (LocalKSub(maxnreg=128, name="_local_k_sub_r128"), dict(lk_block=32, lk_warps=4), {}),
    "sub-32x4-wide": (LocalKSub(tiles=False, name="_local_k_sub_wide"), dict(lk_block=32, lk_warps=4), {}),
}


class _WithConstexprs:
    """`kernel` launched with extra constexpr keyword arguments (ones the launcher does not pass)."""

    def __init__(self, kernel, extra):
        self.kernel, self.extra = kernel, extra

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel[grid](*args, **kwargs, **self.extra)


def _patched(kernel, knobs, extra):
    """The patches that make chunk_kda's backward launch `kernel` with `knobs` (entered together)."""
    launch = _WithConstexprs(kernel, extra) if extra else kernel
    return (
        mock.patch.object(chunk_bwd, "_local_k_kernel", launch),
        mock.patch.object(chunk_bwd, "chunk_kda_bwd", functools.partial(LAUNCHER, **knobs)),
    )


def _compiled(kernel) -> dict:
    """The kernel's compiled variants, {cache key: CompiledKernel}, over every device."""
    out = {}
    for device, entry in getattr(kernel, "device_caches", {}).items():
        cache = entry[0] if isinstance(entry, tuple) else entry
        for key, compiled in cache.items():
            out[(device, str(key))] = compiled
    return out


def _resources(compiled) -> list[dict]:
    """Registers, spilled registers (Triton's n_spills), shared memory and warps of compiled kernels."""
    rows = []
    for c in compiled:
        meta = getattr(c, "metadata", None)
        rows.append(
            dict(
                regs=getattr(c, "n_regs", None),
                spills=getattr(c, "n_spills", None),
                shared=getattr(meta, "shared", None),
                warps=getattr(meta, "num_warps", None),
                stages=getattr(meta, "num_stages", None),
            )
        )
    return rows


def _local_k_us(x, do, fn) -> dict:
    """CUDA time of the local_k kernel (old or new name) in one backward, and the backward's total, in us."""
    from torch.profiler import ProfilerActivity, profile

    o = fn(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        o.backward(do)
        torch.cuda.synchronize()
    for t in x.values():
        t.grad = None
    times = per_kernel_us(prof)
    local_k = {name: us for name, us in times.items() if name.startswith(("_local_k", "_dg_cumsum"))}
    return dict(local_k=local_k, backward_total=round(sum(times.values()), 1))


def run_variant(name, x, do, reference):
    """One variant at one shape: its row (and its gradients, for the reference when it is "current")."""
    kernel, knobs, extra = VARIANTS[name]
    fn = METHODS["kda_edu chunk_kda"]
    row = dict(variant=name, kernel=kernel.__name__, knobs=knobs, extra=extra)
    before = _compiled(kernel)
    patch_kernel, patch_launcher = _patched(kernel, knobs, extra)
    with patch_kernel, patch_launcher:
        for t in x.values():
            t.grad = None
        step(fn, x, do)  # compile
        grads = [x[n].grad.float().clone() for n in NAMES]
        for t in x.values():
            t.grad = None
        row["fwd+bwd ms"] = do_bench(
            lambda: step(fn, x, do), grad_to_none=list(x.values()), return_mode="median"
        )
        row["kernel us"] = _local_k_us(x, do, fn)
    new = {k: c for k, c in _compiled(kernel).items() if k not in before}
    row["resources"] = _resources(new.values() if new else _compiled(kernel).values())
    if reference is not None:
        diff = {
            n: ((a - b).norm() / b.norm()).item() for n, a, b in zip(NAMES, grads, reference, strict=True)
        }
        row["rel diff vs current"] = diff
        row["max rel diff vs current"] = max(diff.values())
    return row, grads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="+", default=[",".join(map(str, s)) for s in SHAPES], help="B,T,H")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = ap.parse_args()
    res = dict(**run_environment(), note="fwd+bwd: median ms of do_bench; kernel us: torch profiler", rows=[])
    names = ["current"] + [v for v in args.variants if v != "current"]  # the reference first
    for shape in args.shapes:
        B, T, H = (int(s) for s in shape.split(","))
        x, do = make_inputs(B, T, H)
        reference = None
        for name in names:
            try:
                row, grads = run_variant(name, x, do, reference)
                if name == "current":
                    reference = grads
            except Exception as e:  # noqa: BLE001 - a variant that fails is recorded, the others still run
                row = dict(variant=name, error=repr(e)[:1000])
                for t in x.values():
                    t.grad = None
            row = dict(B=B, T=T, H=H, **row)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        x = do = reference = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
