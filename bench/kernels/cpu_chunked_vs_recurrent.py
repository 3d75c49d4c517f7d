"""How much faster is the chunked KDA reference than the loop on a CPU?

Times `kda_recurrent` (T sequential steps) and `kda_chunked` (T / C sequential chunk steps plus batched
intra-chunk work) at B = 1, T = 4096, H = HV = 4, K = V = 64 in float32, forward only, and writes the medians,
the speed-up and the machine to bench/results/cpu_chunked_vs_recurrent.json.

Each function runs once to warm up, then `--repeats` rounds run every function once, in turn, so that a
change in the machine's load affects all of them alike. Two medians are reported per function: wall time,
and the CPU time of this process (`time.process_time`), which other jobs on the machine inflate much less.
Every thread count in `--threads` (default: 1) is measured separately. One thread is the default because on a
machine shared with other jobs PyTorch's thread pool can spend more time waking threads than computing
(on a loaded 2-core machine two threads made both forms 10x slower).
The load average before and after is recorded for the same reason.

    .venv/bin/python -m bench.kernels.cpu_chunked_vs_recurrent [--repeats 7] [--threads 1,2]
"""

import argparse
import os
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import write_result
from kda_edu.ops.kda import kda_chunked, kda_recurrent

B, T, H, K, V = 1, 4096, 4, 64, 64
CHUNK_SIZES = (64, 32, 16)  # 64 is kda_chunked's default and the headline number
RESULT = Path(__file__).resolve().parents[1] / "results" / "cpu_chunked_vs_recurrent.json"


def make_inputs(seed: int = 0) -> dict:
    """Inputs as a KDA layer produces them: unit-length q and k, gates in [-1, 0], beta in (0, 1), float32.

    Not `bench.common.kda_inputs`: these are the inputs the published CPU numbers were measured on (uniform
    gates and beta from the CPU's default generator, in float32, the references' own precision), and the
    two references cost the same whatever the values, so the GPU benchmarks' distribution would buy nothing.
    """
    gen = torch.Generator().manual_seed(seed)
    return dict(
        q=F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
        k=F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
        v=torch.randn(B, T, H, V, generator=gen),
        g=-torch.rand(B, T, H, K, generator=gen),
        beta=torch.rand(B, T, H, generator=gen),
    )


def median_ms(fns: dict, repeats: int) -> dict:
    """{name: (median wall ms, median process CPU ms)} of each function, timed in interleaved rounds."""
    for fn in fns.values():
        fn()  # warm-up
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {
        name: tuple(1e3 * statistics.median(column) for column in zip(*t, strict=True))
        for name, t in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", default="1", help="comma-separated torch thread counts to measure")
    args = parser.parse_args()

    x = make_inputs()
    load_before = os.getloadavg()
    runs = []
    with torch.inference_mode():
        o_ref, _ = kda_recurrent(**x)
        for threads in (int(n) for n in args.threads.split(",")):
            torch.set_num_threads(threads)
            fns = {"recurrent": lambda: kda_recurrent(**x)}
            fns.update({C: (lambda C=C: kda_chunked(**x, chunk_size=C)) for C in CHUNK_SIZES})
            ms = median_ms(fns, args.repeats)
            (rec_wall, rec_cpu) = ms["recurrent"]
            run = {
                "threads": threads,
                "recurrent_ms": round(rec_wall, 2),
                "recurrent_cpu_ms": round(rec_cpu, 2),
            }
            run["chunked"] = []
            for C in CHUNK_SIZES:
                o, _ = kda_chunked(**x, chunk_size=C)
                wall, cpu = ms[C]
                run["chunked"].append(
                    {
                        "chunk_size": C,
                        "chunked_ms": round(wall, 2),
                        "speedup": round(rec_wall / wall, 2),
                        "chunked_cpu_ms": round(cpu, 2),
                        "speedup_cpu_time": round(rec_cpu / cpu, 2),
                        "rel_err_vs_recurrent": float((o - o_ref).norm() / o_ref.norm()),
                    }
                )
                print(
                    f"threads={threads} C={C:>2}: recurrent {rec_wall:7.1f} ms, chunked {wall:7.1f} ms, "
                    f"speed-up {rec_wall / wall:4.2f}x (CPU time {rec_cpu:7.1f} / {cpu:7.1f} ms = {rec_cpu / cpu:4.2f}x)"
                )
            runs.append(run)

    result = {
        "what": "kda_chunked vs kda_recurrent forward on CPU: median wall time and process CPU time",
        "shape": {"B": B, "T": T, "H": H, "HV": H, "K": K, "V": V, "dtype": "float32"},
        "repeats": args.repeats,
        "runs": runs,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "load_average_1_5_15_before": [round(v, 2) for v in load_before],
            "load_average_1_5_15_after": [round(v, 2) for v in os.getloadavg()],
        },
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    write_result(RESULT, result, indent=2)
    print(f"wrote {RESULT}")


if __name__ == "__main__":
    main()
