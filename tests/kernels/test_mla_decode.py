"""The absorbed MLA decoding kernel's input checks (its results against the PyTorch reference are in
tests/models/test_serving.py, beside the serving decoder that runs it)."""

import pytest
import torch

from kda_edu.kernels.mla_decode import mla_absorbed_attention
from kda_edu.layers.mla import mla_absorbed_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels run compiled there, interpreted here


def test_a_cache_elsewhere_and_a_bad_split_count_are_named():
    """A cache on another device than q reached the kernel as a pointer it cannot read (a Triton error
    about copying or a CPU tensor); num_splits = 0 divided by zero."""
    q = torch.randn(2, 1, 2, 8)
    slots, lengths = torch.tensor([0, 1]), torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cache \[P, L_max, D\] must be on q's device \(cpu\), got meta"):
        mla_absorbed_attention(q, torch.empty(3, 16, 8, device="meta"), slots, lengths, 0.3, 6)
    for splits in (0, -1, 1.5):
        with pytest.raises(ValueError, match="num_splits must be None or an int >= 1"):
            mla_absorbed_attention(q, torch.randn(3, 16, 8), slots, lengths, 0.3, 6, num_splits=splits)


@pytest.mark.parametrize(
    "mla_absorbed_attention", [mla_absorbed_attention, mla_absorbed_reference], ids=["kernel", "reference"]
)
def test_a_wrongly_shaped_q_or_cache_is_named(mla_absorbed_attention):
    """q of another rank than [B, T, H, D] failed in unpacking its shape ("not enough values to unpack"), an
    empty one divided by zero and an integer one was taken; a cache not [P, L_max, D] failed alike. The
    PyTorch reference checks the same way (it broadcast a wrong q into an einsum error, or a wrong answer)."""
    cache, slots = torch.randn(3, 16, 8), torch.tensor([0, 1])
    lengths = torch.tensor([3, 4], dtype=torch.int32)
    for q in (torch.randn(2, 2, 8), torch.randn(2, 1, 1, 2, 8)):
        with pytest.raises(ValueError, match=r"q must have rank 4, shape \[B, T, H, D\], got \("):
            mla_absorbed_attention(q, cache, slots, lengths, 0.3, 6)
    empty = r"q must have no empty dimension in \[B, T, H, D\], got \(2, 0, 2, 8\)"
    with pytest.raises(ValueError, match=empty):
        mla_absorbed_attention(torch.randn(2, 0, 2, 8), cache, slots, lengths, 0.3, 6)
    integer = r"q of shape \[B, T, H, D\] must have a floating dtype, got torch.int64"
    with pytest.raises(TypeError, match=integer):
        mla_absorbed_attention(torch.ones(2, 1, 2, 8, dtype=torch.long), cache, slots, lengths, 0.3, 6)
    with pytest.raises(TypeError, match=r"q must be a torch.Tensor of shape \[B, T, H, D\], got list"):
        mla_absorbed_attention([[0.0] * 8], cache, slots, lengths, 0.3, 6)
    q = torch.randn(2, 1, 2, 8)
    for bad in (cache.flatten(0, 1), cache[None]):
        with pytest.raises(ValueError, match=r"cache must have rank 3, shape \[P, L_max, D\], got \("):
            mla_absorbed_attention(q, bad, slots, lengths, 0.3, 6)
    with pytest.raises(TypeError, match=r"slots must be a torch.Tensor of shape \[B\], got list"):
        mla_absorbed_attention(q, cache, [0, 1], lengths, 0.3, 6)


