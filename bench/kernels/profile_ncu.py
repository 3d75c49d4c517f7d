"""Nsight Compute profile of the KDA forward (and, with --backward, the training step): ours beside fla's.

A profile comes before a new design: stall reasons, occupancy, tensor-core use and bytes per
kernel, for fla's kernels and ours at one shape, in one process. Autotuning (fla's first call at a shape takes
80-95 s and launches every configuration it tries) must stay out of the profile, so the script runs every method
a few times first and only then opens the profiler's range (cudaProfilerStart); ncu is started with
`--profile-from-start off` and records only the launches inside it: one call of each method.

    ncu --profile-from-start off --clock-control none --csv --page raw \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \\
        python -m bench.kernels.profile_ncu --shape 1 8192 32 > $OUT/ncu_forward.csv
    python -m bench.kernels.profile_ncu --summarize $OUT/ncu_forward.csv --out $OUT/ncu_forward.json

(`bench/device/profile.sh` runs both.) `--summarize` reads ncu's raw CSV and writes, per kernel launch, its
duration, registers, shared memory, theoretical and achieved occupancy, the DRAM bytes and throughput, the SM
and tensor-pipe utilisation and the five largest stall reasons (cycles per issued instruction), keeping every
metric it does not know under "other" untouched. Without a GPU, `--smoke` runs the methods' set-up at a tiny
shape through the interpreter (a check of the script, not a profile).
"""

import argparse
import csv
import io
import os
import re
import sys

import torch

from bench.common import kda_inputs, write_result

os.environ.setdefault("FLA_FLASH_KDA", "0")  # fla's Triton path, as every timing of ours compares against

# The metrics the summary names (ncu's raw names, as its sections collect them) and what it calls them.
METRICS = {
    "gpu__time_duration.sum": "duration",
    "launch__registers_per_thread": "registers",
    "launch__shared_mem_per_block_static": "shared_static",
    "launch__shared_mem_per_block_dynamic": "shared_dynamic",
    "launch__grid_size": "grid",
    "launch__block_size": "block",
    "sm__maximum_warps_per_active_cycle_pct": "occupancy_theoretical_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy_achieved_pct",
    "dram__bytes.sum": "dram_bytes",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor_pct",
    "smsp__average_warp_latency_per_inst_issued.ratio": "cycles_per_issue",
}
STALL = re.compile(r"smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio")


def summarize(text: str) -> list[dict]:
    """ncu's `--csv --page raw` output (one row per launch, a units row after the header) as one dict per
    launch: `kernel`, the METRICS by their short names (numbers where they parse), `stalls` (the five largest
    stall reasons, cycles per issued instruction) and `other` (every remaining metric, as ncu wrote it)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError('no ncu raw CSV header (a line starting with "ID") in the input')
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, units, data = rows[0], rows[1], rows[2:]
    launches = []
    for row in data:
        if len(row) != len(header):
            continue  # a line of the program's own output between ncu's rows
        record = dict(zip(header, row, strict=True))
        out = {"kernel": record.get("Kernel Name", ""), "id": record.get("ID"), "units": {}, "other": {}}
        stalls = {}
        for name, value in record.items():
            unit = units[header.index(name)]
            try:
                number = float(value.replace(",", ""))
            except ValueError:
                number = None
            if name in METRICS:
                out[METRICS[name]] = value if number is None else number
                out["units"][METRICS[name]] = unit
            elif (m := STALL.fullmatch(name)) and number is not None:
                stalls[m.group(1)] = number
            elif "__" in name:
                out["other"][name] = value
        out["stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:5])
        launches.append(out)
    return launches


def methods(x: dict, backward: bool, which=("kda_edu", "fla")) -> dict:
    """name -> a callable running one forward (or forward + backward) on the inputs `x`, for the names in
    `which` (fla only where it imports and the inputs are on a GPU)."""
    from kda_edu.kernels import chunk_kda

    fns = {}
    if "kda_edu" in which:
        fns["kda_edu"] = lambda: chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], check_inputs=False)
    if x["q"].is_cuda and "fla" in which:
        try:
            from fla.ops.kda import chunk_kda as fla_chunk_kda

            fns["fla"] = lambda: fla_chunk_kda(
                x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=False
            )
        except ImportError as e:
            print(f"fla not importable ({e}): profiling kda_edu alone", file=sys.stderr)
    if not backward:
        return fns

    def step(fn):
        def run():
            for t in (x["q"], x["k"], x["v"], x["g"], x["beta"]):
                t.grad = None
            o, _ = fn()
            o.backward(do)

        return run

    for t in (x["q"], x["k"], x["v"], x["g"], x["beta"]):
        t.requires_grad_(True)
    do = torch.randn_like(x["v"])
    return {name: step(fn) for name, fn in fns.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=3, default=[1, 8192, 32], metavar=("B", "T", "H"))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--backward", action="store_true", help="profile forward + backward")
    ap.add_argument("--warmup", type=int, default=3, help="calls of each method before the profiled one")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on the CPU (interpreter), no profiler")
    ap.add_argument("--summarize", type=str, default=None, help="read an ncu raw CSV and write --out")
    ap.add_argument("--out", type=str, default=None)
    ap.add_argument(
        "--methods",
        type=str,
        default="kda_edu,fla",
        help="comma-separated: kda_edu, fla (fla's profile is "
        "bench/results/h200_ncu_profile.json; leaving it out skips its 80-95 s autotune)",
    )
    args = ap.parse_args()
    if args.summarize:
        with open(args.summarize) as f:
            launches = summarize(f.read())
        write_result(args.out, {"source": os.path.basename(args.summarize), "launches": launches})
        for r in launches:
            print(
                f"{r['kernel'][:48]:48s} {r.get('duration', '?')} {r['units'].get('duration', '')}  "
                f"regs {r.get('registers', '?')}  occ {r.get('occupancy_achieved_pct', '?')}%  "
                f"dram {r.get('dram_pct', '?')}%  tensor {r.get('tensor_pct', '?')}%  stalls {r['stalls']}"
            )
        return

    B, T, H = (1, 130, 2) if args.smoke else args.shape
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    x = kda_inputs(B, T, H, 32 if args.smoke else args.head_dim, dtype=dtype, device=device)
    fns = methods(x, args.backward, tuple(args.methods.split(",")))
    for fn in fns.values():  # autotuning and compilation, outside the profiled range
        for _ in range(1 if args.smoke else args.warmup):
            fn()
    if args.smoke:
        print(f"smoke: {sorted(fns)} ran at {(B, T, H)}")
        return
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fn in fns.items():
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
