"""A paged MLA latent cache: each MLA layer's rows in fixed-size blocks, attention read through block tables.

An MLA layer caches one row `[c_t; k^R_t]` of `r + d_r` numbers per token (`kda_edu.layers.mla`). Here the
rows of every request live in one pool per layer, `[num_blocks, block_size, r + d_r]`, and a request names its
blocks in a block table (`kda_edu.models.serving.blocks`): token t's row is `pool[table[t // block_size],
t % block_size]`. The same block id is used in every MLA layer, so one table serves the whole model.

**Writing.** A step writes the rows of a request's new tokens (a prefill chunk, or one decoded token) at
positions `start ... end - 1`. A block that other requests hold, or that the prefix index names, must not
change under them: before writing, `prepare_write` gives the request a private copy of such a block
(copy-on-write) and appends fresh blocks for positions past the table's end.

**Attention.** The new tokens attend over rows `0 ... end - 1` of their request, gathered through the table,
token `start + i` seeing positions up to itself (causal within the chunk, everything before it). Two forms
of the same sum, as in `kda_edu.layers.mla`:

- absorbed (`"absorbed"`): the key up-projection folded into the query, attention over the rows themselves
  (one shared key head of width `r + d_r`), the value up-projection after the weighted sum;
- expanded (`"expanded"`): the gathered rows expanded into per-head keys and values, ordinary attention.

Decoded tokens (one new token per request) are attended together: on a GPU the split-context kernel
`kda_edu.kernels.mla_decode.paged_mla_absorbed_attention` reads their rows in place through the block tables;
the PyTorch path gathers them into one padded batch `[B, L_max, r + d_r]` for `mla_absorbed_reference` (both
mask each row at its own length). A prefill chunk is attended on its own.
"""

import torch

from kda_edu.layers.mla import MLA, mla_absorbed_reference
from kda_edu.models.serving.blocks import BlockPool
from kda_edu.ops.attention import causal_attention

MODES = ("absorbed", "expanded")


