"""The serving engine and its block pool: every request's greedy tokens equal `HybridLM.generate`'s and its
logits the model's plain forward over its tokens (float64, 1e-10: the same sums in another order; a wrong
block, slot, snapshot or position gives errors of order 1e-2 and up), through prefix hits, partial blocks,
eviction, copy-on-write, requests joining and leaving, and chunked prefill mixed with decodes."""

import pytest
import torch

from kda_edu.layers.kda_layer import KDAConfig
from kda_edu.layers.mla import MLAConfig
from kda_edu.models.model import HybridConfig, HybridLM
from kda_edu.models.serving import BlockPool, Engine
from kda_edu.models.serving.blocks import prefix_hashes
from kda_edu.models.serving.paged_mla import PagedMLACache

TOL = dict(rtol=1e-10, atol=1e-10)
PATTERNS = ["KKKA", "A", "K"]


def make_model(pattern: str = "KKKA") -> HybridLM:
    config = HybridConfig(
        vocab_size=48,
        d_model=16,
        n_layers=4 if pattern == "KKKA" else 2,
        layer_pattern=pattern,
        kda=KDAConfig(num_heads=2, head_dim=8, chunk_size=8),
        mla=MLAConfig(num_heads=2, kv_rank=12, qk_head_dim=8, v_head_dim=8, rope_head_dim=4),
        init_std=0.3,  # large enough weights that greedy decoding does not repeat one token
    )
    torch.manual_seed(0)
    return HybridLM(config).double().eval()


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 48, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_request(model: HybridLM, engine: Engine, rid: int) -> None:
    """The request's tokens are generate's and its logits the forward's at every generated position."""
    r = engine.requests[rid]
    assert r.finished
    prompt = torch.tensor(r.prompt)[None]
    expected = model.generate(prompt, len(r.output))[0, len(r.prompt) :].tolist()
    assert r.output == expected
    with torch.no_grad():
        full = model(torch.tensor(r.tokens)[None])[0]
    got = torch.stack(r.logits)
    torch.testing.assert_close(got, full[len(r.prompt) - 1 : len(r.tokens) - 1], **TOL)


# The block pool


def test_pool_refcounts_free_list_and_exhaustion():
    pool = BlockPool(num_blocks=3, block_size=4)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert sorted([a, b, c]) == [0, 1, 2] and pool.in_use() == 3 and pool.available() == 0
    with pytest.raises(RuntimeError, match="exhausted: all 3 blocks"):
        pool.allocate()
    pool.ref(a)
    pool.release(a)
    assert pool.in_use() == 3  # still held once
    pool.release(a)
    assert pool.free == [a] and pool.allocate() == a  # never indexed: back to the free list
    pool.release(b)
    with pytest.raises(ValueError, match="not held"):
        pool.release(b)


def test_pool_lru_eviction_keeps_referenced_blocks_and_tells_listeners():
    pool = BlockPool(num_blocks=3, block_size=2)
    evicted = []
    pool.on_evict.append(evicted.append)
    hashes = prefix_hashes([1, 2, 3, 4, 5, 6], 2)
    blocks = [pool.allocate() for _ in range(3)]
    for block, h in zip(blocks, hashes, strict=True):
        assert pool.register(block, h)
    pool.release(blocks[1])  # released first: least recently used
    pool.release(blocks[0])
    assert pool.available() == 2 and pool.in_use() == 1
    assert pool.allocate() == blocks[1] and evicted == [hashes[1]]  # the LRU one, out of the index
    assert pool.lookup(hashes) == [blocks[0]]  # the chain stops at the evicted block
    pool.ref(blocks[0])  # a hit takes it back: not evictable while held
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate()
    pool.release(blocks[0])
    assert pool.allocate() == blocks[0] and evicted == [hashes[1], hashes[0]]


def test_prefix_index_longest_prefix_and_chained_hashes():
    pool = BlockPool(num_blocks=8, block_size=3)
    tokens = [5, 1, 4, 1, 5, 9, 2, 6]  # two full blocks and a partial one
    hashes = prefix_hashes(tokens, 3)
    assert len(hashes) == 2  # no hash for the partial block
    blocks = [pool.allocate() for _ in hashes]
    for block, h in zip(blocks, hashes, strict=True):
        pool.register(block, h)
    assert pool.lookup(prefix_hashes(tokens + [7, 7, 7, 7], 3)) == blocks
    assert pool.lookup(prefix_hashes([5, 1, 4, 0, 0, 0], 3)) == blocks[:1]
    assert pool.lookup(prefix_hashes([0, 0, 0, 1, 5, 9], 3)) == []  # same second block, other parent
    assert pool.lookup(prefix_hashes([5, 1], 3)) == []
    other = pool.allocate()
    assert not pool.register(other, hashes[0])  # one block per prefix: the first one stays
    assert pool.lookup(hashes[:1]) == blocks[:1]


