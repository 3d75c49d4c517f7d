"""The warm-up kernels of chapter 7 against PyTorch (through the interpreter on a CPU)."""

import pytest
import torch

from kda_edu.chapters import ch07_primer as primer
from kda_edu.kernels import interpreting
from kda_edu.ops.linear_attention import linear_attention_parallel

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


PRECISIONS = ["tf32", "tf32x3", "ieee"]


def error_ratio(out, exact, size):
    """max |out - exact| / size, elementwise: the quantity `primer.dot_error_bound` bounds."""
    return ((out.double() - exact).abs() / size).max().item()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("Z, M, K, N", [(1, 16, 16, 16), (3, 40, 50, 24)])
def test_batched_matmul_fp32(Z, M, K, N, precision):
    a, b = randn(Z, M, K, seed=3), randn(Z, K, N, seed=4)
    exact, size = a.double() @ b.double(), a.double().abs() @ b.double().abs()
    out = primer.batched_matmul(a, b, input_precision=precision)
    assert error_ratio(out, exact, size) <= primer.dot_error_bound(precision, depth=K)


def test_tf32_is_the_gpu_default_and_the_interpreter_ignores_it():
    a, b = randn(2, 64, 64, seed=8), randn(2, 64, 64, seed=9)
    exact, size = a.double() @ b.double(), a.double().abs() @ b.double().abs()
    default = primer.batched_matmul(a, b)  # no input_precision: Triton's own default
    tf32 = primer.batched_matmul(a, b, input_precision="tf32")
    ieee = primer.batched_matmul(a, b, input_precision="ieee")
    float32_bound = primer.dot_error_bound("ieee", depth=64)
    assert error_ratio(ieee, exact, size) <= float32_bound
    if interpreting():  # numpy's float32 matmul whatever the precision says
        assert error_ratio(default, exact, size) <= float32_bound
    else:  # TF32 operands: errors no float32 product could make, within the TF32 bound
        assert float32_bound < error_ratio(default, exact, size) <= primer.dot_error_bound("tf32", depth=64)
        assert error_ratio(tf32, exact, size) > float32_bound


def test_dot_error_bound_follows_the_mantissa():
    assert primer.dot_error_bound("tf32", depth=0) == 2 * 2.0**-10
    assert primer.dot_error_bound("ieee", depth=100) == 200 * 2.0**-24
    assert (
        primer.dot_error_bound("ieee", 10)
        < primer.dot_error_bound("tf32x3", 10)
        < primer.dot_error_bound("tf32", 10)
    )
    with pytest.raises(ValueError, match="precision"):
        primer.dot_error_bound("fp32", 10)
    with pytest.raises(ValueError, match="input_precision"):
        primer.batched_matmul(randn(1, 16, 16), randn(1, 16, 16), input_precision="highest")


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
@pytest.mark.parametrize("precision", PRECISIONS)
def test_chunked_linear_attention(B, T, H, K, V, chunk, precision):
    q, k, v = randn(B, T, H, K, seed=5), randn(B, T, H, K, seed=6), randn(B, T, H, V, seed=7)
    exact = linear_attention_parallel(q.double(), k.double(), v.double())
    # scale * sum_{s <= t} |q_t| . |k_s| |v_s|: the size the error is measured against
    size = linear_attention_parallel(q.double().abs(), k.double().abs(), v.double().abs())
    out = primer.chunked_linear_attention(q, k, v, chunk=chunk, input_precision=precision)
    # two tl.dots in a row on every path (q k^T then v, or k^T v then q): four rounded operands per term
    bound = primer.dot_error_bound(precision, depth=T + 2 * K + chunk, roundings=4)
    assert error_ratio(out, exact, size) <= bound


def test_chunked_linear_attention_error_bound_catches_a_missing_state():
    q, k, v = randn(1, 40, 1, 16, seed=5), randn(1, 40, 1, 16, seed=6), randn(1, 40, 1, 16, seed=7)
    size = linear_attention_parallel(q.double().abs(), k.double().abs(), v.double().abs())
    exact = linear_attention_parallel(q.double(), k.double(), v.double())
    # without the earlier chunks (what a kernel that forgot its state would return) the bound is far exceeded
    alone = torch.cat(
        [linear_attention_parallel(*(x[:, i : i + 16] for x in (q, k, v))) for i in (0, 16, 32)], 1
    )
    assert error_ratio(alone, exact, size) > 10 * primer.dot_error_bound("tf32", depth=40 + 48, roundings=4)


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


