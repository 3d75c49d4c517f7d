"""Shared test set-up.

Triton's interpreter must be switched on before the first `import triton` (fla imports it
too), so this happens here, before any test module is collected.
"""

import torch

from kda_edu import _backend

_backend.configure()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
