"""What one rank of a context-parallel KDA prefill computes, timed on one GPU (chapter 15's scaling model).

For a sequence of `--tokens` tokens (default 2^20) split over n ranks, n = 1, 2, 4, ..., 64, one rank holds
T = tokens / n. At H = 32, K = V = 128, bf16 q, k, v, beta and a float32 log-space gate
(`bench.common.kda_inputs`), this times with `triton.testing.do_bench` (median):

- `shard_fwd_ms`: `chunk_kda` on the shard from a given initial state, with its final state (what every
  scheme runs once per rank);
- `map_ms`: `kda_edu.parallel.context_parallel.shard_map` on the shard, the extra pass of the scan scheme that gives
  `(M, B)` (one kernel call with V + K = 256 value columns);
- `combine_ms`: `fold_maps` over n maps, what the last rank does after the all-gather (n - 1 products of
  K x K by K x V per head);
- `one_pass_ms`: the one-pass scheme's single pass, `one_pass_shard` with `chunk_kda` (values widened by K
  identity columns: outputs, states and the carry's maps in one call), and `correct_ms`: `corrected`, its
  fix-up once the carry arrives (`o + R S_in` for the shard's tokens, `ht + M S_in`).

Communication cannot be measured on one GPU; the chapter takes bandwidths from public specifications.

    python -m bench.kernels.cp_shard_costs                       # on one H200: writes $OUT/h200_cp_shard_costs.json
    python -m bench.kernels.cp_shard_costs --tokens 512 --heads 1 --dim 16 --ranks 1 2  # CPU smoke (interpreter)
"""

import argparse
import datetime
import json
import os
import platform
import time

import torch

from bench.common import kda_inputs, write_result
from kda_edu.kernels import chunk_kda
from kda_edu.parallel.context_parallel import corrected, fold_maps, one_pass_shard, shard_layout, shard_map

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def bench(fn) -> float:
    """Median milliseconds of `fn()`."""
    if DEVICE == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=40, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[1]


def measure(tokens: int, n: int, H: int, D: int, dtype) -> dict:
    T = tokens // n
    x = kda_inputs(1, T, H, D, dtype=dtype, device=DEVICE)
    inputs = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    h0 = torch.randn(1, H, D, D, device=DEVICE)
    row = {"n": n, "T": T}
    with torch.no_grad():
        row["shard_fwd_ms"] = bench(
            lambda: chunk_kda(*inputs, initial_state=h0, output_final_state=True, check_inputs=False)
        )
        if n > 1:
            layout = shard_layout([T] * 3, 1, 1, None)  # a middle rank: it receives and sends a state
            scale = D**-0.5
            row["map_ms"] = bench(lambda: shard_map(chunk_kda, inputs, h0, layout, scale))
            M, B = shard_map(chunk_kda, inputs, h0, layout, scale)
            maps = [(M, B)] * n
            row["combine_ms"] = bench(lambda: fold_maps(maps, n - 1))
            row["one_pass_ms"] = bench(lambda: one_pass_shard(inputs, h0, layout, scale, kernel=chunk_kda))
            shard = one_pass_shard(inputs, h0, layout, scale, kernel=chunk_kda)
            carry = torch.randn(layout.carries, H, D, D, device=DEVICE)
            row["correct_ms"] = bench(lambda: corrected(shard, carry, layout))
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return row


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2**20)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128, help="K = V")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--max-seconds", type=float, default=140, help="start no new row after this")
    parser.add_argument("--out", default=None, help="JSON path; default $OUT/<device>_cp_shard_costs.json")
    args = parser.parse_args()
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # the interpreter's bf16 dot is wrong
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu-interpreter"
    result = {
        "date": datetime.date.today().isoformat(),
        "device": name,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "tokens": args.tokens,
        "H": args.heads,
        "K": args.dim,
        "V": args.dim,
        "dtype": str(dtype).removeprefix("torch."),
        "gate": "-5 sigmoid(N(0, 1) - 2), float32",
        "rows": [],
    }
    tag = "h200" if "H200" in name else DEVICE
    out = args.out or os.path.join(os.environ.get("OUT", "."), f"{tag}_cp_shard_costs.json")
    start = time.time()
    for n in sorted(args.ranks, reverse=True):  # short shards first; the file is rewritten after each row
        if time.time() - start > args.max_seconds:
            result["rows"].append({"n": n, "T": args.tokens // n, "error": "skipped: time budget spent"})
            continue
        try:
            row = measure(args.tokens, n, args.heads, args.dim, dtype)
        except torch.OutOfMemoryError as error:
            row = {"n": n, "T": args.tokens // n, "error": f"out of memory: {error}"[:200]}
            torch.cuda.empty_cache()
        result["rows"].append(row)
        print(json.dumps(row), f"({time.time() - start:.0f} s)", flush=True)
        write_result(out, result)
    print("wrote", out)


if __name__ == "__main__":
    main()
