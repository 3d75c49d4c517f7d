"""Experiment on a GPU: the forward cut into pieces of the time axis, each piece's scan on a side
stream beside the next piece's prepare kernels (`kda_edu.kernels.chunk_launch.time_pieces`, `chunk_kda_fwd`).

At each shape (bf16, K = V = 128, `bench.common.kda_inputs`): the forward's median time for 1, 2, 4
and 8 pieces, how far o and the final state move from one piece (relative norm; expected 0: the same kernel
code per chunk, the state crossing pieces in float32), and a CUDA-graph capture and replay of the default
forward against eager; at the two smaller shapes the forward + backward step, recomputed and kept, in one
piece and in the default pieces. "default" is `time_pieces`' choice (at (8, 4096, 16): pieces of two sequences).

    source bench/device/env.sh
    python -m bench.experiments.time_pieces --out $OUT/time_pieces.json [--shapes 1,8192,32 ...]
"""

import argparse
import functools
import json
from unittest import mock

import torch
from triton.testing import do_bench

from bench.common import kda_inputs, run_environment, write_result
from bench.kernels.bench_kda import HEADLINE, D
from kda_edu.kernels import chunk, chunk_common, chunk_fwd, chunk_launch

COUNTS = (1, 2, 4, 8, None)  # pieces of the time axis; None: `time_pieces`' choice ("default")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def one_shape(B, T, H):
    x = kda_inputs(B, T, H, D)
    h0 = torch.randn(B, H, D, D, device="cuda")
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5, h0, True)
    ref_o, ref_h = chunk_fwd.chunk_kda_fwd(*args, pieces=1)
    row = dict(shape=(B, T, H), forward_ms={}, o_rel_to_one={}, ht_rel_to_one={})
    for p in COUNTS:
        key = str(p) if p else "default"
        o, ht = chunk_fwd.chunk_kda_fwd(*args, pieces=p)
        row["o_rel_to_one"][key], row["ht_rel_to_one"][key] = rel(o, ref_o), rel(ht, ref_h)
        row["forward_ms"][key] = do_bench(
            lambda p=p: chunk_fwd.chunk_kda_fwd(*args, pieces=p), return_mode="median"
        )
    row["default_pieces"] = chunk_launch.time_pieces(
        B, chunk_common.chunk_layout(T, B)[0], H, D, D, 2, False, chunk_launch.device_multiprocessors("cuda")
    )
    # A CUDA graph of the default forward, replayed on new inputs of the same shape, against eager.
    static = [t.clone() for t in args[:5]]
    chunk_fwd.chunk_kda_fwd(*static, *args[5:])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = chunk_fwd.chunk_kda_fwd(*static, *args[5:])
    fresh = kda_inputs(B, T, H, D, seed=1)
    for s, name in zip(static, ("q", "k", "v", "g", "beta"), strict=True):
        s.copy_(fresh[name])
    graph.replay()
    e_out = chunk_fwd.chunk_kda_fwd(*(fresh[n] for n in ("q", "k", "v", "g", "beta")), *args[5:])
    row["graph_rel_to_eager"] = [rel(g_out[0], e_out[0]), rel(g_out[1], e_out[1])]
    del graph
    if B * T * H <= 2**19:  # the training step too, at the two smaller shapes
        row["fwd_bwd_ms"] = step_times(B, T, H)
    return row


def step_times(B, T, H):
    """Forward + backward of sum(o * do) (bench.kernels.bench_kda_bwd's step), recomputed and kept, with the forward in
    one piece or in `time_pieces`' default pieces. (The backward in pieces, its state passes on the side
    stream, gained nothing: they could not run beside the chunk-local kernels; the backward runs in one piece.)"""
    from bench.kernels.bench_kda_bwd import make_inputs as step_inputs

    xs, do = step_inputs(B, T, H)
    out = {}
    for keep in (False, True):
        for p in (1, None):
            fwd = functools.partial(chunk_fwd.chunk_kda_fwd, pieces=p)
            with mock.patch.object(chunk_fwd, "chunk_kda_fwd", fwd):

                def step(keep=keep):
                    o = chunk.chunk_kda(*(xs[n] for n in ("q", "k", "v", "g", "beta")), check_inputs=False,
                                        keep_intermediates=keep)[0]  # fmt: skip
                    o.backward(do)

                step()
                key = ("kept " if keep else "") + ("one piece" if p == 1 else "default pieces")
                out[key] = do_bench(step, grad_to_none=list(xs.values()), return_mode="median")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="time_pieces.json")
    ap.add_argument(
        "--shapes", nargs="+", default=None, help="B,T,H (default: the headline shapes and (1, 2048, 16))"
    )
    args = ap.parse_args()
    shapes = (
        [tuple(int(n) for n in s.split(",")) for s in args.shapes]
        if args.shapes
        else HEADLINE + [(1, 2048, 16)]
    )
    result = dict(environment=run_environment(), rows=[])
    for B, T, H in shapes:
        try:
            row = one_shape(B, T, H)
        except Exception as e:  # a failure is a result
            row = dict(shape=(B, T, H), error=f"{type(e).__name__}: {str(e)[:400]}")
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        write_result(args.out, result)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
