"""Issue 20's prepare-kernel designs on a GPU, each against the default and fla's chunk_kda in one run.

The designs (`kda_edu.kernels.chunk.DESIGN`, bench/NOTES.md session 13): the diagonal blocks' inverse by
recursive doubling instead of substitution (`inverse="doubling"`), and pass 1 split into a queries' pass and a
keys' pass (`two_pass=True`), alone and together, and the two-pass designs with 16 key columns per step
(`kc=16`: no spills offline). For each shape (bf16, K = V = 128, the inputs of
bench_kda.py) the script records, per design: the forward's median time (`triton.testing.do_bench`), the
prepare kernel's own time (torch profiler, one forward), its registers and spills, and the output's relative
difference from the default design's (the designs change only float32 arithmetic inside the chunk, so the bf16
outputs should differ by a few roundings: about 1e-3 relative; correctness against float64 is the kernel
tests' job, run in the same device call). With --backward, forward + backward too. fla's forward (and
backward) is timed beside them. The JSON is written after every shape.

    python bench/kernels/bench_prepare_designs.py --out $OUT/h200_prepare_designs.json \\
        [--shapes 1,8192,32 8,4096,16] [--backward]

Set TRITON_CACHE_AUTOTUNING=1 (bench/device/env.sh does) so fla's autotuning at a shape is done once per
machine, not once per process. `--smoke` runs the designs at a tiny shape on the CPU (interpreter, float32,
no timing): a check of the script.
"""

import argparse
import json
import os
import sys

import torch

from kda_edu.kernels import chunk_kda
from kda_edu.kernels.chunk import chunk_kda_fwd, prepare_design
from kda_edu.ops._checks import resolve_scale

os.environ.setdefault("FLA_FLASH_KDA", "0")
DESIGNS = {
    "default": {},
    "doubling": {"inverse": "doubling"},
    "two_pass": {"two_pass": True},
    "doubling two_pass": {"inverse": "doubling", "two_pass": True},
    "two_pass kc16": {"two_pass": True, "kc": 16},
    "doubling two_pass kc16": {"inverse": "doubling", "two_pass": True, "kc": 16},
}
HEADLINE = [(1, 8192, 32), (8, 4096, 16), (1, 32768, 32), (1, 131072, 16)]


def make_inputs(B, T, H, D, device, dtype):
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    return dict(
        q=torch.nn.functional.normalize(randn(B, T, H, D), dim=-1).to(dtype),
        k=torch.nn.functional.normalize(randn(B, T, H, D), dim=-1).to(dtype),
        v=randn(B, T, H, D).to(dtype),
        g=-5.0 * torch.sigmoid(randn(B, T, H, D) - 2.0),
        beta=torch.sigmoid(randn(B, T, H)).to(dtype),
    )


def forward(x):
    return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], check_inputs=False)[0]


def prepare_us(x) -> float | None:
    """Device time of the prepare kernel in one forward (torch profiler), microseconds."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        forward(x)
        torch.cuda.synchronize()
    for e in prof.key_averages():
        if "_chunk_prepare_kernel" in e.key:
            return getattr(e, "device_time_total", None) or e.cuda_time_total
    return None


def resources(x) -> dict:
    info = {}
    q = x["q"]
    chunk_kda_fwd(
        q, x["k"], x["v"], x["g"], x["beta"], resolve_scale(None, q.shape[-1]), None, False, stop_after="prepare",
        info=info,
    )  # fmt: skip
    return info.get("prepare", {})


def fla_forward():
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    return lambda x: fla_chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=False)[
        0
    ]


def bench_shape(B, T, H, backward: bool, smoke: bool) -> dict:
    from triton.testing import do_bench

    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    x = make_inputs(B, T, H, 32 if smoke else 128, device, dtype)
    do = torch.randn_like(x["v"])
    row = {"B": B, "T": T, "H": H, "designs": {}}
    ref = None
    for name, design in DESIGNS.items():
        with prepare_design(**design):
            o = forward(x)
            rec = {
                "rel diff from default": 0.0
                if ref is None
                else ((o - ref).float().norm() / ref.float().norm()).item()
            }
            ref = o if ref is None else ref
            if not smoke:
                rec["fwd ms"] = do_bench(lambda: forward(x), return_mode="median")
                rec["prepare us"] = prepare_us(x)
                rec["prepare resources"] = resources(x)
                if backward:
                    xs = {k: t.detach().requires_grad_() for k, t in x.items()}
                    rec["fwd+bwd ms"] = do_bench(
                        lambda xs=xs: forward(xs).backward(do),
                        grad_to_none=list(xs.values()),
                        return_mode="median",
                    )
        row["designs"][name] = rec
        print(name, (B, T, H), rec, flush=True)
    if not smoke:
        try:
            fla = fla_forward()
            fla(x)  # autotune
            row["fla fwd ms"] = do_bench(lambda: fla(x), return_mode="median")
            if backward:
                xs = {k: t.detach().requires_grad_() for k, t in x.items()}
                fla(xs).backward(do)
                row["fla fwd+bwd ms"] = do_bench(
                    lambda: fla(xs).backward(do), grad_to_none=list(xs.values()), return_mode="median"
                )
        except Exception as e:  # noqa: BLE001 - record why fla could not run
            row["fla error"] = repr(e)[:300]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="*", default=None, help="B,T,H ... (default: the four headline shapes)")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    shapes = (
        [(1, 100, 2)]
        if args.smoke
        else [tuple(map(int, s.split(","))) for s in args.shapes or []] or HEADLINE
    )
    result = {"designs": DESIGNS, "rows": []}
    if not args.smoke:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_kda import run_environment  # the date, GPU and versions, as every benchmark JSON records

        result.update(run_environment())
    for B, T, H in shapes:
        result["rows"].append(bench_shape(B, T, H, args.backward, args.smoke))
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
