"""The fold of context parallelism's shard maps: one product per rank against a batched log-depth scan.

After the all-gather every rank holds R maps `(M_r, B_r)`, M `[H, K, K]` and B `[H, K, V]` per rank (one
carry, H heads), and folds them into the state it receives. This times, per head count H and rank count R:

- `loop_ms`: `kda_edu.parallel.context_parallel.fold_maps` for the last rank, a Python loop of R - 1
  steps, each a K x K by K x V product and an add (two launches per rank on a GPU);
- `batched_ms`: `fold_maps_batched` for the last rank on the stacked `[R, H, K, K]` and `[R, H, K, V]`
  maps: a tree of ceil(log2 R) levels, each one batched product (`affine_reduce`), with about twice the
  loop's arithmetic (it composes the M's, K x K by K x (K + V)).

Each row also records the largest difference between the two, relative to the states' largest entry.
The maps are random contractions (M scaled to spectral norm about 0.9), float32.

    python -m bench.kernels.cp_fold                              # writes $OUT/<device>_cp_fold.json
    python -m bench.kernels.cp_fold --heads 1 --dim 16 --ranks 2 4 --out /tmp/f.json   # a quick CPU check
"""

import argparse
import json
import os
import time

import torch

from bench.common import run_environment, write_result
from kda_edu.parallel.context_parallel import fold_maps, fold_maps_batched

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def bench(fn, repeats: int = 5) -> float:
    """Median milliseconds of `fn()` (a warm-up call first; on a GPU, `triton.testing.do_bench`)."""
    if DEVICE == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=50, return_mode="median")
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def measure(R: int, H: int, K: int, V: int, seed: int = 0) -> dict:
    """One row: both folds' times at R ranks and H heads, and their largest relative difference."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    M = torch.randn(R, H, K, K, device=DEVICE, generator=gen) * (0.9 / (2 * K**0.5))
    B = torch.randn(R, H, K, V, device=DEVICE, generator=gen)
    maps = list(zip(M, B, strict=True))
    with torch.no_grad():
        loop = fold_maps(maps, R - 1)
        batched = fold_maps_batched(M, B, R - 1)
        diff = ((loop - batched).abs().max() / batched.abs().max().clamp_min(1e-30)).item()
        return {
            "R": R,
            "H": H,
            "loop_ms": bench(lambda: fold_maps(maps, R - 1)),
            "batched_ms": bench(lambda: fold_maps_batched(M, B, R - 1)),
            "max_rel_diff": diff,
        }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--heads", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--dim", type=int, default=128, help="K = V")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--out", default=None, help="JSON path; default $OUT/<device>_cp_fold.json")
    args = parser.parse_args()
    if DEVICE == "cpu":
        torch.set_num_threads(1)  # tiny products: one thread is steadier than a contended pool
    if any(r < 1 for r in args.ranks) or any(h < 1 for h in args.heads) or args.dim < 1:
        parser.error("--ranks, --heads and --dim must be positive")
    result = dict(run_environment(), K=args.dim, V=args.dim, dtype="float32", rows=[])
    tag = "cpu" if DEVICE == "cpu" else result["device"].split()[-1].lower()
    out = args.out or os.path.join(os.environ.get("OUT", "."), f"{tag}_cp_fold.json")
    for H in args.heads:
        for R in args.ranks:
            row = measure(R, H, args.dim, args.dim)
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            write_result(out, result)
    print("wrote", out)


if __name__ == "__main__":
    main()
