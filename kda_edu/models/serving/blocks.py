"""A pool of fixed-size token blocks and the prefix index over them: the bookkeeping of paging and prefix caching.

An agent's requests share long histories: turn n + 1 sends turn n's prompt, its answer and a tool's output.
Recomputing the shared history every turn costs a full prefill of it; a serving engine keeps what the model
computed for it and reuses it. Two ideas make that work.

**Paging.** A request's cache is not one contiguous buffer but a list of fixed-size *blocks* of
`block_size` tokens, taken from one pool (`BlockPool`) and named by a *block table* (the request's list of
block ids). Token t of a request lives in block `table[t // block_size]` at row `t % block_size`. A request
grows by one block at a time; nothing is reserved for a maximum length, and no request's cache is ever moved.

**Prefix index.** A block that is *full* (all `block_size` tokens written) is named by a hash of its whole
prefix: `h_j = hash(h_{j-1}, tokens of block j)`, with `h_{-1}` a fixed start. Two requests whose first j blocks
hold the same tokens get the same `h_j`, and nothing else does (up to a hash collision, which sha256 makes
negligible). The index maps `h_j` to the block that holds it. A new request walks its own chain
`h_0, h_1, ...` through the index and reuses every block it finds, up to the first miss: the longest cached
prefix, found in one pass and at whole-block granularity (a half-full last block is never shared).

**Reference counts and eviction.** Every block has a count of the requests whose table names it. At 0 a block
either returns to the free list (it was never indexed) or stays in the index as a *cached* block, still
holding its rows, in least-recently-used order. When the free list is empty, `allocate` evicts the least
recently used cached block (drops it from the index, tells the listeners of `on_evict`, reuses it). A block
with a count above 0 is never evicted: when every block is referenced, `allocate` raises.

Requests release their blocks last-first, so the tail of a history (the part least likely to be shared) is
evicted before its head.
"""

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

ROOT_HASH = b"kda-edu-prefix-root"


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The name of a full block: sha256 of its parent's hash and its token ids (8 bytes each, little-endian)."""
    digest = hashlib.sha256(parent)
    digest.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens))
    return digest.digest()


def prefix_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """`[h_0, h_1, ...]`, one hash per full block of `tokens` (a partial last block gets none)."""
    hashes, parent = [], ROOT_HASH
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes


class BlockPool:
    """`num_blocks` blocks of `block_size` tokens: reference counts, a free list, and the prefix index.

    The pool holds no tensors: it decides which block id a request's tokens go to; the caches that hold rows
    per block (`kda_edu.models.serving.paged_mla.PagedMLACache`) index their tensors with these ids.

    Attributes:
        refcount: per block, the requests that hold it.
        hash_of: block id -> its prefix hash, for the blocks in the index.
        on_evict: callables `f(hash)` run when a cached block leaves the index (to free what belongs to it,
            such as a KDA state snapshot).
    """

    def __init__(self, num_blocks: int, block_size: int):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refcount = [0] * num_blocks
        self.free = list(range(num_blocks))  # never indexed, count 0
        self.index: dict[bytes, int] = {}  # prefix hash -> block
        self.hash_of: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached with count 0, oldest first
        self.on_evict: list[Callable[[bytes], None]] = []
        self.evictions = 0

    def available(self) -> int:
        """Blocks `allocate` can hand out now: free ones and unreferenced cached ones."""
        return len(self.free) + len(self.evictable)

    def in_use(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - self.available()

    def allocate(self) -> int:
        """A block for one request (count 1): a free one, else the least recently used cached one, evicted.

        Raises:
            RuntimeError: every block is referenced by a request.
        """
        if self.free:
            block = self.free.pop()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            self._evict(block)
        else:
            raise RuntimeError(
                f"the block pool is exhausted: all {self.num_blocks} blocks of {self.block_size} tokens are "
                "referenced by running requests (finish or release a request, or build a larger pool)"
            )
        self.refcount[block] = 1
        return block

    def ref(self, block: int) -> None:
        """One more request holds `block` (a cached block leaves the eviction order while held)."""
        self._check_block(block)
        if self.refcount[block] == 0:
            if block not in self.evictable:
                raise ValueError(f"block {block} is free: allocate it instead of taking a reference")
            del self.evictable[block]
        self.refcount[block] += 1

    def release(self, block: int) -> None:
        """One request fewer holds `block`; at 0 it becomes the most recently used cached block, or free."""
        self._check_block(block)
        if self.refcount[block] == 0:
            raise ValueError(f"block {block} is not held by any request")
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            if block in self.hash_of:
                self.evictable[block] = None
            else:
                self.free.append(block)

    def register(self, block: int, h: bytes) -> bool:
        """Put the full block `block` into the index under its prefix hash `h`. Returns False (and changes
        nothing) when `h` is already there, held by another block: the index keeps one block per prefix."""
        self._check_block(block)
        if self.refcount[block] == 0:
            raise ValueError(f"block {block} is not held by any request: only a held block is registered")
        if h in self.index or block in self.hash_of:
            return False
        self.index[h] = block
        self.hash_of[block] = h
        return True

    def is_cached(self, block: int) -> bool:
        """The block is in the prefix index (its rows must not change while it is)."""
        return block in self.hash_of

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks of the longest cached prefix: `index[h_0], index[h_1], ...` up to the first miss.
        Takes no reference (the caller `ref`s what it keeps)."""
        blocks = []
        for h in hashes:
            block = self.index.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _evict(self, block: int) -> None:
        h = self.hash_of.pop(block)
        del self.index[h]
        self.evictions += 1
        for listener in self.on_evict:
            listener(h)

    def _check_block(self, block: int) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block must be an int in [0, num_blocks = {self.num_blocks}), got {block!r}")
