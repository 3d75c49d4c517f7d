"""Decoding throughput (tokens/s) against context length: full attention, the 3:1 hybrid and pure KDA.

For each layer pattern ("A" = every mixer MLA, "KKKA" = Kimi Linear's 3:1 hybrid, "K" = every mixer KDA) and
each context length, the script builds a randomly initialised `HybridLM` in bf16 on the GPU, gives it a cache
of the shapes that context would leave (`kda_edu.inference.synthetic_cache`: decoding time depends on the
cache's shapes, not its contents), and times one decoding step (`decode_step_seconds`: the fastest of a few,
one token per sequence). Two batch sizes per point: 1, and the largest batch whose caches fit in
`--cache-budget-gib` (capped at `--max-batch`), which is where a long context limits full attention.

Writes JSON (device, versions, configuration, one row per measurement) that chapter 13 reads from
`bench/results/h200_decode_throughput.json`.

    python bench/bench_decode_throughput.py                       # on the GPU machine
    python bench/bench_decode_throughput.py --smoke --out /tmp/x.json   # tiny sizes, CPU, checks the logic
"""

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from kda_edu.inference import decode_throughput, max_batch
from kda_edu.kda_layer import KDAConfig
from kda_edu.mla import MLAConfig
from kda_edu.model import HybridConfig

PATTERNS = ("A", "KKKA", "K")
DEFAULT_OUT = Path(__file__).parent / "results" / "h200_decode_throughput.json"


def model_config(pattern: str, smoke: bool) -> HybridConfig:
    """A Kimi-Linear-like slice: 32 heads of 128 in both layer kinds, MLA latent 512 (8 layers on the GPU)."""
    if smoke:
        return HybridConfig(
            vocab_size=64,
            d_model=32,
            n_layers=4,
            layer_pattern=pattern,
            kda=KDAConfig(num_heads=2, head_dim=16, lower_bound=-5.0, gate="lower_bound"),
            mla=MLAConfig(num_heads=2, kv_rank=16, qk_head_dim=16, v_head_dim=16),
        )
    return HybridConfig(
        vocab_size=32000,
        d_model=2304,
        n_layers=8,
        layer_pattern=pattern,
        kda=KDAConfig(num_heads=32, head_dim=128, gate="lower_bound"),
        mla=MLAConfig(num_heads=32, kv_rank=512, qk_head_dim=128, v_head_dim=128),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model and contexts on the CPU")
    parser.add_argument("--out", type=Path, default=None, help=f"output JSON (default {DEFAULT_OUT})")
    parser.add_argument("--cache-budget-gib", type=float, default=60.0, help="memory for the caches")
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument(
        "--steps", type=int, default=5, help="timed decoding steps per point (fastest counts)"
    )
    args = parser.parse_args()

    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        contexts, budget, cap = [16, 64], 2e6, 8
        out = args.out or Path("/tmp/decode_throughput_smoke.json")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU: run with --smoke to check the logic on the CPU")
        device, dtype = torch.device("cuda"), torch.bfloat16
        contexts = [4096, 16384, 65536, 262144, 1048576]
        budget, cap = args.cache_budget_gib * 2**30, args.max_batch
        out = args.out or DEFAULT_OUT
    dtype_bytes = torch.finfo(dtype).bits // 8

    rows, configs = [], {}
    for pattern in PATTERNS:
        config = model_config(pattern, args.smoke)
        configs[pattern] = config.to_dict()
        for S in contexts:
            fit = max_batch(config, S, budget, dtype_bytes=dtype_bytes)
            for batch in sorted({1, min(fit, cap)}):
                if batch < 1:
                    continue
                start = time.perf_counter()
                (row,) = decode_throughput(config, batch, [S], steps=args.steps, device=device, dtype=dtype)
                row.update(
                    pattern=pattern,
                    cache_limited_batch=fit,
                    cache_bytes_per_sequence=row["cache_bytes"] // batch,
                )
                rows.append(row)
                print(
                    f"{pattern:5s} S = {S:8d} B = {batch:4d}: {row['tokens_per_s']:10.1f} tokens/s, "
                    f"step {row['step_s'] * 1e3:8.2f} ms, cache {row['cache_bytes'] / 2**30:7.3f} GiB "
                    f"({time.perf_counter() - start:.1f} s)",
                    flush=True,
                )
                if device.type == "cuda":
                    torch.cuda.empty_cache()

    result = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({platform.machine()})",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "smoke": args.smoke,
        "cache_budget_bytes": budget,
        "max_batch": cap,
        "configs": configs,
        "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
