"""KDA forward + backward on a GPU: kda_edu's Triton backward (chunk_kda) beside fla's.

Inputs from `bench.common.kda_inputs`, as in bench_kda.py: bf16 l2-normalised q, k, v ~ N(0, 1), beta = sigmoid(N(0, 1)), float32
log-space gate g = -5 sigmoid(N(0, 1) - 2); K = V = 128. One step = forward, then backward of sum(o * do) with
a fixed random do; every input requires grad. Timed with `triton.testing.do_bench` (median), gradients reset
to None between steps. Peak memory: `torch.cuda.max_memory_allocated` during one step, minus what was
allocated before it (the inputs and do), and what the forward leaves allocated for the backward. Also the
relative difference of each of our gradients from fla's, and whether what the forward keeps for the
backward (`keep_intermediates`: the default "matrices"; "none", the "recomputed" rows; "all", the "kept"
rows) changes any bit of them.

    python -m bench.kernels.bench_kda_bwd --out bench/results/h200_fwd_bwd.json
    python -m bench.kernels.bench_kda_bwd --out bench/results/h200_fwd_bwd.json --shapes 8,4096,16

All three shapes take more than 400 s on the H200 (fla autotunes at every shape); `--shapes` times some of
them and keeps the other rows of an existing --out file.
"""

import argparse
import datetime
import json
import os

import torch
from triton.testing import do_bench

from bench.common import kda_inputs, write_result
from kda_edu.kernels import chunk_kda

os.environ.setdefault("FLA_FLASH_KDA", "0")
D = 128
TIMED = [(1, 8192, 32), (8, 4096, 16), (1, 32768, 32)]
MEMORY = (1, 32768, 32)
NAMES = ("q", "k", "v", "g", "beta")


def make_inputs(B, T, H, seed=0):
    """(`kda_inputs` requiring grad, the output gradient do ~ N(0, 1) in bf16). A wrapper rather than
    `kda_inputs` itself because do is drawn from the same generator right after the inputs, so that the
    inputs and do of a shape are the ones every earlier run of this benchmark used."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = kda_inputs(B, T, H, D, generator=gen, requires_grad=True)
    return x, torch.randn(B, T, H, D, device="cuda", generator=gen).to(torch.bfloat16)


def _fla(x):
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    return fla_chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=False)[0]


def _ours(keep=None):
    """chunk_kda's output with the default `keep_intermediates` (None) or the mode `keep`."""
    kw = {} if keep is None else dict(keep_intermediates=keep)
    return lambda x: chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], check_inputs=False, **kw)[0]


METHODS = {
    "kda_edu chunk_kda": _ours(),  # the default: keep_intermediates="matrices"
    # The same kernels, with nothing kept (the backward recomputes all three prepare kernels) and with every
    # intermediate kept (it recomputes none).
    "kda_edu chunk_kda recomputed": _ours("none"),
    "kda_edu chunk_kda kept": _ours("all"),
    "fla chunk_kda": _fla,
}
OURS = [name for name in METHODS if name.startswith("kda_edu")]


def step(fn, x, do):
    fn(x).backward(do)


def memory_gib(fn, x, do):
    """(peak of one step, memory held between its forward and its backward), GiB beyond the inputs and do."""
    for t in x.values():
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o = fn(x)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base  # o and whatever autograd keeps for the backward
    o.backward(do)
    del o
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30, held / 2**30


def per_kernel_us(prof, width=60):
    """CUDA time per kernel name (cut to `width` characters) of a finished torch profile, microseconds."""
    out = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us:
            out[e.key[:width]] = round(us, 1)
    return out


