"""Append-prefill on one GPU: n new tokens onto a history of S, MLA's MHA mode, MLA's absorbed mode and KDA.

What it measures. One layer of Kimi Linear 48B's widths (`kda_edu.models.costs.KIMI_LINEAR_48B`: MLA with 32 heads,
latent 512 plus the kept 64-wide rope slot; KDA 32 heads of 128; d_model 2304), bf16, batch 1. For n in
{64, 512, 4096} appended tokens and S in {32768, 131072} cached ones:

- "mha": `kda_edu.models.serving.mla_append(..., "mha")`: every cached latent expanded into per-head keys and
  values, then PyTorch's fused attention with a lower-right causal mask;
- "mqa": `mla_append(..., "mqa")`: absorbed queries over the cached rows in the Triton kernel of
  `kda_edu.kernels.mla_decode`;
- "kda": `KDALayer` continuing from a state (the chunked Triton forward, `chunk_kda`), whose cost does not
  depend on S.

Prefill, for "prefill is linear in the length" (it is, for KDA layers): one fresh prefill of T in {8192,
32768, 131072} tokens through the KDA layer (mode "kda prefill") and through the MLA layer in MHA mode
(`mla_append` onto an empty history, mode "mla prefill"), recorded with n = T, S = 0 and the time per token.

The MLA caches are preallocated rows filled with random numbers (the time depends on shapes, not contents)
into which the append writes. Each point: one untimed call, then `--repeats` calls timed with CUDA events (the
median counts), then one call between `torch.cuda.reset_peak_memory_stats` and `max_memory_allocated`
(recorded whole, `peak_bytes`, and above what was allocated before the call, `peak_extra_bytes`). Beside each
point the FLOP/byte model of `kda_edu.models.costs` (`mla_token_cost`, `kda_token_cost`, times n) and the bound
max(FLOPs / matmul rate, bytes / copy bandwidth), with both rates measured at the start of the same run
(a bf16 8192^3 matmul; a 2 GiB device copy).

Time. 18 append points and 6 prefill points; the slowest is absorbed mode at n = 4096, S = 131072 (37 TFLOP of attention, tens to
hundreds of ms a call); about a minute in all with compilation, under 3 minutes on one H200.

    python -m bench.kernels.bench_append_prefill                    # GPU; writes $OUT/h200_append_prefill.json
    python -m bench.kernels.bench_append_prefill --smoke --out DIR   # tiny sizes on the CPU, checks the logic
"""

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from bench.common import write_result
from kda_edu.layers.kda_layer import KDAConfig, KDALayer
from kda_edu.layers.mla import MLA, MLAConfig
from kda_edu.models.costs import KIMI_LINEAR_48B, kda_token_cost, mla_token_cost
from kda_edu.models.serving import mla_append

