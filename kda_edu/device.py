"""Where the book's code runs, and how large its examples are.

Every notebook asks this module, and only this module, for its device and problem sizes, so
the same notebook runs in a couple of minutes on a laptop CPU and at realistic sizes on a GPU.
Set ``KDA_EDU_DEVICE=cpu`` to force the CPU on a GPU machine.
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


def pick(cpu, gpu):
    """Return ``gpu`` when the book runs on a GPU and ``cpu`` otherwise (a size, a list, ...)."""
    return gpu if ON_GPU else cpu


def describe() -> str:
    """One line naming the device, the library versions and the host, for the top of a chapter."""
    where = torch.cuda.get_device_name(DEVICE) if ON_GPU else f"CPU ({platform.machine()})"
    threads = torch.get_num_threads()
    return f"running on {where}; torch {torch.__version__}, {threads} CPU threads"
