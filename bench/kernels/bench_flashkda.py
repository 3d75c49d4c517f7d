"""FlashKDA (Moonshot's CUTLASS KDA forward, MIT) beside kda_edu's chunk_kda and fla's, on one H200.

FlashKDA takes the raw projections (q, k not normalised, the gate's pre-activation g_raw, beta's logits) and
does everything in two kernels; it is called through `bench/flashkda/flashkda.py` (build it first with
`bench/flashkda/build.sh`). The same math outside its kernels, as kda_edu spells it (checked in FlashKDA's
`csrc/smxx/fwd_kernel1.cuh`):

    q, k = l2_normalize(q_raw), l2_normalize(k_raw)                  x / sqrt(|x|^2 + 1e-6), in bf16
    g    = kda_gate_lower_bound(g_raw, A_log, dt_bias, lower_bound)  lower_bound * sigmoid(exp(A_log)(g_raw + dt_bias))
    beta = beta_sigmoid(beta_raw)

and FlashKDA's state is `[B, H, V, K]`, the transpose of ours. Inputs follow FlashKDA's own benchmark
(`benchmarks/bench_fwd.py`): q, k, v, g_raw, beta_raw ~ N(0, 1) in bf16, A_log, dt_bias ~ U(0, 1) in float32,
lower_bound = -5, scale = 128 ** -0.5; here with a float32 initial state ~ 0.1 N(0, 1) and the final state out.

Checks (exit 1 if one fails), relative errors ||x - ref|| / ||ref|| of o and of the final state:
  * small: B=2, T=200 (not a multiple of FlashKDA's 16 or our 64), H=4: FlashKDA and kda_edu's chunk_kda
    against `kda_edu.ops.kda.kda_recurrent` in float64 on the same raw inputs, with and without a state:
    each <= BOUND = 0.05. kda_edu's bf16 bound against float64 is 5e-3 (tests/kernels/test_chunk_kda_gpu.py);
    FlashKDA keeps its state in bf16 between chunks of 16 (unit roundoff 2^-9 per chunk) and inverts in
    fp16, so it is allowed ten times that. Two negative controls show the check can fail: FlashKDA's state
    left untransposed, and a reference with the softplus gate `-exp(A_log) softplus(g_raw + dt_bias)`, must
    each be off by more than 2 BOUND.
  * every shape: FlashKDA against kda_edu's chunk_kda (<= BOUND); at the fla shapes fla's two variants
    against kda_edu's too (<= BOUND).

Timings (`triton.testing.do_bench`, median, ms), all under torch.inference_mode():
  flashkda_state     FlashKDA, float32 state in and out (the beta transpose and workspace included)
  flashkda_nostate   FlashKDA without a state (its benchmark's 'no state' case)
  ours_full          kda_edu: l2_normalize, kda_gate_lower_bound, beta_sigmoid, then chunk_kda
  ours_chunk         kda_edu's chunk_kda alone, on the prepared inputs
  fla_precomputed    fla chunk_kda on the prepared inputs (safe_gate=True, lower_bound), at the fla shapes
  fla_in_kernel      fla chunk_kda on the raw inputs with its in-kernel gate, l2norm and sigmoid options
fla autotunes about 90 s per new shape, so it runs only at --fla-shapes, after everything else.

    python -m bench.kernels.bench_flashkda [--shapes 1x8192x32,...] [--fla-shapes 1x8192x96] [--out DIR]

Writes DIR/h200_flashkda.json (DIR: --out, else $OUT, else bench/results) after every step.
"""

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("FLA_FLASH_KDA", "0")  # fla's own Triton path, never a FlashKDA dispatch

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from bench.common import ROOT, run_environment, write_result  # noqa: E402
from bench.flashkda.flashkda import build_info, flashkda_fwd  # noqa: E402
from kda_edu.kernels import chunk_kda  # noqa: E402
from kda_edu.ops.gates import beta_sigmoid, kda_gate, kda_gate_lower_bound, l2_normalize  # noqa: E402
from kda_edu.ops.kda import kda_recurrent  # noqa: E402

D = 128
LOWER_BOUND = -5.0
SCALE = D**-0.5
BOUND = 0.05
SHAPES = [(1, 8192, 32), (8, 4096, 16), (1, 32768, 32), (1, 131072, 16), (1, 8192, 96)]
FLA_SHAPES = [(1, 8192, 96)]


