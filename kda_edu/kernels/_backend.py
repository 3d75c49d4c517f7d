"""Where kda_edu's Triton kernels run: compiled for a CUDA GPU, or through Triton's interpreter on a CPU.

Triton turns a function into a kernel when `@triton.jit` runs on it: a compiled kernel if the
`TRITON_INTERPRET` setting is off at that moment, an interpreted one (NumPy on the CPU, one program after
another) if it is on. kda_edu decides for its own kernels, without touching the rest of the process:

- `INTERPRET` (`kda_edu.backend`) is True when there is no CUDA GPU, or when the user started Python with `TRITON_INTERPRET=1`;
- `jit` is `triton.jit` for kda_edu's kernels: with `INTERPRET` it builds the interpreted kernel with the
  setting switched on for that moment only, and switches it on again around each launch (Triton reads it
  while interpreting too), restoring the environment afterwards.

So `import kda_edu.kernels` works whether or not Triton (or fla, or torch.compile) was imported first, and
it never changes how anyone else's kernels are built. The rule for kernels defined outside kda_edu with a
plain `@triton.jit` (a notebook's, a reader's, fla's) is Triton's own: on a machine without a GPU they run
only if `TRITON_INTERPRET=1` is in the environment when they are defined (`interpret_plain_kernels()` sets
it, or `%env TRITON_INTERPRET=1` in a notebook).
"""

import os
import sys
from contextlib import contextmanager

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from kda_edu.backend import INTERPRET, interpreting  # noqa: F401 (interpreting: the kernels' own import)


@contextmanager
def interpreter_on():
    """Triton's interpreter setting switched on inside the block; the environment as it was afterwards."""
    previous = os.environ.get("TRITON_INTERPRET")
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4 reads the setting through triton.knobs
    try:
        if knobs is not None:
            with knobs.runtime.scope():
                knobs.runtime.interpret = True
                yield
        else:
            os.environ["TRITON_INTERPRET"] = "1"
            yield
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


def _interpret_triton_language() -> None:
    """Rebuild Triton's own library kernels (`tl.sum`, `tl.cumsum`, `tl.zeros`, ... and the tensor methods that
    call them) for the interpreter, when Triton was imported before anyone switched it on.

    Triton builds these with `@jit` as it is imported; an interpreted kernel cannot call a compiled one. This
    runs only when kda_edu interprets because there is no CUDA GPU, where a compiled kernel cannot run at all,
    so nothing that worked before stops working.
    """
    built = {}
    owners = [
        m for name, m in list(sys.modules.items()) if name.startswith("triton.language") and m is not None
    ]
    for owner in [*owners, tl.core.tensor]:
        for name, value in list(vars(owner).items()):
            if isinstance(value, JITFunction):
                if id(value) not in built:
                    with interpreter_on():
                        built[id(value)] = triton.jit(value.fn)
                setattr(owner, name, built[id(value)])


def jit(fn=None, **options):
    """`triton.jit` for kda_edu's kernels: compiled on a GPU, interpreted (per kernel, per launch) on a CPU.

    Used as `@jit` or `@jit(do_not_specialize=[...])`, with `triton.jit`'s options. The kernel keeps
    Triton's interface (`kernel[grid](...)`, `.fn` for its Python source).
    """

    def decorate(fn):
        if not INTERPRET:
            return triton.jit(fn, **options)
        with interpreter_on():
            kernel = triton.jit(fn, **options)
        launch = kernel.run

        def run(*args, **kwargs):
            with interpreter_on():
                return launch(*args, **kwargs)

        kernel.run = run  # `kernel[grid](...)` calls self.run: the interpreter is on while it runs
        return kernel

    return decorate if fn is None else decorate(fn)


def launchable(kernel):
    """`kernel` ready to launch here: on a machine that interpretes, a kernel that a plain `@triton.jit` compiled
    (it was defined while `TRITON_INTERPRET` was off, e.g. in a notebook) is rebuilt from its Python function
    as `jit` builds kda_edu's own; anything else is returned as it is. Exercise checkers launch readers' kernels
    through it."""
    if INTERPRET and isinstance(kernel, triton.runtime.JITFunction):
        return jit(kernel.fn)
    return kernel


def interpret_plain_kernels() -> None:
    """On a machine without a CUDA GPU, set `TRITON_INTERPRET=1` for this process, so that kernels defined
    from now on with a plain `@triton.jit` (a notebook's, fla's) run through the interpreter. kda_edu's own
    kernels do not need it; on a GPU machine this does nothing."""
    if not torch.cuda.is_available():
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
                "(no CUDA GPU, or TRITON_INTERPRET=1 at start-up): pass CPU tensors, or start Python without "
                "TRITON_INTERPRET=1 on a GPU machine to compile the kernels for the GPU"
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


if INTERPRET and isinstance(tl.standard.sum, JITFunction):
    _interpret_triton_language()
