"""The absorbed MLA decoding kernel's input checks (its results against the PyTorch reference are in
tests/models/test_serving.py, beside the serving decoder that runs it)."""

import pytest
import torch

from kda_edu.kernels.mla_decode import mla_absorbed_attention
from kda_edu.layers.mla import mla_absorbed_reference


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
