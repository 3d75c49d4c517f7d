"""The serving decoder on a CUDA GPU: the CUDA-graph step equals the eager step (skipped without CUDA)."""

import pytest
import torch

from kda_edu.layers.kda_layer import KDAConfig
from kda_edu.layers.mla import MLAConfig, mla_absorbed_reference
from kda_edu.models.model import HybridConfig, HybridLM
from kda_edu.models.serving import ServingDecoder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CONFIG = HybridConfig(
    vocab_size=256,
    d_model=128,
    n_layers=4,
    kda=KDAConfig(num_heads=4, head_dim=64, gate="lower_bound"),
    mla=MLAConfig(num_heads=4, kv_rank=64, qk_head_dim=32, v_head_dim=32, rope_head_dim=16),
)


def decoders(dtype):
    torch.manual_seed(0)
    model = HybridLM(CONFIG).cuda().to(dtype).eval()
    return model, [ServingDecoder(model, 4, 64, cuda_graph=graph) for graph in (True, False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_step_equals_eager_step_with_joins_and_leaves(dtype):
    """The same prompts and tokens through a graphed and an eager decoder (same kernels, same order of
    operations): float32 within 1e-5, bf16 within 2e-2 of the logits' scale (replay and eager may pick
    different matmul algorithms for the same shapes). Batch sizes 2 and 3, a sequence leaving and one
    joining into its row, rows in changing order."""
    model, (graphed, eager) = decoders(dtype)
    gen = torch.Generator(device="cuda").manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), device="cuda", generator=gen) for n in (5, 9, 3)]
    slots = [[d.add(p)[0] for p in prompts[:2]] for d in (graphed, eager)]
    assert slots[0] == slots[1]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    rows = slots[0]
    for step in range(6):
        if step == 3:
            for d in (graphed, eager):
                d.release(rows[0])
                rows_new = d.add(prompts[2])[0]
            rows = [rows[1], rows_new]
        if step == 4:
            for d in (graphed, eager):
                extra = d.add(prompts[0])[0]
            rows = [extra, *rows]
        tokens = torch.randint(0, 256, (len(rows),), device="cuda", generator=gen)
        index = torch.tensor(rows[::-1] if step % 2 else rows, device="cuda")
        a = graphed.step(tokens, index).clone()
        b = eager.step(tokens, index)
        torch.testing.assert_close(a.float(), b.float(), **tol)
    torch.testing.assert_close(graphed.lengths, eager.lengths)


def test_graph_decoding_equals_the_reference_forward_in_float32():
    """Decoded logits through the graph equal the model's full forward (float32, TF32 off: 1e-4)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model, (graphed, _) = decoders(torch.float32)
    ids = torch.randint(0, 256, (20,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    with torch.no_grad():
        full = model(ids[None])[0]
    slot, _ = graphed.add(ids[:12])
    for t in range(12, 20):
        logits = graphed.step(ids[t : t + 1], torch.tensor([slot], device="cuda"))
        torch.testing.assert_close(logits[0], full[t], rtol=1e-4, atol=1e-4)


def test_absorbed_kernel_in_bf16_against_the_float32_reference():
    """Kimi's widths (32 heads, 512 + 64), bf16 cache and queries, 3 tokens per sequence, 5000 positions:
    relative RMS error below 1e-2 (bf16 products over 576 numbers, float32 accumulation)."""
    from kda_edu.kernels.mla_decode import mla_absorbed_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 3, 32, 576, device="cuda", generator=gen, dtype=torch.bfloat16)
    cache = torch.randn(3, 5000, 576, device="cuda", generator=gen, dtype=torch.bfloat16)
    slots, lengths = (
        torch.tensor([2, 0], device="cuda"),
        torch.tensor([4000, 5000], device="cuda", dtype=torch.int32),
    )
    out = mla_absorbed_attention(q, cache, slots, lengths, 576**-0.5, 512)
    ref = mla_absorbed_reference(q.float(), cache.float(), slots, lengths, 576**-0.5, 512)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("splits", [None, 1, 7])
def test_paged_kernel_in_bf16_over_shuffled_blocks(splits):
    """Kimi's widths (32 heads, 512 + 64), bf16 pool of 64-position blocks in a shuffled order, one decoded
    token per sequence, lengths not multiples of the block: relative RMS error below 1e-2 against the float32
    reference over the same rows laid out contiguously (bf16 products over 576 numbers, float32 sums)."""
    from kda_edu.kernels.mla_decode import paged_mla_absorbed_attention

    gen = torch.Generator(device="cuda").manual_seed(1)
    lengths = torch.tensor([1, 700, 4099], device="cuda", dtype=torch.int32)
    width = 65  # blocks per table: 4160 positions
    pool = torch.randn(3 * width, 64, 576, device="cuda", generator=gen, dtype=torch.bfloat16)
    table = torch.randperm(3 * width, device="cuda", generator=gen).view(3, width).to(torch.int32)
    q = torch.randn(3, 1, 32, 576, device="cuda", generator=gen, dtype=torch.bfloat16)
    out = paged_mla_absorbed_attention(q, pool, table, lengths, 576**-0.5, 512, num_splits=splits)
    rows = pool[table.long()].reshape(3, width * 64, 576).float()
    ref = mla_absorbed_reference(q.float(), rows, torch.arange(3, device="cuda"), lengths, 576**-0.5, 512)
    err = ((out - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"paged bf16 kernel vs float32 reference: relative RMS {err:.2e} (tolerance 1e-2)"
