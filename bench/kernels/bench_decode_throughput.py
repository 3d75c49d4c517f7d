"""Decoding throughput (tokens/s) against context length: full attention, the 3:1 hybrid and pure KDA.

What it measures. For each layer pattern ("A" = every mixer MLA, "KKKA" = Kimi Linear's 3:1 hybrid, "K" =
every mixer KDA) and each context length S (4k to 1M tokens), the time of one decoding step of a randomly
initialised `HybridLM` in bf16 on the GPU: one new token for each sequence of the batch, through a cache that
holds S tokens per sequence (`kda_edu.chapters.ch13_inference.synthetic_cache`: decoding time depends on the cache's shapes,
not its contents, so no prefill is run). The step is `decode_step_seconds`: the fastest of `--steps` timed
steps after `--warmup` untimed ones; tokens/s = batch / step time. MLA layers decode in MQA mode (absorbed
projections, attention over the latent cache), KDA layers take one recurrent step. Two batch sizes per point:
1, and the largest batch that fits `--cache-budget-gib` (capped at `--max-batch`), which is where a long
context limits full attention.

Memory. The budget holds the caches and one step's temporaries (`kda_edu.chapters.ch13_inference.max_batch` with
`decode_step_bytes`): per MLA layer, one layer at a time, the longer latent cache `torch.cat` builds next to
the old one (S r 2 bytes per sequence), or the float32 scores and probabilities [B, H, 1, S] (2 H S 4 bytes
per sequence) and a float32 slice of the latents (at most 256 MiB, twice). The weights (all three models
stay on the GPU: 1.06 G parameters, 2.1 GiB in bf16) come on top. On a GPU the budget is also cut to leave
`HEADROOM` of the card free. Estimated peak, the largest point (pattern "A", S = 65536, batch 106; default
budget 60 GiB, 32 heads, latent r = 512, 8 layers):

    caches      8 layers x 106 x 65536 x 512 x 2 B                 = 53.0 GiB
    temporaries the cat, 106 x 65537 x 512 x 2 B                    =  6.6 GiB
                (more than the scores and probabilities, 106 x 2 x 32 x 65537 x 4 B = 1.7 GiB,
                with two float32 slices, 0.5 GiB)
    weights     (282 + 374 + 404) M parameters x 2 B                =  2.1 GiB
    total                                                           ~ 62 GiB (+ CUDA context), of 139 GiB

Before this accounting and the fix in `kda_edu.layers.mla.causal_attention`, MQA mode's broadcasting matmul copied
a layer's float32 latents once per head: at S = 4096 and batch 256, 256 x 32 x 512 x 4097 x 4 B = 64.02 GiB
for one layer, which ran an H200 out of memory (`tests/layers/test_mla.py` now checks that no step makes such a copy).
Each row records the estimate (`estimated_bytes`, caches + temporaries) and, on a GPU, the measured peak
above the weights (`measured_peak_bytes`).

Robustness. A point that runs out of memory anyway is recorded as skipped (`"skipped": reason`), memory is
freed and the run goes on; after `--time-limit-s` the remaining points are recorded as skipped too. Each point
prints a line when it starts and when it ends.

Time. 5 contexts x 3 patterns x 2 batches = 30 points, each 1 warm-up + 3 timed steps (a point stops timing
after `--point-seconds`). The slowest steps move about 0.75 TB through memory (pattern "A", S = 65536, batch
106: per layer the cat, then two passes over the bf16 latents, each writing and reading float32 slices),
about 0.25 s at 3 TB/s, so the largest points take about 1 s with their cache and all 30 about 10 s
(estimated; 30 s if 3 times slower). With CUDA start-up, three models and the Triton compile of the KDA
step, about a minute in all; after `--time-limit-s` (210 s) the remaining points are skipped, so the run
stays under 4 minutes even if the estimate is far off.

Writes JSON (device, versions, configuration, one row per point) that chapter 13 reads from
`bench/results/h200_decode_throughput.json`.

    python -m bench.kernels.bench_decode_throughput                       # on the GPU machine
    python -m bench.kernels.bench_decode_throughput --smoke --out /tmp/x.json   # tiny sizes, CPU, checks the logic
"""

import argparse
import gc
import os
import platform
import time
from pathlib import Path

import torch

from bench.common import write_result
from kda_edu.chapters.ch13_inference import decode_row, decode_step_bytes, max_batch
from kda_edu.layers.kda_layer import KDAConfig
from kda_edu.layers.mla import MLAConfig
from kda_edu.models.costs import cache_bytes
from kda_edu.models.model import HybridConfig, HybridLM

PATTERNS = ("A", "KKKA", "K")
CONTEXTS = (4096, 16384, 65536, 262144, 1048576)
HEADROOM = 0.15  # fraction of the GPU's memory kept free beyond the weights and the budget
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "h200_decode_throughput.json"
GiB = 2**30


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


def build_model(config: HybridConfig, device: torch.device, dtype: torch.dtype) -> HybridLM:
    """A randomly initialised model, created on `device` (not on the CPU and then copied)."""
    torch.manual_seed(0)
    with device:
        model = HybridLM(config)
    return model.to(dtype=dtype).eval()


