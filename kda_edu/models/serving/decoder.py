"""Serving a hybrid model: the decoding path a serving engine would run, and MLA appends into its caches.

- `ServingDecoder(model, max_seqs, max_len)`: preallocated cache pools, rows indexed per sequence (continuous
  batching: sequences join with `add` and leave with `release`), absorbed MLA through the split-context Triton
  kernel of `kda_edu.kernels.mla_decode`, KDA through `fused_recurrent_kda` with state indices, and the step
  captured as a CUDA graph on a GPU (the same code runs eagerly on a CPU, in PyTorch or through the interpreter).
- `mla_append(layer, x, rows, length, mode)`: one append of n tokens to a preallocated MLA cache, in MHA mode
  (expanded keys and values, fused attention through SDPA) or in absorbed mode.

Chapter 13 measures both (`kda_edu.chapters.ch13_inference` holds its timing and cost helpers).
"""

import torch
import torch.nn.functional as F

from kda_edu.layers.mla import MLA, mla_absorbed_reference
from kda_edu.models.model import HybridConfig, HybridLM
from kda_edu.models.serving.graphs import bucket_for, pad_batch
from kda_edu.ops._checks import value_checks_enabled
from kda_edu.ops.gates import beta_sigmoid, kda_gate, kda_gate_lower_bound, l2_normalize
from kda_edu.ops.kda import kda_step