def test_pool_bad_arguments():
    with pytest.raises(ValueError, match="num_blocks must be an int >= 1"):
        BlockPool(0, 4)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        BlockPool(4, 2.0)
    pool = BlockPool(2, 4)
    with pytest.raises(ValueError, match="block must be an int in"):
        pool.release(2)
    with pytest.raises(ValueError, match="is free"):
        pool.ref(0)


# The engine


@pytest.mark.parametrize("pattern", PATTERNS)
def test_one_request_and_a_shared_history(pattern):
    """One request, then the agent's next turn: its history, its answer and a tool output. The second turn
    resumes after 24 cached tokens (the 6 full blocks of the 26 tokens the first turn computed, with the KDA
    snapshot its last decoding step took) and computes only the rest."""
    model = make_model(pattern)
    engine = Engine(model, block_size=4, num_blocks=32, token_budget=8, max_running=2)
    first = engine.add_request(ids(21, 1), 6, keep_logits=True)
    engine.run()
    check_request(model, engine, first)
    assert engine.stats["hit_tokens"] == 0
    turn = engine.requests[first].tokens + ids(7, 2)
    second = engine.add_request(turn, 5, keep_logits=True)
    prefill_before = engine.stats["prefill_tokens"]
    engine.run()
    check_request(model, engine, second)
    assert engine.stats["hit_tokens"] == engine.requests[second].cached == 24
    assert engine.stats["prefill_tokens"] - prefill_before == len(turn) - 24
    summary = engine.summary()
    assert summary["lookup_tokens"] == 21 + len(turn) and summary["blocks_in_use"] == 0


@pytest.mark.parametrize("pattern", ["KKKA", "A"])
def test_history_ending_mid_block(pattern):
    """A history of 10 tokens with blocks of 4: the next request reuses the two full blocks and computes the
    partial third one again (its tokens are the same, its block was never shared)."""
    model = make_model(pattern)
    engine = Engine(model, block_size=4, num_blocks=16, token_budget=16, max_running=2)
    history = ids(10, 3)
    engine.add_request(history, 1)
    engine.run()
    rid = engine.add_request(history + ids(5, 4), 3, keep_logits=True)
    engine.run()
    check_request(model, engine, rid)
    assert engine.requests[rid].cached == 8


def test_prepare_write_copies_shared_and_indexed_blocks():
    """Writing into a block the prefix index names (or another request holds) writes into a private copy:
    the copy starts with the block's rows, the block keeps its own, and the table grows to cover the end."""
    model = make_model("KKKA")
    pool = BlockPool(num_blocks=6, block_size=4)
    cache = PagedMLACache(model, pool)
    (layer,) = cache.pools  # the one MLA block of the hybrid
    shared = pool.allocate()
    pool.register(shared, b"some prefix")
    cache.pools[layer][shared] = torch.randn(4, 16, dtype=torch.float64)
    before = cache.pools[layer][shared].clone()
    table = [shared]
    cache.prepare_write(table, 3, 9)
    assert table[0] != shared and len(table) == 3 and pool.refcount[shared] == 0 and pool.is_cached(shared)
    cache.write(layer, table, 3, torch.ones(6, 16, dtype=torch.float64))
    assert torch.equal(cache.pools[layer][shared], before)
    assert torch.equal(cache.pools[layer][table[0]][:3], before[:3])
    assert torch.equal(cache.gather(layer, [table], 9)[0, 3:], torch.ones(6, 16, dtype=torch.float64))
    own = table[1]
    cache.prepare_write(table, 4, 8)  # a private block is written in place
    assert table[1] == own


def test_repeated_prompt_copies_the_shared_block_before_writing():
    """All-MLA: a prompt of 3 full blocks seen before is all cached; its last token is computed again for
    its logits, which writes into the third (shared, indexed) block: the request gets a copy, and the cached
    block keeps its rows for a third request."""
    model = make_model("A")
    engine = Engine(model, block_size=4, num_blocks=16, token_budget=16, max_running=2)
    prompt = ids(12, 5)
    rids = [engine.add_request(prompt, 4, keep_logits=True)]
    engine.run()
    cached = engine.blocks.lookup(prefix_hashes(prompt, 4))
    rows = [pool[cached[2]].clone() for pool in engine.mla.pools.values()]
    rids.append(engine.add_request(prompt, 4, keep_logits=True))
    engine.step()
    table = engine.requests[rids[1]].table
    assert table[:2] == cached[:2] and table[2] != cached[2] and engine.blocks.is_cached(cached[2])
    assert all(
        torch.equal(pool[cached[2]], row) for pool, row in zip(engine.mla.pools.values(), rows, strict=True)
    )
    engine.run()
    rids.append(engine.add_request(prompt, 4, keep_logits=True))
    engine.run()
    for rid in rids:
        check_request(model, engine, rid)
    assert [engine.requests[r].cached for r in rids] == [0, 11, 11]


