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
- `"one_pass"`: as `"scan"`, but the shard runs once. Its chunked pass starts from a zero carry and keeps,
  per token, how the output depends on the carry (`o = o(0) + R S_in`, R `[T_r, K]` per head; see
  `one_pass_shard`); after the fold the outputs are corrected by one matrix product instead of a second pass.

The backward is the same picture reversed: the gradient of the incoming state is affine in the gradient of
the outgoing one, `dS_in = M^T dS_out + G` (G from the shard's own outputs), and it travels from the last
rank to the first, either rank by rank or by one all-gather of the G's and a fold with the saved maps.

The communication uses `torch.distributed` only (send / recv, all_gather), on tensors of the inputs' device:
gloo on CPU tensors, NCCL on CUDA tensors.
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from kda_edu.ops._checks import check_chunk_size, check_kda_inputs, compute_dtype, resolve_scale
from kda_edu.ops._chunks import chunk_inputs, from_chunks, state_passing
from kda_edu.ops.kda import kda_chunked, kda_intra_chunk

SCHEMES = ("scan", "sequential", "one_pass")


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


def default_kernel():
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


class ShardPass(NamedTuple):
    """What `one_pass_shard` leaves: everything from a zero carry, and how the carry enters it.

    Attributes:
        o: `[B, T_r, HV, V]`, the outputs when the carry is zero (the pieces that start a sequence already
            ran from their `initial_state` row and are final).
        ht: `[P, HV, K, V]`, the last state of each piece, from the zero carry.
        M: `[C, HV, K, K]`, the shard's transition of the carry: the piece that receives it ends in state
            `ht + M S_in` (empty when the shard receives nothing).
        R: `[C, T_in, HV, K]`, the read-out of the carry for the T_in tokens of the receiving piece(s), which
            are the shard's first tokens: `o[:, :T_in] + R S_in` (per head).
    """

    o: torch.Tensor
    ht: torch.Tensor
    M: torch.Tensor
    R: torch.Tensor


def chunk_pass_with_carry(q, k, v, g, beta, scale: float, h0, chunk_size: int = 64):
    """One chunked KDA pass that also returns how its outputs and last state depend on the entering state.

    Returns `(o, ht, M, R)` with o `[B, T, HV, V]` and ht `[B, HV, K, V]` the pass from `h0`, and, for any
    other entering state `h0 + S`,

        o_t(h0 + S) = o_t + R_t S          R `[B, T, HV, K]` (row t of R_t per head)
        ht(h0 + S)  = ht + M S             M `[B, HV, K, K]`

    Derivation from `kda_edu.ops.kda.kda_chunked`'s WY form. Chunk n with entering state S_n writes
    `U = u - w S_n`, reads `O_n = (Q * exp(gc)) S_n + Aqk U` and leaves
    `S_{n+1} = Diag(exp(gc_C)) S_n + (K * exp(gc_C - gc))^T U`, where Aqk, w, u do not depend on S_n.
    Substituting U, both are affine in S_n with the chunk's own factors:

        O_n     = O_n|_{S_n = 0} + P_n S_n          P_n = Q * exp(gc) - Aqk w                      [C, K]
        S_{n+1} = S_{n+1}|_{S_n = 0} + M_n S_n      M_n = Diag(exp(gc_C)) - (K * exp(gc_C - gc))^T w  [K, K]

    Adding S to the state entering chunk 0 therefore adds `Pi_n S` to the state entering chunk n, with
    `Pi_0 = I` and `Pi_{n+1} = M_n Pi_n` (the change propagates through the chunks' linear parts only), and
    adds `P_n Pi_n S` to chunk n's outputs: `R = P_n Pi_n` per chunk and `M = Pi_NC`. The state-independent
    factors (Aqk, w, u) come from one call of `kda_intra_chunk`, shared by the pass from h0 and by P_n, M_n;
    the prefix products Pi_n are a scan of the M_n (`affine_scan`, log-depth). Padding steps of the last
    chunk have k = g = beta = 0, so they leave M_n unchanged and their rows of R are dropped.

    Non-finite inputs are not handled here (`kda_chunked` isolates them); call on finite inputs.
    """
    B, T, HV = v.shape[:3]
    Qc, Kc, Vc, _, gc, beta_c = chunk_inputs(
        q, k, v, g, beta, scale=scale, chunk_size=chunk_size, resets=True
    )
    Aqk, w, u = kda_intra_chunk(Qc, Kc, Vc, gc, beta_c)
    o_c, ht = state_passing(Qc, Kc, gc, Aqk, w, u, h0)
    dtype = Qc.dtype
    P = Qc * gc.exp().to(dtype) - Aqk @ w  # [B, HV, NC, C, K]
    writes = Kc * (gc[..., -1:, :] - gc).exp().to(dtype)
    M_n = torch.diag_embed(gc[..., -1, :].exp().to(dtype)) - writes.transpose(-1, -2) @ w  # [B, HV, NC, K, K]
    through = affine_scan(M_n.movedim(2, 0))[0].movedim(0, 2)  # M_n ... M_0: [B, HV, NC, K, K]
    eye = torch.eye(Kc.shape[-1], dtype=dtype, device=Kc.device).expand_as(through[:, :, :1])
    Pi = torch.cat([eye, through[:, :, :-1]], dim=2)  # the product before chunk n
    R = from_chunks(P @ Pi, T, dtype)  # [B, T, HV, K]
    return from_chunks(o_c, T, v.dtype), ht, through[:, :, -1], R


def kernel_pass_with_carry(kernel, q, k, v, g, beta, scale: float, h0):
    """`chunk_pass_with_carry`'s `(o, ht, M, R)` from a kernel with `chunk_kda`'s contract, in one call.

    The carry's read-out and transition are the outputs and final state of K extra value columns that start
    at the identity with zero values (`shard_map`'s observation): column j of the state then holds
    `(A_t ... A_1) e_j`, so output column j is row t of R and the final columns are M. One call with values
    `[v | 0]` and initial state `[h0 | I]` gives `[o | R]` and `[ht | M]`: the map's pass, kept instead of
    rerun. When V + K exceeds 256 (`chunk_kda`'s widest value block) the two halves run as two calls. The
    kernel's own backward differentiates R and M, so a Triton kernel's one pass has gradients too.
    """
    B, _, HV, V = v.shape
    K = k.shape[3]
    eye = torch.eye(K, dtype=h0.dtype, device=h0.device).expand(B, HV, K, K)
    zeros_v = torch.zeros(*v.shape[:3], K, dtype=v.dtype, device=v.device)
    if V + K <= 256:
        wide_v, wide_h0 = torch.cat([v, zeros_v], dim=-1), torch.cat([h0, eye], dim=-1)
        o_w, ht_w = kernel(q, k, wide_v, g, beta, scale=scale, initial_state=wide_h0, output_final_state=True)
        return o_w[..., :V], ht_w[..., :V], ht_w[..., V:], o_w[..., V:]
    o, ht = kernel(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True)
    R, M = kernel(
        q, k, zeros_v, g, beta, scale=scale, initial_state=eye.contiguous(), output_final_state=True
    )
    return o, ht, M, R


def one_pass_shard(
    inputs, h0, layout: ShardLayout, scale: float, chunk_size: int = 64, kernel=None
) -> ShardPass:
    """This shard's chunked pass, run once with a zero carry: its outputs and states, and the carry's maps.

    `h0` holds every piece's initial state with the carry set to zero (`_local_state`). Without cu_seqlens
    the B rows run together; with cu_seqlens each piece runs alone (a piece of length zero passes its state
    through). The pieces that receive the carry also return (M, R) (`chunk_pass_with_carry`, or
    `kernel_pass_with_carry` when a `kernel` is given); the others run from their own initial state, which is
    already right.
    """
    q, k, v, g, beta = inputs
    if layout.local_cu is None:
        rows = [(slice(None), 0, q.shape[1], layout.takes_in)]
    else:
        cu = layout.local_cu
        rows = [(slice(None), cu[p], cu[p + 1], p in layout.in_rows) for p in range(len(cu) - 1)]
    outs, finals, M, R = [], [], None, None
    for p, (batch, a, b, takes) in enumerate(rows):
        state = h0 if layout.local_cu is None else h0[p : p + 1]
        if a == b:
            finals.append(state)
            continue
        piece = (x[batch, a:b] for x in inputs)
        if kernel is None:
            o_p, ht_p, M_p, R_p = chunk_pass_with_carry(*piece, scale, state, chunk_size)
        elif takes:
            o_p, ht_p, M_p, R_p = kernel_pass_with_carry(kernel, *piece, scale, state)
        else:
            o_p, ht_p = kernel(*piece, scale=scale, initial_state=state, output_final_state=True)
        outs.append(o_p)
        finals.append(ht_p)
        if takes:
            M, R = M_p, R_p
    HV, K = v.shape[2], k.shape[3]
    if M is None:  # nothing enters this shard
        M = h0.new_zeros(0, HV, K, K)
        R = h0.new_zeros(0, 0, HV, K)
    o = torch.cat(outs, dim=1) if outs else v[:, :0]
    return ShardPass(o, torch.cat(finals), M, R)


def corrected(shard: ShardPass, carry: torch.Tensor, layout: ShardLayout):
    """The shard's outputs and piece states for the carry it receives: `o + R S_in`, `ht + M S_in`."""
    if not layout.takes_in:
        return shard.o, shard.ht
    T_in = shard.R.shape[1]
    read = torch.einsum(
        "cthk,chkv->cthv", shard.R.to(carry.dtype), carry
    )  # R in the outputs' dtype from a kernel
    o_in = (shard.o[:, :T_in].to(carry.dtype) + read).to(shard.o.dtype)
    o = torch.cat([o_in, shard.o[:, T_in:]], dim=1)
    rows = list(layout.in_rows)
    ht = shard.ht.index_add(0, torch.tensor(rows, device=carry.device), shard.M @ carry)
    return o, ht


def one_pass_map(shard: ShardPass, layout: ShardLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """`(M, B)` of the shard as `shard_map` gives them, read off a `ShardPass`: B the outgoing piece's
    state from the zero carry, M the carry's transition when that piece is the one receiving the carry."""
    C, HV, K, V = layout.carries, *shard.ht.shape[1:]
    M = shard.ht.new_zeros(C, HV, K, K)
    B = shard.ht.new_zeros(C, HV, K, V)
    if layout.gives_out:
        B = shard.ht[list(layout.out_rows)]
        if layout.out_rows == layout.in_rows:
            M = shard.M
    return M.contiguous(), B.contiguous()


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


def affine_scan(M: torch.Tensor, B: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every prefix of a chain of affine maps `S -> M_r S + B_r` along dim 0, in ceil(log2 R) batched steps.

    Returns `(M'_r, B'_r)` for r = 0 .. R - 1 with `M'_r = M_r ... M_0` and `B'_r` the state after map r when
    the state before map 0 is zero (`B'_r = M_r B'_{r-1} + B_r`). With B None, only the products.

    Composition is associative, `(M2, B2) o (M1, B1) = (M2 M1, M2 B1 + B2)`, so the prefixes come from a
    Hillis-Steele scan: at step d = 1, 2, 4, ... element r >= d takes in element r - d, which by then covers
    the d maps before it. Each step is one batched matrix product over the stacked `[R, ..., K, K + V]`
    tensor (M and B side by side), an add and a concatenation: a fixed number of launches per step, where
    a loop launches one product per element. It does about R log2 R compositions instead of R; for one
    prefix alone, `affine_reduce` does R.

    Args:
        M: `[R, ..., K, K]`. B: `[R, ..., K, V]` or None.
    """
    if B is not None and B.shape[:-1] != M.shape[:-1]:
        raise ValueError(
            f"B must have shape [R, ..., K, V] matching M {tuple(M.shape)}, got {tuple(B.shape)}"
        )
    K = M.shape[-1]
    X = M if B is None else torch.cat([M, B], dim=-1)
    d = 1
    while d < X.shape[0]:
        later = X[d:, ..., :K] @ X[:-d]  # element r composed with the d maps before it
        if B is not None:
            later[..., K:] += X[d:, ..., K:]
        X = torch.cat([X[:d], later])
        d *= 2
    return X[..., :K], (None if B is None else X[..., K:])


def affine_reduce(M: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The composition of all the maps along dim 0, `(M_{R-1} ... M_0, B'_{R-1})`, in ceil(log2 R) batched
    steps and R - 1 compositions in all.

    A tree: at each level the maps pair up, `(M_{2i+1}, B_{2i+1}) o (M_{2i}, B_{2i})`, as one batched product
    of the `[R / 2, ..., K, K]` odd maps by the `[R / 2, ..., K, K + V]` even ones (an odd one out moves up
    as it is). Where `affine_scan` gives every prefix at R log R compositions, a rank needs one prefix:
    this does the loop's work, about twice its products (each composition is K x K by K x (K + V), the loop's
    step K x K by K x V), in log-depth launches.

    Args:
        M: `[R, ..., K, K]`, R >= 1. B: `[R, ..., K, V]`.
    """
    if B.shape[:-1] != M.shape[:-1] or M.shape[0] < 1:
        raise ValueError(
            f"M [R, ..., K, K] and B [R, ..., K, V] must match, R >= 1: {tuple(M.shape)}, {tuple(B.shape)}"
        )
    K = M.shape[-1]
    X = torch.cat([M, B], dim=-1)
    while X.shape[0] > 1:
        pairs = X.shape[0] // 2
        later, earlier = X[1 : 2 * pairs : 2], X[0 : 2 * pairs : 2]
        up = later[..., :K] @ earlier
        up[..., K:] += later[..., K:]
        X = torch.cat([up, X[2 * pairs :]]) if X.shape[0] % 2 else up
    return X[0, ..., :K], X[0, ..., K:]


def fold_maps_batched(M: torch.Tensor, B: torch.Tensor, upto: int) -> torch.Tensor:
    """`fold_maps` on the stacked maps `M [R, ..., K, K]`, `B [R, ..., K, V]`: the state entering rank `upto`,
    by `affine_reduce` of the first `upto` maps (zero for rank 0)."""
    if upto == 0:
        return torch.zeros_like(B[0])
    return affine_reduce(M[:upto], B[:upto])[1]


def fold_grads_batched(M: torch.Tensor, G: torch.Tensor, after: int) -> torch.Tensor:
    """`fold_grads` on the stacked `M [R, ..., K, K]` and `G [R, ..., K, V]`: the gradient of the state
    leaving rank `after`, the same reduction from the last rank back with the maps transposed
    (`dS_in_r = M_r^T dS_out_r + G_r`; zero for the last rank)."""
    if after == G.shape[0] - 1:
        return torch.zeros_like(G[0])
    return affine_reduce(M[after + 1 :].flip(0).transpose(-1, -2), G[after + 1 :].flip(0))[1]


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
        d_initial = _initial_state_grad(layout, initial_state, grads[5], ctx.needs_input_grad[5])
        return (*grads[:5], d_initial, None, None, None, None, None)


def _initial_state_grad(layout: ShardLayout, initial_state, piece_grads, needed: bool):
    """The gradient of `initial_state` from the pieces' initial-state gradients: the rows of the sequences
    that start in this shard, zeros elsewhere (None when there is no initial state or it needs none)."""
    if initial_state is None or not needed:
        return None
    d_initial = torch.zeros_like(initial_state)
    for p, n in enumerate(layout.seq_ids):
        if layout.starts[p]:
            d_initial[n] = piece_grads[p]
    return d_initial


def _final_rows(layout: ShardLayout, ht: torch.Tensor) -> torch.Tensor:
    """The `[N, HV, K, V]` final states: the pieces that end their sequence here, zeros elsewhere."""
    final = ht.new_zeros(layout.sequences, *ht.shape[1:])
    for p, n in enumerate(layout.seq_ids):
        if layout.ends[p]:
            final[n] = ht[p]
    return final


class OnePassKDA(torch.autograd.Function):
    """The `"one_pass"` scheme on one rank (call `context_parallel_kda`, not this class).

    Forward: run the shard once from a zero carry (`one_pass_shard`: outputs, piece states, and the carry's
    transition M and read-out R), all-gather the maps `(M, B)`, fold them in a log-depth tree of batched
    products (`fold_maps_batched`), and correct the outputs and states with the incoming state S_in:
    `o + R S_in`, `ht + M S_in`.

    Backward: the incoming state's gradient from this shard's own outputs needs no backward pass,
    `G = sum_t R_t^T dO_t + M^T dht` (the correction is linear in S_in); the G's are all-gathered and
    folded back (`fold_grads_batched`) into the gradient of the outgoing state. Then one autograd pass
    through the recomputed shard and its correction, with S_in held fixed, gives the shard's input gradients
    (the path through S_in belongs to the ranks before, which receive it through their folded G's).
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, layout, chunk_size, group, kernel=None):
        inputs = (q, k, v, g, beta)
        HV, K, V = v.shape[2], k.shape[3], v.shape[3]
        zero = torch.zeros(layout.carries, HV, K, V, dtype=compute_dtype(q.dtype), device=q.device)
        h0 = _local_state(layout, initial_state, zero, zero[0])
        shard = one_pass_shard(inputs, h0, layout, scale, chunk_size, kernel)
        M, B = one_pass_map(shard, layout)
        Ms, Bs = (torch.stack(_all_gather(x, group)) for x in (M, B))
        carry = fold_maps_batched(Ms, Bs, layout.rank)
        o, ht = corrected(shard, carry, layout)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, carry, Ms, shard.M, shard.R)
        ctx.layout, ctx.scale, ctx.chunk_size, ctx.group, ctx.kernel = (
            layout,
            scale,
            chunk_size,
            group,
            kernel,
        )
        return o, _final_rows(layout, ht)

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, g, beta, initial_state, carry, Ms, M_in, R_in = ctx.saved_tensors
        layout, scale, chunk_size, group = ctx.layout, ctx.scale, ctx.chunk_size, ctx.group
        dht = carry.new_zeros(len(layout.seq_ids), *carry.shape[1:])
        for p, n in enumerate(layout.seq_ids):
            if layout.ends[p]:
                dht[p] = dfinal[n]
        G = torch.zeros_like(carry)
        if layout.takes_in:
            rows_in = list(layout.in_rows)
            do_in = do[:, : R_in.shape[1]].to(carry.dtype)
            G = (
                torch.einsum("cthk,cthv->chkv", R_in.to(carry.dtype), do_in)
                + M_in.transpose(-1, -2) @ dht[rows_in]
            )
        Gs = torch.stack(_all_gather(G, group))  # every rank takes part in the collective
        if layout.gives_out:
            dht[list(layout.out_rows)] = fold_grads_batched(Ms, Gs, layout.rank)
        with torch.enable_grad():
            xs = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
            zero = torch.zeros_like(carry)
            h0 = _local_state(layout, initial_state, zero, zero[0]).detach().requires_grad_()
            shard = one_pass_shard(xs, h0, layout, scale, chunk_size, ctx.kernel)
            o, ht = corrected(shard, carry, layout)
            grads = torch.autograd.grad((o, ht), [*xs, h0], (do, dht), allow_unused=True)
        grads = [torch.zeros_like(x) if gx is None else gx for x, gx in zip([*xs, h0], grads, strict=True)]
        d_initial = _initial_state_grad(layout, initial_state, grads[5], ctx.needs_input_grad[5])
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
    chunk_size: int = 64,
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
        scheme: `"scan"` (all ranks compute their affine maps at once and all-gather them),
            `"sequential"` (each rank waits for the state of the previous one) or `"one_pass"` (as scan,
            but each shard runs once and its outputs are corrected with the incoming state).
        kernel: the single-device function run on each shard, with `chunk_kda`'s signature; `chunk_kda`
            when None, `reference_kernel` for plain PyTorch. With `"one_pass"`, None or `reference_kernel`
            runs the plain-PyTorch pass that reads R and M off the chunks' own factors
            (`chunk_pass_with_carry`); any other kernel runs once on K extra identity columns
            (`kernel_pass_with_carry`).
        group: the process group; the default group when None.
        chunk_size: the chunk of `"one_pass"`'s chunked pass (the other schemes' kernel chooses its own).

    Returns:
        `(o, final_state)`: o `[B, T_r, HV, V]`; final_state `[B or N, HV, K, V]` holding the final states of
        the sequences that end in this rank's shard and zeros in the other rows (without cu_seqlens every
        sequence ends on the last rank), or None when `output_final_state` is False.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if kernel is not None and not callable(kernel):
        raise ValueError(f"kernel must be None or a function with chunk_kda's signature, got {kernel!r}")
    chunk_size = check_chunk_size(chunk_size)
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
    if scheme == "one_pass":
        own = None if kernel in (None, reference_kernel) else kernel  # None: the chunks' own factors
        o, final = OnePassKDA.apply(q, k, v, g, beta, initial_state, scale, layout, chunk_size, group, own)
        return o, final if output_final_state else None
    o, final = ContextParallelKDA.apply(
        q, k, v, g, beta, initial_state, scale, layout, kernel or default_kernel(), scheme, group
    )
    return o, final if output_final_state else None
