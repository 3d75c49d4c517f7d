"""Chapter 15's tools around context parallelism: a model of prefill time against the number of ranks (KDA
layers alone, and a whole KDA:MLA stack), and a harness that runs gloo processes on one machine (the
chapter's demonstrations and the tests).

The algorithm itself is `kda_edu.parallel.context_parallel`.
"""

import io
import os
import socket
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kda_edu.parallel.context_parallel import (
    SCHEMES,
    context_parallel_kda,
    default_kernel,
    reference_kernel,
)
from kda_edu.parallel.context_parallel_mla import (
    context_parallel_mla,
    mla_exchange_bytes,
    zigzag_shard,
    zigzag_unshard,
)

# ---------------------------------------------------------------------------------------------------------
# A model of prefill time against the number of ranks


def boundary_bytes(scheme: str, H: int, K: int, V: int, bytes_per_number: int = 4) -> int:
    """Bytes one rank contributes per boundary in the forward: its outgoing state (`"sequential"`, K x V per
    head) or its map (`"scan"`, K x K + K x V per head), float32 by default."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    return H * K * (V if scheme == "sequential" else K + V) * bytes_per_number


@dataclass(frozen=True)
class Link:
    """A link between ranks for the model: bytes per second in one direction, seconds per message."""

    name: str
    bandwidth: float
    latency: float


def prefill_seconds(
    scheme: str,
    n: int,
    shard_s: float,
    map_s: float,
    combine_s: float,
    link: Link,
    H: int,
    K: int,
    V: int,
    layers: int = 1,
) -> dict:
    """Modelled forward time of `layers` KDA layers over n ranks, split into compute and communication.

    `shard_s`, `map_s` and `combine_s` are the times of one rank at T / n tokens (measured or assumed); a
    message of m bytes costs `latency + m / bandwidth`.

    - scan: per layer, every rank at once computes its map (`map_s`), takes part in a ring all-gather of the
      n maps (n - 1 steps, one map per step), folds them (`combine_s`) and runs its shard (`shard_s`).
    - sequential: rank r runs layer l as soon as rank r - 1 has sent its state of layer l (a wavefront).
      The last rank finishes after `layers + n - 1` shard passes and `layers + n - 2` messages; for one
      layer that is n passes, one rank after the other.

    Returns `{"compute": s, "communication": s, "total": s}`.
    """
    message = boundary_bytes(scheme, H, K, V)
    hop = link.latency + message / link.bandwidth
    if scheme == "sequential":
        compute, comm = (layers + n - 1) * shard_s, (layers + n - 2) * hop
    else:
        compute, comm = layers * (map_s + combine_s + shard_s), layers * (n - 1) * hop
    return {"compute": compute, "communication": comm, "total": compute + comm}


@dataclass(frozen=True)
class RankCosts:
    """Seconds one rank spends on one layer at its share of the sequence (T / n tokens), measured or assumed.

    Attributes:
        kda_pass: the KDA shard's one chunked pass with the carry's maps (the `"one_pass"` scheme).
        kda_fold: folding the n gathered maps into the incoming state.
        kda_correct: correcting the outputs with it, `o + R S_in`.
        mla: the MLA layer on the rank's zigzag shard: projections and attention over the gathered cache
            (about `T^2 / (2 n)` query-key pairs: it grows with T at a fixed n where the KDA terms stay
            linear).
    """

    kda_pass: float
    kda_fold: float
    kda_correct: float
    mla: float


def hybrid_stack_seconds(
    n: int,
    costs: RankCosts,
    link: Link,
    *,
    T: int,
    H: int,
    K: int,
    V: int,
    cache_width: int,
    layers: int,
    kda_per_mla: int = 3,
    cache_bytes_per_number: int = 2,
) -> dict:
    """Modelled forward time of one rank in a KDA:MLA hybrid stack over n ranks, compute and communication.

    The stack has `layers` layers in groups of `kda_per_mla` KDA layers and one MLA layer (Kimi Linear's
    3:1). Per KDA layer, the one_pass scheme: `kda_pass + kda_fold + kda_correct`, and a ring all-gather of
    the n maps, n - 1 messages of `boundary_bytes("one_pass", H, K, V)` (float32). Per MLA layer: `mla`, and
    a ring all-gather of the latent rows, n - 1 messages carrying `mla_exchange_bytes(T, n, cache_width)`
    bytes in all (`cache_bytes_per_number` per number: the cache's dtype). A message of m bytes costs
    `latency + m / bandwidth`. The ranks run in lockstep (zigzag balances MLA's causal work; KDA's shards
    are equal), so one rank's time is the stack's.

    Returns `{"kda": {...}, "mla": {...}, "compute", "communication", "total", "bytes"}`: per kind the
    seconds of all its layers (`compute`, `communication`) and `bytes` sent per rank over the stack.
    """
    if layers < 1 or layers % (kda_per_mla + 1):
        raise ValueError(
            f"layers must be a positive multiple of kda_per_mla + 1 = {kda_per_mla + 1}, got {layers}"
        )
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    n_mla = layers // (kda_per_mla + 1)
    n_kda = layers - n_mla
    kda_bytes = (n - 1) * boundary_bytes("one_pass", H, K, V)
    mla_bytes = mla_exchange_bytes(T, n, cache_width, bytes_per_number=cache_bytes_per_number, backward=False)
    mla_bytes = mla_bytes["forward"]
    kda = {
        "compute": n_kda * (costs.kda_pass + (costs.kda_fold + costs.kda_correct if n > 1 else 0.0)),
        "communication": n_kda * ((n - 1) * link.latency + kda_bytes / link.bandwidth),
    }
    mla = {
        "compute": n_mla * costs.mla,
        "communication": n_mla * ((n - 1) * link.latency + mla_bytes / link.bandwidth),
    }
    compute = kda["compute"] + mla["compute"]
    comm = kda["communication"] + mla["communication"]
    return {
        "kda": kda,
        "mla": mla,
        "compute": compute,
        "communication": comm,
        "total": compute + comm,
        "bytes": n_kda * kda_bytes + n_mla * mla_bytes,
    }


# ---------------------------------------------------------------------------------------------------------
# Running gloo processes on one machine (tests, the book)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, buffer.getvalue(), None))
    except Exception:  # the parent re-raises it with the traceback
        queue.put((rank, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_gloo(fn, world: int, *args, timeout: float = 300.0) -> list:
    """Run `fn(rank, world, *args)` in `world` fresh processes joined by a gloo group; return their results.

    `fn` must be importable by name (a function of a module, not of a notebook), as `torch.multiprocessing`
    spawn starts new interpreters. Each process uses one thread. The results travel back through `torch.save`.
    """
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, data, error = queue.get(timeout=timeout)
            if error is not None:
                raise RuntimeError(f"rank {rank} of {world} failed:\n{error}")
            results[rank] = torch.load(io.BytesIO(data), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"a gloo process failed (exit codes {[p.exitcode for p in procs]})")
    return [results[r] for r in range(world)]


def shard_case(rank: int, world: int, case: dict) -> dict:
    """One rank's part of a context-parallel run (for `run_gloo`): slice the shard, run, backpropagate.

    `case` holds the whole inputs (`q, k, v, g, beta`, optional `initial_state`, `cu_seqlens`), `lengths`
    (tokens per rank), `scheme`, `kernel` (`"reference"` or `"chunk_kda"`), optionally `chunk_size` (of the
    `"one_pass"` scheme's chunked pass), and optionally `do` and `dfinal`
    (then the result has the gradients of `<o, do> + <final, dfinal>`) and `repeats` (then it has the median
    wall time of that many forward calls, after one warm-up, in `seconds`).
    """
    a = sum(case["lengths"][:rank])
    b = a + case["lengths"][rank]
    names = ("q", "k", "v", "g", "beta")
    shard = {n: case[n][:, a:b].clone().requires_grad_("do" in case) for n in names}
    h0 = case.get("initial_state")
    if h0 is not None:
        h0 = h0.clone().requires_grad_("do" in case)
    kernel = reference_kernel if case["kernel"] == "reference" else default_kernel()
    run = lambda: context_parallel_kda(  # noqa: E731
        *(shard[n] for n in names), initial_state=h0, output_final_state=True,
        cu_seqlens=case.get("cu_seqlens"), scheme=case["scheme"], kernel=kernel,
        chunk_size=case.get("chunk_size", 64),
    )  # fmt: skip
    out = {}
    if case.get("repeats"):
        with torch.no_grad():
            run()
            times = []
            for _ in range(case["repeats"]):
                dist.barrier()
                start = time.perf_counter()
                run()
                dist.barrier()
                times.append(time.perf_counter() - start)
        out["seconds"] = sorted(times)[len(times) // 2]
    o, final = run()
    out.update(o=o.detach(), final=final.detach())
    if "do" in case:
        loss = (o * case["do"][:, a:b]).sum() + (final * case["dfinal"]).sum()
        loss.backward()
        out["grads"] = {n: shard[n].grad for n in names}
        if h0 is not None:
            out["grads"]["initial_state"] = h0.grad
    return out


def gather_case(results: list[dict]) -> dict:
    """Put the ranks' results of `shard_case` back together: outputs and per-token gradients concatenated
    along T, final states and initial-state gradients summed over the ranks (each holds its own rows)."""
    whole = {
        "o": torch.cat([r["o"] for r in results], dim=1),
        "final": sum(r["final"] for r in results),
    }
    if "grads" in results[0]:
        whole["grads"] = {
            n: sum(r["grads"][n] for r in results) if n == "initial_state"
            else torch.cat([r["grads"][n] for r in results], dim=1)
            for n in results[0]["grads"]
        }  # fmt: skip
    if "seconds" in results[0]:
        whole["seconds"] = max(r["seconds"] for r in results)
    return whole


def mla_shard_case(rank: int, world: int, case: dict) -> dict:
    """One rank's part of a context-parallel MLA run (for `run_gloo`): its zigzag shard through the layer.

    `case` holds `layer` (an `MLA`, the same weights on every rank), the whole input `x` `[B, T, D]`,
    optionally `mode` (`"mha"` by default) and `dy` (then the result also has the gradients of `<y, dy>`:
    `dx` for this rank's tokens and `params`, this rank's share of every parameter's gradient).
    """
    layer = case["layer"]
    layer.zero_grad(set_to_none=True)
    x = zigzag_shard(case["x"], rank, world).clone().requires_grad_("dy" in case)
    y = context_parallel_mla(layer, x, case["x"].shape[1], mode=case.get("mode", "mha"))
    out = {"y": y.detach()}
    if "dy" in case:
        (y * zigzag_shard(case["dy"], rank, world)).sum().backward()
        out["dx"] = x.grad
        out["params"] = {n: p.grad for n, p in layer.named_parameters()}
    return out


def gather_mla_case(results: list[dict]) -> dict:
    """Put the ranks' results of `mla_shard_case` back in sequence order: outputs and input gradients
    unshuffled from the zigzag, parameter gradients summed over the ranks."""
    whole = {"y": zigzag_unshard([r["y"] for r in results])}
    if "dx" in results[0]:
        whole["dx"] = zigzag_unshard([r["dx"] for r in results])
        whole["params"] = {n: sum(r["params"][n] for r in results) for n in results[0]["params"]}
    return whole


def shard_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Several cases in one set of processes (starting processes costs seconds): `mla_shard_case` for a
    case that holds an MLA `layer`, `shard_case` (KDA) for the others."""
    return [(mla_shard_case if "layer" in case else shard_case)(rank, world, case) for case in cases]
