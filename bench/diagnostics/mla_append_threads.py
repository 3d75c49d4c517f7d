"""How the thread count changes chapter 13's CPU comparison of MLA's two append modes at one decoded token.

Chapter 13 times one MLA layer (r = 256, H = 4, d_k = d_v = 64, d_model = 128) appending one token to 2048
cached latents in MHA mode (expand every latent) and in MQA mode (absorb the up-projections). MHA mode has
about 60x the FLOPs, but MQA mode's many small operations each carry a fixed cost, so the measured ratio is
far smaller, and more threads shrink it further (they speed up MHA mode's large products, not fixed costs).
Each run is a fresh process (the fastest of 10 appends per mode, as the chapter does); the results are
appended to bench/results/mla_append_threads.json under a machine label, which the chapter reads.

    python -m bench.diagnostics.mla_append_threads --label "2-core CI-like CPU" --runs 10 --threads 1
"""

import argparse
import json
import os
import subprocess
import sys

from bench.common import write_result

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
RESULT = os.path.join(ROOT, "bench", "results", "mla_append_threads.json")

ONE_RUN = """
import json, sys, torch
from kda_edu.layers.mla import MLA, MLAConfig
from kda_edu.chapters.ch13_inference import mla_append_seconds
torch.manual_seed(0)
layer = MLA(128, MLAConfig(num_heads=4, kv_rank=256, qk_head_dim=64, v_head_dim=64))
t = {m: mla_append_seconds(layer, 2048, 1, m, repeats=10, threads=int(sys.argv[1])) for m in ("mha", "mqa")}
print(json.dumps(t))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="the machine, in words")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    data = json.load(open(RESULT)) if os.path.exists(RESULT) else {"runs": []}
    for threads in args.threads:
        for _ in range(args.runs):
            out = subprocess.run(
                [sys.executable, "-c", ONE_RUN, str(threads)],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            t = json.loads(out.strip().splitlines()[-1])
            row = {
                "machine": args.label,
                "cores": os.cpu_count(),
                "threads": threads,
                "mha_s": t["mha"],
                "mqa_s": t["mqa"],
                "ratio": t["mha"] / t["mqa"],
            }
            data["runs"].append(row)
            print(
                f"{threads} thread(s): MHA {t['mha'] * 1e3:.2f} ms, MQA {t['mqa'] * 1e3:.2f} ms, ratio {row['ratio']:.2f}"
            )
    write_result(RESULT, data)


if __name__ == "__main__":
    main()
