"""Triton kernels for KDA: the chunked forward/backward, the recurrent decoding kernel, and the layer's parts
around them (the short convolution, the q/k L2 norm, the decay gate and beta, the gated output norm).

On a CUDA GPU the kernels are compiled; without one they run through Triton's interpreter on CPU tensors
(`kda_edu.kernels._backend` decides per kernel, whether or not Triton was imported first, and leaves other
Triton users alone). ``import kda_edu`` alone never imports Triton; this subpackage does.
"""

from kda_edu.kernels._backend import interpreting
from kda_edu.kernels.chunk import chunk_kda, raise_value_errors
from kda_edu.kernels.fused_recurrent import fused_recurrent_kda
from kda_edu.kernels.layer_gates import fused_kda_gates
from kda_edu.kernels.norms import fused_gated_rms_norm, fused_l2_normalize
from kda_edu.kernels.short_conv import fused_short_conv

__all__ = [
    "chunk_kda",
    "fused_gated_rms_norm",
    "fused_kda_gates",
    "fused_l2_normalize",
    "fused_recurrent_kda",
    "fused_short_conv",
    "interpreting",
    "raise_value_errors",
]
