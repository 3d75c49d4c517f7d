"""KDA layers in a serving engine: per-request state slots, and prefix caching by state snapshots.

An MLA layer's cache is one row per token, so a shared prefix is shared row by row (`paged_mla`). A KDA
layer's cache is not: after t tokens it is a recurrent state `S_t` `[HV, K, V]` (float32) and the short
convolution's window (the last `W - 1` inputs of its q, k, v channels), both of a fixed size, both a function
of all t tokens. There is nothing to share per token; what can be reused is the state *at a point*. So:

- **Snapshots at block boundaries.** When a request's processed length crosses a block boundary
  `j * block_size`, the state and window of every KDA layer right after that token is copied aside, keyed by
  the prefix hash of the block that ends there (`kda_edu.models.serving.blocks`). A prefill chunk that spans
  several boundaries keeps the last one: its recurrence runs as two segments, up to the boundary and past it,
  and the state between them is the snapshot. The last chunk of a prompt keeps the last boundary before the
  prompt's last token (a request must compute at least its last token, for its logits: the same prompt sent
  again resumes there). Only full blocks get one (a hash names a full block).
- **Only usable hits.** A hybrid model can resume at block j only where every KDA layer has the snapshot of
  `h_j` (the MLA rows of blocks 0..j are in the pool as long as the index names them). The engine's lookup
  walks the chain of cached blocks and stops at the deepest block that has a snapshot.
- **Copy-on-extend.** A request that resumes from a snapshot copies it into its own slot of the state pools
  and extends the copy; the snapshot itself never changes, so any number of later requests can start from it.
- **Freed on eviction.** A snapshot lives as long as its block is in the prefix index: the block pool calls
  `drop` when it evicts the block.

A request's running state lives in a slot of preallocated pools, `[max_running, HV, K, V]` and
`[max_running, W - 1, C]` per KDA layer, as in `ServingDecoder`. `kda_mixed_forward` runs one KDA layer over a
step's mixed batch: decoded tokens (one per request) through the recurrent step, prefill chunks through the
chunked form over packed sequences, each from its own slot's state.
"""

import torch

from kda_edu.layers.kda_layer import KDALayer
from kda_edu.ops.gates import beta_sigmoid, kda_gate, kda_gate_lower_bound, l2_normalize
from kda_edu.ops.kda import kda_chunked, kda_step


