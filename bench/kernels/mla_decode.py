"""The absorbed-MLA decoding kernel against the GPU's copy bandwidth, paged and contiguous, beside PyTorch.

What it measures. One decoding step of one MLA layer of Kimi Linear's layout (32 query heads, a 512-wide
latent and a 64-wide rope slot: cached rows of 576 bf16 numbers, 1152 bytes), for batches of sequences of
one context length each:

- `paged`: `paged_mla_absorbed_attention` over a pool of 64-position blocks whose tables name the blocks in
  a shuffled order (as a serving engine's pool looks after requests came and went);
- `contiguous`: `mla_absorbed_attention`, each sequence's rows one after another;
- `torch`: the same sum in PyTorch over the contiguous rows (bf16 matmuls through cuBLAS, a float32 softmax),
  the baseline, at batches up to 16.

Every time is the median of CUDA-graph replays (`bench.common.interleaved(graphs=True)`, the three taking
turns), the split kernel and the merge together, as a server replays its step. The bound is the cache:
a step must read every cached row once, `batch x context x 1152` bytes; `fraction_of_copy_bandwidth` is
those bytes over the time, divided by the bandwidth of a large device-to-device copy measured in the same
process (bytes read plus bytes written per second). The queries, the partial outputs of the splits and the
merge are not counted: they are the kernel's overhead.

`tuning` rows: at four (batch, context) points, every tile size, warp count, pipeline depth and split count
of a small grid (the splits from half the default to 128), timed the same way, so that the defaults
(`default_config`, `default_splits`) can be judged against the best the grid holds.

    python -m bench.kernels.mla_decode --out DIR            # DIR/mla_decode_<gpu>.json
    python -m bench.kernels.mla_decode --out DIR --smoke    # small sizes, a minute, to check the script
"""

import argparse
import itertools
import math
import time
from functools import partial

import torch

from bench.common import interleaved, run_environment, write_result
from bench.kernels.bench_decode import copy_bandwidth
from kda_edu.kernels.mla_decode import (
    _launch,
    default_config,
    default_splits,
    mla_absorbed_attention,
    paged_mla_absorbed_attention,
)
from kda_edu.layers.mla import mla_absorbed_reference

H, R, DR, BLOCK = 32, 512, 64, 64
D = R + DR
SCALE = (128 + DR) ** -0.5