class PagedMLACache:
    """The latent pools of a model's MLA layers, one `[num_blocks, block_size, r + d_r]` per layer.

    Args:
        model: a `HybridLM`; a pool is made for every block whose mixer is an `MLA`.
        blocks: the `BlockPool` whose ids index the pools.

    Attributes:
        pools: block index in the model -> its pool (only MLA blocks have one).
    """

    def __init__(self, model, blocks: BlockPool):
        param = next(model.parameters())
        self.blocks = blocks
        self.pools: dict[int, torch.Tensor] = {
            i: torch.zeros(
                blocks.num_blocks,
                blocks.block_size,
                block.mixer.config.cache_width,
                dtype=param.dtype,
                device=param.device,
            )
            for i, block in enumerate(model.blocks)
            if isinstance(block.mixer, MLA)
        }

    def nbytes(self) -> int:
        """Bytes of all pools."""
        return sum(p.numel() * p.element_size() for p in self.pools.values())

    def prepare_write(self, table: list[int], start: int, end: int) -> None:
        """Make positions `start ... end - 1` of the request with block table `table` writable, in place:
        a block there that another request holds or the prefix index names is replaced by a private copy
        (its rows copied in every layer, the shared one released), and new blocks are appended until the
        table covers `end` positions."""
        bs = self.blocks.block_size
        for j in range(start // bs, min(len(table), -(-end // bs))):
            block = table[j]
            if self.blocks.refcount[block] > 1 or self.blocks.is_cached(block):
                copy = self.blocks.allocate()
                for pool in self.pools.values():
                    pool[copy] = pool[block]
                self.blocks.release(block)
                table[j] = copy
        while len(table) * bs < end:
            table.append(self.blocks.allocate())

    def write(self, layer: int, table: list[int], start: int, rows: torch.Tensor) -> None:
        """Write `rows` `[n, r + d_r]` at positions `start ... start + n - 1` of layer `layer`'s pool."""
        pool = self.pools[layer]
        positions = torch.arange(start, start + rows.shape[0], device=pool.device)
        blocks = torch.tensor(table, dtype=torch.long, device=pool.device)[positions // pool.shape[1]]
        pool[blocks, positions % pool.shape[1]] = rows.to(pool.dtype)

    def gather(self, layer: int, tables: list[list[int]], length: int) -> torch.Tensor:
        """The first `length` positions of each table's rows, `[B, length, r + d_r]` (a copy); a table shorter
        than `length` positions is padded with block 0's rows, which its attention must mask."""
        pool = self.pools[layer]
        bs = pool.shape[1]
        n = -(-length // bs)
        ids = torch.tensor([t[:n] + [0] * (n - len(t[:n])) for t in tables], device=pool.device)
        return pool[ids].reshape(len(tables), n * bs, -1)[:, :length].contiguous()


def paged_mla_forward(
    layer: MLA,
    h: torch.Tensor,
    cache: PagedMLACache,
    index: int,
    pieces: list[tuple[list[int], int, int]],
    mode: str = "absorbed",
    kernels: bool = False,
) -> torch.Tensor:
    """The MLA layer `layer` (block `index` of the model) over a packed batch of pieces of requests.

    Args:
        layer: the `MLA` mixer.
        h: its input `[1, N, D]`: the pieces' tokens one after another.
        cache: the `PagedMLACache`; each piece's rows are written into it, then read.
        index: the block's index in the model (which pool).
        pieces: per request `(block table, start, end)`: its tokens at positions `start ... end - 1`, in the
            order of h (the `end - start` summing to N). The tables must be writable there
            (`PagedMLACache.prepare_write`).
        mode: `"absorbed"` or `"expanded"` for the prefill chunks (decoded tokens always run absorbed).
        kernels: decoded tokens through the Triton kernel `paged_mla_absorbed_attention` instead of PyTorch.

    Returns:
        `[1, N, D]`, what `layer` returns for these tokens after the cached ones of each request.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    cfg = layer.config
    H, r, dk, dr = cfg.num_heads, cfg.kv_rank, cfg.qk_head_dim, cfg.rope_head_dim
    N = h.shape[1]
    scale = (dk + dr) ** -0.5
    q = layer.q_proj(h).view(1, N, H, dk + dr)
    latents = layer.latents(h)[0]  # [N, r + d_r]
    offsets, o = [0], [None] * len(pieces)
    for table, start, end in pieces:
        cache.write(index, table, start, latents[offsets[-1] : offsets[-1] + end - start])
        offsets.append(offsets[-1] + end - start)
    decodes = [i for i, (_, start, end) in enumerate(pieces) if end - start == 1]
    if decodes:  # one token per request: one padded batch
        lengths = [pieces[i][2] for i in decodes]
        tables = [pieces[i][0] for i in decodes]
        query = layer.absorb_query(q[0, [offsets[i] for i in decodes]][:, None])  # [B, 1, H, r + d_r]
        lengths_t = torch.tensor(lengths, dtype=torch.int32, device=h.device)
        if kernels:  # read in place through the block tables
            from kda_edu.kernels.mla_decode import paged_mla_absorbed_attention

            width = max(len(t) for t in tables)
            table = torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=h.device
            )
            o_latent = paged_mla_absorbed_attention(query, cache.pools[index], table, lengths_t, scale, r)
        else:
            rows = cache.gather(index, tables, max(lengths))
            slots = torch.arange(len(decodes), device=h.device)
            o_latent = mla_absorbed_reference(query, rows, slots, lengths_t, scale, r)
        for row, i in enumerate(decodes):
            o[i] = layer.expand_output(o_latent[row : row + 1]).to(h.dtype)
    for i, (table, _, end) in enumerate(pieces):
        if o[i] is not None:
            continue
        rows = cache.gather(index, [table], end)  # [1, end, r + d_r]
        q_piece = q[:, offsets[i] : offsets[i + 1]]
        if mode == "absorbed":
            lengths_t = torch.tensor([end], dtype=torch.int32, device=h.device)
            slots = torch.zeros(1, dtype=torch.long, device=h.device)
            o_latent = mla_absorbed_reference(layer.absorb_query(q_piece), rows, slots, lengths_t, scale, r)
            o[i] = layer.expand_output(o_latent).to(h.dtype)
        else:
            k = layer.k_up(rows[..., :r]).view(1, end, H, dk)
            if dr:
                k = torch.cat([k, rows[:, :, None, r:].expand(1, end, H, dr)], dim=-1)
            v = layer.v_up(rows[..., :r]).view(1, end, H, cfg.v_head_dim)
            o[i] = causal_attention(q_piece, k, v, scale=scale)
    return layer.project_out(torch.cat(o, dim=1), h)