class KDAStates:
    """The state slots of running requests and the prefix snapshots, for every KDA layer of a model.

    Args:
        model: a `HybridLM`; pools are made for every block whose mixer is a `KDALayer`.
        max_running: slots: requests running at once at most.

    Attributes:
        layers: indices of the KDA blocks in the model.
        state, window: block index -> pool `[max_running, HV, K, V]` (float32; float64 for a float64 model)
            and `[max_running, W - 1, C]` (the model's dtype).
        snapshots: prefix hash -> {block index: (state `[HV, K, V]`, window `[W - 1, C]`)}.
    """

    def __init__(self, model, max_running: int):
        param = next(model.parameters())
        state_dtype = torch.float64 if param.dtype == torch.float64 else torch.float32
        self.layers = [i for i, b in enumerate(model.blocks) if isinstance(b.mixer, KDALayer)]
        self.state: dict[int, torch.Tensor] = {}
        self.window: dict[int, torch.Tensor] = {}
        for i in self.layers:
            cfg = model.blocks[i].mixer.config
            channels = 2 * cfg.num_heads * cfg.head_dim + cfg.hv * cfg.v_dim
            self.state[i] = torch.zeros(
                max_running, cfg.hv, cfg.head_dim, cfg.v_dim, dtype=state_dtype, device=param.device
            )
            self.window[i] = torch.zeros(
                max_running, cfg.conv_size - 1, channels, dtype=param.dtype, device=param.device
            )
        self.free = list(range(max_running))[::-1]
        self.snapshots: dict[bytes, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def acquire(self, snapshot: bytes | None = None) -> int:
        """A free slot holding the snapshot `snapshot` (copied: copy-on-extend), or zeros (a new sequence)."""
        if not self.free:
            raise RuntimeError("every KDA state slot is taken: finish a request first")
        slot = self.free.pop()
        for i in self.layers:
            if snapshot is None:
                self.state[i][slot].zero_()
                self.window[i][slot].zero_()
            else:
                state, window = self.snapshots[snapshot][i]
                self.state[i][slot].copy_(state)
                self.window[i][slot].copy_(window)
        return slot

    def release(self, slot: int) -> None:
        """The request in `slot` has left."""
        self.free.append(slot)

    def has(self, h: bytes) -> bool:
        """A snapshot of every KDA layer is kept for the prefix `h` (always True for a model without KDA
        layers, which needs none)."""
        return not self.layers or h in self.snapshots

    def save(self, h: bytes, taken: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep `taken` (block index -> (state, window), one entry per KDA layer) as the snapshot of `h`."""
        if self.layers and h not in self.snapshots:
            self.snapshots[h] = taken

    def drop(self, h: bytes) -> None:
        """Forget the snapshot of `h` (its block was evicted), if there is one."""
        self.snapshots.pop(h, None)

    def nbytes(self) -> int:
        """Bytes of the slot pools and of the snapshots kept."""
        tensors = [*self.state.values(), *self.window.values()]
        tensors += [t for snap in self.snapshots.values() for pair in snap.values() for t in pair]
        return sum(t.numel() * t.element_size() for t in tensors)


def kda_mixed_forward(
    layer: KDALayer,
    h: torch.Tensor,
    states: KDAStates,
    index: int,
    pieces: list[tuple[int, int, int | None]],
    kernels: bool = False,
) -> tuple[torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """The KDA layer `layer` (block `index` of the model) over a packed batch of pieces of requests.

    Args:
        layer: the `KDALayer`.
        h: its input `[1, N, D]`: the pieces' tokens one after another.
        states: the `KDAStates`; each piece continues from its slot's state and window and leaves its own
            there.
        index: the block's index in the model.
        pieces: per request `(slot, n, split)`: n tokens, and `split` in [1, n] (take a snapshot after the
            piece's first `split` tokens) or None. A piece of one token takes the recurrent step; longer ones
            run chunked, packed along time.
        kernels: the Triton kernels (`chunk_kda` over packed sequences with initial states,
            `fused_recurrent_kda` with state indices) instead of PyTorch's `kda_chunked` and `kda_step`.

    Returns:
        `(y, snapshots)`: y `[1, N, D]`, what `layer` returns for these tokens after each request's earlier
        ones; snapshots: piece number -> (state `[HV, K, V]`, window `[W - 1, C]`), copies, for the pieces
        with a split.
    """
    cfg = layer.config
    N = h.shape[1]
    H, HV, K, V, W = cfg.num_heads, cfg.hv, cfg.head_dim, cfg.v_dim, cfg.conv_size
    state_pool, window_pool = states.state[index], states.window[index]
    qkv_in = torch.cat([layer.q_proj(h), layer.k_proj(h), layer.v_proj(h)], dim=-1)  # [1, N, C]
    starts, outputs, windows_at, states_at = [0], [], {}, {}
    for p, (slot, n, split) in enumerate(pieces):
        a = starts[-1]
        y, window = layer.conv(qkv_in[:, a : a + n], window_pool[slot][None])
        if split is not None:  # the inputs before the snapshot's point: the window it needs
            history = torch.cat([window_pool[slot], qkv_in[0, a : a + split]], dim=0)
            windows_at[p] = history[split : split + W - 1].clone()
        window_pool[slot] = window[0]
        outputs.append(y)
        starts.append(a + n)
    q, k, v = torch.cat(outputs, dim=1).split([H * K, H * K, HV * V], dim=-1)
    q = l2_normalize(q.reshape(1, N, H, K))
    k = l2_normalize(k.reshape(1, N, H, K))
    v = v.reshape(1, N, HV, V)
    f = (layer.f_proj(h) if cfg.full_rank_decay else layer.f_up(layer.f_down(h))).view(1, N, HV, K)
    if cfg.gate == "softplus":
        g = kda_gate(f, layer.A_log, layer.dt_bias)
    else:
        g = kda_gate_lower_bound(f, layer.A_log, layer.dt_bias, lower_bound=cfg.lower_bound)
    beta = beta_sigmoid(layer.b_proj(h))
    inputs = (q, k, v, g, beta)
    o = torch.empty_like(v)

    steps = [p for p, (_, n, _) in enumerate(pieces) if n == 1]
    if steps:  # one token per request: one recurrent step for all of them
        at = torch.tensor([starts[p] for p in steps], device=h.device)
        slots = torch.tensor([pieces[p][0] for p in steps], device=h.device)
        step_in = [t[0, at][:, None] for t in inputs]  # [B, 1, ...]
        if kernels:
            from kda_edu.kernels import fused_recurrent_kda

            o_steps, _ = fused_recurrent_kda(
                *step_in, initial_state=state_pool, inplace_final_state=True, state_indices=slots
            )
        else:
            o_steps, new = kda_step(*step_in, state_pool[slots])
            state_pool.index_copy_(0, slots, new)
        o[0, at] = o_steps[:, 0].to(o.dtype)

    # Prefill chunks: segment 1 runs to the snapshot's point (or the end), segment 2 from there.
    chunks = [p for p, (_, n, _) in enumerate(pieces) if n > 1]
    first = [(p, starts[p], pieces[p][2] or pieces[p][1]) for p in chunks]
    second = [(p, starts[p] + pieces[p][2], pieces[p][1] - pieces[p][2]) for p in chunks if pieces[p][2]]
    second = [s for s in second if s[2] > 0]
    for segments in (first, second):
        if not segments:
            continue
        slots = torch.tensor([pieces[p][0] for p, _, _ in segments], device=h.device)
        out, final = _packed_chunks(inputs, segments, state_pool[slots], cfg.chunk_size, kernels)
        for (p, a, n), o_seg, state in zip(segments, out, final, strict=True):
            o[0, a : a + n] = o_seg
            if segments is first and p in windows_at:
                states_at[p] = state.to(state_pool.dtype).clone()
        state_pool.index_copy_(0, slots, final.to(state_pool.dtype))
    for p in steps:
        if p in windows_at:
            states_at[p] = state_pool[pieces[p][0]].clone()
    snapshots = {p: (states_at[p], windows_at[p]) for p in windows_at}

    gate = layer.g_proj(h) if cfg.full_rank_output else layer.g_up(layer.g_down(h))
    o = layer.o_norm(o, gate.view(1, N, HV, V))
    return layer.o_proj(o.reshape(1, N, HV * V)), snapshots


def _packed_chunks(inputs, segments, initial, chunk_size, kernels):
    """Run the chunked form over `segments` `(piece, start, n)` of the packed inputs, each from its row of
    `initial` `[S, HV, K, V]`; return (the outputs per segment, the final states `[S, HV, K, V]`)."""
    if kernels:
        from kda_edu.kernels import chunk_kda

        index = torch.cat([torch.arange(a, a + n) for _, a, n in segments]).to(initial.device)
        lengths = torch.tensor([0] + [n for _, _, n in segments])
        cu = lengths.cumsum(0).to(device=initial.device, dtype=torch.int32)
        q, k, v, g, beta = (t[:, index] for t in inputs)
        o, final = chunk_kda(
            q, k, v, g, beta, initial_state=initial.float(), output_final_state=True, cu_seqlens=cu
        )
        return list(o[0].split([n for _, _, n in segments])), final
    outs, finals = [], []
    for row, (_, a, n) in enumerate(segments):
        o, final = kda_chunked(
            *(t[:, a : a + n] for t in inputs),
            initial_state=initial[row : row + 1],
            output_final_state=True,
            chunk_size=chunk_size,
        )
        outs.append(o[0])
        finals.append(final)
    return outs, torch.cat(finals)
