"""Shared test set-up.

Triton's interpreter must be switched on before the first `import triton` (fla imports it
too), so this happens here, before any test module is collected.
"""

import torch

from kda_edu import _backend

_backend.configure()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# The unit tests use small tensors, for which PyTorch's intra-op thread pool costs more than it
# saves; on a busy 2-core machine two threads made some tiny ops 100x slower. One thread is also
# what makes CPU results independent of the machine's core count.
if DEVICE == "cpu":
    torch.set_num_threads(1)
