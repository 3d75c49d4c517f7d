"""kda_edu: the code behind the book "From softmax attention to Kimi Delta Attention".

Each chapter of the book is backed by one module here; the notebooks import these modules and
show their source, so the text and the library cannot drift apart. ``import kda_edu`` is cheap:
it imports neither Triton nor the notebook tooling. The Triton kernels live in
``kda_edu.kernels`` and are imported on demand.
"""

__version__ = "0.1.0"

from kda_edu.ops.kda import kda_chunked, kda_recurrent, kda_step  # noqa: E402

__all__ = ["kda_chunked", "kda_recurrent", "kda_step"]
