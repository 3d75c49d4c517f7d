"""Serving-grade decoding on one GPU: tokens/s and achieved bandwidth beside each configuration's bound.

What it measures. Three 8-layer models of Kimi Linear's widths (d_model 2304; MLA with Kimi's real layout:
32 heads, latent 512 plus the kept 64-wide rope slot, 576 cached numbers per token; KDA 32 heads of 128,
lower-bounded gate; vocabulary 32000; a small dense feed-forward layer, since the mixers are what is
compared), bf16: all-MLA ("A"), the 3:1 hybrid ("KKKA") and all-KDA ("K"). Each decodes through
`kda_edu.models.serving.ServingDecoder`: preallocated pools, absorbed MLA in the split-context Triton kernel, KDA in
`fused_recurrent_kda` with state indices, one CUDA graph per batch size. For each context S (`--contexts`,
default 4K, 16K, 64K, 256K, 1M) and two batches (1, and the largest that fits the free memory, capped at
`--max-batch`), the pools are filled with random numbers as if S tokens had been prefilled (decoding time
depends on the shapes, not the contents), then `--steps` graph replays are timed with CUDA events (the median
counts).

Bound. `decode_bytes_per_step` counts what a step must move (every weight once, every cached MLA row once,
every KDA state read and written); divided by the copy bandwidth measured at the start of the same run
(`torch.Tensor.copy_` of 2 GiB, read + write counted) it gives the step's lower bound. Each row records both,
and achieved bandwidth = bytes / measured step time.

Overhead. For the all-KDA model at batch 1: the step replayed as a CUDA graph, the same step run eagerly, and
the sum of the step's kernel durations under `torch.profiler` (goal: graph step within 1.5x of that sum).

Time. 30 points; the largest move about 100 GB per step (all-MLA at 1M, about 10 sequences), about 25 ms
at 4 TB/s, so timing is short; filling the pools with random numbers and compiling the kernels (a few shapes)
dominate. Expected 1-2 minutes on one H200; after `--time-limit-s` (130 s) the remaining points are recorded
as skipped. A point that runs out of memory is skipped and the run goes on.

    python -m bench.kernels.bench_decode_serving                     # GPU; writes $OUT/h200_decode_serving.json
    python -m bench.kernels.bench_decode_serving --smoke --out DIR    # tiny sizes on the CPU, checks the logic
"""

import argparse
import gc
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from bench.common import write_result
from kda_edu.chapters.ch13_inference import decode_bytes_per_step
from kda_edu.layers.kda_layer import KDAConfig
from kda_edu.layers.mla import MLAConfig
from kda_edu.models.model import HybridConfig, HybridLM
from kda_edu.models.serving import ServingDecoder

PATTERNS = ("A", "KKKA", "K")
CONTEXTS = (4096, 16384, 65536, 262144, 1048576)
GiB = 2**30
FILENAME = "h200_decode_serving.json"


