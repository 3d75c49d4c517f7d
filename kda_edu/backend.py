"""Where the KDA recurrence runs: the package's one backend switch (importing it does not import Triton).

A layer that runs the KDA recurrence (`kda_edu.layers.kda_layer.KDALayer`, `kda_edu.layers.mixers.TokenMixer`)
has a `backend` in its config, one of `BACKENDS`, and asks `use_triton(backend, x)` on every call:

    "auto"    the Triton kernels of `kda_edu.kernels` where they run compiled (x on a CUDA GPU, in a 16- or
              32-bit float dtype, interpreter off); the PyTorch forms of `kda_edu.ops.kda` everywhere else
    "torch"   always the PyTorch forms
    "triton"  always the kernels; on a CPU that is Triton's interpreter (slow: for tests and for reading),
              and where they cannot run at all the kernels' device check raises a ValueError saying why

`INTERPRET` says how kda_edu's own kernels are built (`kda_edu.kernels._backend.jit`): through Triton's
interpreter when there is no CUDA GPU or when Python was started with `TRITON_INTERPRET=1`, compiled otherwise.
"""

import os

import torch

BACKENDS = ("auto", "torch", "triton")
KERNEL_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1" or not torch.cuda.is_available()


def interpreting() -> bool:
    """True when kda_edu's Triton kernels run through the interpreter (on CPU tensors)."""
    return INTERPRET


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