@pytest.mark.parametrize("pattern", ["KKKA", "K"])
def test_repeated_prompt_resumes_before_its_last_token(pattern):
    """With KDA layers a prompt of 3 full blocks sent again resumes at 8 tokens: its last chunk took the
    snapshot before the prompt's last token, not at its end. Two copies admitted in the same step find
    nothing (neither has computed anything yet) and both match the model."""
    model = make_model(pattern)
    engine = Engine(model, block_size=4, num_blocks=16, token_budget=16, max_running=2)
    prompt = ids(12, 17)
    rids = [engine.add_request(prompt, 2, keep_logits=True) for _ in range(2)]
    engine.run()
    rids.append(engine.add_request(prompt, 3, keep_logits=True))
    engine.run()
    for rid in rids:
        check_request(model, engine, rid)
    assert [engine.requests[r].cached for r in rids] == [0, 0, 8]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_eviction_under_a_tight_pool(pattern):
    """A pool of 10 blocks of 4. The first request leaves 5 full blocks cached (23 tokens computed), with KDA
    snapshots at its chunk ends 16 and 20; an unrelated request then needs 7 blocks, 5 free ones and 2
    evicted, the history's tail first (blocks 4 and 3, with both snapshots). The next turn of the first
    request finds its head, 12 tokens, in an all-MLA model and nothing to resume from with KDA layers; it
    recomputes the rest and still matches the model."""
    model = make_model(pattern)
    engine = Engine(model, block_size=4, num_blocks=10, token_budget=16, max_running=1)
    a = engine.add_request(ids(20, 6), 4, keep_logits=True)
    engine.run()
    cached_before = engine.summary()["blocks_cached"]
    b = engine.add_request(ids(22, 7), 4, keep_logits=True)
    engine.run()
    assert engine.summary()["evictions"] > 0 and cached_before > 0
    assert set(engine.kda.snapshots) <= set(engine.blocks.index)  # no snapshot outlives its block
    c = engine.add_request(engine.requests[a].tokens + ids(6, 8), 3, keep_logits=True)
    engine.run()
    assert engine.requests[c].cached == (12 if pattern == "A" else 0)
    for rid in (a, b, c):
        check_request(model, engine, rid)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_requests_join_and_leave_with_chunked_prefill(pattern):
    """Four requests arrive at different steps, finish at different steps, and a token budget of 5 cuts their
    prompts into chunks that share steps with the others' decodes; one request shares another's prompt
    head. Each equals the model run on it alone."""
    model = make_model(pattern)
    engine = Engine(model, block_size=4, num_blocks=40, token_budget=5, max_running=3)
    head = ids(9, 9)
    arrivals = {0: [(ids(13, 10), 6)], 2: [(head + ids(3, 11), 3)], 5: [(ids(4, 12), 8)], 9: [(head, 4)]}
    rids, mixed, step = [], 0, 0
    while step in arrivals or engine.has_work():
        for prompt, n in arrivals.get(step, []):
            rids.append(engine.add_request(prompt, n, keep_logits=True))
        engine.step()
        kinds = {engine.requests[rid].prompt.__len__() > start for rid, start, _ in engine.last_pieces}
        mixed += kinds == {True, False}  # a prefill chunk beside a decode in one step
        assert sum(end - start for _, start, end in engine.last_pieces) <= 5
        step += 1
    assert mixed >= 3
    for rid in rids:
        check_request(model, engine, rid)


def test_options_give_the_same_results():
    """Expanded MLA attention for the chunks, the prefix cache off, an end-of-sequence token: the same
    tokens and logits as the model."""
    model = make_model("KKKA")
    prompt = ids(11, 13)
    for kwargs in (dict(mla_mode="expanded"), dict(prefix_cache=False)):
        engine = Engine(model, block_size=4, num_blocks=16, token_budget=6, max_running=2, **kwargs)
        for _ in range(2):
            rid = engine.add_request(prompt, 4, keep_logits=True)
            engine.run()
            check_request(model, engine, rid)
        assert engine.stats["hit_tokens"] == (0 if kwargs.get("prefix_cache") is False else 8)
    engine = Engine(model, block_size=4, num_blocks=16, token_budget=6, max_running=2)
    eos = model.generate(torch.tensor(prompt)[None], 3)[0, -1].item()
    rid = engine.add_request(prompt, 10, eos_token_id=eos)
    engine.run()
    assert engine.requests[rid].output[-1] == eos and len(engine.requests[rid].output) <= 3


