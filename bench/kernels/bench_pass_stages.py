"""Pipeline depth of the passes over the chunks (the forward's scan, the backward's two state passes) on a GPU.

`chunk_launch.pass_stages` picks three stages for 16-bit inputs when the pass has the multiprocessor to itself, and
two when the forward's scan shares it with the next piece's prepare kernels (unless its 16 value columns leave
them room). This script times each choice against the others at the benchmark shapes (inputs of
bench/kernels/bench_kda_bwd.py), in one process:

- forward (`chunk_kda`, no grad): the scan at 2 and 3 stages, and the default;
- forward + backward (as bench_kda_bwd.py's step): the backward's passes at 2 and 3 stages, the forward at
  its default;
- CUDA time per kernel of one forward and one backward of each variant (torch profiler): the scan,
  `_states_kernel`, `_dstates_kernel` and the rest.

Every variant's outputs and gradients are compared with the default's first: the pipeline depth changes when
the tiles arrive, not what is computed, so they must be equal bit for bit (a difference is printed and the
script exits 1). Results to JSON after every shape.

    python -m bench.kernels.bench_pass_stages --out $OUT/h200_pass_stages.json
"""

import argparse
import datetime
import sys
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from bench.common import write_result
from bench.kernels.bench_kda_bwd import make_inputs, per_kernel_us, step
from kda_edu.kernels import chunk_bwd, chunk_fwd, chunk_kda

SHAPES = [(1, 8192, 32), (8, 4096, 16), (1, 32768, 32), (1, 131072, 16)]
STEP_SHAPES = SHAPES[:3]


def _run(x):
    return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], check_inputs=False)[0]


def _variant(fwd_stages=None, pass_depth=None):
    """A context in which chunk_kda runs with the scan's and the backward passes' depth forced (None: default)."""
    fwd, bwd = chunk_fwd.chunk_kda_fwd, chunk_bwd.chunk_kda_bwd

    def fwd_forced(*a, **kw):
        return fwd(*a, **kw, **({} if fwd_stages is None else dict(stages=fwd_stages)))

    def bwd_forced(*a, **kw):
        return bwd(*a, **kw, **({} if pass_depth is None else dict(pass_depth=pass_depth)))

    class Both:
        def __enter__(self):
            self.p = [mock.patch.object(chunk_fwd, "chunk_kda_fwd", fwd_forced)]
            self.p.append(mock.patch.object(chunk_bwd, "chunk_kda_bwd", bwd_forced))
            for p in self.p:
                p.start()

        def __exit__(self, *exc):
            for p in self.p:
                p.stop()

    return Both()


def _grads(x, do):
    for t in x.values():
        t.grad = None
    o = _run(x)
    o.backward(do)
    out = {"o": o.detach().clone(), **{n: t.grad.clone() for n, t in x.items()}}
    for t in x.values():
        t.grad = None
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="pass_stages.json")
    ap.add_argument("--shapes", nargs="+", default=[",".join(map(str, s)) for s in SHAPES])
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes]
    res = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(), rows=[])
    failed = False
    for B, T, H in shapes:
        x, do = make_inputs(B, T, H)
        row = dict(shape=[B, T, H], forward_ms={}, step_ms={}, kernels_us={}, equal_to_default={})
        ref = _grads(x, do) if (B, T, H) in STEP_SHAPES else None
        with torch.no_grad():
            o_ref = _run(x).clone()
        for name, kw in (("default", {}), ("scan 2", dict(fwd_stages=2)), ("scan 3", dict(fwd_stages=3))):
            with _variant(**kw), torch.no_grad():
                o = _run(x)
                row["equal_to_default"][f"forward {name}"] = bool(torch.equal(o, o_ref))
                row["forward_ms"][name] = do_bench(lambda x=x: _run(x), return_mode="median")
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    _run(x)
                    torch.cuda.synchronize()
                row["kernels_us"][f"forward {name}"] = per_kernel_us(prof)
            print((B, T, H), "forward", name, f"{row['forward_ms'][name]:.3f} ms", flush=True)
        if ref is not None:
            for name, kw in (
                ("default", {}),
                ("passes 2", dict(pass_depth=2)),
                ("passes 3", dict(pass_depth=3)),
            ):
                with _variant(**kw):
                    got = _grads(x, do)
                    same = all(torch.equal(got[n], ref[n]) for n in ref)
                    row["equal_to_default"][f"step {name}"] = same
                    row["step_ms"][name] = do_bench(
                        lambda x=x, do=do: step(_run, x, do),
                        grad_to_none=list(x.values()),
                        return_mode="median",
                    )
                    o = _run(x)
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        o.backward(do)
                        torch.cuda.synchronize()
                    for t in x.values():
                        t.grad = None
                    row["kernels_us"][f"backward {name}"] = per_kernel_us(prof)
                print((B, T, H), "step", name, f"{row['step_ms'][name]:.3f} ms", flush=True)
        bad = [k for k, v in row["equal_to_default"].items() if not v]
        if bad:
            print("NOT EQUAL to the default:", bad, flush=True)
            failed = True
        res["rows"].append(row)
        write_result(args.out, res)
        del x, do, ref
        torch.cuda.empty_cache()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
