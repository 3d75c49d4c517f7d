"""KDA forward on a GPU: kda_edu chunk_kda beside fla kernels, softmax attention and the PyTorch reference.

For each shape (B, T, H), K = V = 128, bf16 inputs, every method in METHODS runs on the same random inputs
(`bench.common.kda_inputs`: l2-normalised q and k, v ~ N(0, 1), beta = sigmoid(N(0, 1)), a lower-bounded
log-space gate g = -5 sigmoid(N(0, 1) - 2) in float32) and is timed with `triton.testing.do_bench` (median). Beside each
time go the achieved bandwidth and arithmetic rate, against the ceilings measured in the same run:

  bytes  = what must move at least once: q, k, v, beta, o in bf16 and g in float32,
           B T (2 (2 H K + 2 HV V + HV) + 4 HV K)
  FLOPs  = the chunked algorithm's count from ANCHORS.md, per value head 6 T d^2 + 3 T C d + T C^2 with
           d = 128 and C = 64 (the same count for every KDA/GDN method, so the rates compare times);
           for softmax attention the causal count 2 T^2 d per head (half of 4 T^2 d).
  floor  = max(bytes / copy bandwidth, FLOPs / bf16 matmul rate).

METHODS maps a name to a function (inputs dict -> callable to time, or a string saying why it is skipped);
columns for forward+backward or decoding can be added as more entries.

    python -m bench.kernels.bench_kda --out bench/results/h200_forward.json [--tune]

--tune also times the launcher's knobs (scan value block, prepare warps, scan pipeline depth) at the three
headline shapes.
"""

import argparse
import os

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from bench.common import kda_inputs, run_environment, write_result
from kda_edu.kernels import chunk_kda
from kda_edu.kernels.chunk_fwd import chunk_kda_fwd
from kda_edu.ops.kda import kda_chunked

os.environ.setdefault("FLA_FLASH_KDA", "0")
D = 128
C = 64
HEADLINE = [(1, 8192, 32), (1, 32768, 32), (8, 4096, 16), (1, 131072, 16)]
SWEEP = [(1, 1024 * 2**i, 16) for i in range(8)]  # T = 1K .. 128K


def _ours(x):
    return lambda: chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], check_inputs=False)


def _fla_kda(x):
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except ImportError as e:
        return f"fla not importable: {e}"
    return lambda: fla_chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=False)


def _fla_gdn(x):
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        return f"fla not importable: {e}"
    g_head = x["g"].mean(-1)  # one decay per head and step
    return lambda: chunk_gated_delta_rule(x["q"], x["k"], x["v"], g_head, x["beta"])


def _sdpa(x):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.transpose(1, 2).contiguous() for t in (x["q"], x["k"], x["v"]))  # [B, H, T, D]

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return run


def _torch_chunked(x):
    B, T, H, _ = x["q"].shape
    pairwise_gb = B * H * T * C * D * 4 * 3 / 1e9  # its [C, C, K] decays, float32, with temporaries
    if pairwise_gb > 40 or T > 32768:
        return f"skipped: its pairwise decays need about {pairwise_gb:.0f} GB and it takes seconds"
    return lambda: kda_chunked(x["q"], x["k"], x["v"], x["g"], x["beta"])


METHODS = {
    "kda_edu chunk_kda": _ours,
    "fla chunk_kda": _fla_kda,
    "fla chunk_gated_delta_rule": _fla_gdn,
    "torch sdpa flash causal": _sdpa,
    "kda_edu kda_chunked (PyTorch)": _torch_chunked,
}


def count(B, T, H, method):
    nbytes = B * T * (2 * (2 * H * D + 2 * H * D + H) + 4 * H * D)
    if method.startswith("torch sdpa"):
        flops = B * H * 2 * T * T * D
        nbytes = B * T * H * D * 2 * 4
    else:
        flops = B * H * (6 * T * D * D + 3 * T * C * D + T * C * C)
    return nbytes, flops