def kernel_times(x, do):
    """CUDA time per kernel of one forward and of its backward (torch profiler, one profile each, since both
    passes run the prepare kernels), in microseconds: `{"forward": {name: us}, "backward": {name: us}}`. The
    backward is the recomputing mode's ("none"), which runs every kernel; the default mode's backward runs
    the same kernels less the gram and inverse kernels."""
    from torch.profiler import ProfilerActivity, profile

    fn = METHODS["kda_edu chunk_kda recomputed"]
    with profile(activities=[ProfilerActivity.CUDA]) as fwd:
        o = fn(x)
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as bwd:
        o.backward(do)
        torch.cuda.synchronize()
    for t in x.values():
        t.grad = None
    return {"forward": per_kernel_us(fwd), "backward": per_kernel_us(bwd)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/h200_fwd_bwd.json")
    ap.add_argument(
        "--shapes",
        nargs="+",
        default=[",".join(map(str, s)) for s in TIMED],
        help="B,T,H shapes to time (default: all). Rows of other shapes already in --out are kept, so a run cut "
        "short by a time limit can be completed shape by shape.",
    )
    ap.add_argument("--build", help="what was measured (e.g. a commit), stored as the file's 'build' field")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
    res = dict(
        date=datetime.date.today().isoformat(),
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        note="fwd+bwd = forward then backward of sum(o * do); median ms of triton.testing.do_bench",
        rows=[],
    )
    if os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
        res = {**old, **{k: v for k, v in res.items() if k != "rows"}, "rows": old.get("rows", [])}
    if args.build:
        res["build"] = args.build
    for B, T, H in shapes:
        x, do = make_inputs(B, T, H)
        row = dict(B=B, T=T, H=H, build=args.build or "unknown")  # rows of other runs may stay in the file
        grads = {}
        for name, fn in METHODS.items():
            try:
                step(fn, x, do)  # compile
                grads[name] = [x[n].grad.float().clone() for n in NAMES]
                row[f"{name} fwd+bwd ms"] = do_bench(
                    lambda fn=fn, x=x, do=do: step(fn, x, do),
                    grad_to_none=list(x.values()),
                    return_mode="median",
                )
            except Exception as e:  # noqa: BLE001 - record why a method could not run
                row[f"{name} error"] = repr(e)[:300]
            for t in x.values():
                t.grad = None
        with torch.no_grad():
            row["kda_edu chunk_kda fwd ms"] = do_bench(
                lambda x=x: chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], check_inputs=False),
                return_mode="median",
            )
        if (B, T, H) == TIMED[0]:
            row["kda_edu kernels us"] = kernel_times(x, do)
        if "fla chunk_kda" in grads and "kda_edu chunk_kda" in grads:
            ours, fla = grads["kda_edu chunk_kda"], grads["fla chunk_kda"]
            row["rel diff ours vs fla"] = {
                n: ((a - b).norm() / b.norm()).item() for n, a, b in zip(NAMES, ours, fla, strict=True)
            }
        base = grads.get("kda_edu chunk_kda recomputed")
        for name in (n for n in OURS if n != "kda_edu chunk_kda recomputed"):  # each other mode, bit for bit
            if base is not None and name in grads:
                pairs = zip(base, grads[name], strict=True)
                row[f"{name} gradients equal to recomputed"] = all(torch.equal(a, b) for a, b in pairs)
        if (B, T, H) == MEMORY:
            for name, fn in METHODS.items():
                try:
                    row[f"{name} peak GiB"], row[f"{name} held after forward GiB"] = memory_gib(fn, x, do)
                except Exception as e:  # noqa: BLE001
                    row[f"{name} peak error"] = repr(e)[:300]
            row["inputs GiB"] = sum(t.numel() * t.element_size() for t in x.values()) / 2**30
        res["rows"] = [r for r in res["rows"] if (r["B"], r["T"], r["H"]) != (B, T, H)] + [row]
        print(json.dumps(row), flush=True)
        if {(r["B"], r["T"], r["H"]) for r in res["rows"]} >= set(TIMED):
            res.pop("note_partial", None)  # every shape is in: the file is no longer partial
        write_result(args.out, res)  # after every shape: a run cut short still leaves its rows
        x = do = grads = None
        torch.cuda.empty_cache()
    print(f"{'B,T,H':>14} {'ours ms':>9} {'fla ms':>9} {'ratio':>6}")
    for r in res["rows"]:
        a, b = r.get("kda_edu chunk_kda fwd+bwd ms"), r.get("fla chunk_kda fwd+bwd ms")
        ratio = f"{a / b:6.2f}" if a and b else "   n/a"
        print(
            f"{r['B']:>3},{r['T']:>6},{r['H']:>3} {a or float('nan'):9.3f} {b or float('nan'):9.3f} {ratio}"
        )


if __name__ == "__main__":
    main()