def _paged_case(block_size, seed=0, T=2, H=3, D=20, R=16, dtype=torch.float32, lengths=(2, 37, 70)):
    """Three sequences (by default of lengths 2, 37 and 70) in a pool of shuffled blocks, the first two sharing their
    first block (a common prefix), every table padded with an id past the pool's used blocks; returns the
    inputs and the same rows laid out contiguously (`[B, L_max, D]`) for the reference."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths, dtype=torch.int32)
    blocks = [-(-int(n) // block_size) for n in lengths]
    pool = torch.randn(sum(blocks) + 2, block_size, D, generator=gen, dtype=dtype)
    order = torch.randperm(pool.shape[0] - 1, generator=gen).tolist()
    tables, used = [], 0
    for b in blocks:
        tables.append(order[used : used + b])
        used += b
    tables[1][0] = tables[0][0]  # shared prefix block
    width = max(blocks) + 1
    table = torch.tensor([t + [pool.shape[0] - 1] * (width - len(t)) for t in tables], dtype=torch.int32)
    contiguous = pool[table.long()].reshape(3, width * block_size, D)
    q = torch.randn(3, T, H, D, generator=gen, dtype=dtype)
    return tuple(x.to(DEVICE) for x in (q, pool, table, lengths, contiguous))


@pytest.mark.parametrize("block_size", [1, 5, 16, 64])
@pytest.mark.parametrize("splits", [1, 4])
def test_paged_kernel_equals_the_reference_over_shuffled_shared_blocks(block_size, splits):
    """Read through block tables (blocks shuffled, one shared by two sequences, sizes that do and do not
    divide the kernel's tile) against the PyTorch reference over the same rows laid out contiguously;
    float32 products over 20 numbers and a softmax: 1e-5."""
    from kda_edu.kernels.mla_decode import paged_mla_absorbed_attention

    q, pool, table, lengths, contiguous = _paged_case(block_size)
    out = paged_mla_absorbed_attention(q, pool, table, lengths, 0.3, 16, num_splits=splits)
    reference = mla_absorbed_reference(q, contiguous, torch.arange(3, device=DEVICE), lengths, 0.3, 16)
    err = (out - reference).abs().max().item()
    assert err < 1e-5, f"paged kernel vs reference (block_size {block_size}, {splits} splits): {err:.1e}"


@pytest.mark.parametrize("T", [1, 2])
def test_paged_kernel_reads_nothing_past_a_sequence(T):
    """Non-finite rows past each sequence's length (in its last block and in blocks its table names past
    the end) leave every output finite and unchanged, for decoding (T = 1) and an append (T = 2); the
    PyTorch reference over the same rows laid out contiguously alike: 1e-6."""
    from kda_edu.kernels.mla_decode import paged_mla_absorbed_attention

    q, pool, table, lengths, _ = _paged_case(16, T=T)
    dirty = pool.clone()
    for b, n in enumerate(lengths.tolist()):
        last = table[b, (n - 1) // 16]
        if b != 0:  # block 0's tail is sequence 1's shared prefix
            dirty[last, (n - 1) % 16 + 1 :] = float("nan")
    dirty[-1] = float("inf")  # the padding id every table ends with
    slots = torch.arange(3, device=DEVICE)
    runs = {
        "kernel": lambda p: paged_mla_absorbed_attention(q, p, table, lengths, 0.3, 16, num_splits=3),
        "reference": lambda p: mla_absorbed_reference(
            q, p[table.long()].flatten(1, 2), slots, lengths, 0.3, 16
        ),
    }
    for name, run in runs.items():
        clean, out = run(pool), run(dirty)
        assert torch.isfinite(out).all(), name
        err = (out - clean).abs().max().item()
        assert err < 1e-6, f"{name}: outputs with non-finite rows past the lengths vs without: {err:.1e}"


def test_paged_kernel_arguments_are_named():
    """A table of the wrong rank, batch or dtype, a pool of the wrong width or not contiguous."""
    from kda_edu.kernels.mla_decode import paged_mla_absorbed_attention

    q, pool, table, lengths, _ = _paged_case(16)
    with pytest.raises(ValueError, match=r"block_table must be int32/int64 \[B, max_blocks\] with B = 3"):
        paged_mla_absorbed_attention(q, pool, table[0], lengths, 0.3, 16)
    with pytest.raises(ValueError, match=r"block_table must be int32/int64"):
        paged_mla_absorbed_attention(q, pool, table.float(), lengths, 0.3, 16)
    with pytest.raises(ValueError, match=r"block_table must be int32/int64 \[B, max_blocks\] with B = 3"):
        paged_mla_absorbed_attention(q, pool, table[:2], lengths, 0.3, 16)
    with pytest.raises(ValueError, match=r"pool must be \[N, block_size, D\] with q's D = 20"):
        paged_mla_absorbed_attention(q, pool[..., :18], table, lengths, 0.3, 16)
    with pytest.raises(ValueError, match=r"pool \[N, block_size, D\] must be contiguous"):
        paged_mla_absorbed_attention(
            q, pool.transpose(0, 1).contiguous().transpose(0, 1), table, lengths, 0.3, 16
        )
    with pytest.raises(TypeError, match=r"block_table must be a torch.Tensor of shape \[B, max_blocks\]"):
        paged_mla_absorbed_attention(q, pool, table.tolist(), lengths, 0.3, 16)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_bad_cached_value_spoils_only_the_tokens_that_see_it(bad):
    """Three new tokens per sequence (an append): a non-finite number cached at the second new token's
    position, in the latent part of one sequence and in the rope part of another. The first new token does
    not see it: its output must equal the clean run's (it used to become NaN as 0 * inf in the value
    product), while the second and third see it and are non-finite; a sequence without a bad value is
    untouched. Kernel (2 splits and 1) and PyTorch reference alike; float32, 1e-6."""
    from kda_edu.kernels.mla_decode import paged_mla_absorbed_attention

    q, pool, table, lengths, contiguous = _paged_case(16, T=3, lengths=(5, 37, 70))
    slots = torch.arange(3, device=DEVICE)
    dirty, dirty_rows = pool.clone(), contiguous.clone()
    for b, column in ((1, 3), (2, 18)):  # sequence 1: latent column 3; sequence 2: rope column 18 (R = 16)
        s = int(lengths[b]) - 2  # the second new token's position
        dirty[table[b, s // 16], s % 16, column] = bad
        dirty_rows[b, s, column] = bad
    runs = {
        "kernel, 2 splits": lambda p, rows: paged_mla_absorbed_attention(q, p, table, lengths, 0.3, 16, 2),
        "kernel, 1 split": lambda p, rows: paged_mla_absorbed_attention(q, p, table, lengths, 0.3, 16, 1),
        "reference": lambda p, rows: mla_absorbed_reference(q, rows, slots, lengths, 0.3, 16),
    }
    for name, run in runs.items():
        clean, out = run(pool, contiguous), run(dirty, dirty_rows)
        assert torch.isfinite(clean).all(), name
        for b in (1, 2):
            err = (out[b, 0] - clean[b, 0]).abs().max().item()
            assert err < 1e-6, f"{name}: sequence {b}'s first new token changed by {err:.1e}"
            assert not torch.isfinite(out[b, 1:]).any(), (
                f"{name}: a token that sees the bad value stayed finite"
            )
        assert (out[0] - clean[0]).abs().max().item() < 1e-6, f"{name}: the clean sequence changed"
