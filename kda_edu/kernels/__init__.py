"""Triton kernels for KDA: the chunked forward/backward and the recurrent decoding kernel.

Importing this subpackage picks the backend first: compiled kernels on a CUDA GPU, Triton's
interpreter on a CPU (see ``kda_edu.kernels._backend``). ``import kda_edu`` alone never imports Triton.
"""

from kda_edu.kernels._backend import configure, interpreting

configure()

from kda_edu.kernels.chunk import chunk_kda  # noqa: E402
from kda_edu.kernels.fused_recurrent import fused_recurrent_kda  # noqa: E402

__all__ = ["chunk_kda", "fused_recurrent_kda", "interpreting"]
