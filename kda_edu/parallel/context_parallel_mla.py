"""Context-parallel MLA: one long sequence's global-attention layer split across the ranks of a group.

MLA caches one row per token, the latent and the shared key slot (`r + d_r` numbers, the layer's
`config.cache_width`). For a sequence of T tokens over R ranks, each rank computes its own tokens' queries
and latents, the ranks all-gather the latents (every rank then holds the whole cache, `T (r + d_r)` numbers,
far less than the per-head keys and values it stands for), and each rank attends from its own queries over
the cached rows before them.

Load balance (zigzag): under a causal mask the token at position t attends over t + 1 keys, so contiguous
shards would give the last rank R times the work of the first. The sequence is cut into 2R pieces and rank
r holds pieces r and 2R - 1 - r, one early and one late: every rank's two pieces together see about the same
number of keys. When T is not a multiple of 2R, the first `T mod 2R` pieces hold one token more (pieces
differ by at most one token, so shards by at most two); for the all-gather each shard is padded with zeros
to the longest one, and the padding rows are dropped before any attention reads them.

Causal mask per piece: a piece covering positions `[a, b)` attends over the cached rows `[0, b)`, with the
ordinary causal mask on its own positions (`kda_edu.ops.attention.causal_attention`, whose queries are the
last `b - a` of the `b` keys): every piece before it is fully visible and none after it is read.

Backward: the all-gather's gradient is a sum over ranks (every rank's queries may read a rank's latents):
the gathered rows' gradients are all-reduced and each rank keeps its own rows. Parameter gradients are each
rank's share, summed over the ranks as data parallelism does (the tests sum them).

The layer is passed in (an `MLA` of `kda_edu.layers.mla`, duck-typed: this floor sits below the layers and
does not import them). Communication is `torch.distributed` only (all_gather, all_reduce).
"""

import torch
import torch.distributed as dist

from kda_edu.ops.attention import causal_attention

MODES = ("mha", "mqa")