def model_config(pattern: str, smoke: bool) -> HybridConfig:
    if smoke:
        return HybridConfig(
            vocab_size=64,
            d_model=32,
            n_layers=4,
            layer_pattern=pattern,
            kda=KDAConfig(num_heads=2, head_dim=16, gate="lower_bound"),
            mla=MLAConfig(num_heads=2, kv_rank=16, qk_head_dim=16, v_head_dim=16, rope_head_dim=8),
        )
    return HybridConfig(
        vocab_size=32000,
        d_model=2304,
        n_layers=8,
        layer_pattern=pattern,
        kda=KDAConfig(num_heads=32, head_dim=128, gate="lower_bound"),
        mla=MLAConfig(num_heads=32, kv_rank=512, qk_head_dim=128, v_head_dim=128, rope_head_dim=64),
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, smoke: bool) -> float:
    """Bytes per second of a large device copy (read + write), the median of 10."""
    n = 2**20 if smoke else GiB
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    times = []
    for i in range(11):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        if i:
            times.append(time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def fill(decoder: ServingDecoder, batch: int, context_len: int, generator: torch.Generator) -> None:
    """Random pools as if `context_len` tokens had been prefilled into rows 0 .. batch - 1."""
    for pool in decoder.pools:
        for name, tensor in pool.items():
            part = tensor[:batch, :context_len] if name == "latent" else tensor[:batch]
            part.normal_(generator=generator)
            if name == "state":
                part.mul_(0.01)
    decoder.lengths[:batch] = context_len
    decoder.free = list(range(batch, decoder.max_seqs))


def time_steps(decoder: ServingDecoder, batch: int, steps: int, device: torch.device) -> list[float]:
    """Seconds of each of `steps` decoding steps after one untimed step (which captures the graph)."""
    tokens = torch.zeros(batch, dtype=torch.long, device=device)
    slots = torch.arange(batch, device=device)
    decoder.step(tokens, slots)
    sync(device)
    seconds = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            decoder.step(tokens, slots)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            decoder.step(tokens, slots)
            seconds.append(time.perf_counter() - begin)
    return seconds


def kernel_seconds(fn, device: torch.device, repeats: int = 5) -> float | None:
    """Sum of the GPU kernel durations of one call of `fn`, from torch.profiler (median over `repeats`)."""
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sums = []
    for _ in range(repeats):
        sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            sync(device)
        events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        sums.append(sum(e.time_range.elapsed_us() for e in events) / 1e6)
    return statistics.median(sums)


def overhead(models: dict, device: torch.device, steps: int) -> dict:
    """All-KDA model, batch 1: graph step, eager step, and the sum of the step's kernels."""
    model = models["K"]
    graphed = ServingDecoder(model, 1, 64, cuda_graph=device.type == "cuda")
    eager = ServingDecoder(model, 1, 64, cuda_graph=False)
    gen = torch.Generator(device=device).manual_seed(0)
    for decoder in (graphed, eager):
        fill(decoder, 1, 8, gen)
    graph_s = statistics.median(time_steps(graphed, 1, steps, device))
    eager_s = statistics.median(time_steps(eager, 1, steps, device))
    tokens, slots = (
        torch.zeros(1, dtype=torch.long, device=device),
        torch.zeros(1, dtype=torch.long, device=device),
    )
    row = {
        "pattern": "K",
        "n_layers": model.config.n_layers,
        "batch": 1,
        "graph_step_s": graph_s,
        "eager_step_s": eager_s,
    }
    try:
        with torch.no_grad():
            row["kernel_sum_s"] = kernel_seconds(lambda: eager._step(tokens, slots), device)
    except Exception as error:  # the profiler is not essential: keep the timings
        row["kernel_sum_error"] = repr(error)[:300]
    if row.get("kernel_sum_s"):
        row["graph_over_kernels"] = graph_s / row["kernel_sum_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model and contexts on the CPU")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default $OUT)")
    parser.add_argument("--contexts", type=int, nargs="*", default=None)
    parser.add_argument("--max-batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per point (the median counts)")
    parser.add_argument(
        "--memory-fraction", type=float, default=0.85, help="of the free memory for the pools"
    )
    parser.add_argument("--time-limit-s", type=float, default=130.0)
    args = parser.parse_args()
    began = time.perf_counter()
    out_dir = args.out or Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)

    if args.smoke:
        device, dtype, contexts, cap = torch.device("cpu"), torch.float32, args.contexts or [16], 3
        steps = min(args.steps, 2)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU: run with --smoke to check the logic on the CPU")
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        device, dtype, contexts, cap = (
            torch.device("cuda"),
            torch.bfloat16,
            args.contexts or list(CONTEXTS),
            args.max_batch,
        )
        steps = args.steps
    dtype_bytes = torch.finfo(dtype).bits // 8
    bandwidth = copy_bandwidth(device, args.smoke)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)

    configs = {p: model_config(p, args.smoke) for p in PATTERNS}
    models = {}
    for pattern, config in configs.items():
        torch.manual_seed(0)
        with device:
            models[pattern] = HybridLM(config).to(dtype).eval()

    rows = []
    generator = torch.Generator(device=device).manual_seed(0)
    for S in contexts:
        for pattern, config in configs.items():
            per_sequence = ServingDecoder.pool_bytes(config, 1, S + steps + 2, dtype_bytes)
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                fit = int(args.memory_fraction * free // per_sequence)
            else:
                fit = cap
            for batch in sorted({1, min(fit, cap)}):
                row = {"pattern": pattern, "context_len": S, "batch": batch, "largest_fit": fit}
                rows.append(row)
                if batch < 1:
                    row["skipped"] = "not even one sequence fits"
                    continue
                if time.perf_counter() - began > args.time_limit_s:
                    row["skipped"] = "time limit"
                    continue
                print(f"{pattern:5s} S={S:8d} batch={batch:4d} ...", end=" ", flush=True)
                try:
                    decoder = ServingDecoder(models[pattern], batch, S + steps + 2)
                    fill(decoder, batch, S, generator)
                    seconds = time_steps(decoder, batch, steps, device)
                    step = statistics.median(seconds)
                    need = decode_bytes_per_step(config, S + steps // 2, batch, dtype_bytes)
                    total = sum(need.values())
                    row.update(
                        step_s=step,
                        step_s_all=seconds,
                        tokens_per_s=batch / step,
                        bytes_per_step=need,
                        achieved_bytes_per_s=total / step,
                        bound_step_s=total / bandwidth,
                        pool_bytes=decoder.nbytes(),
                    )
                    print(f"{step * 1e3:8.3f} ms, bound {total / bandwidth * 1e3:8.3f} ms", flush=True)
                except torch.OutOfMemoryError as error:
                    row["skipped"] = "out of memory: " + str(error).splitlines()[0][:200]
                    print("out of memory", flush=True)
                decoder = None
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()

    overhead_row = overhead(models, device, steps)
    print(f"overhead: {overhead_row}", flush=True)
    result = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "smoke": args.smoke,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "steps": steps,
        "configs": {p: c.to_dict() for p, c in configs.items()},
        "rows": rows,
        "overhead": overhead_row,
        "seconds": time.perf_counter() - began,
    }
    path = out_dir / FILENAME
    write_result(path, result)
    print(f"wrote {path} in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
