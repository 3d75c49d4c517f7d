"""The warm-up kernels of chapter 7 against PyTorch (through the interpreter on a CPU)."""

import pytest
import torch

from kda_edu.linear_attention import linear_attention_parallel
from kda_edu.triton import interpreting, primer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def randn(*shape, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("n, block", [(1, 16), (1000, 256), (4096, 1024)])
def test_vector_add(n, block):
    x, y = randn(n, seed=1), randn(n, seed=2)
    assert torch.equal(primer.vector_add(x, y, block), x + y)


@pytest.mark.parametrize("rows, cols", [(1, 1), (7, 100), (3, 128)])
def test_row_softmax(rows, cols):
    x = 30 * randn(rows, cols)  # large logits: the max subtraction matters
    torch.testing.assert_close(primer.row_softmax(x), x.softmax(-1), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("T, chunk", [(1, 16), (100, 16), (128, 64)])
def test_chunk_cumsum(T, chunk):
    g = -randn(2, T, 3, 20).abs()
    ref = primer.chunk_cumsum_reference(g, chunk)
    torch.testing.assert_close(primer.chunk_cumsum(g, chunk), ref, atol=1e-5, rtol=1e-5)
    if T % chunk == 0:  # the last step of each chunk holds the chunk's total
        torch.testing.assert_close(ref[:, chunk - 1 :: chunk], g.unflatten(1, (-1, chunk)).sum(2))


def test_chunk_cumsum_restarts_at_every_chunk():
    g = -torch.ones(1, 48, 1, 1, device=DEVICE)
    gc = primer.chunk_cumsum(g, 16).flatten()
    assert torch.equal(gc, -(torch.arange(48, device=DEVICE) % 16 + 1).float())


@pytest.mark.parametrize("Z, M, K, N", [(1, 16, 16, 16), (3, 40, 50, 24)])
def test_batched_matmul_fp32(Z, M, K, N):
    a, b = randn(Z, M, K, seed=3), randn(Z, K, N, seed=4)
    torch.testing.assert_close(primer.batched_matmul(a, b), a @ b, atol=1e-4, rtol=1e-4)


def test_batched_matmul_bf16_upcasts_when_interpreting():
    a, b = randn(2, 32, 48, dtype=torch.bfloat16), randn(2, 48, 32, seed=1, dtype=torch.bfloat16)
    ref = a.float() @ b.float()
    out = primer.batched_matmul(a, b)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    if interpreting():
        # The interpreter's bf16 tl.dot is the reason for the cast: without it the result is garbage.
        bad = primer.batched_matmul(a, b, upcast=False).float()
        assert not ((bad - ref).norm() / ref.norm()).item() < 1e-2


def test_batched_matmul_refuses_small_blocks():
    a = randn(1, 16, 16)
    with pytest.raises(ValueError, match=">= 16"):
        primer.batched_matmul(a, a, block=(8, 16, 16))
    with pytest.raises(ValueError, match=r"\[Z, M, K\]"):
        primer.batched_matmul(a, a[0])


@pytest.mark.parametrize(
    "B, T, H, K, V, chunk", [(1, 1, 1, 16, 16, 16), (2, 70, 2, 20, 24, 16), (1, 64, 1, 32, 32, 32)]
)
def test_chunked_linear_attention(B, T, H, K, V, chunk):
    q, k, v = randn(B, T, H, K, seed=5), randn(B, T, H, K, seed=6), randn(B, T, H, V, seed=7)
    ref = linear_attention_parallel(q, k, v)
    torch.testing.assert_close(
        primer.chunked_linear_attention(q, k, v, chunk=chunk), ref, atol=1e-4, rtol=1e-4
    )


def test_bad_arguments_are_named():
    x = randn(4)
    with pytest.raises(ValueError, match="1-D"):
        primer.vector_add(x, randn(5))
    with pytest.raises(ValueError, match="2-D"):
        primer.row_softmax(x)
    with pytest.raises(ValueError, match="power of two"):
        primer.chunk_cumsum(randn(1, 4, 1, 2), chunk=12)
    with pytest.raises(ValueError, match="chunk"):
        q = randn(1, 8, 1, 16)
        primer.chunked_linear_attention(q, q, q, chunk=8)


def test_program_ids_cover_the_output_once():
    ids = primer.program_ids((37, 50), (16, 32))
    assert ids.shape == (48, 64)
    assert (ids[:37, :50] >= 0).all() and (ids[37:] == -1).all() and (ids[:, 50:] == -1).all()
    assert ids.max().item() == 3 * 2 - 1 and ids[0, 32].item() == 3  # first grid axis fastest
