"""Kernels that must not build for some GPUs, planted by test_offline_compile.py to show that its build fails
for them. Imported by the fresh Python that compiles (`kda_edu.kernels.offline.in_fresh_python`)."""

import torch
import triton.language as tl

from kda_edu.kernels._backend import jit


@jit
def bf16_pack(x, out, N: tl.constexpr):
    """Two float32 numbers rounded to bfloat16 and packed in one register by one PTX instruction
    (`cvt.rn.bf16x2.f32`), which GPUs older than 8.0 do not have."""
    i = tl.arange(0, N)
    packed = tl.inline_asm_elementwise(
        "cvt.rn.bf16x2.f32 $0, $1, $1;", "=r,f", [tl.load(x + i)], dtype=tl.int32, is_pure=True, pack=1
    )
    tl.store(out + i, packed)


@jit
def cluster_rank(out, N: tl.constexpr):
    """Each program's rank in its thread-block cluster: a special register that only Hopper (9.0) has."""
    i = tl.arange(0, N)
    rank = tl.inline_asm_elementwise(
        "mov.u32 $0, %cluster_ctarank;", "=r,r", [i], dtype=tl.int32, is_pure=True, pack=1
    )
    tl.store(out + i, rank)


def launch_bf16_pack(capability) -> None:
    bf16_pack[(1,)](torch.empty(32, device="meta"), torch.empty(32, dtype=torch.int32, device="meta"), N=32)


def launch_cluster_rank(capability) -> None:
    cluster_rank[(1,)](torch.empty(32, dtype=torch.int32, device="meta"), N=32)
