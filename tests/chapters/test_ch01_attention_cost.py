"""The counters chapters 1 and 2 measure with: operations dispatched, and live tensor bytes."""

import torch

from kda_edu.chapters.ch01_attention_cost import LiveTensorBytes, OperationCount
from kda_edu.ops.linear_attention import linear_attention_recurrent


def test_operation_count_counts_each_dispatched_operation():
    x = torch.randn(8)
    with OperationCount() as three:
        x.exp(), x.sin(), x + x
    with OperationCount() as none:
        pass
    assert (three.count, none.count) == (3, 0)


def test_recurrent_operations_grow_with_the_length():
    counts = {}
    for T in (8, 16, 32):
        q, k, v = (torch.randn(1, T, 2, 4, dtype=torch.float64) for _ in range(3))
        with OperationCount() as counter:
            linear_attention_recurrent(q, k, v)
        counts[T] = counter.count
    per_token = (counts[32] - counts[16]) / 16
    assert per_token >= 2  # at least a read and a write per token
    assert counts[32] - counts[16] == 2 * (counts[16] - counts[8])  # a fixed number per token


def test_live_tensor_bytes_sees_a_new_tensor():
    with LiveTensorBytes() as memory:
        y = torch.ones(1000, dtype=torch.float64)
    assert memory.peak == 8000 and y.numel() == 1000