FILENAME = "h200_append_prefill.json"
APPENDED = (64, 512, 4096)
HISTORIES = (32768, 131072)
PREFILLS = (8192, 32768, 131072)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `repeats` calls after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def rates(device: torch.device, smoke: bool) -> tuple[float, float]:
    """(bf16 matmul FLOP/s, copy bytes/s), measured here."""
    n = 256 if smoke else 8192
    dtype = torch.float32 if smoke else torch.bfloat16
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    flops = 2 * n**3 / seconds(lambda: a @ b, device, 5)
    src = torch.randn(2**20 if smoke else 2**30, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 2 / seconds(lambda: dst.copy_(src), device, 10)
    return flops, bandwidth


def peak(fn, device: torch.device) -> tuple[int, int]:
    """(max_memory_allocated during one call of fn, the same minus what was allocated before it)."""
    if device.type != "cuda":
        return 0, 0
    sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    sync(device)
    top = torch.cuda.max_memory_allocated(device)
    return top, top - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny layer and lengths on the CPU")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default $OUT)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    began = time.perf_counter()
    out_dir = args.out or Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)

    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        d_model, appended, histories, prefills, repeats = 32, (4, 16), (64,), (32, 64), 1
        mla_cfg = MLAConfig(num_heads=2, kv_rank=16, qk_head_dim=16, v_head_dim=16, rope_head_dim=8)
        kda_cfg = KDAConfig(num_heads=2, head_dim=16, chunk_size=16)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU: run with --smoke to check the logic on the CPU")
        device, dtype = torch.device("cuda"), torch.bfloat16
        d_model, appended, histories, prefills = KIMI_LINEAR_48B.d_model, APPENDED, HISTORIES, PREFILLS
        repeats = args.repeats
        mla_cfg, kda_cfg = KIMI_LINEAR_48B.mla, KIMI_LINEAR_48B.kda
    flop_rate, bandwidth = rates(device, args.smoke)
    print(f"matmul {flop_rate / 1e12:.0f} TFLOP/s, copy {bandwidth / 1e12:.2f} TB/s", flush=True)

    torch.manual_seed(0)
    with device:
        mla = MLA(d_model, mla_cfg).to(dtype).eval()
        kda = KDALayer(d_model, kda_cfg).to(dtype).eval()
    generator = torch.Generator(device=device).manual_seed(0)
    rows = []
    for S in histories:
        cache_rows = torch.randn(
            1, S + max(appended), mla_cfg.cache_width, generator=generator, device=device, dtype=dtype
        )
        window = torch.randn(
            1,
            kda_cfg.conv_size - 1,
            2 * kda_cfg.num_heads * kda_cfg.head_dim + kda_cfg.hv * kda_cfg.v_dim,
            generator=generator,
            device=device,
            dtype=dtype,
        )
        state = 0.01 * torch.randn(
            1, kda_cfg.hv, kda_cfg.head_dim, kda_cfg.v_dim, generator=generator, device=device
        )
        for n in appended:
            x = torch.randn(1, n, d_model, generator=generator, device=device, dtype=dtype)
            for mode in ("mha", "mqa", "kda"):
                if mode == "kda":
                    cache = kda.new_cache()

                    def call(cache=cache, x=x, window=window, state=state, S=S):
                        cache.conv_window, cache.state, cache.seq_len = window, state, S
                        with torch.no_grad():
                            kda(x, cache=cache)

                    cost = kda_token_cost(kda_cfg, d_model, appended=n)
                else:

                    def call(mode=mode, x=x, rows=cache_rows, S=S):  # rewrites rows S .. S + n - 1: same work
                        mla_append(mla, x, rows, S, mode)

                    cost = mla_token_cost(mla_cfg, d_model, S + n, mode, appended=n)
                row = {"n": n, "S": S, "mode": mode}
                try:
                    ms = seconds(call, device, repeats) * 1e3
                    top, extra = peak(call, device)
                    flops, nbytes = cost.flops * n, cost.bytes * n
                    bound_ms = max(flops / flop_rate, nbytes / bandwidth) * 1e3
                    row.update(
                        ms=ms,
                        peak_bytes=top,
                        peak_extra_bytes=extra,
                        model_flops=flops,
                        model_bytes=nbytes,
                        model_bound_ms=bound_ms,
                    )
                    print(
                        f"S={S:7d} n={n:5d} {mode}: {ms:9.3f} ms (model bound {bound_ms:8.3f} ms), peak {top / 2**30:6.2f} GiB",
                        flush=True,
                    )
                except torch.OutOfMemoryError as error:
                    row["skipped"] = "out of memory: " + str(error).splitlines()[0][:200]
                    print(f"S={S} n={n} {mode}: out of memory", flush=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                rows.append(row)
        cache_rows = call = None  # free this history's rows before the next one is allocated

    for T in prefills:
        x = torch.randn(1, T, d_model, generator=generator, device=device, dtype=dtype)
        fresh_rows = torch.empty(1, T, mla_cfg.cache_width, device=device, dtype=dtype)
        calls = {
            "kda prefill": (
                lambda x=x: kda(x, cache=kda.new_cache()),
                kda_token_cost(kda_cfg, d_model, appended=T),
            ),
            "mla prefill": (
                lambda x=x, rows=fresh_rows: mla_append(mla, x, rows, 0, "mha"),
                mla_token_cost(mla_cfg, d_model, T, "mha", appended=T),
            ),
        }
        for mode, (call, cost) in calls.items():
            row = {"n": T, "S": 0, "mode": mode}
            try:
                with torch.no_grad():
                    ms = seconds(call, device, repeats) * 1e3
                    top, extra = peak(call, device)
                flops, nbytes = cost.flops * T, cost.bytes * T
                bound_ms = max(flops / flop_rate, nbytes / bandwidth) * 1e3
                row.update(
                    ms=ms,
                    ms_per_token=ms / T,
                    peak_bytes=top,
                    peak_extra_bytes=extra,
                    model_flops=flops,
                    model_bytes=nbytes,
                    model_bound_ms=bound_ms,
                )
                print(f"prefill T={T:7d} {mode}: {ms:9.3f} ms, {ms / T * 1e3:8.3f} us per token", flush=True)
            except torch.OutOfMemoryError as error:
                row["skipped"] = "out of memory: " + str(error).splitlines()[0][:200]
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
        x = fresh_rows = calls = call = None

    result = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "smoke": args.smoke,
        "batch": 1,
        "d_model": d_model,
        "mla": vars(mla_cfg),
        "kda": vars(kda_cfg),
        "matmul_flops_per_s": flop_rate,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "repeats": repeats,
        "rows": rows,
        "seconds": time.perf_counter() - began,
    }
    path = out_dir / FILENAME
    write_result(path, result)
    print(f"wrote {path} in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
