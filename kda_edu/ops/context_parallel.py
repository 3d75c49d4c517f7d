"""Context-parallel KDA: one long sequence split across the ranks of a `torch.distributed` group.

Rank r holds the contiguous tokens `[a_r, b_r)` of the sequence (or of a packed batch, `cu_seqlens`). Per
value head, KDA's step is affine in the state,

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,

so a whole shard is one affine map of the state it receives: `S_out = M S_in + B`, with
`M = prod_t (I - beta_t k_t k_t^T) Diag(exp(g_t))` (K x K, latest step on the left) and `B` the state the
shard leaves when it starts from zero (K x V). Two ways to give every rank its `S_in`:

- `"sequential"`: rank r waits for `S_out` of rank r - 1 (K x V numbers per head per boundary), runs its
  shard, and sends its own `S_out` on. The ranks work one after the other.
- `"scan"`: every rank computes its `(M, B)` at once, the ranks all-gather the maps (K x K + K x V per head
  per rank), and each folds the maps of the ranks before it into its `S_in`; then every rank runs its shard
  from that state, all at the same time.

The backward is the same picture reversed: the gradient of the incoming state is affine in the gradient of
the outgoing one, `dS_in = M^T dS_out + G` (G from the shard's own outputs), and it travels from the last
rank to the first, either rank by rank or by one all-gather of the G's and a fold with the saved maps.

The communication uses `torch.distributed` only (send / recv, all_gather), on tensors of the inputs' device:
gloo on CPU tensors, NCCL on CUDA tensors.
"""

import io
import os
import socket
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kda_edu.ops._checks import check_kda_inputs, compute_dtype, resolve_scale
from kda_edu.ops.kda import kda_chunked

SCHEMES = ("scan", "sequential")


def reference_kernel(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None
):
    """`kda_edu.ops.kda.kda_chunked` with `chunk_kda`'s contract for packed sequences (one call per sequence).

    Plain PyTorch, so autograd differentiates it; float64 inputs run in float64. A sequence of length zero
    returns its initial state (zeros when None) as its final state.
    """
    if cu_seqlens is None:
        return kda_chunked(q, k, v, g, beta, scale, initial_state, output_final_state)
    bounds = cu_seqlens.tolist()
    HV, K, V = v.shape[2], k.shape[3], v.shape[3]
    outs, finals = [], []
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        h0 = None if initial_state is None else initial_state[n : n + 1]
        if eos == bos:
            outs.append(v[:, bos:eos])
            zero = torch.zeros(1, HV, K, V, dtype=compute_dtype(q.dtype), device=q.device)
            finals.append(zero if h0 is None else h0)
            continue
        piece = (x[:, bos:eos] for x in (q, k, v, g, beta))
        o, ht = kda_chunked(*piece, scale, h0, True)
        outs.append(o)
        finals.append(ht)
    return torch.cat(outs, dim=1), torch.cat(finals) if output_final_state else None


def _default_kernel():
    from kda_edu.kernels import chunk_kda  # imported here: `import kda_edu` never imports Triton

    return chunk_kda


@dataclass(frozen=True)
class ShardLayout:
    """What this rank's tokens are: pieces of which sequences, and which of them cross its two boundaries.

    A piece is the part of one sequence inside the shard (without cu_seqlens, one batch row). `starts[p]`:
    piece p begins its sequence here (so its state comes from `initial_state`); `ends[p]`: it ends its
    sequence here (so its last state is that sequence's final state). The carry is the state crossing a
    boundary: `in_rows` are the pieces that receive it from the previous rank, `out_rows` those whose last
    state goes to the next rank (all B rows without cu_seqlens, at most one piece with cu_seqlens).
    """

    rank: int
    world: int
    start: int
    stop: int
    seq_ids: tuple[int, ...]
    starts: tuple[bool, ...]
    ends: tuple[bool, ...]
    in_rows: tuple[int, ...]
    out_rows: tuple[int, ...]
    local_cu: tuple[int, ...] | None
    carries: int
    sequences: int

    @property
    def takes_in(self) -> bool:
        return bool(self.in_rows)

    @property
    def gives_out(self) -> bool:
        return bool(self.out_rows)


