"""Where the KDA recurrence runs: the one backend switch of the package, and how Triton is set up.

A layer that runs the KDA recurrence (`kda_edu.layers.kda_layer.KDALayer`, `kda_edu.layers.mixers.TokenMixer`) has a
`backend` in its config, one of `BACKENDS`, and asks `use_triton(backend, x)` on every call:

    "auto"    the Triton kernels of `kda_edu.kernels` where they run compiled (x on a CUDA GPU, in a 16- or
              32-bit float dtype, interpreter off); the PyTorch forms of `kda_edu.ops.kda` everywhere else
    "torch"   always the PyTorch forms
    "triton"  always the kernels; on a CPU that is Triton's interpreter (slow: for tests and for reading),
              and where they cannot run at all the kernels' device check raises a ValueError saying why

Triton decides once, at import time, whether it compiles kernels for a GPU or runs them
through its Python interpreter (``TRITON_INTERPRET=1``). `configure` makes that choice for
``kda_edu.kernels``: on a machine without a CUDA GPU it turns the interpreter on, so every
kernel in the book also runs on a laptop CPU (slowly, at small sizes).
"""

import os
import sys

import torch

_HELP = (
    "kda_edu.kernels needs Triton's interpreter on a machine without a CUDA GPU, and the "
    "interpreter can only be switched on before `import triton`. Triton was already imported "
    "without it. Either set the environment variable TRITON_INTERPRET=1 before starting Python "
    "(in a notebook: `%env TRITON_INTERPRET=1` in the first cell), or import kda_edu.kernels "
    "before anything that imports triton, then restart the kernel."
)


BACKENDS = ("auto", "torch", "triton")
KERNEL_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def check_backend(backend, owner: str) -> None:
    """Raise a ValueError naming `owner` (e.g. "KDAConfig.backend") unless backend is one of `BACKENDS`."""
    if backend not in BACKENDS:
        raise ValueError(f"{owner} must be one of {BACKENDS}, got {backend!r}")


def use_triton(backend: str, x: torch.Tensor) -> bool:
    """True when the recurrence on x (the queries, say) runs in the Triton kernels under `backend`."""
    if backend == "torch":
        return False
    if backend == "triton":
        return True
    return x.is_cuda and x.dtype in KERNEL_FLOATS and not interpreting()


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


def check_device(x: torch.Tensor, name: str = "q") -> None:
    """Raise a ValueError, naming `name`, when the kernels cannot run on `x` where it is.

    The interpreter runs kernels on CPU tensors only; compiled kernels need CUDA tensors (a CPU tensor
    would reach the kernel as a pointer the GPU cannot read), and bfloat16 needs a GPU of compute capability
    8.0 or newer. Every other tensor of a call is checked against `x`'s device by the input checks.
    """
    if interpreting():
        if x.device.type != "cpu":
            raise ValueError(
                f"{name} is on {x.device}, but Triton runs kernels through its CPU interpreter here "
                "(TRITON_INTERPRET=1): pass CPU tensors, or start Python without TRITON_INTERPRET=1 to compile "
                "the kernels for the GPU"
            )
        return
    if x.device.type != "cuda":
        raise ValueError(
            f"{name} is on {x.device}, but the Triton kernels are compiled for the CUDA GPU here: move the "
            f"tensors there first ({name}.cuda()), or use the PyTorch forms in kda_edu.ops.kda on the CPU"
        )
    if x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) < (8, 0):
        major, minor = torch.cuda.get_device_capability(x.device)
        raise ValueError(
            f"{name} is bfloat16, which this GPU (compute capability {major}.{minor}) cannot run in the kernels "
            "(it needs 8.0 or newer): pass float16 or float32 tensors"
        )