def inputs(batch: int, context: int, seed: int = 0):
    """Queries `[B, 1, H, D]`, a shuffled paged pool with its tables, and the same rows contiguous."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = math.ceil(context / BLOCK)
    pool = torch.randn(batch * blocks, BLOCK, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    order = torch.randperm(batch * blocks, device="cuda", generator=gen)
    table = order.view(batch, blocks).to(torch.int32)
    contiguous = pool[table.long()].reshape(batch, blocks * BLOCK, D)
    q = torch.randn(batch, 1, H, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    lengths = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    return q, pool, table, contiguous, lengths


def torch_step(q, contiguous, lengths):
    """Absorbed attention in PyTorch at full lengths: bf16 scores and values through cuBLAS, float32 softmax."""
    scores = torch.einsum("bthd,bld->bthl", q, contiguous).float() * SCALE
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.einsum("bthl,blr->bthr", probs, contiguous[..., :R])


def check(batch, context):
    """The paged kernel against the float32 reference on the same rows: relative RMS error."""
    q, pool, table, contiguous, lengths = inputs(batch, context, seed=1)
    out = paged_mla_absorbed_attention(q, pool, table, lengths, SCALE, R)
    slots = torch.arange(batch, device="cuda")
    ref = mla_absorbed_reference(q.float(), contiguous.float(), slots, lengths, SCALE, R)
    return ((out - ref).norm() / ref.norm()).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--contexts", type=int, nargs="*", help="the rows' contexts (default: 4K to 256K)")
    parser.add_argument("--batches", type=int, nargs="*", help="the rows' batches (default: 1, 4, 16, 64)")
    parser.add_argument("--no-tuning", action="store_true", help="skip the tuning grid")
    args = parser.parse_args()
    started = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    name = torch.cuda.get_device_name()
    gpu = "h200" if "H200" in name else "h100" if "H100" in name else "gpu"
    bandwidth = copy_bandwidth(2**26 if args.smoke else 2**30)
    contexts = args.contexts or ([4096, 32768] if args.smoke else [4096, 16384, 32768, 65536, 131072, 262144])
    batches = args.batches or ([1, 4] if args.smoke else [1, 4, 16, 64])
    max_bytes = 2**28 if args.smoke else 24 * 2**30
    path = f"{args.out}/mla_decode_{gpu}.json"
    result = {
        **run_environment(),
        "smoke": args.smoke,
        "shape": {"heads": H, "latent": R, "rope": DR, "block_size": BLOCK, "dtype": "bfloat16", "tokens": 1},
        "copy_bandwidth_bytes_per_s": bandwidth,
        "default_config": None,
        "errors": [],
        "rows": [],
        "tuning": [],
    }
    for batch, context in [(1, 4096), (4, 32768)]:
        result["errors"].append(
            {"batch": batch, "context": context, "relative_rms_error": check(batch, context)}
        )
    for context, batch in itertools.product(contexts, batches):
        cache_bytes = batch * context * D * 2
        if 2 * cache_bytes > max_bytes:  # the pool and its contiguous copy
            continue
        q, pool, table, contiguous, lengths = inputs(batch, context)
        slots = torch.arange(batch, device="cuda")
        fns = {
            "paged": partial(paged_mla_absorbed_attention, q, pool, table, lengths, SCALE, R),
            "contiguous": partial(mla_absorbed_attention, q, contiguous, slots, lengths, SCALE, R),
        }
        if batch <= 16:
            fns["torch"] = partial(torch_step, q, contiguous, lengths)
        ms = interleaved(fns, repeats=3, rep=100, graphs=True)
        row = {
            "context": context,
            "batch": batch,
            "cache_bytes": cache_bytes,
            "splits": default_splits(batch, H, table.shape[1] * BLOCK, q.device),
            "ms": ms,
        }
        for key, t in ms.items():
            row[f"{key}_bytes_per_s"] = cache_bytes / (t * 1e-3)
        row["fraction_of_copy_bandwidth"] = row["paged_bytes_per_s"] / bandwidth
        row["contiguous_fraction_of_copy_bandwidth"] = row["contiguous_bytes_per_s"] / bandwidth
        result["rows"].append(row)
        print({k: row[k] for k in ("context", "batch", "ms", "fraction_of_copy_bandwidth")}, flush=True)
        del q, pool, table, contiguous, fns
        torch.cuda.empty_cache()
        write_result(path, result)
    config = default_config(torch.empty(1, BLOCK, D, device="cuda", dtype=torch.bfloat16))
    result["default_config"] = dict(zip(("BN", "num_warps", "num_stages"), config, strict=True))
    points = [(1, 4096), (4, 32768)] if args.smoke else [(1, 4096), (1, 32768), (16, 32768), (64, 16384)]
    points = [] if args.no_tuning else points
    for batch, context in points:
        q, pool, table, _, lengths = inputs(batch, context)
        base = default_splits(batch, H, table.shape[1] * BLOCK, q.device)
        most = table.shape[1] * BLOCK // 32  # ranges of at least 32 positions
        counts = {max(1, base // 2), base, 2 * base, 4 * base, 16, 32, 64, 128}
        grid = itertools.product((32, 64), (4, 8), (1, 2, 3), sorted(n for n in counts if n <= most))
        for bn, warps, stages, splits in grid:
            fn = partial(_launch, q, pool, table, lengths, SCALE, R, splits, bn, warps, stages)
            try:
                t = interleaved({"k": fn}, repeats=1, rep=50, graphs=True)["k"]
            except Exception as error:  # noqa: BLE001 (a configuration that does not compile is a result)
                t, note = None, f"{type(error).__name__}: {str(error)[:120]}"
            else:
                note = None
            result["tuning"].append(
                {
                    "batch": batch,
                    "context": context,
                    "BN": bn,
                    "num_warps": warps,
                    "num_stages": stages,
                    "splits": splits,
                    "default_splits": base,
                    "ms": t,
                    "fraction_of_copy_bandwidth": None
                    if t is None
                    else batch * context * D * 2 / (t * 1e-3) / bandwidth,
                    "error": note,
                }
            )
        del q, pool, table, fn
        torch.cuda.empty_cache()
        write_result(path, result)
    result["seconds"] = time.time() - started
    write_result(path, result)
    print(f"wrote {path} in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