class ServingDecoder:
    """Decode many sequences of a `HybridLM` at once, as a serving engine does: preallocated caches, sequences
    joining and leaving between steps (continuous batching), one token per sequence per step.

    Every cache is allocated once, for `max_seqs` sequences of up to `max_len` tokens, plus one scratch row
    (used while a CUDA graph is captured):

    - MLA layer: a pool `[max_seqs + 1, max_len, r + d_r]` of cached rows in the model's dtype; a step writes
      the new token's row at its position and attends in absorbed (MQA) mode.
    - KDA layer: a state pool `[max_seqs + 1, HV, K, V]` (float32) and a convolution-window pool
      `[max_seqs + 1, W - 1, C]`; a step updates sequence b's state in place at row `slots[b]` (vLLM's state
      indices).
    - `lengths[slot]`: tokens cached for the sequence in that row (int32, on the device).

    A sequence joins with `add(prompt)` (a prefill through the model's ordinary forward, copied into a free
    row) and leaves with `release(slot)`; `step(tokens, slots)` decodes one token for each listed row, in
    any order and any subset. The step reads its positions from `lengths` on the device and launches work whose
    shapes depend only on the batch size, so on a GPU it makes no host synchronisation and (in a CUDA graph)
    allocates nothing. It checks the shapes and dtypes of its arguments; their values (slots in use and
    distinct, every sequence shorter than `max_len`, token ids in the vocabulary) are checked before anything
    changes when the decoder is on the CPU, and on a GPU only with `KDA_EDU_DEBUG=1` in the environment
    (`kda_edu.ops._checks.value_checks_enabled`), since reading them costs a host synchronisation. On a CUDA device the attention runs in `kda_edu.kernels.mla_decode` and the
    recurrence in `fused_recurrent_kda` with state indices, and each batch size's step is captured once as a
    CUDA graph and replayed; elsewhere the same step runs eagerly with PyTorch's `mla_absorbed_reference` and
    `mla_absorbed_reference` and `kda_step` (or with the kernels through Triton's interpreter, `kernels=True`).

    Args:
        model: a `HybridLM` without attention residuals, in eval mode, in its serving dtype (bf16 on a GPU).
            Its feed-forward layers must not synchronise with the host (a dense SwiGLU does not).
        max_seqs: rows of the pools: sequences decoded at once at most.
        max_len: tokens per sequence at most (prompt and generated).
        kernels: use the Triton kernels; None means on a CUDA device.
        cuda_graph: capture and replay the step; None means on a CUDA device.
        buckets: None (a step runs at its own batch size: one CUDA graph per size met), or ascending batch
            sizes ending at `max_seqs` (`kda_edu.models.serving.graphs.decode_buckets`): a step of B
            sequences runs padded to the smallest bucket >= B, so that a few graphs serve every B.
    """

    def __init__(
        self,
        model: HybridLM,
        max_seqs: int,
        max_len: int,
        kernels: bool | None = None,
        cuda_graph: bool | None = None,
        buckets: list[int] | None = None,
    ):
        if not isinstance(model, HybridLM) or model.depth is not None:
            raise ValueError("model must be a HybridLM without attention residuals")
        if max_seqs < 1 or max_len < 1:
            raise ValueError(f"max_seqs and max_len must be >= 1, got {max_seqs}, {max_len}")
        param = next(model.parameters())
        device, dtype = param.device, param.dtype
        self.model = model.eval()
        self.max_seqs, self.max_len = max_seqs, max_len
        self.kernels = device.type == "cuda" if kernels is None else kernels
        self.cuda_graph = device.type == "cuda" if cuda_graph is None else cuda_graph
        if self.cuda_graph and device.type != "cuda":
            raise ValueError("cuda_graph=True needs the model on a CUDA device")
        rows = max_seqs + 1
        self.scratch = max_seqs  # the extra row: CUDA-graph warm-up and capture write there
        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.lengths = torch.zeros(rows, dtype=torch.int32, device=device)
        self.pools: list[dict] = []
        for block in model.blocks:
            cfg = block.mixer.config
            if isinstance(block.mixer, MLA):
                latent = torch.zeros(rows, max_len, cfg.cache_width, dtype=dtype, device=device)
                self.pools.append({"latent": latent})
            else:
                channels = 2 * cfg.num_heads * cfg.head_dim + cfg.hv * cfg.v_dim
                window = torch.zeros(rows, cfg.conv_size - 1, channels, dtype=dtype, device=device)
                state = torch.zeros(rows, cfg.hv, cfg.head_dim, cfg.v_dim, dtype=state_dtype, device=device)
                self.pools.append({"window": window, "state": state})
        if buckets is not None and (
            not isinstance(buckets, (list, tuple))
            or not all(isinstance(b, int) and not isinstance(b, bool) for b in buckets)
            or list(buckets) != sorted(set(buckets))
            or not buckets
            or buckets[0] < 1
            or buckets[-1] != max_seqs
        ):
            raise ValueError(
                f"buckets must be None or ascending distinct ints >= 1 ending at max_seqs = {max_seqs}, "
                f"got {buckets!r}"
            )
        self.buckets = None if buckets is None else list(buckets)
        self.free = list(range(max_seqs))
        self._graphs: dict[int, tuple] = {}

    @staticmethod
    def pool_bytes(config: HybridConfig, rows: int, max_len: int, dtype_bytes: int = 2) -> int:
        """Bytes of the pools for `rows` sequences of up to `max_len` tokens (lengths not counted): per MLA
        layer `max_len (r + d_r)` numbers, per KDA layer a float32 state and a convolution window, per row."""
        m, k = config.mla, config.kda
        window = (k.conv_size - 1) * (2 * k.num_heads * k.head_dim + k.hv * k.v_dim) * dtype_bytes
        per_kda = k.hv * k.head_dim * k.v_dim * max(4, dtype_bytes) + window
        per_mla = max_len * m.cache_width * dtype_bytes
        kinds = config.layer_kinds
        return rows * (kinds.count("A") * per_mla + kinds.count("K") * per_kda)

    def nbytes(self) -> int:
        """Bytes of every pool (all rows, scratch included)."""
        tensors = [self.lengths, *(t for pool in self.pools for t in pool.values())]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.no_grad()
    def add(self, prompt: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Prefill `prompt` (int64 `[T]`, 1 <= T < max_len) into a free row; return (its slot, the logits
        `[vocab]` after the prompt's last token)."""
        if prompt.dim() != 1 or not 1 <= prompt.numel() < self.max_len:
            raise ValueError(
                f"prompt must be [T] with 1 <= T < max_len = {self.max_len}, got {tuple(prompt.shape)}"
            )
        if not self.free:
            raise RuntimeError(f"all {self.max_seqs} rows are in use: release a sequence first")
        T, cache = prompt.numel(), self.model.new_cache()
        logits = self.model(prompt[None], cache=cache)[0, -1]  # may raise: take the row only after it
        slot = self.free.pop(0)
        for pool, layer in zip(self.pools, cache.layers, strict=True):
            if "latent" in pool:
                pool["latent"][slot, :T] = layer.latent[0]
            else:
                pool["window"][slot] = layer.conv_window[0]
                pool["state"][slot] = layer.state[0]
        self.lengths[slot] = T
        return slot, logits

    def release(self, slot: int) -> None:
        """The sequence in `slot` has left; its row is reused by the next `add`."""
        if not 0 <= slot < self.max_seqs or slot in self.free:
            raise ValueError(f"slot {slot} is not in use")
        self.free.append(slot)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Decode one token for each sequence: `tokens` int64 `[B]` at rows `slots` (int64 `[B]`, distinct, in
        use, each holding fewer than `max_len` tokens). Returns the logits `[B, vocab]`; with CUDA graphs a
        buffer that the next step overwrites. With `buckets`, the batch runs padded to its bucket (padding
        rows decode into the scratch row) and the first B rows are returned.

        Raises:
            ValueError: bad shapes or dtypes; and, where the values are checked (see the class), a slot not
                in use or listed twice, a sequence already `max_len` tokens long, a token id outside the
                vocabulary. Nothing has changed when it is raised.
        """
        self._check_step(tokens, slots)
        B = tokens.shape[0]
        if self.buckets is not None:
            tokens, slots = pad_batch(tokens, slots, bucket_for(B, self.buckets), self.scratch)
        if not self.cuda_graph:
            return self._step(tokens, slots)[:B]
        size = tokens.shape[0]
        if size not in self._graphs:
            self._graphs[size] = self._capture(size)
        graph, static_tokens, static_slots, logits = self._graphs[size]
        static_tokens.copy_(tokens)
        static_slots.copy_(slots)
        graph.replay()
        return logits[:B]

    def _check_step(self, tokens: torch.Tensor, slots: torch.Tensor) -> None:
        device = self.lengths.device
        for name, x in (("tokens", tokens), ("slots", slots)):
            if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype != torch.long or x.device != device:
                got = f"{tuple(x.shape)} {x.dtype} on {x.device}" if isinstance(x, torch.Tensor) else type(x)
                raise ValueError(f"{name} must be an int64 tensor [B] on {device}, got {got}")
        if not 1 <= tokens.shape[0] == slots.shape[0] <= self.max_seqs:
            raise ValueError(
                f"tokens and slots must both have length B in [1, max_seqs = {self.max_seqs}], got "
                f"{tokens.shape[0]} and {slots.shape[0]}"
            )
        if not value_checks_enabled(device):
            return
        rows, vocab = slots.tolist(), self.model.config.vocab_size
        seen = set()
        for slot in rows:
            if not 0 <= slot < self.max_seqs or slot in self.free:
                raise ValueError(f"slot {slot} is not in use (add a sequence first)")
            if slot in seen:
                raise ValueError(
                    f"slot {slot} is listed twice in slots {rows}: one token per sequence per step"
                )
            seen.add(slot)
        for slot, length in zip(rows, self.lengths[slots].tolist(), strict=True):
            if length >= self.max_len:
                raise ValueError(
                    f"slot {slot} already holds max_len = {self.max_len} tokens: it cannot take another "
                    "(release it, or build the decoder with a larger max_len)"
                )
        if tokens.min() < 0 or tokens.max() >= vocab:
            raise ValueError(f"tokens must lie in [0, vocab_size = {vocab}), got {tokens.tolist()}")

    def _capture(self, B: int) -> tuple:
        """Record one step for batch size B as a CUDA graph, warming up (compiling the kernels) on the
        scratch row so that no sequence's cache changes."""
        device = self.lengths.device
        tokens = torch.zeros(B, dtype=torch.long, device=device)
        slots = torch.full((B,), self.scratch, dtype=torch.long, device=device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(tokens, slots)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._step(tokens, slots)
        self.lengths[self.scratch :].zero_()
        return graph, tokens, slots, logits

    def _step(self, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        model = self.model
        x = model.embed(tokens)[:, None]  # [B, 1, D]
        positions = self.lengths[slots]  # where the new token goes, [B]
        lengths = positions + 1  # visible positions, the new one included
        for block, pool in zip(model.blocks, self.pools, strict=True):
            h = block.mixer_norm(x)
            if isinstance(block.mixer, MLA):
                x = x + self._mla(block.mixer, h, pool["latent"], slots, positions, lengths)
            else:
                x = x + self._kda(block.mixer, h, pool["window"], pool["state"], slots)
            x = x + block.ffn(block.ffn_norm(x))
        self.lengths.index_copy_(0, slots, lengths)
        self.lengths[self.scratch :].zero_()  # padding rows and captures write there: it never grows
        return model.lm_head(model.norm(x))[:, 0]

    def _mla(self, layer, h, latent_pool, slots, positions, lengths):
        """Absorbed-mode MLA for one token per sequence, its new row written into the pool first."""
        cfg = layer.config
        B = h.shape[0]
        q = layer.q_proj(h).view(B, 1, cfg.num_heads, cfg.qk_head_dim + cfg.rope_head_dim)
        latent_pool.index_put_((slots, positions.long()), layer.latents(h)[:, 0])
        query = layer.absorb_query(q)  # [B, 1, H, r + d_r]
        scale = (cfg.qk_head_dim + cfg.rope_head_dim) ** -0.5
        if self.kernels:
            from kda_edu.kernels.mla_decode import mla_absorbed_attention

            o = mla_absorbed_attention(query, latent_pool, slots, lengths, scale, cfg.kv_rank)
        else:
            o = mla_absorbed_reference(query, latent_pool, slots, lengths, scale, cfg.kv_rank)
        return layer.project_out(layer.expand_output(o), h)

    def _kda(self, layer, h, window_pool, state_pool, slots):
        """One KDA step per sequence: `KDALayer.forward`'s inputs and output, the state updated in its row."""
        cfg = layer.config
        B = h.shape[0]
        H, HV, K, V = cfg.num_heads, cfg.hv, cfg.head_dim, cfg.v_dim
        qkv = torch.cat([layer.q_proj(h), layer.k_proj(h), layer.v_proj(h)], dim=-1)
        qkv, window = layer.conv(qkv, window_pool[slots])
        window_pool.index_copy_(0, slots, window)
        q, k, v = qkv.split([H * K, H * K, HV * V], dim=-1)
        q = l2_normalize(q.reshape(B, 1, H, K))
        k = l2_normalize(k.reshape(B, 1, H, K))
        v = v.reshape(B, 1, HV, V)
        f = (layer.f_proj(h) if cfg.full_rank_decay else layer.f_up(layer.f_down(h))).view(B, 1, HV, K)
        if cfg.gate == "softplus":
            g = kda_gate(f, layer.A_log, layer.dt_bias)
        else:
            g = kda_gate_lower_bound(f, layer.A_log, layer.dt_bias, lower_bound=cfg.lower_bound)
        beta = beta_sigmoid(layer.b_proj(h))
        if self.kernels:
            from kda_edu.kernels import fused_recurrent_kda

            o, _ = fused_recurrent_kda(
                q, k, v, g, beta, initial_state=state_pool, inplace_final_state=True, state_indices=slots
            )
        else:
            o, state = kda_step(q, k, v, g, beta, state_pool[slots])
            state_pool.index_copy_(0, slots, state)
        gate = layer.g_proj(h) if cfg.full_rank_output else layer.g_up(layer.g_down(h))
        o = layer.o_norm(o, gate.view(B, 1, HV, V))
        return layer.o_proj(o.reshape(B, 1, HV * V))


@torch.no_grad()
def mla_append(
    layer, x: torch.Tensor, rows: torch.Tensor, length: int, mode: str, kernels: bool | None = None
):
    """Append the tokens x `[B, n, D]` to sequences whose `length` cached rows sit in `rows` `[B, L_max, r +
    d_r]` (preallocated, `length + n <= L_max`), as a serving engine does: write the new rows in place, attend
    from the new tokens to everything cached, return the layer's output `[B, n, D]`.

    - `"mha"`: expand every cached latent into per-head keys and values (`H (d_k + d_r + d_v)` numbers per
      position, bf16) and run PyTorch's fused attention (`scaled_dot_product_attention` with a lower-right
      causal mask: token i sees the history and the new tokens up to itself).
    - `"mqa"`: absorbed queries over the cached rows themselves, in `kda_edu.kernels.mla_decode` on a GPU
      (`kernels`, None means on CUDA) or `mla_absorbed_reference` elsewhere.
    """
    from torch.nn.attention.bias import causal_lower_right

    if mode not in ("mha", "mqa"):
        raise ValueError(f"mode must be 'mha' or 'mqa', got {mode!r}")
    B, n, _ = x.shape
    if length + n > rows.shape[1]:
        raise ValueError(f"rows hold {rows.shape[1]} positions, fewer than length + n = {length + n}")
    cfg = layer.config
    H, r, dk, dv, dr = cfg.num_heads, cfg.kv_rank, cfg.qk_head_dim, cfg.v_head_dim, cfg.rope_head_dim
    S = length + n
    q = layer.q_proj(x).view(B, n, H, dk + dr)
    rows[:, length:S] = layer.latents(x)
    scale = (dk + dr) ** -0.5
    if mode == "mha":
        cached = rows[:, :S]
        k = layer.k_up(cached[..., :r]).view(B, S, H, dk)
        if dr:
            k = torch.cat([k, cached[:, :, None, r:].expand(B, S, H, dr)], dim=-1)
        v = layer.v_up(cached[..., :r]).view(B, S, H, dv)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=causal_lower_right(n, S),
            scale=scale,
        ).transpose(1, 2)
    else:
        query = layer.absorb_query(q)  # [B, n, H, r + d_r]
        slots = torch.arange(B, device=x.device)
        lengths = torch.full((B,), S, device=x.device, dtype=torch.int32)
        use_kernels = x.is_cuda if kernels is None else kernels
        if use_kernels:
            from kda_edu.kernels.mla_decode import mla_absorbed_attention

            o = mla_absorbed_attention(query, rows, slots, lengths, scale, r)
        else:
            o = mla_absorbed_reference(query, rows, slots, lengths, scale, r)
        o = layer.expand_output(o)
    return layer.project_out(o, x)
