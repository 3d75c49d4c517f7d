"""kda_edu against fla on one GPU, with default arguments: the table the README and chapters read.

Every case runs both implementations on the same inputs in one process, and the timings interleave them
(`REPEATS` rounds of ours-then-fla, each a `triton.testing.do_bench` median; the row keeps the median of the
rounds; `bench.common.interleaved`), so that a drift of the GPU's clock or temperature hits both alike.
Inputs from `bench.common.kda_inputs`: bf16,
K = V = 128, l2-normalised q and k, beta = sigmoid(N(0, 1)), a gate g = -5 sigmoid(N(0, 1) - 2) in float32.
Our calls use chunk_kda's defaults (its value check included); fla's `chunk_kda` runs with
`use_qk_l2norm_in_kernel=False` (the inputs are normalised already) and FLA_FLASH_KDA=0.

Cases (the `case` field of a row):
  "fwd"           the operator's forward, (B, T, H) in FWD_SHAPES;
  "fwd+bwd"       forward and backward of sum(o * do), gradients of q, k, v, g, beta, at FWD_BWD_SHAPES,
                  with the peak memory of one step beyond the inputs;
  "layer step softplus", "layer step lower_bound"
                  one training step of the KDA layer (hidden 2048, 16 heads of 128) against fla's
                  `KimiDeltaAttention` with the same weights (bench.kernels.bench_kda_layer), peak memory beside;
  "decode"        one decoding step at (B, H) = (64, 32) and (1, 32) against the floor: twice the fp32
                  state's bytes over the copy bandwidth measured in this run. `kda_edu ms` and `fla ms` replay
                  the step in a CUDA graph (as a server does; at B = 1 the 2 MiB state may stay in L2);
                  the `eager` times launch it from Python each time, and `host us` is the wall time per
                  call of back-to-back calls, the host's cost when the GPU's part is shorter;
  "bf16 error"    the relative error of the bf16 output against a float64 loop on the same rounded inputs,
                  ours and fla's, at BF16_SHAPES.

    python -m bench.kernels.speed --out $OUT/speed_h100.json [--cases fwd fwd+bwd ...]
"""

import argparse
import functools
import os
import time

import torch

from bench.common import interleaved as interleaved_rounds
from bench.common import kda_inputs, run_environment, write_result
from bench.kernels.bench_decode import copy_bandwidth, decode_inputs
from kda_edu.kernels import chunk_kda, fused_recurrent_kda, raise_value_errors
from kda_edu.ops.kda import kda_recurrent

os.environ.setdefault("FLA_FLASH_KDA", "0")
FWD_SHAPES = [(1, 8192, 32), (8, 4096, 16), (1, 32768, 32), (1, 131072, 16), (1, 8192, 96)]
FWD_BWD_SHAPES = [(1, 8192, 32), (8, 4096, 16), (1, 32768, 32)]
BF16_SHAPES = [(1, 512, 4), (2, 1000, 2), (1, 2048, 2), (1, 4096, 1)]
REPEATS = 3


interleaved = functools.partial(interleaved_rounds, repeats=REPEATS, warmup=25, rep=200)


def fla_chunk():
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    return lambda x, **kw: fla_chunk_kda(
        x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=False, **kw
    )


def ours(x, **kw):
    return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)


def forward_rows() -> list:
    theirs = fla_chunk()
    rows = []
    for B, T, H in FWD_SHAPES:
        x = kda_inputs(B, T, H)
        with torch.no_grad():
            t = interleaved({"kda_edu": lambda x=x: ours(x), "fla": lambda x=x: theirs(x)})
        raise_value_errors()  # the default check found nothing (it would raise here)
        rows.append(dict(case="fwd", B=B, T=T, H=H, **{"kda_edu ms": t["kda_edu"], "fla ms": t["fla"]}))
        print(rows[-1], flush=True)
        del x
        torch.cuda.empty_cache()
    return rows


def step_peak_gib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def fwd_bwd_row(B: int, T: int, H: int, theirs) -> dict:
    x = kda_inputs(B, T, H, requires_grad=True)
    do = torch.randn_like(x["v"])

    def step(fn):
        for t in x.values():
            t.grad = None
        fn(x)[0].backward(do)

    t = interleaved({"kda_edu": lambda: step(ours), "fla": lambda: step(theirs)})
    raise_value_errors()
    return dict(
        case="fwd+bwd", B=B, T=T, H=H,
        **{"kda_edu ms": t["kda_edu"], "fla ms": t["fla"],
           "kda_edu peak GiB": step_peak_gib(lambda: step(ours)),
           "fla peak GiB": step_peak_gib(lambda: step(theirs))},
    )  # fmt: skip