def test_engine_bad_arguments():
    model = make_model("KKKA")
    with pytest.raises(ValueError, match="token_budget must be >= max_running"):
        Engine(model, token_budget=2, max_running=4)
    with pytest.raises(ValueError, match="mla_mode must be one of"):
        Engine(model, mla_mode="mha")
    with pytest.raises(ValueError, match="num_blocks must be an int >= 1"):
        Engine(model, num_blocks=0)
    with pytest.raises(ValueError, match="model must be a HybridLM without attention residuals"):
        Engine(torch.nn.Linear(2, 2))
    engine = Engine(model, block_size=4, num_blocks=4, token_budget=8, max_running=2)
    for prompt, match in (
        ([], "non-empty list of token ids"),
        ([1, 48], "in \\[0, vocab_size = 48\\)"),
        (torch.tensor([1.0, 2.0]), "1-D int64 tensor"),
    ):
        with pytest.raises(ValueError, match=match):
            engine.add_request(prompt, 2)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        engine.add_request([1, 2], 0)
    with pytest.raises(ValueError, match="eos_token_id must be None or a token id"):
        engine.add_request([1, 2], 2, eos_token_id=-1)
    with pytest.raises(ValueError, match="needs 5 blocks of 4 tokens, more than the pool's num_blocks = 4"):
        engine.add_request(list(range(10)), 4)
    assert not engine.has_work()  # nothing was queued


@pytest.mark.slow
def test_kernel_path_matches_the_model():
    """`kernels=True`: prefill chunks through `chunk_kda` over packed sequences with initial states (a prefix
    hit resumes from a snapshot, a chunk ends mid-block), decoded tokens through `fused_recurrent_kda` with
    state indices and `paged_mla_absorbed_attention`; on a GPU compiled, elsewhere through Triton's interpreter
    (slow). The kernels compute in float32: float32 model and 1e-4 (rounding over 4 layers and a softmax)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = HybridConfig(
        vocab_size=48,
        d_model=16,
        n_layers=4,
        kda=KDAConfig(num_heads=2, head_dim=16, chunk_size=16),
        mla=MLAConfig(num_heads=2, kv_rank=16, qk_head_dim=16, v_head_dim=16, rope_head_dim=16),
        init_std=0.3,
    )
    torch.manual_seed(0)
    model = HybridLM(config).to(device).float().eval()
    engine = Engine(model, block_size=8, num_blocks=24, token_budget=12, max_running=2, kernels=True)
    first = engine.add_request(ids(21, 14), 4, keep_logits=True)
    engine.run()
    turn = engine.requests[first].tokens + ids(5, 15)
    rids = [
        first,
        engine.add_request(turn, 3, keep_logits=True),
        engine.add_request(ids(14, 16), 5, keep_logits=True),
    ]
    engine.run()
    assert engine.requests[rids[1]].cached == 24  # the snapshot of the first request's last decoding step
    for rid in rids:
        r = engine.requests[rid]
        with torch.no_grad():
            full = model(torch.tensor(r.tokens, device=device)[None])[0]
        expected = full[len(r.prompt) - 1 : len(r.tokens) - 1]
        torch.testing.assert_close(torch.stack(r.logits), expected, rtol=1e-4, atol=1e-4)
        assert r.output == expected.argmax(-1).tolist()


def test_a_waiting_request_hashes_its_prompt_once(monkeypatch):
    """The second request waits while the first runs (a pool of 7 blocks holds one of them at a time): its
    prompt's block hashes are computed once, not at every step's admission attempt; reading a part of a
    request's tokens copies only that part and equals slicing the whole history."""
    import kda_edu.models.serving.engine as engine_module

    calls = []

    def counted(tokens, block_size):
        calls.append(len(tokens))
        return prefix_hashes(tokens, block_size)

    monkeypatch.setattr(engine_module, "prefix_hashes", counted)
    model = make_model("KKKA")
    engine = Engine(model, block_size=4, num_blocks=7, token_budget=8, max_running=2)
    a = engine.add_request(ids(10, 11), 5)
    b = engine.add_request(ids(9, 12), 3, keep_logits=True)
    engine.run()
    assert engine.stats["steps"] > 6 and sorted(calls) == [9, 10]
    r = engine.requests[a]
    for start, end in [(0, 3), (8, 12), (10, 15), (0, r.num_tokens)]:
        assert r.tokens_between(start, end) == r.tokens[start:end]
    check_request(model, engine, b)