def test_unspecialised_reads_do_not_specialize():
    from kda_edu.kernels import chunk_fwd

    assert primer.unspecialised(chunk_fwd._chunk_scan_kernel) == {"NT", "N0", "CS", "CN"}
    assert primer.unspecialised(primer.add_kernel) == set()


def test_occupancy_hand_worked_cases():
    from kda_edu.chapters.ch07_primer import H100, T4, occupancy

    # 255 registers: 255 * 32 = 8160 per warp, rounded up to 8192 (32 units of 256); 4 warps take 32768 of
    # the 65536 registers: two programs, and registers bind (64 warps and 32 blocks would allow more)
    o = occupancy(255, 0, 4, H100)
    assert (o.blocks_per_sm, o.limit, o.warps_per_sm, o.fraction) == (2, "registers", 8, 8 / 64)
    assert occupancy(128, 0, 4).blocks_per_sm == 4 and occupancy(129, 0, 4).blocks_per_sm == 3  # 129 -> 136
    # 32 registers, 1 warp: the registers allow 64 programs, the SM's block limit 32
    assert occupancy(32, 0, 1).by_limit["registers"] == 64 and occupancy(32, 0, 1)[:2] == (32, "blocks")
    # a scan of 96 registers at 4 warps with 123136 bytes of shared memory: (123136 + 1024) bytes of the
    # 233472 fit once; the registers alone would allow 5
    o = occupancy(96, 123136, 4, H100)
    assert (o.blocks_per_sm, o.limit, o.by_limit["registers"]) == (1, "shared memory", 5)
    # 16 registers, 16 warps on a T4: registers allow 8, its 32 warps only 2
    assert occupancy(16, 0, 16, T4)[:2] == (2, "warps")
    # 40 kB of shared memory on a T4 (64 kB per SM, no reserve): one program
    assert occupancy(64, 40 * 1024, 4, T4)[:2] == (1, "shared memory")


def test_occupancy_refuses_kernels_that_cannot_run():
    import pytest

    from kda_edu.chapters.ch07_primer import T4, occupancy

    with pytest.raises(ValueError, match="registers per thread"):
        occupancy(256, 0, 4)
    with pytest.raises(ValueError, match="shared memory"):
        occupancy(64, 65 * 1024, 4, T4)
    with pytest.raises(ValueError, match="warps"):
        occupancy(32, 0, 33, T4)


def _props(major, minor, **reported):
    from types import SimpleNamespace

    return SimpleNamespace(name="Some GPU", major=major, minor=minor, multi_processor_count=114, **reported)


HOPPER_REPORTED = dict(
    regs_per_multiprocessor=65536,
    shared_memory_per_multiprocessor=233472,
    shared_memory_per_block_optin=232448,
    max_threads_per_multi_processor=2048,
)


def test_device_limits_reads_the_device_and_the_documented_table(monkeypatch):
    """The reported limits come from the device (114 SMs: an H100 PCIe, not the SXM example's 132); the rest
    from the compute capability's row; an unknown capability or an unreported limit is refused, never
    borrowed from another GPU."""
    from kda_edu.chapters import ch07_primer as primer

    monkeypatch.setattr(primer.torch.cuda, "get_device_properties", lambda i: _props(9, 0, **HOPPER_REPORTED))
    limits = primer.device_limits()
    assert (limits.sms, limits.shared_per_sm, limits.max_warps_per_sm) == (114, 233472, 64)
    assert (limits.max_blocks_per_sm, limits.reserved_shared_per_block) == (32, 1024)
    assert primer.occupancy(96, 123136, 4, limits).limit == "shared memory"

    monkeypatch.setattr(
        primer.torch.cuda, "get_device_properties", lambda i: _props(12, 0, **HOPPER_REPORTED)
    )
    with pytest.raises(ValueError, match="is 12.0"):
        primer.device_limits()
    partial = {k: v for k, v in HOPPER_REPORTED.items() if k != "regs_per_multiprocessor"}
    monkeypatch.setattr(primer.torch.cuda, "get_device_properties", lambda i: _props(9, 0, **partial))
    with pytest.raises(ValueError, match="regs_per_multiprocessor"):
        primer.device_limits()


def test_the_cpu_examples_follow_the_documented_table():
    from kda_edu.chapters.ch07_primer import DOCUMENTED, H100, T4

    for example, cc in ((H100, (9, 0)), (T4, (7, 5))):
        assert {k: getattr(example, k) for k in DOCUMENTED[cc]} == DOCUMENTED[cc]
