"""Triton kernels for KDA: the chunked forward/backward and the recurrent decoding kernel.

On a CUDA GPU the kernels are compiled; without one they run through Triton's interpreter on CPU tensors
(`kda_edu.kernels._backend` decides per kernel, whether or not Triton was imported first, and leaves other
Triton users alone). ``import kda_edu`` alone never imports Triton; this subpackage does.
"""

from kda_edu.kernels._backend import interpreting
from kda_edu.kernels.chunk import chunk_kda, raise_value_errors
from kda_edu.kernels.fused_recurrent import fused_recurrent_kda

__all__ = ["chunk_kda", "fused_recurrent_kda", "interpreting", "raise_value_errors"]
