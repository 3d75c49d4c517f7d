"""The absorbed MLA decoding kernel's input checks (its results against the PyTorch reference are in
tests/models/test_serving.py, beside the serving decoder that runs it)."""

import pytest
import torch

from kda_edu.kernels.mla_decode import mla_absorbed_attention


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