def parse_shapes(text):
    return [tuple(int(n) for n in s.split("x")) for s in text.split(",") if s]


def raw_inputs(B, T, H, seed=0):
    """FlashKDA's benchmark distributions, plus a float32 initial state in our [B, H, K, V] layout."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype)

    def rand(*shape):
        return torch.rand(*shape, device="cuda", generator=gen)

    return dict(
        q=randn(B, T, H, D),
        k=randn(B, T, H, D),
        v=randn(B, T, H, D),
        g_raw=randn(B, T, H, D),
        beta_raw=randn(B, T, H),
        A_log=rand(H),
        dt_bias=rand(H, D),
        h0=0.1 * randn(B, H, D, D, dtype=torch.float32),
    )


def with_flashkda_state(x):
    """x plus its initial state in FlashKDA's [B, H, V, K] layout (made once, outside the timings)."""
    return dict(x, h0_vk=x["h0"].transpose(-1, -2).contiguous())


def prepare(x, dtype=None):
    """kda_edu's gate, normalisation and sigmoid on the raw inputs (in `dtype` when given, e.g. float64)."""
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    return dict(
        q=l2_normalize(cast(x["q"])),
        k=l2_normalize(cast(x["k"])),
        v=cast(x["v"]),
        g=kda_gate_lower_bound(cast(x["g_raw"]), cast(x["A_log"]), cast(x["dt_bias"]), LOWER_BOUND),
        beta=beta_sigmoid(cast(x["beta_raw"])),
    )


def run_flashkda(x, state=True):
    o, s = flashkda_fwd(
        x["q"],
        x["k"],
        x["v"],
        x["g_raw"],
        x["beta_raw"],
        SCALE,
        x["A_log"],
        x["dt_bias"],
        LOWER_BOUND,
        initial_state=x["h0_vk"] if state else None,
        output_final_state=state,
    )
    return o, (s.transpose(-1, -2) if state else None)  # back to [B, H, K, V]


def run_ours(x, p=None, state=True):
    p = prepare(x) if p is None else p
    h0 = x["h0"] if state else None
    return chunk_kda(
        p["q"],
        p["k"],
        p["v"],
        p["g"],
        p["beta"],
        SCALE,
        initial_state=h0,
        output_final_state=state,
        check_inputs=False,
    )


def fla_variants(x, p):
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    common = dict(scale=SCALE, initial_state=x["h0"], output_final_state=True, safe_gate=True)
    return {
        "fla_precomputed": lambda: fla_chunk_kda(
            p["q"], p["k"], p["v"], p["g"], p["beta"], lower_bound=LOWER_BOUND, **common
        ),
        "fla_in_kernel": lambda: fla_chunk_kda(
            x["q"],
            x["k"],
            x["v"],
            x["g_raw"],
            x["beta_raw"],
            use_gate_in_kernel=True,
            use_qk_l2norm_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            A_log=x["A_log"],
            dt_bias=x["dt_bias"],
            lower_bound=LOWER_BOUND,
            **common,
        ),
    }


def rel(a, b):
    """||a - b|| / ||b|| in float64; inf when a is not finite."""
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm()).item()


