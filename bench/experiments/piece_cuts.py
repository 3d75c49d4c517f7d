"""Experiment on a GPU: where to cut the time axis of the forward, and the scan's pipeline depth.

`chunk_kda_fwd` cuts the time axis into equal pieces (`time_pieces`) and runs each piece's scan beside the next
piece's prepare kernels. Only the last piece's scan runs alone, after every prepare kernel: a shorter last piece
shortens that tail, and pieces that shrink towards the end keep each scan about as long as the prepare kernels
it runs beside. This times the forward (bf16, K = V = 128, `bench.common.kda_inputs`, with an initial
state and the final state) for several cuts, each given as chunks per piece, at 2 and 3 pipeline stages of
the scan, beside the default (`time_pieces`, `pass_stages`). Each output must equal the one-piece forward's
bit for bit (the same code per chunk; the state crosses pieces in float32): a difference fails the script.

    source bench/device/env.sh
    python -m bench.experiments.piece_cuts --out $OUT/piece_cuts.json
"""

import argparse
import sys

import torch
from triton.testing import do_bench

from bench.common import kda_inputs, write_result
from bench.kernels.bench_kda import D
from kda_edu.kernels import chunk_common, chunk_fwd

# chunks per piece, first piece first; None: the default cut
CUTS = {
    (1, 8192, 32): [None, [64, 64], [80, 48], [96, 32], [64, 32, 32], [64, 32, 16, 16]],
    (1, 32768, 32): [None, [128] * 4, [192, 128, 128, 64], [256, 128, 64, 64], [192, 128, 96, 64, 32]],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="piece_cuts.json")
    args = ap.parse_args()
    rows, failed = [], False
    for (B, T, H), cuts in CUTS.items():
        x = kda_inputs(B, T, H, D)
        h0 = torch.randn(B, H, D, D, device="cuda")
        fwd_args = (x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5, h0, True)
        ref_o, ref_h = chunk_fwd.chunk_kda_fwd(*fwd_args, pieces=1)
        for cut in cuts:
            pieces = None
            if cut is not None:
                assert sum(cut) == T // chunk_common.CHUNK, cut
                starts = [sum(cut[:i]) for i in range(len(cut))]
                pieces = [(0, B, cs, cn) for cs, cn in zip(starts, cut, strict=True)]
            for stages in (None, 2, 3):
                o, ht = chunk_fwd.chunk_kda_fwd(*fwd_args, pieces=pieces, stages=stages)
                same = bool(torch.equal(o, ref_o) and torch.equal(ht, ref_h))
                ms = do_bench(
                    lambda a=fwd_args, p=pieces, s=stages: chunk_fwd.chunk_kda_fwd(*a, pieces=p, stages=s),
                    return_mode="median",
                )
                rows.append(
                    dict(shape=[B, T, H], cut=cut or "default", stages=stages or "default", ms=ms, same=same)
                )
                print(
                    (B, T, H),
                    cut or "default",
                    stages or "default",
                    f"{ms:.3f} ms",
                    "" if same else "DIFFERS",
                )
                failed |= not same
                write_result(args.out, dict(device=torch.cuda.get_device_name(), rows=rows))
        del x, h0, fwd_args, ref_o, ref_h
        torch.cuda.empty_cache()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
