"""A small serving engine for the hybrid model: paged MLA, KDA state slots, prefix caching, chunked prefill.

An agent talks to a model in turns: every turn sends the whole history so far plus something new (a tool's
output, often long), and gets a short answer. Served naively, each turn recomputes the whole history. This
engine keeps what the model computed and reuses it, with the parts of its package:

- `blocks`: the block pool (paging) and the prefix index (hash chain over full blocks, LRU eviction);
- `paged_mla`: each MLA layer's latent rows in the pool's blocks, attention through block tables;
- `kda_prefix`: each KDA layer's state in a slot per running request, and state snapshots at block boundaries
  keyed by the same prefix index;
- `scheduler`: each step's pieces (decodes first, then prefill chunks) under a token budget.

`Engine.step()` does one scheduled forward pass:

1. *Admit* waiting requests, oldest first, while a KDA slot is free and the pool can hold their whole
   length: look up the longest cached prefix of the prompt whose KDA snapshot is kept, take references to its
   blocks, copy the snapshot into the request's slot. The prompt is then computed from there.
2. *Schedule* the pieces and make the positions they write writable (new blocks, copy-on-write).
3. *Run* the model once over the packed pieces: embeddings, then per block the MLA layer through the paged
   cache or the KDA layer through the slots (the recurrent step for decoded tokens, the chunked form for
   prefill chunks), the feed-forward layer, the head.
4. *Record*: every block that became full enters the prefix index (with the KDA snapshot taken at its end,
   if one was); a piece that reached the end of its request's tokens yields the next token (greedy); a
   request that is done releases its blocks (cached ones stay in the index until evicted) and its slot.

The logits equal the model's own forward over each request's tokens (the same sums in another order), and the
tokens equal `HybridLM.generate`'s greedy ones. On a CPU everything runs in PyTorch; on a GPU (`kernels`)
prefill chunks run through `kda_edu.kernels.chunk_kda` over packed sequences with initial states, decoded
tokens through `fused_recurrent_kda` with state indices and the split-context `paged_mla_absorbed_attention`.
"""

import torch

from kda_edu.layers.mla import MLA
from kda_edu.models.model import HybridLM
from kda_edu.models.serving.blocks import ROOT_HASH, BlockPool, block_hash, prefix_hashes
from kda_edu.models.serving.kda_prefix import KDAStates, kda_mixed_forward
from kda_edu.models.serving.paged_mla import MODES, PagedMLACache, paged_mla_forward
from kda_edu.models.serving.scheduler import Request, Scheduler


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


