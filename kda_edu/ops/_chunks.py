"""Splitting a sequence into chunks and back, for the chunked forms of every chapter."""

import torch
import torch.nn.functional as F


def to_chunks(x: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """`[B, T, HV, ...]` -> `[B, HV, NC, C, ...]` in `dtype`, NC = ceil(T / C).

    The last chunk is zero-padded. Every chunked form in the book treats a zero step (k = v = 0, g = 0,
    beta = 0) as one that leaves the state alone, so padding never changes a result.
    """
    B, T, HV = x.shape[:3]
    NC = -(-T // chunk_size)
    x = x.to(dtype).transpose(1, 2)
    x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, NC * chunk_size - T))
    return x.reshape(B, HV, NC, chunk_size, *x.shape[3:])


def from_chunks(x: torch.Tensor, T: int, dtype: torch.dtype) -> torch.Tensor:
    """`[B, HV, NC, C, D]` -> `[B, T, HV, D]` in `dtype`, dropping the padding."""
    B, HV, NC, C, D = x.shape
    return x.reshape(B, HV, NC * C, D)[:, :, :T].transpose(1, 2).to(dtype)
