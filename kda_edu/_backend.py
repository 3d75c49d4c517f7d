"""Choose how Triton runs before Triton is imported.

Triton decides once, at import time, whether it compiles kernels for a GPU or runs them
through its Python interpreter (``TRITON_INTERPRET=1``). This module makes that choice for
``kda_edu.triton``: on a machine without a CUDA GPU it turns the interpreter on, so every
kernel in the book also runs on a laptop CPU (slowly, at small sizes).
"""

import os
import sys

import torch

_HELP = (
    "kda_edu.triton needs Triton's interpreter on a machine without a CUDA GPU, and the "
    "interpreter can only be switched on before `import triton`. Triton was already imported "
    "without it. Either set the environment variable TRITON_INTERPRET=1 before starting Python "
    "(in a notebook: `%env TRITON_INTERPRET=1` in the first cell), or import kda_edu.triton "
    "before anything that imports triton, then restart the kernel."
)


def interpreting() -> bool:
    """True when Triton kernels run through the interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def configure() -> None:
    """Switch the interpreter on when there is no GPU; fail clearly when it is too late."""
    if torch.cuda.is_available() or interpreting():
        return
    if "triton" in sys.modules:
        raise RuntimeError(_HELP)
    os.environ["TRITON_INTERPRET"] = "1"
