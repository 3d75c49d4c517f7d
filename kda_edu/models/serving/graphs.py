"""CUDA-graph buckets: a few captured decode steps serve every batch size, by padding the batch.

A CUDA graph replays a recorded sequence of kernel launches with the shapes they were recorded with: a
decoding step captured for a batch of B sequences serves only batches of exactly B. Capturing every B from 1
to `max_seqs` costs a capture (and the graph's memory) per size, and a server's batch size changes every
time a request joins or leaves. So servers capture a few *buckets* (1, 2, 4, 8, ..., `max_seqs`) and run a
batch of B in the smallest bucket that holds it, padding it with rows whose results are thrown away.

A padding row must not disturb a real one: here every padding row decodes token 0 into the decoder's
scratch row (`ServingDecoder.scratch`, which no sequence uses), and the scratch row's length is reset after
the step so it never grows. The real rows' logits are the first B rows of the bucket's output.
"""

import torch


def decode_buckets(max_batch: int) -> list[int]:
    """The powers of two below `max_batch`, then `max_batch`: `decode_buckets(12) == [1, 2, 4, 8, 12]`."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
    buckets, size = [], 1
    while size < max_batch:
        buckets.append(size)
        size *= 2
    return [*buckets, max_batch]


def bucket_for(batch: int, buckets: list[int]) -> int:
    """The smallest bucket that holds `batch` rows (buckets ascending)."""
    for size in buckets:
        if size >= batch:
            return size
    raise ValueError(f"a batch of {batch} is larger than the largest bucket, {buckets[-1]}")


def pad_batch(
    tokens: torch.Tensor, slots: torch.Tensor, bucket: int, pad_slot: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`tokens` and `slots` `[B]` padded to `[bucket]`: token 0 at row `pad_slot` for every padding row."""
    pad = bucket - tokens.shape[0]
    if pad < 0:
        raise ValueError(f"bucket = {bucket} is smaller than the batch, {tokens.shape[0]}")
    return (
        torch.cat([tokens, tokens.new_zeros(pad)]),
        torch.cat([slots, slots.new_full((pad,), pad_slot)]),
    )
