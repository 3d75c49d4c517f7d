"""Which shapes make chunk_kda (forward, or forward + backward) fault on the GPU: each case in its own process.

An illegal memory access breaks the whole CUDA context, so every case runs in a fresh process (with
CUDA_LAUNCH_BLOCKING=1, so the traceback names the launch that faulted) and prints one line: OK with the
relative RMS error of o against the float64 loop, or FAIL with the last lines of the child's stderr.
Written after the one-chunk GPU test case (8, 64, 2, 2, 64, 64) faulted on the H200 (bench/NOTES.md).

    python bench/diagnostics/diagnose_crash.py                      # the default case list
    python bench/diagnostics/diagnose_crash.py --case 8,64,2,2,64,64:bf16:bwd
    compute-sanitizer --tool memcheck python bench/diagnostics/diagnose_crash.py --one 8,64,2,2,64,64:bf16:fwd
"""

import argparse
import os
import subprocess
import sys

# this file is bench/diagnostics/<name>.py: the repository is two folders up
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# Shape B,T,H,HV,K,V : dtype : fwd (forward only) or bwd (forward + backward).
CASES = [
    "8,64,2,2,64,64:bf16:fwd",  # the failing GPU test case, forward only
    "8,64,2,2,64,64:bf16:bwd",
    "8,64,2,2,64,64:fp32:fwd",
    "1,64,1,1,64,64:bf16:fwd",  # one sequence, one chunk
    "8,50,2,2,64,64:bf16:fwd",  # one (partial) chunk
    "8,65,2,2,64,64:bf16:fwd",  # two chunks, the second of one token
    "8,128,2,2,64,64:bf16:bwd",  # two chunks
    "2,64,2,2,128,128:bf16:fwd",  # one chunk, K = V = 128
]


def run_one(case: str) -> None:
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    import torch
    from test_chunk_bwd import make_inputs

    from kda_edu.kernels import chunk_kda
    from kda_edu.ops.kda import kda_recurrent

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter, for a smoke test
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    shape, dtype, mode = case.split(":")
    shape = tuple(int(x) for x in shape.split(","))
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    (q, k, v, g, beta, h0), do, _ = make_inputs(*shape, gate=-5.0, seed=3, device=dev)
    xs = [x.to(dt) for x in (q, k, v)] + [g, beta, h0]
    xs = [x.detach().requires_grad_(mode == "bwd") for x in xs]
    o, ht = chunk_kda(*xs[:5], initial_state=xs[5], output_final_state=True)
    sync()
    ref, _ = kda_recurrent(*(x.detach().double() for x in xs[:5]), initial_state=xs[5].detach().double())
    err = ((o.double() - ref).norm() / ref.norm()).item()
    msg = f"o rel err {err:.2e}"
    if mode == "bwd":
        (o.float() * do).sum().backward()
        sync()
        msg += ", backward ran, grads finite: " + str(all(x.grad.isfinite().all().item() for x in xs))
    print(msg, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", help="run this case in this process")
    ap.add_argument("--case", nargs="+", default=CASES)
    args = ap.parse_args()
    if args.one:
        run_one(args.one)
        return
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
    for case in args.case:
        p = subprocess.run([sys.executable, __file__, "--one", case], capture_output=True, text=True, env=env)
        if p.returncode == 0:
            print(f"OK    {case}: {p.stdout.strip()}", flush=True)
        else:
            tail = "\n      ".join((p.stdout + p.stderr).strip().splitlines()[-12:])
            print(f"FAIL  {case}:\n      {tail}", flush=True)


if __name__ == "__main__":
    main()