def is_out_of_memory(error: Exception) -> bool:
    """PyTorch's OutOfMemoryError, or a library's allocation failure reported as a RuntimeError."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and ("out of memory" in str(error) or "ALLOC_FAILED" in str(error))
    )


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(model: HybridLM, row: dict, args, device: torch.device) -> None:
    """Time one point into `row`; on running out of memory, mark the row skipped and free the memory."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    try:
        timing = decode_row(
            model,
            row["batch"],
            row["context_len"],
            steps=args.steps,
            warmup=args.warmup,
            max_seconds=args.point_seconds,
        )
        row.update(timing)
        if device.type == "cuda":
            row["measured_peak_bytes"] = torch.cuda.max_memory_allocated(device) - before
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if not is_out_of_memory(error):
            raise
        row["skipped"] = "out of memory: " + str(error).strip().splitlines()[0][:300]
    free_memory(device)  # after the except block, which holds the failed step's tensors through the traceback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model and contexts on the CPU")
    parser.add_argument("--out", type=Path, default=None, help=f"output JSON (default {DEFAULT_OUT})")
    parser.add_argument(
        "--cache-budget-gib",
        type=float,
        default=60.0,
        help="memory for the caches and one decoding step's temporaries (weights not counted)",
    )
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument(
        "--steps", type=int, default=3, help="timed decoding steps per point (fastest counts)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed decoding steps before them")
    parser.add_argument("--point-seconds", type=float, default=20.0, help="stop timing a point after this")
    parser.add_argument("--time-limit-s", type=float, default=210.0, help="skip the points left after this")
    args = parser.parse_args()
    began = time.perf_counter()

    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        contexts, budget, cap = [16, 64], 2e6, 8
        out = args.out or Path("/tmp/decode_throughput_smoke.json")
    else:
        # Large allocations of many sizes: let the allocator grow segments instead of fragmenting (read when
        # CUDA is first used, which is below).
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU: run with --smoke to check the logic on the CPU")
        device, dtype = torch.device("cuda"), torch.bfloat16
        contexts, budget, cap = list(CONTEXTS), args.cache_budget_gib * GiB, args.max_batch
        out = args.out or DEFAULT_OUT
    dtype_bytes = torch.finfo(dtype).bits // 8

    configs = {pattern: model_config(pattern, args.smoke) for pattern in PATTERNS}
    models = {pattern: build_model(config, device, dtype) for pattern, config in configs.items()}
    weight_bytes = sum(p.numel() * p.element_size() for m in models.values() for p in m.parameters())
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = min(budget, free - HEADROOM * total)
        print(
            f"{torch.cuda.get_device_name(device)}: {total / GiB:.1f} GiB, {free / GiB:.1f} GiB free with the "
            f"weights ({weight_bytes / GiB:.2f} GiB) loaded; budget {budget / GiB:.1f} GiB",
            flush=True,
        )

    # Contexts outer, patterns inner: if the time limit cuts the run short, it cuts the longest contexts
    # of every pattern rather than a whole pattern.
    points = []
    for S in contexts:
        for pattern, config in configs.items():
            fit = max_batch(config, S, budget, dtype_bytes=dtype_bytes)
            points += [(S, pattern, fit, batch) for batch in sorted({1, min(fit, cap)}) if batch >= 1]
    rows = []
    for i, (S, pattern, fit, batch) in enumerate(points, start=1):
        config = configs[pattern]
        per_sequence = sum(cache_bytes(config, S, batch_size=1, dtype_bytes=dtype_bytes).values())
        row = {
            "pattern": pattern,
            "context_len": S,
            "batch": batch,
            "cache_limited_batch": fit,
            "cache_bytes_per_sequence": per_sequence,
            "estimated_bytes": batch * per_sequence + decode_step_bytes(config, S, batch, dtype_bytes),
        }
        rows.append(row)
        label = f"[{i:2d}/{len(points)}] {pattern:4s} S = {S:8d} B = {batch:4d}"
        elapsed = time.perf_counter() - began
        if elapsed > args.time_limit_s:
            row["skipped"] = f"time limit: {elapsed:.0f} s > --time-limit-s {args.time_limit_s:.0f}"
            print(f"{label}: skipped ({row['skipped']})", flush=True)
            continue
        print(f"{label}: estimated {row['estimated_bytes'] / GiB:7.3f} GiB ...", end=" ", flush=True)
        start = time.perf_counter()
        measure(models[pattern], row, args, device)
        seconds = time.perf_counter() - start
        if "skipped" in row:
            print(f"skipped, {row['skipped']} ({seconds:.1f} s)", flush=True)
            continue
        peak = f", peak {row['measured_peak_bytes'] / GiB:7.3f} GiB" if "measured_peak_bytes" in row else ""
        print(
            f"{row['tokens_per_s']:10.1f} tokens/s, step {row['step_s'] * 1e3:8.2f} ms{peak} ({seconds:.1f} s)",
            flush=True,
        )

    result = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({platform.machine()})",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "smoke": args.smoke,
        "cache_budget_bytes": budget,
        "max_batch": cap,
        "steps": args.steps,
        "warmup": args.warmup,
        "weight_bytes": weight_bytes,
        "seconds": time.perf_counter() - began,
        "configs": {pattern: config.to_dict() for pattern, config in configs.items()},
        "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, result)
    print(f"wrote {out} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