def zigzag_pieces(T: int, world: int) -> list[tuple[int, int]]:
    """The 2R pieces `[a, b)` of a sequence of T tokens, in order; the first `T mod 2R` have one token
    more."""
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    if not isinstance(T, int) or T < 2 * world:
        raise ValueError(
            f"T must be an int of at least 2 * world = {2 * world} (one token per piece), got {T!r}"
        )
    n = 2 * world
    sizes = [T // n + (i < T % n) for i in range(n)]
    bounds = [sum(sizes[:i]) for i in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def zigzag_positions(T: int, rank: int, world: int) -> torch.Tensor:
    """The positions of rank `rank`'s tokens: pieces `rank` and `2 world - 1 - rank`, in that order."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    pieces = zigzag_pieces(T, world)
    first, second = pieces[rank], pieces[2 * world - 1 - rank]
    return torch.cat([torch.arange(*first), torch.arange(*second)])


def zigzag_shard(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s tokens of the whole sequence x `[B, T, ...]`: `[B, T_r, ...]` (`zigzag_positions`)."""
    return x[:, zigzag_positions(x.shape[1], rank, world).to(x.device)]


def zigzag_unshard(shards: list[torch.Tensor]) -> torch.Tensor:
    """The whole `[B, T, ...]` from every rank's `[B, T_r, ...]` (the inverse of `zigzag_shard`)."""
    world, T = len(shards), sum(s.shape[1] for s in shards)
    order = torch.cat([zigzag_positions(T, r, world) for r in range(world)])
    whole = torch.cat(shards, dim=1)
    return whole[:, torch.argsort(order).to(whole.device)]


def mla_exchange_bytes(
    T: int, world: int, cache_width: int, batch: int = 1, bytes_per_number: int = 2, backward: bool = True
) -> dict:
    """Bytes one rank sends per MLA layer under `context_parallel_mla`, for the scaling model.

    Forward: a ring all-gather of the padded shards, `(R - 1) L B w` numbers sent (and as many received),
    L the longest shard (two of the longest pieces, `2 ceil(T / 2R)`) and w = `cache_width` (`r + d_r`).
    Backward: the all-reduce of the gathered rows' gradients, `R L B w` numbers, which a ring sends as a
    reduce-scatter and an all-gather, `2 (R - 1) L B w`. Returns `{"forward": bytes, "backward": bytes,
    "total": bytes}` (backward 0 when `backward` is False).
    """
    pieces = zigzag_pieces(T, world)
    L = max(b - a for a, b in pieces[:world]) + max(b - a for a, b in pieces[world:])
    row = L * batch * cache_width * bytes_per_number
    forward = (world - 1) * row
    back = 2 * (world - 1) * row if backward else 0
    return {"forward": forward, "backward": back, "total": forward + back}


class _GatherRows(torch.autograd.Function):
    """All-gather of `[B, L, w]` (every rank's padded shard) into `[R, B, L, w]`; backward: all-reduce the
    gradient and keep this rank's rows."""

    @staticmethod
    def forward(ctx, x, group):
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x.contiguous(), group=group)
        ctx.group, ctx.rank = group, dist.get_rank(group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


def context_parallel_mla(
    layer, x: torch.Tensor, seq_len: int, *, mode: str = "mha", group=None
) -> torch.Tensor:
    """The MLA layer `layer` over a sequence split across `group` in zigzag order; call it on every rank.

    Args:
        layer: an `MLA` layer (the same weights on every rank).
        x: `[B, T_r, D]`, this rank's tokens: `zigzag_shard(whole, rank, world)`.
        seq_len: T, the length of the whole sequence.
        mode: `"mha"` (expand the gathered latents into per-head keys and values) or `"mqa"` (absorbed
            projections, attention over the latents), as `MLA.forward`.
        group: the process group; the default group when None.

    Returns:
        `[B, T_r, D]`: the layer's output at this rank's positions, as one device computes it on the whole.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not dist.is_initialized():
        raise RuntimeError("context_parallel_mla needs torch.distributed initialised (init_process_group)")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    pieces = zigzag_pieces(seq_len, world)
    mine = (pieces[rank], pieces[2 * world - 1 - rank])
    T_r = sum(b - a for a, b in mine)
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[1:] != (T_r, layer.d_model):
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be this rank's zigzag shard [B, {T_r}, {layer.d_model}], got {shape}")
    cfg = layer.config
    B = x.shape[0]
    H, r, dk, dv, dr = cfg.num_heads, cfg.kv_rank, cfg.qk_head_dim, cfg.v_head_dim, cfg.rope_head_dim
    q = layer.q_proj(x).view(B, T_r, H, dk + dr)
    latent = layer.latents(x)  # [B, T_r, r + dr]

    # The whole cache, in sequence order: gather the padded shards, drop the padding, undo the zigzag.
    L = max(b - a for a, b in pieces[:world]) + max(b - a for a, b in pieces[world:])
    padded = torch.nn.functional.pad(latent, (0, 0, 0, L - T_r))
    gathered = _GatherRows.apply(padded, group)  # [R, B, L, w]
    rows = [gathered[s, :, : zigzag_positions(seq_len, s, world).numel()] for s in range(world)]
    cache = zigzag_unshard(rows)  # [B, T, w]

    scale = (dk + dr) ** -0.5
    outs, start = [], 0
    for a, b in mine:  # each piece attends over the rows before its end, causally on its own positions
        q_p, c = q[:, start : start + b - a], cache[:, :b]
        start += b - a
        if mode == "mha":
            k = layer.k_up(c[..., :r]).view(B, b, H, dk)
            if dr:
                k = torch.cat([k, c[:, :, None, r:].expand(B, b, H, dr)], dim=-1)
            v = layer.v_up(c[..., :r]).view(B, b, H, dv)
            outs.append(causal_attention(q_p, k, v, scale=scale))
        else:
            q_latent = layer.absorb_query(q_p)
            work = torch.promote_types(q_latent.dtype, torch.float32)
            c = c[:, :, None, :]
            o_latent = causal_attention(q_latent, c, c[..., :r], scale=scale, out_dtype=work)
            outs.append(layer.expand_output(o_latent))
    return layer.project_out(torch.cat(outs, dim=1), x)