def shard_layout(lengths: list[int], rank: int, B: int, cu_seqlens: list[int] | None) -> ShardLayout:
    """The `ShardLayout` of `rank` when the ranks hold `lengths[r]` consecutive tokens each.

    With cu_seqlens, sequence n covers tokens `[cu[n], cu[n+1])` of the concatenated shards; a sequence of
    length zero at position s belongs to the rank whose shard holds token s (the last rank when s is the end).
    """
    world = len(lengths)
    start = sum(lengths[:rank])
    stop = start + lengths[rank]
    last = rank == world - 1
    if cu_seqlens is None:
        rows = tuple(range(B))
        return ShardLayout(
            rank, world, start, stop, rows, (rank == 0,) * B, (last,) * B,
            () if rank == 0 else rows, () if last else rows, None, B, B,
        )  # fmt: skip
    seq_ids, starts, ends, cu = [], [], [], [0]
    for n, (s, e) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)):
        lo, hi = max(s, start), min(e, stop)
        empty_here = s == e and (start <= s < stop or (last and s == stop))
        if lo < hi or empty_here:
            seq_ids.append(n)
            starts.append(lo == s)
            ends.append(hi == e)
            cu.append(cu[-1] + max(hi - lo, 0))
    in_rows = (0,) if not starts[0] else ()
    out_rows = (len(seq_ids) - 1,) if not ends[-1] else ()
    return ShardLayout(
        rank, world, start, stop, tuple(seq_ids), tuple(starts), tuple(ends),
        in_rows, out_rows, tuple(cu), 1, len(cu_seqlens) - 1,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# One shard on one device: the local kernel call, its affine map, its vector-Jacobian product


def _local_state(layout: ShardLayout, initial_state, carry, like: torch.Tensor) -> torch.Tensor:
    """The initial state of every piece: the user's `initial_state` row where a piece starts its sequence,
    the carry where it continues one, zeros where the user gave none."""
    rows = []
    for p, n in enumerate(layout.seq_ids):
        if not layout.starts[p]:
            rows.append(carry[layout.in_rows.index(p)])
        elif initial_state is not None:
            rows.append(initial_state[n])
        else:
            rows.append(torch.zeros_like(like))
    return torch.stack(rows)


def _run(kernel, inputs, h0, layout: ShardLayout, scale: float):
    cu = None
    if layout.local_cu is not None:
        cu = torch.tensor(layout.local_cu, dtype=torch.int32, device=inputs[0].device)
    return kernel(*inputs, scale=scale, initial_state=h0, output_final_state=True, cu_seqlens=cu)


def shard_map(kernel, inputs, h0, layout: ShardLayout, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`(M, B)` of this shard: `carry_out = M carry_in + B`, M `[C, HV, K, K]`, B `[C, HV, K, V]`.

    The state recurrence acts on each column of S separately, and a column that starts at a unit vector
    e_j with zero values ends as `M e_j`. So one kernel call with the values `[v | 0]` (V + K columns) and
    the initial states `[h0 | E]` (E the identity in the pieces that receive the carry, zero elsewhere)
    leaves `[B | M]` in the outgoing pieces: the map costs one pass with K more value columns, and it reuses
    the kernel's chunked (WY) algebra. A shard that contains a sequence start has M = 0 (the carry does not
    reach its end). When V + K exceeds what the kernel takes (256 for `chunk_kda`), B and M come from two calls.
    """
    q, k, v, g, beta = inputs
    C, HV, K, V = layout.carries, v.shape[2], k.shape[3], v.shape[3]
    if not layout.gives_out:  # nothing leaves this shard for the next rank
        zero = torch.zeros(C, HV, K, K + V, dtype=h0.dtype, device=h0.device)
        return zero[..., :K], zero[..., K:]
    eye = torch.zeros(h0.shape[0], HV, K, K, dtype=h0.dtype, device=h0.device)
    if layout.takes_in:
        eye[list(layout.in_rows)] = torch.eye(K, dtype=h0.dtype, device=h0.device)
    zeros_v = torch.zeros(*v.shape[:3], K, dtype=v.dtype, device=v.device)
    if V + K <= 256:
        values = torch.cat([v, zeros_v], dim=-1)
        _, ht = _run(kernel, (q, k, values, g, beta), torch.cat([h0, eye], dim=-1), layout, scale)
        B_all, M_all = ht[..., :V], ht[..., V:]
    else:
        B_all = _run(kernel, inputs, h0, layout, scale)[1]
        M_all = _run(kernel, (q, k, zeros_v, g, beta), eye, layout, scale)[1]
    rows = list(layout.out_rows)
    return M_all[rows].contiguous(), B_all[rows].contiguous()


def _vjp(kernel, inputs, h0, layout, scale, do, dht):
    """Gradients of `<o, do> + <final states, dht>` for q, k, v, g, beta and the pieces' initial states."""
    with torch.enable_grad():
        xs = [x.detach().requires_grad_() for x in (*inputs, h0)]
        o, ht = _run(kernel, xs[:5], xs[5], layout, scale)
        grads = torch.autograd.grad((o, ht), xs, (do, dht), allow_unused=True)
    return [torch.zeros_like(x) if gx is None else gx for x, gx in zip(xs, grads, strict=True)]


# ---------------------------------------------------------------------------------------------------------
# Across ranks


def _peer(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _all_gather(x: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, x.contiguous(), group=group)
    return out


def fold_maps(maps: list[tuple[torch.Tensor, torch.Tensor]], upto: int) -> torch.Tensor:
    """The state entering rank `upto`: apply the maps `(M_r, B_r)` of ranks 0 .. upto - 1 in order.

    Rank 0 receives nothing (its pieces start from `initial_state`), so its M is zero and the fold starts
    from its B. This is a scan whose elements are small (K x K per head): each rank folds the prefix it needs
    itself, at a cost of `upto` products of K x K by K x V per head.
    """
    S = torch.zeros_like(maps[0][1])
    for M, B in maps[:upto]:
        S = M @ S + B
    return S


def fold_grads(maps: list[torch.Tensor], G: list[torch.Tensor], after: int) -> torch.Tensor:
    """The gradient of the state leaving rank `after`: `dS_in_r = M_r^T dS_out_r + G_r`, folded from the
    last rank back to rank `after + 1`."""
    D = torch.zeros_like(G[0])
    for r in range(len(G) - 1, after, -1):
        D = maps[r].transpose(-1, -2) @ D + G[r]
    return D


class ContextParallelKDA(torch.autograd.Function):
    """The forward and backward of `context_parallel_kda` on one rank (call that function, not this class).

    Forward: get the carry (receive it, or compute this shard's map, all-gather the maps and fold them), run
    the shard from it, pass the outgoing state on. Backward: get the gradient of the outgoing state (receive
    it, or all-gather every rank's G and fold with the saved maps), run the shard's backward with it, send
    the gradient of the incoming state back. The shard's kernel is recomputed inside the backward.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, layout, kernel, scheme, group):
        inputs = (q, k, v, g, beta)
        HV, K, V = v.shape[2], k.shape[3], v.shape[3]
        sdt = compute_dtype(q.dtype)
        carry = torch.zeros(layout.carries, HV, K, V, dtype=sdt, device=q.device)
        maps = None
        if scheme == "sequential":
            if layout.takes_in:
                dist.recv(carry, src=_peer(group, layout.rank - 1), group=group)
        else:
            h0_zero = _local_state(layout, initial_state, carry, carry[0])
            M, B = shard_map(kernel, inputs, h0_zero, layout, scale)
            maps = list(zip(_all_gather(M, group), _all_gather(B, group), strict=True))
            carry = fold_maps(maps, layout.rank)
        h0 = _local_state(layout, initial_state, carry, carry[0])
        o, ht = _run(kernel, inputs, h0, layout, scale)
        if scheme == "sequential" and layout.gives_out:
            dist.send(ht[list(layout.out_rows)].contiguous(), dst=_peer(group, layout.rank + 1), group=group)
        final = torch.zeros(layout.sequences, HV, K, V, dtype=sdt, device=q.device)
        for p, n in enumerate(layout.seq_ids):
            if layout.ends[p]:
                final[n] = ht[p]
        ctx.save_for_backward(q, k, v, g, beta, initial_state, carry)
        ctx.layout, ctx.kernel, ctx.scheme, ctx.group, ctx.scale = layout, kernel, scheme, group, scale
        ctx.maps = None if maps is None else [M for M, _ in maps]
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, g, beta, initial_state, carry = ctx.saved_tensors
        layout, kernel, scheme, group, scale = ctx.layout, ctx.kernel, ctx.scheme, ctx.group, ctx.scale
        inputs = (q, k, v, g, beta)
        h0 = _local_state(layout, initial_state, carry, carry[0])
        dht = torch.zeros(len(layout.seq_ids), *carry.shape[1:], dtype=carry.dtype, device=carry.device)
        for p, n in enumerate(layout.seq_ids):
            if layout.ends[p]:
                dht[p] = dfinal[n]
        rows_in, rows_out = list(layout.in_rows), list(layout.out_rows)
        if scheme == "sequential":
            if layout.gives_out:
                d_out = torch.empty_like(carry)
                dist.recv(d_out, src=_peer(group, layout.rank + 1), group=group)
                dht[rows_out] = d_out
            grads = _vjp(kernel, inputs, h0, layout, scale, do, dht)
            if layout.takes_in:
                dist.send(grads[5][rows_in].contiguous(), dst=_peer(group, layout.rank - 1), group=group)
        else:
            # G: what this shard's outputs alone send to its incoming state (a backward without d_out);
            # a rank that both receives and sends a state runs its backward twice, once for G, once in full
            grads, G = None, torch.zeros_like(carry)
            if layout.takes_in:
                grads = _vjp(kernel, inputs, h0, layout, scale, do, dht)
                G = grads[5][rows_in]
            d_out = fold_grads(ctx.maps, _all_gather(G, group), layout.rank)
            if layout.gives_out or grads is None:
                if layout.gives_out:
                    dht[rows_out] = d_out
                grads = _vjp(kernel, inputs, h0, layout, scale, do, dht)
        d_initial = None
        if initial_state is not None and ctx.needs_input_grad[5]:
            d_initial = torch.zeros_like(initial_state)
            for p, n in enumerate(layout.seq_ids):
                if layout.starts[p]:
                    d_initial[n] = grads[5][p]
        return (*grads[:5], d_initial, None, None, None, None, None)


def context_parallel_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    scheme: str = "scan",
    kernel=None,
    group=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA over a sequence split across the ranks of `group`; call it on every rank with that rank's shard.

    Rank r passes the tokens `[a_r, b_r)` of the whole (its shard; the ranks in order, every shard at least
    one token, lengths may differ). The result on each rank is that shard's part of what one device computes
    on the whole, and the backward gives each rank the gradients of its own shard.

    Args:
        q, k: `[B, T_r, H, K]`, this rank's tokens; v `[B, T_r, HV, V]`; g `[B, T_r, HV, K]`; beta
            `[B, T_r, HV]` (the contract of `kda_edu.ops.kda.kda_recurrent`).
        scale: query scale; `K ** -0.5` when None.
        initial_state: optional `[B, HV, K, V]` (`[N, HV, K, V]` with cu_seqlens), the same on every rank;
            each rank uses the rows of the sequences that start in its shard, so its gradient holds those
            rows and zeros elsewhere (the sum over ranks is the full gradient).
        output_final_state: also return the final states.
        cu_seqlens: optional `[N + 1]` cumulative lengths of N sequences packed along the whole of T (the
            concatenation of all shards; B = 1), the same on every rank. Sequences may cross shard boundaries
            and span several ranks.
        scheme: `"scan"` (all ranks compute their affine maps at once and all-gather them) or
            `"sequential"` (each rank waits for the state of the previous one).
        kernel: the single-device function run on each shard, with `chunk_kda`'s signature; `chunk_kda`
            when None, `reference_kernel` for plain PyTorch.
        group: the process group; the default group when None.

    Returns:
        `(o, final_state)`: o `[B, T_r, HV, V]`; final_state `[B or N, HV, K, V]` holding the final states of
        the sequences that end in this rank's shard and zeros in the other rows (without cu_seqlens every
        sequence ends on the last rank), or None when `output_final_state` is False.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if not dist.is_initialized():
        raise RuntimeError("context_parallel_kda needs torch.distributed initialised (init_process_group)")
    B, T, H, HV, K, V = check_kda_inputs(q, k, v, g, beta, initial_state if cu_seqlens is None else None)
    scale = resolve_scale(scale, K)
    lengths = [int(x) for x in _all_gather(torch.tensor([T], device=q.device), group)]
    cu = None
    if cu_seqlens is not None:
        cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
        total = sum(lengths)
        if (
            B != 1
            or len(cu) < 2
            or cu[0] != 0
            or cu[-1] != total
            or any(a > b for a, b in zip(cu[:-1], cu[1:], strict=True))
        ):
            raise ValueError(
                f"cu_seqlens must be a non-decreasing [N + 1] sequence from 0 to the total length {total} "
                f"of all shards, with B = 1; got {cu} with B = {B}"
            )
        if initial_state is not None and tuple(initial_state.shape) != (len(cu) - 1, HV, K, V):
            raise ValueError(
                f"initial_state must have shape [N, HV, K, V] = {(len(cu) - 1, HV, K, V)} with cu_seqlens, "
                f"got {tuple(initial_state.shape)}"
            )
    rank = dist.get_rank(group)
    layout = shard_layout(lengths, rank, B, cu)
    o, final = ContextParallelKDA.apply(
        q, k, v, g, beta, initial_state, scale, layout, kernel or _default_kernel(), scheme, group
    )
    return o, final if output_final_state else None


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
    (tokens per rank), `scheme`, `kernel` (`"reference"` or `"chunk_kda"`), and optionally `do` and `dfinal`
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
    kernel = reference_kernel if case["kernel"] == "reference" else _default_kernel()
    run = lambda: context_parallel_kda(  # noqa: E731
        *(shard[n] for n in names), initial_state=h0, output_final_state=True,
        cu_seqlens=case.get("cu_seqlens"), scheme=case["scheme"], kernel=kernel,
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


def shard_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """`shard_case` for several cases in one set of processes (starting processes costs seconds)."""
    return [shard_case(rank, world, case) for case in cases]
