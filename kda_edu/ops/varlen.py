"""Batches of sequences of different lengths: padding masks and packed sequences (`cu_seqlens`).

Two ways to hand a layer sequences of different lengths, the two that FlashAttention and fla use:

- **padded**: `x [B, T, D]` with an `attention_mask [B, T]`, 1 (or True) for a real token and 0 for padding.
  Each row is one sequence, made of its real tokens in order; what the padding holds is never read.
- **packed**: `x [1, T, D]` holding N sequences one after the other, with `cu_seqlens` int32/int64 `[N + 1]`,
  the cumulative lengths `[0, T_1, T_1 + T_2, ..., T]`. Every sequence runs as if it were alone.

A layer that takes a mask packs its real tokens (`unpad`), runs them with `cu_seqlens`, and puts the outputs
back in place (`repad`), zeros at the padding, as fla's layers do.
"""

import torch


def check_cu_seqlens(cu_seqlens, B: int, T: int, device: torch.device) -> list[int]:
    """Check FlashAttention-style cumulative lengths for x `[B, T, ...]`; return them as a list of ints.

    Raises a TypeError or ValueError naming `cu_seqlens` when it is not an int32/int64 1-D tensor on x's device
    that starts at 0, ends at T and never decreases, or when B != 1 (sequences are packed along T). The one
    check of the package: the layers, the model and the Triton kernels (`kda_edu.kernels`) all call it.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor [N + 1], got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens [N + 1] must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be 1-D with N + 1 >= 2 entries [0, ..., T], got shape {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device}, but the inputs are on {device}")
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1 (sequences packed along T), got B = {B}")
    # One small device-to-host copy; it is what makes a bad cu_seqlens an error, not a bad read in a kernel.
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T = {T}, got {cu[0]} ... {cu[-1]}")
    if any(b < a for a, b in zip(cu[:-1], cu[1:], strict=True)):
        raise ValueError(f"cu_seqlens must be nondecreasing, got {cu}")
    return cu


def check_attention_mask(attention_mask, B: int, T: int, device: torch.device) -> torch.Tensor:
    """Check a padding mask for x `[B, T, ...]` (`[B, T]`, bool or integer 0/1, on x's device); return it as
    bool. Raises a TypeError or ValueError naming `attention_mask` otherwise."""
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor [B, T], got {type(attention_mask).__name__}")
    if tuple(attention_mask.shape) != (B, T):
        raise ValueError(
            f"attention_mask must be a [B, T] = {(B, T)} padding mask (1 = token, 0 = padding), "
            f"got shape {tuple(attention_mask.shape)}"
        )
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise TypeError(
            f"attention_mask [B, T] must be bool or an integer 0/1 tensor, got {attention_mask.dtype}"
        )
    if attention_mask.device != device:
        raise ValueError(f"attention_mask is on {attention_mask.device}, but the inputs are on {device}")
    if attention_mask.dtype != torch.bool and not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError("attention_mask [B, T] must hold only 0 (padding) and 1 (token)")
    return attention_mask.bool()


def unpad(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack the real tokens of a padded batch.

    Args:
        x: `[B, T, ...]`.
        mask: bool `[B, T]` (from `check_attention_mask`).

    Returns:
        `(packed, indices, cu_seqlens)`: packed `[1, n, ...]`, the n real tokens row by row; indices int64
        `[n]`, where each came from in the flattened `[B T]`; cu_seqlens int32 `[B + 1]`, one sequence per row.
    """
    B, T = mask.shape
    indices = mask.reshape(-1).nonzero().squeeze(-1)
    lengths = mask.sum(dim=1, dtype=torch.int32)
    cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0, dtype=torch.int32)])
    return x.reshape(B * T, *x.shape[2:])[indices][None], indices, cu_seqlens


def repad(packed: torch.Tensor, indices: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """The inverse of `unpad`: packed `[1, n, ...]` -> `[B, T, ...]`, zeros at the padding."""
    out = packed.new_zeros(B * T, *packed.shape[2:])
    out[indices] = packed[0]
    return out.view(B, T, *packed.shape[2:])


def positions_in_sequence(cu_seqlens: list[int], device: torch.device) -> torch.Tensor:
    """For every packed token, its position in its own sequence: int64 `[T]`."""
    starts = torch.tensor(cu_seqlens[:-1], device=device)
    lengths = torch.tensor(
        [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)], device=device
    )
    T = cu_seqlens[-1]
    return torch.arange(T, device=device) - starts.repeat_interleave(lengths, output_size=T)


def check_varlen_state(initial_state, N: int, HV: int, K: int, V: int, device: torch.device) -> None:
    """With cu_seqlens there is one state per sequence, [N, HV, K, V], not one per batch row."""
    if not isinstance(initial_state, torch.Tensor):
        raise TypeError(f"initial_state must be a torch.Tensor, got {type(initial_state).__name__}")
    if tuple(initial_state.shape) != (N, HV, K, V):
        raise ValueError(
            f"with cu_seqlens, initial_state must have shape [N, HV, K, V] = {(N, HV, K, V)}, one state per "
            f"sequence, got {tuple(initial_state.shape)}"
        )
    if initial_state.dtype != torch.float32:
        raise TypeError(f"initial_state must be float32, got {initial_state.dtype}")
    if initial_state.device != device:
        raise ValueError(f"initial_state must be on q's device ({device}), got {initial_state.device}")
