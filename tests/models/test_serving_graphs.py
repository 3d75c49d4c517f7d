"""CUDA-graph buckets: the bucket choice and padding, and a decoder whose padded steps give the real rows the
logits of unpadded steps (padding rows must not disturb a real one). On a GPU the steps are captured graphs
running the Triton kernels."""

import pytest
import torch

from kda_edu.layers.kda_layer import KDAConfig
from kda_edu.layers.mla import MLAConfig
from kda_edu.models.model import HybridConfig, HybridLM
from kda_edu.models.serving import ServingDecoder
from kda_edu.models.serving.graphs import bucket_for, decode_buckets, pad_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_buckets_and_padding():
    assert decode_buckets(12) == [1, 2, 4, 8, 12]
    assert decode_buckets(8) == [1, 2, 4, 8] and decode_buckets(1) == [1]
    assert [bucket_for(b, [1, 2, 4, 8, 12]) for b in (1, 2, 3, 5, 8, 9, 12)] == [1, 2, 4, 8, 8, 12, 12]
    tokens, slots = pad_batch(torch.tensor([7, 8, 9]), torch.tensor([2, 0, 1]), 4, pad_slot=5)
    assert tokens.tolist() == [7, 8, 9, 0] and slots.tolist() == [2, 0, 1, 5]
    with pytest.raises(ValueError, match="larger than the largest bucket, 12"):
        bucket_for(13, [1, 2, 4, 8, 12])
    with pytest.raises(ValueError, match="max_batch must be an int >= 1"):
        decode_buckets(0)
    with pytest.raises(ValueError, match="smaller than the batch"):
        pad_batch(torch.tensor([1, 2]), torch.tensor([0, 1]), 1, pad_slot=3)


def model(dtype=torch.float64) -> HybridLM:
    config = HybridConfig(
        vocab_size=40,
        d_model=16,
        n_layers=4,
        kda=KDAConfig(num_heads=2, head_dim=8, chunk_size=8),
        mla=MLAConfig(num_heads=2, kv_rank=12, qk_head_dim=8, v_head_dim=8, rope_head_dim=4),
    )
    torch.manual_seed(0)
    return HybridLM(config).to(device=DEVICE, dtype=dtype).eval()


def test_padded_steps_equal_unpadded_steps():
    """Three sequences decoded for 8 steps with buckets [1, 2, 4] (one padding row into the scratch row),
    then one of them alone (bucket 1): the same logits as a decoder without buckets, and the scratch row
    never keeps a length. CPU: PyTorch in float64, 1e-10. GPU: CUDA graphs of the kernels, float32, 1e-5 (the
    same kernels on the same rows; a disturbed row is off by far more)."""
    lm = model(torch.float32 if DEVICE == "cuda" else torch.float64)
    tol = dict(rtol=1e-5, atol=1e-5) if DEVICE == "cuda" else dict(rtol=1e-10, atol=1e-10)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 40, (n,), generator=gen).to(DEVICE) for n in (3, 5, 4)]
    steps = torch.randint(0, 40, (8, 3), generator=gen).to(DEVICE)
    plain = ServingDecoder(lm, max_seqs=4, max_len=16)
    padded = ServingDecoder(lm, max_seqs=4, max_len=16, buckets=[1, 2, 4])
    slots = torch.tensor([plain.add(p)[0] for p in prompts], device=DEVICE)
    assert torch.equal(slots, torch.tensor([padded.add(p)[0] for p in prompts], device=DEVICE))
    for t in range(8):
        rows = slots if t < 6 else slots[1:2]
        tokens = steps[t, : len(rows)]
        torch.testing.assert_close(padded.step(tokens, rows).clone(), plain.step(tokens, rows), **tol)
        assert int(padded.lengths[padded.scratch]) == 0
    assert torch.equal(padded.lengths, plain.lengths)


def test_bad_buckets():
    lm = model()
    for buckets in ([1, 2], [2, 1, 4], [0, 4], [], [1, 1, 4], [1, 2.0, 4]):
        with pytest.raises(ValueError, match="buckets must be None or ascending distinct ints"):
            ServingDecoder(lm, max_seqs=4, max_len=8, kernels=False, cuda_graph=False, buckets=buckets)