def ceilings():
    src = torch.randn(2**29, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    copy_bw = 2 * src.numel() * 4 / (ms * 1e-3)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return copy_bw, 2 * 8192**3 / (ms * 1e-3)


def bench_shape(B, T, H, copy_bw, mm_rate):
    x = kda_inputs(B, T, H, D)
    out = dict(B=B, T=T, H=H, K=D, V=D, methods={})
    for name, make in METHODS.items():
        fn = make(x)
        if isinstance(fn, str):
            out["methods"][name] = dict(skipped=fn)
            continue
        try:
            ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
        except torch.OutOfMemoryError as e:
            torch.cuda.empty_cache()
            out["methods"][name] = dict(skipped=f"out of memory: {str(e)[:80]}")
            continue
        nbytes, flops = count(B, T, H, name)
        out["methods"][name] = dict(
            ms=ms,
            GBps=nbytes / (ms * 1e-3) / 1e9,
            TFLOPs=flops / (ms * 1e-3) / 1e12,
            floor_ms=max(nbytes / copy_bw, flops / mm_rate) * 1e3,
        )
    del x
    torch.cuda.empty_cache()
    return out


def tune(shapes):
    """Time the launcher's knobs at each shape; the first row of each shape is the default."""
    rows = []
    variants = (
        [dict()]
        + [dict(bv=bv) for bv in (16, 32, 64)]
        + [dict(kc=16), dict(kc=64), dict(warps_prepare=(8, 1, 8)), dict(stages=3)]
    )
    for B, T, H in shapes:
        x = kda_inputs(B, T, H, D)
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5, None, False)
        for kw in variants:
            ms = do_bench(
                lambda kw=kw, args=args: chunk_kda_fwd(*args, **kw), warmup=25, rep=100, return_mode="median"
            )
            rows.append(dict(B=B, T=T, H=H, knobs=kw, ms=ms))
            print(f"tune {B}x{T}x{H} {kw}: {ms:.3f} ms", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/h200_forward.json")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), help="time only these (default: all)")
    ap.add_argument("--build", help="what was measured (e.g. a commit), stored as the file's 'build' field")
    args = ap.parse_args()
    for name in set(METHODS) - set(args.methods or METHODS):
        del METHODS[name]
    copy_bw, mm_rate = ceilings()
    print(f"copy {copy_bw / 1e12:.2f} TB/s, bf16 matmul {mm_rate / 1e12:.0f} TFLOP/s", flush=True)
    result = dict(
        **run_environment(),
        copy_bandwidth_TBps=copy_bw / 1e12,
        bf16_matmul_TFLOPs=mm_rate / 1e12,
        counts=(
            "bytes: q, k, v, beta, o in bf16 and g in float32, each once; FLOPs: per value head "
            "6 T d^2 + 3 T C d + T C^2 (d = 128, C = 64; ANCHORS.md), for SDPA 2 T^2 d (causal)"
        ),
        headline=[],
        sweep=[],
    )
    if args.build:
        result["build"] = args.build
    if args.tune:
        result["tune"] = tune(HEADLINE[:3])
    for B, T, H in HEADLINE:
        result["headline"].append(bench_shape(B, T, H, copy_bw, mm_rate))
    if not args.no_sweep:
        for B, T, H in SWEEP:
            result["sweep"].append(bench_shape(B, T, H, copy_bw, mm_rate))
    write_result(args.out, result)

    names = list(METHODS)
    print(f"{'B':>2} {'T':>7} {'H':>3} | " + " | ".join(f"{n[:22]:>22}" for n in names))
    for row in result["headline"] + result["sweep"]:
        cells = []
        for n in names:
            m = row["methods"][n]
            cells.append(f"{m['ms']:9.3f} ms {m['GBps']:6.0f}GB/s" if "ms" in m else f"{'skip':>22}")
        print(f"{row['B']:>2} {row['T']:>7} {row['H']:>3} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
