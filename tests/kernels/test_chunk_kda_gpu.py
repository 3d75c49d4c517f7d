"""GPU tolerance checks for kda_edu.kernels.chunk_kda (collected by pytest, skipped without a CUDA GPU).

Relative RMS error ||o - ref|| / ||ref|| against float64 references computed on the GPU:
  * small cousins of the benchmark shapes, odd shapes (K != V, non-powers of two, HV > H, T = 1, T not a
    multiple of the chunk, K = V = 256), with an initial state and the final state: bf16 <= 5e-3,
    fp16 <= 5e-3, fp32 <= 1e-3, against `kda_recurrent` in float64 (and `kda_chunked` in float64);
  * T = 65536 with every gate at the lower bound -5, and with gates uniform in [-5, 0): finite and within the
    same tolerances, against `kda_chunked` in float64;
  * gates far below -5 (the pairwise branch of the diagonal blocks);
  * agreement with fla's `chunk_kda` on a benchmark-like input, when fla is importable.

    python tests/kernels/test_chunk_kda_gpu.py --out check.json     (the table, with T = 65536)
"""

import argparse
import json
import sys

import pytest
import torch
import torch.nn.functional as F

from kda_edu.kernels import chunk_kda
from kda_edu.ops.kda import kda_chunked, kda_recurrent

TOL = {torch.bfloat16: 5e-3, torch.float16: 5e-3, torch.float32: 1e-3}


def inputs(B, T, H, HV, K, V, dtype, gate="sigmoid", seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q = F.normalize(randn(B, T, H, K), dim=-1).to(dtype)
    k = F.normalize(randn(B, T, H, K), dim=-1).to(dtype)
    v = randn(B, T, HV, V).to(dtype)
    if gate == "sigmoid":  # a lower-bounded gate like Kimi's: -5 * sigmoid(x)
        g = -5.0 * torch.sigmoid(randn(B, T, HV, K) - 2.0)
    elif gate == "uniform":
        g = -5.0 * torch.rand(B, T, HV, K, device="cuda", generator=gen)
    elif gate == "bound":
        g = torch.full((B, T, HV, K), -5.0, device="cuda")
    else:  # "huge": far below the lower bound
        g = -60.0 * torch.rand(B, T, HV, K, device="cuda", generator=gen)
    beta = torch.sigmoid(randn(B, T, HV))
    h0 = randn(B, HV, K, V)
    return q, k, v, g, beta, h0


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def check(name, B, T, H, HV, K, V, dtype, gate="sigmoid", reference="recurrent"):
    q, k, v, g, beta, h0 = inputs(B, T, H, HV, K, V, dtype, gate)
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.cuda.synchronize()
    ref_fn = kda_recurrent if reference == "recurrent" else kda_chunked
    ro, rh = ref_fn(
        *(x.double() for x in (q, k, v, g, beta)), initial_state=h0.double(), output_final_state=True
    )
    finite = bool(torch.isfinite(o).all() and torch.isfinite(ht).all())
    eo, eh = rel(o, ro), rel(ht, rh)
    ok = finite and eo <= TOL[dtype] and eh <= TOL[dtype]
    row = dict(
        name=name,
        shape=[B, T, H, HV, K, V],
        dtype=str(dtype).split(".")[-1],
        gate=gate,
        reference=reference,
        err_o=eo,
        err_state=eh,
        finite=finite,
        tol=TOL[dtype],
        ok=ok,
    )
    print(
        f"{'ok  ' if ok else 'FAIL'} {name:28s} {row['dtype']:9s} {gate:8s} o {eo:.2e} S {eh:.2e}", flush=True
    )
    return row


def cases(long: int = 65536) -> list[tuple]:
    """The checks, as `check`'s arguments."""
    out = []
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        out += [
            ("cousin (1,1024,4) 128/128", 1, 1024, 4, 4, 128, 128, dtype),
            ("cousin (2,512,2) 128/128", 2, 512, 2, 2, 128, 128, dtype, "uniform"),
            ("T=1", 1, 1, 2, 2, 128, 128, dtype),
            ("T=200 K=96 V=80 HV=2H", 2, 200, 2, 4, 96, 80, dtype),
            ("T=130 K=48 V=40", 1, 130, 1, 1, 48, 40, dtype),
            ("T=256 K=64 V=128", 1, 256, 2, 2, 64, 128, dtype, "sigmoid", "chunked"),
            ("gates to -60 (pairwise)", 1, 200, 2, 2, 128, 128, dtype, "huge"),
        ]
    for dtype in (torch.bfloat16, torch.float32):
        for gate in ("bound", "uniform"):
            out.append((f"T={long} at -5", 1, long, 2, 2, 128, 128, dtype, gate, "chunked"))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):  # last: float32 runs a one-stage scan
        out.append(("T=100 K=V=256", 1, 100, 2, 2, 256, 256, dtype))
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need a CUDA GPU")
@pytest.mark.parametrize("case", cases(long=8192), ids=lambda c: f"{c[0]}-{str(c[7]).split('.')[-1]}")
def test_within_tolerance_on_the_gpu(case):
    row = check(*case)
    assert row["ok"], row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--long", type=int, default=65536)
    args = ap.parse_args()
    rows = [check(*case) for case in cases(args.long)]
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, checks=rows)
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        q, k, v, g, beta, _ = inputs(1, 4096, 8, 8, 128, 128, torch.bfloat16)
        ours = chunk_kda(q, k, v, g, beta)[0]
        theirs = fla_chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=False)[0]
        ref = kda_chunked(*(x.double() for x in (q, k, v, g, beta)))[0]
        result["vs_fla"] = dict(
            ours_vs_fla=rel(ours, theirs.double()), ours=rel(ours, ref), fla=rel(theirs, ref)
        )
        print("vs fla (bf16, 1x4096x8):", result["vs_fla"], flush=True)
    except ImportError as e:
        result["vs_fla"] = f"skipped: {e}"
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    failed = [r["name"] for r in rows if not r["ok"]]
    print("all passed" if not failed else f"FAILED: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