def fwd_bwd_rows() -> list:
    theirs = fla_chunk()
    rows = []
    for B, T, H in FWD_BWD_SHAPES:
        rows.append(fwd_bwd_row(B, T, H, theirs))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    return rows


def layer_row(gate: str, B: int, T: int) -> dict:
    from bench.kernels.bench_kda_layer import TOL, layers, rel, step

    theirs, mine = layers(gate)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(B, T, 2048, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    do = torch.randn(B, T, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    o_fla = step(theirs, x, do).detach()
    dx_fla = x.grad.clone()
    o_ours = step(mine, x, do).detach()
    agree = max(rel(o_ours, o_fla), rel(x.grad, dx_fla))
    t = interleaved({"kda_edu": lambda: step(mine, x, do), "fla": lambda: step(theirs, x, do)})
    return dict(
        case=f"layer step {gate}", B=B, T=T, H=16,
        **{"kda_edu ms": t["kda_edu"], "fla ms": t["fla"],
           "kda_edu peak GiB": step_peak_gib(lambda: step(mine, x, do)),
           "fla peak GiB": step_peak_gib(lambda: step(theirs, x, do)),
           "rel diff": agree, "agree": agree < TOL},
    )  # fmt: skip


def layer_rows(B: int = 1, T: int = 8192) -> list:
    from bench.kernels.bench_kda_layer import GATES

    rows = []
    for gate in GATES:
        rows.append(layer_row(gate, B, T))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    return rows


def host_us(fn, calls: int = 200) -> float:
    """Microseconds of wall time per call over `calls` back-to-back calls, one sync at the end: when the
    GPU's work is shorter than the launch, this is the host's cost of a call (checks, launch)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def decode_row(B: int, H: int, bandwidth: float) -> dict:
    from fla.ops.kda import fused_recurrent_kda as fla_fused

    q, k, v, g, beta, h0 = decode_inputs(B, H, H, 128, 128, torch.bfloat16)
    state = h0.clone()
    fns = {
        "kda_edu": lambda: fused_recurrent_kda(
            q, k, v, g, beta, initial_state=state, inplace_final_state=True
        ),
        "fla": lambda: fla_fused(q, k, v, g, beta, initial_state=h0, output_final_state=True),
    }
    graph = interleaved(fns, graphs=True)
    eager = interleaved(fns)
    floor_ms = 2 * h0.numel() * 4 / bandwidth * 1e3
    return dict(
        case="decode", B=B, T=1, H=H,
        **{"kda_edu ms": graph["kda_edu"], "fla ms": graph["fla"], "floor ms": floor_ms,
           "kda_edu eager ms": eager["kda_edu"], "fla eager ms": eager["fla"],
           "kda_edu host us": host_us(fns["kda_edu"]), "fla host us": host_us(fns["fla"]),
           "copy bandwidth GB/s": bandwidth / 1e9},
    )  # fmt: skip


def decode_rows() -> list:
    bandwidth = copy_bandwidth()
    rows = []
    for B in (64, 1):
        rows.append(decode_row(B, 32, bandwidth))
        print(rows[-1], flush=True)
    return rows


def rel64(o: torch.Tensor, ref: torch.Tensor) -> float:
    return ((o.double() - ref).norm() / ref.norm()).item()


def bf16_error_rows() -> list:
    theirs = fla_chunk()
    rows = []
    for B, T, H in BF16_SHAPES:
        x = kda_inputs(B, T, H, seed=T)
        ref = kda_recurrent(*(x[n].double() for n in ("q", "k", "v", "g", "beta")))[0]
        with torch.no_grad():
            e_ours, e_fla = rel64(ours(x)[0], ref), rel64(theirs(x)[0], ref)
        rows.append(dict(case="bf16 error", B=B, T=T, H=H, kda_edu=e_ours, fla=e_fla))
        print(rows[-1], flush=True)
    return rows


CASES = {
    "fwd": forward_rows,
    "fwd+bwd": fwd_bwd_rows,
    "layer": layer_rows,
    "decode": decode_rows,
    "bf16 error": bf16_error_rows,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument(
        "--commit",
        default=os.environ.get("KDA_EDU_COMMIT"),
        help="the commit measured (default: $KDA_EDU_COMMIT, else the checkout's, else unknown)",
    )
    args = ap.parse_args()
    import fla

    result = {**run_environment(), "fla": fla.__version__, "repeats": REPEATS, "rows": []}
    if args.commit:
        result["commit"] = args.commit
    for case in args.cases:
        result["rows"] += CASES[case]()
        write_result(args.out, result)  # after every case: a call cut short keeps what it measured


if __name__ == "__main__":
    main()
