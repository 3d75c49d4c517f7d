"""Where the book's code runs, and how large its examples are.

Every notebook asks this module, and only this module, for its device and problem sizes, so
the same notebook runs in a couple of minutes on a laptop CPU and at realistic sizes on a GPU.
Set ``KDA_EDU_DEVICE=cpu`` to force the CPU on a GPU machine.

It also picks the 16-bit dtype the chapters' GPU runs use (``DTYPE``): bfloat16 where the GPU has bfloat16
tensor cores (compute capability 8.0 and later: A100, H100, H200), float16 on older GPUs (Colab's T4 is
7.5), float32 on a CPU. ``KDA_EDU_DTYPE=float16|bfloat16|float32`` forces a choice, so one GPU can run
every path.

On a CPU, importing this module sets PyTorch's intra-op threads to one (``KDA_EDU_THREADS=n`` asks for n).
The book's CPU examples are small: thousands of operations of microseconds each, which a second thread
barely speeds up on an idle machine. On a machine whose cores other programs share (a laptop is never
idle), PyTorch's OpenMP threads make them slow: after every parallel operation the helper thread spins,
waiting for the next one, on a core that the main thread or the other program needs, and at every operation
the main thread waits for a helper that the scheduler has put behind the other program. Chapter 12's first
training run, on two cores that other programs kept busy (load average 3 to 6), took 154 s of wall time and
135 s of CPU time with PyTorch's default two threads, 12 s and 10 s with two threads that sleep instead of
spinning (``OMP_WAIT_POLICY=PASSIVE``), and 13 s and 9 s with one thread. OpenMP reads its wait policy only
when PyTorch is imported, before this module, so one thread is what this module can choose; ``make`` also
sets ``OMP_WAIT_POLICY=PASSIVE`` for everything it runs, for a reader who asks for more threads.
"""

import os
import platform

import torch

_forced = os.environ.get("KDA_EDU_DEVICE")
if _forced not in (None, "", "cpu", "cuda"):
    raise ValueError(f"KDA_EDU_DEVICE must be 'cpu' or 'cuda', got {_forced!r}")
if _forced == "cuda" and not torch.cuda.is_available():
    raise RuntimeError("KDA_EDU_DEVICE=cuda, but torch sees no CUDA GPU")

DEVICE = torch.device(_forced or ("cuda" if torch.cuda.is_available() else "cpu"))
ON_GPU = DEVICE.type == "cuda"


DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def choose_dtype(forced: str | None, on_gpu: bool, capability: tuple[int, int], bf16_ok: bool) -> torch.dtype:
    """The chapters' low-precision dtype for a device, or the forced one (see the module docstring).

    Args:
        forced: the value of KDA_EDU_DTYPE (None or "" to choose).
        on_gpu: whether the book runs on a CUDA GPU.
        capability: the GPU's compute capability, e.g. (9, 0) for an H200, (7, 5) for a T4.
        bf16_ok: `torch.cuda.is_bf16_supported()`.
    """
    bf16_cores = on_gpu and capability >= (8, 0) and bf16_ok
    if forced:
        if forced not in DTYPES:
            raise ValueError(f"KDA_EDU_DTYPE must be one of {sorted(DTYPES)}, got {forced!r}")
        if forced != "float32" and not on_gpu:
            raise ValueError(
                f"KDA_EDU_DTYPE={forced} needs a CUDA GPU: on a CPU the book runs in float32 (Triton's "
                "interpreter computes bfloat16 products wrongly); unset it or set it to float32"
            )
        if forced == "bfloat16" and not bf16_cores:
            raise ValueError(
                f"KDA_EDU_DTYPE=bfloat16, but this GPU (compute capability {capability[0]}.{capability[1]}) has "
                "no bfloat16 tensor cores (they start at 8.0); use float16 or float32"
            )
        return DTYPES[forced]
    if not on_gpu:
        return torch.float32
    return torch.bfloat16 if bf16_cores else torch.float16


def cpu_threads(forced: str | None) -> int:
    """PyTorch's intra-op threads for the book's CPU runs: one, or the forced count (see the module docstring).

    Args:
        forced: the value of KDA_EDU_THREADS (None or "" to choose), a positive integer.
    """
    if not forced:
        return 1
    if not forced.isdigit() or int(forced) < 1:
        raise ValueError(f"KDA_EDU_THREADS must be a positive integer, got {forced!r}")
    return int(forced)


CPU_THREADS = cpu_threads(os.environ.get("KDA_EDU_THREADS"))
if not ON_GPU:
    torch.set_num_threads(CPU_THREADS)

DTYPE = choose_dtype(
    os.environ.get("KDA_EDU_DTYPE"),
    ON_GPU,
    torch.cuda.get_device_capability(DEVICE) if ON_GPU else (0, 0),
    ON_GPU and torch.cuda.is_bf16_supported(),
)


def pick(cpu, gpu):
    """Return ``gpu`` when the book runs on a GPU and ``cpu`` otherwise (a size, a list, ...)."""
    return gpu if ON_GPU else cpu


def describe() -> str:
    """One line naming the device, the library versions and the host, for the top of a chapter."""
    where = torch.cuda.get_device_name(DEVICE) if ON_GPU else f"CPU ({platform.machine()})"
    threads = torch.get_num_threads()
    dtype = str(DTYPE).removeprefix("torch.")
    return (
        f"running on {where}; torch {torch.__version__}, {threads} CPU threads; low-precision dtype {dtype}"
    )