class Engine:
    """Serve greedy generation for many requests of a `HybridLM` at once (see the module's docstring).

    Args:
        model: a `HybridLM` without attention residuals (any layer pattern: hybrid, all-KDA, all-MLA).
        block_size: tokens per block of the pool and of the prefix index.
        num_blocks: blocks in the pool: the memory budget of the MLA caches, and the most blocks the prefix
            index keeps (a KDA snapshot lives as long as its block is indexed).
        token_budget: tokens one step processes at most; at least `max_running` (every running request
            decodes every step).
        max_running: requests running at once at most (the KDA state slots).
        prefix_cache: reuse cached prefixes; False computes every prompt from its first token.
        mla_mode: `"absorbed"` or `"expanded"` attention for prefill chunks (`paged_mla`).
        kernels: the Triton kernels; None means on a CUDA device.

    Attributes:
        requests: request id -> `Request` (waiting, running or finished).
        stats: counters: `lookup_tokens` (prompt tokens looked up in the prefix cache), `hit_tokens` (those
            found and not computed), `prefill_tokens` and `decode_tokens` (computed), `steps`.
        last_pieces: the last step's pieces, `(request id, start, end)`: positions `start ... end - 1` of
            that request's tokens.
    """

    def __init__(
        self,
        model: HybridLM,
        block_size: int = 16,
        num_blocks: int = 256,
        token_budget: int = 256,
        max_running: int = 8,
        prefix_cache: bool = True,
        mla_mode: str = "absorbed",
        kernels: bool | None = None,
    ):
        if not isinstance(model, HybridLM) or model.depth is not None:
            raise ValueError("model must be a HybridLM without attention residuals")
        _positive_int("max_running", max_running)
        if _positive_int("token_budget", token_budget) < max_running:
            raise ValueError(
                f"token_budget must be >= max_running = {max_running} (each running request decodes every "
                f"step), got {token_budget}"
            )
        if mla_mode not in MODES:
            raise ValueError(f"mla_mode must be one of {MODES}, got {mla_mode!r}")
        self.model = model.eval()
        self.blocks = BlockPool(num_blocks, block_size)
        self.mla = PagedMLACache(model, self.blocks)
        self.kda = KDAStates(model, max_running)
        self.blocks.on_evict.append(self.kda.drop)
        self.scheduler = Scheduler(token_budget)
        self.max_running, self.prefix_cache, self.mla_mode = max_running, prefix_cache, mla_mode
        self.kernels = next(model.parameters()).is_cuda if kernels is None else kernels
        self.requests: dict[int, Request] = {}
        self.stats = dict(lookup_tokens=0, hit_tokens=0, prefill_tokens=0, decode_tokens=0, steps=0)
        self.last_pieces: list[tuple[int, int, int]] = []

    def add_request(
        self,
        prompt_ids,
        max_new_tokens: int,
        eos_token_id: int | None = None,
        keep_logits: bool = False,
    ) -> int:
        """Queue a request; it joins the running batch at a later `step`. Returns its id.

        Args:
            prompt_ids: token ids, a non-empty list of ints or a 1-D int64 tensor, in `[0, vocab_size)`.
            max_new_tokens: tokens to generate, >= 1.
            eos_token_id: a token id that finishes the request when generated, or None.
            keep_logits: keep the logits `[vocab]` of every generated token (`Request.logits`).

        Raises:
            ValueError: a bad argument, or a request longer than the whole pool could ever hold.
        """
        if isinstance(prompt_ids, torch.Tensor):
            if prompt_ids.dim() != 1 or prompt_ids.dtype != torch.long:
                raise ValueError(
                    f"prompt_ids must be a 1-D int64 tensor, got {tuple(prompt_ids.shape)} {prompt_ids.dtype}"
                )
            prompt_ids = prompt_ids.tolist()
        vocab = self.model.config.vocab_size
        if (
            not isinstance(prompt_ids, (list, tuple))
            or not prompt_ids
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt_ids)
        ):
            raise ValueError(f"prompt_ids must be a non-empty list of token ids in [0, vocab_size = {vocab})")
        _positive_int("max_new_tokens", max_new_tokens)
        if eos_token_id is not None and not (
            isinstance(eos_token_id, int) and not isinstance(eos_token_id, bool) and 0 <= eos_token_id < vocab
        ):
            raise ValueError(f"eos_token_id must be None or a token id in [0, {vocab}), got {eos_token_id!r}")
        need = self._blocks_needed(len(prompt_ids) + max_new_tokens)
        if need > self.blocks.num_blocks:
            raise ValueError(
                f"a request of {len(prompt_ids)} + {max_new_tokens} tokens needs {need} blocks of "
                f"{self.blocks.block_size} tokens, more than the pool's num_blocks = {self.blocks.num_blocks}"
            )
        rid = len(self.requests)
        request = Request(rid, list(prompt_ids), max_new_tokens, eos_token_id, keep_logits)
        self.requests[rid] = request
        self.scheduler.waiting.append(request)
        return rid

    def has_work(self) -> bool:
        """Some request is waiting or running."""
        return bool(self.scheduler.waiting or self.scheduler.running)

    def run(self) -> dict[int, list[int]]:
        """Step until every request has finished; return request id -> generated tokens."""
        while self.has_work():
            self.step()
        return {rid: r.output for rid, r in self.requests.items()}

    def summary(self) -> dict:
        """The counters of `stats`, the prefix-cache hit rate (hit / looked-up tokens), and the blocks in use
        (held by requests), cached (indexed, unreferenced) and free, with the KDA snapshots kept."""
        lookups = self.stats["lookup_tokens"]
        return {
            **self.stats,
            "hit_rate": self.stats["hit_tokens"] / lookups if lookups else 0.0,
            "blocks_in_use": self.blocks.in_use(),
            "blocks_cached": len(self.blocks.evictable),
            "blocks_free": len(self.blocks.free),
            "evictions": self.blocks.evictions,
            "snapshots": len(self.kda.snapshots),
        }

    @torch.no_grad()
    def step(self) -> dict[int, int]:
        """Admit, schedule and run one batch; return request id -> the token it generated in this step."""
        self._admit()
        pieces = self.scheduler.schedule()
        self.last_pieces = [(r.id, start, end) for r, start, end in pieces]
        if not pieces:
            return {}
        for r, start, end in pieces:
            self.mla.prepare_write(r.table, start, end)
        bs = self.blocks.block_size
        # Per piece, where in it to take a KDA snapshot: the last block boundary it reaches, except that a
        # prompt's last chunk stops before the prompt's last token, where the same prompt sent again resumes.
        splits = []
        for r, start, end in pieces:
            boundary = (end - 1 if end == len(r.prompt) else end) // bs * bs
            take = self.prefix_cache and bool(self.kda.layers) and boundary > start
            splits.append(boundary - start if take else None)
        taken = self._forward(pieces, splits)
        return self._record(pieces, splits, taken)

    def _forward(self, pieces, splits):
        """One pass of the model over the packed pieces; returns (next-token logits per piece, snapshots
        per piece: block index -> (state, window))."""
        model, device = self.model, self.model.embed.weight.device
        ids = torch.tensor([t for r, a, b in pieces for t in r.tokens_between(a, b)], device=device)
        x = model.embed(ids)[None]  # [1, N, D]
        mla_pieces = [(r.table, a, b) for r, a, b in pieces]
        kda_pieces = [(r.slot, b - a, s) for (r, a, b), s in zip(pieces, splits, strict=True)]
        taken = [{} for _ in pieces]
        for i, block in enumerate(model.blocks):
            h = block.mixer_norm(x)
            if isinstance(block.mixer, MLA):
                y = paged_mla_forward(
                    block.mixer, h, self.mla, i, mla_pieces, mode=self.mla_mode, kernels=self.kernels
                )
            else:
                y, snaps = kda_mixed_forward(block.mixer, h, self.kda, i, kda_pieces, kernels=self.kernels)
                for p, snap in snaps.items():
                    taken[p][i] = snap
            x = x + y
            x = x + block.ffn(block.ffn_norm(x))
        last = torch.tensor([b - a for _, a, b in pieces], device=device).cumsum(0) - 1
        return model.lm_head(model.norm(x[0, last])), taken

    def _record(self, pieces, splits, forward) -> dict[int, int]:
        logits, taken = forward
        bs, new_tokens = self.blocks.block_size, {}
        for p, (r, start, end) in enumerate(pieces):
            decoding = not r.prefilling
            self.stats["decode_tokens" if decoding else "prefill_tokens"] += end - start
            r.done = end
            while len(r.hashes) < end // bs:  # blocks that became full
                j = len(r.hashes)
                r.hashes.append(
                    block_hash(
                        r.hashes[-1] if r.hashes else ROOT_HASH, r.tokens_between(j * bs, (j + 1) * bs)
                    )
                )
                if self.prefix_cache:
                    self.blocks.register(r.table[j], r.hashes[j])
            if splits[p] is not None:
                h = r.hashes[(start + splits[p]) // bs - 1]
                if h in self.blocks.index and not self.kda.has(h):
                    self.kda.save(h, taken[p])
                    if decoding:  # a decoding request keeps only its latest snapshot
                        if r.decode_snapshot is not None:
                            self.kda.drop(r.decode_snapshot)
                        r.decode_snapshot = h
            if end == r.num_tokens:  # the piece reached the last token: the next one is known
                token = int(logits[p].argmax())
                r.output.append(token)
                if r.keep_logits:
                    r.logits.append(logits[p].clone())
                new_tokens[r.id] = token
                if len(r.output) == r.max_new_tokens or token == r.eos_token_id:
                    self._finish(r)
        self.stats["steps"] += 1
        return new_tokens

    def _finish(self, r: Request) -> None:
        r.finished = True
        self.scheduler.running.remove(r)
        for block in reversed(r.table):  # the tail first into the eviction order: it goes first
            self.blocks.release(block)
        r.table = []
        self.kda.release(r.slot)
        r.slot = None

    def _blocks_needed(self, tokens: int) -> int:
        """Blocks a request of `tokens` tokens may take: its positions, and one copy-on-write."""
        return -(-tokens // self.blocks.block_size) + 1

    def _admit(self) -> None:
        """Move waiting requests to running, oldest first, while a slot is free and the pool can hold all of
        them (each running request's remaining blocks are counted as taken)."""
        sched, bs = self.scheduler, self.blocks.block_size
        while sched.waiting and len(sched.running) < self.max_running:
            r = sched.waiting[0]
            T = len(r.prompt)
            if r.prompt_hashes is None:  # once per request: it may wait here for many steps
                r.prompt_hashes = prefix_hashes(r.prompt, bs) if self.prefix_cache else []
            hashes = r.prompt_hashes
            hit = self.blocks.lookup(hashes)
            if self.kda.layers:  # resume only where every KDA layer has a snapshot, before the last token
                hit = hit[: (T - 1) // bs]
                while hit and not self.kda.has(hashes[len(hit) - 1]):
                    hit.pop()
            reserved = sum(
                self._blocks_needed(len(q.prompt) + q.max_new_tokens) - len(q.table) for q in sched.running
            )
            revived = sum(self.blocks.refcount[b] == 0 for b in hit)  # cached blocks the hit takes back
            if (
                self.blocks.available() - revived
                < self._blocks_needed(T + r.max_new_tokens) - len(hit) + reserved
            ):
                break
            sched.waiting.popleft()
            for block in hit:
                self.blocks.ref(block)
            r.table = list(hit)
            r.hashes = hashes[: len(hit)]
            r.done = r.cached = min(len(hit) * bs, T - 1)  # the last token is computed again: its logits
            r.slot = self.kda.acquire(hashes[len(hit) - 1] if hit and self.kda.layers else None)
            self.stats["lookup_tokens"] += T if self.prefix_cache else 0
            self.stats["hit_tokens"] += r.cached
            sched.running.append(r)