def time_ms(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


class Report:
    def __init__(self, path, meta):
        self.path, self.data, self.failures = path, dict(meta, small=None, shapes=[], fla=[]), []

    def check(self, name, value, ok):
        if not ok:
            self.failures.append(f"{name} = {value:.3g}")
        return value

    def save(self):
        self.data["failures"] = self.failures
        write_result(self.path, self.data)


def small_check(rep):
    """FlashKDA and kda_edu against the float64 loop, with and without a state, and the negative controls."""
    B, T, H = 2, 200, 4
    x = with_flashkda_state(raw_inputs(B, T, H, seed=1))
    p64 = prepare(x, torch.float64)
    args64 = (p64["q"], p64["k"], p64["v"], p64["g"], p64["beta"], SCALE)
    o_ref, s_ref = kda_recurrent(*args64, initial_state=x["h0"].double(), output_final_state=True)
    o_ref0, _ = kda_recurrent(*args64)
    out = dict(B=B, T=T, H=H)
    for name, run in (("flashkda", run_flashkda), ("ours", run_ours)):
        o, s = run(x)
        o0, _ = run(x, state=False)
        for key, err in (("o", rel(o, o_ref)), ("state", rel(s, s_ref)), ("o_nostate", rel(o0, o_ref0))):
            out[f"{name}_{key}"] = rep.check(f"small {name} {key} vs float64", err, err <= BOUND)
    # Negative controls: each must miss the reference by more than 2 BOUND, or the check above cannot fail.
    o, s = run_flashkda(x)
    wrong_g = kda_gate(x["g_raw"].double(), x["A_log"].double(), x["dt_bias"].double())
    o_soft, _ = kda_recurrent(*args64[:3], wrong_g, *args64[4:], initial_state=x["h0"].double())
    controls = dict(state_untransposed=rel(s.transpose(-1, -2), s_ref), softplus_gate=rel(o, o_soft))
    for key, err in controls.items():
        out[f"control_{key}"] = rep.check(f"small control {key}", err, err > 2 * BOUND)
    rep.data["small"] = out
    print(
        "small check:", {k: (round(v, 5) if isinstance(v, float) else v) for k, v in out.items()}, flush=True
    )


def shape_step(rep, B, T, H):
    x = with_flashkda_state(raw_inputs(B, T, H))
    p = prepare(x)
    o_ours, s_ours = run_ours(x, p)
    o_f, s_f = run_flashkda(x)
    tag = f"{B}x{T}x{H}"
    row = dict(B=B, T=T, H=H)
    for key, err in (("o", rel(o_f, o_ours)), ("state", rel(s_f, s_ours))):
        row[f"flashkda_vs_ours_{key}"] = rep.check(f"{tag} flashkda {key} vs ours", err, err <= BOUND)
    del o_ours, s_ours, o_f, s_f
    row["ms"] = dict(
        flashkda_state=time_ms(lambda: run_flashkda(x)),
        flashkda_nostate=time_ms(lambda: run_flashkda(x, state=False)),
        ours_full=time_ms(lambda: run_ours(x)),
        ours_chunk=time_ms(lambda: run_ours(x, p)),
    )
    rep.data["shapes"].append(row)
    print(
        tag,
        {k: round(v, 4) for k, v in row["ms"].items()},
        "errors",
        row["flashkda_vs_ours_o"],
        row["flashkda_vs_ours_state"],
        flush=True,
    )


def fla_step(rep, B, T, H):
    x = raw_inputs(B, T, H)
    p = prepare(x)
    o_ours, s_ours = run_ours(x, p)
    tag = f"{B}x{T}x{H}"
    row = dict(B=B, T=T, H=H, ms={}, first_call_s={})
    rep.data["fla"].append(row)
    for name, fn in fla_variants(x, p).items():
        start = time.perf_counter()
        o, s = fn()
        torch.cuda.synchronize()
        row["first_call_s"][name] = time.perf_counter() - start  # autotuning included
        for key, err in (("o", rel(o, o_ours)), ("state", rel(s, s_ours))):
            row[f"{name}_vs_ours_{key}"] = rep.check(f"{tag} {name} {key} vs ours", err, err <= BOUND)
        row["ms"][name] = time_ms(fn)
        rep.save()
        print(tag, name, round(row["ms"][name], 4), "ms", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    ap.add_argument("--fla-shapes", default=",".join("x".join(map(str, s)) for s in FLA_SHAPES))
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    args = ap.parse_args()
    try:
        import fla

        fla_version = fla.__version__
    except ImportError as e:
        fla_version = f"not importable: {e}"
    rep = Report(
        Path(args.out) / "h200_flashkda.json",
        dict(
            **run_environment(),
            fla=fla_version,  # run_environment() gives the commit
            flashkda_build=build_info(),
            settings=dict(K=D, V=D, lower_bound=LOWER_BOUND, scale=SCALE, bound=BOUND, dtype="bfloat16"),
        ),
    )
    t0 = time.perf_counter()
    with torch.inference_mode():
        small_check(rep)
        rep.save()
        for B, T, H in parse_shapes(args.shapes):
            shape_step(rep, B, T, H)
            rep.save()
            torch.cuda.empty_cache()  # the shape's tensors went with shape_step's frame
        if fla_version.startswith("not importable"):
            print(f"fla {fla_version}: its timings are left out", flush=True)
        else:
            for B, T, H in parse_shapes(args.fla_shapes):
                fla_step(rep, B, T, H)
    rep.data["seconds"] = time.perf_counter() - t0
    rep.save()
    print(f"{len(rep.failures)} failed checks in {rep.data['seconds']:.0f} s:", rep.failures, flush=True)
    sys.exit(1 if rep.failures else 0)


if __name__ == "__main__":
    main()
