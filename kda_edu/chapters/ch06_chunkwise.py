"""Chapter 6's figure: how large the exponents of each way of splitting the decays get
(`kda_edu.ops.chunkwise.largest_exponent`)."""

import math

import torch

from kda_edu.ops.chunkwise import largest_exponent


def plot_exponent_budget(lower_bound: float = -5.0, sub_chunk: int = 16):
    """Plot the largest exponent each way of splitting the decays evaluates, against the chunk size (8 to 256).

    Gates sit at `lower_bound` (the worst case). Three schemes: the naive split at the chunk start, the
    split anchored every `sub_chunk` rows, and differences taken before `exp` (never above 0). The
    dashed lines are where `exp` overflows float32 and float16.
    """
    from kda_edu.plotting import figure, finish

    chunk_sizes = [8, 16, 32, 64, 128, 256]
    naive, anchored = [], []
    for C in chunk_sizes:
        gc = torch.full((C, 1), float(lower_bound), dtype=torch.float64).cumsum(dim=0)
        naive.append(largest_exponent(gc, C))
        anchored.append(largest_exponent(gc, sub_chunk))
    fig, (ax,) = figure(
        f"Anchoring every {sub_chunk} rows caps the exponent; the chunk-start split grows with C",
        [("chunk size C (steps)", "largest exponent x passed to exp(x)")],
    )
    ax.plot(chunk_sizes, naive, "o-", color="C3", label="split at the chunk start (naive)")
    ax.plot(chunk_sizes, anchored, "s-", color="C0", label=f"anchored every {sub_chunk} rows")
    ax.plot(chunk_sizes, [0] * len(chunk_sizes), "^-", color="C2", label="differences first (kda_chunked)")
    for dtype, color in ((torch.float32, "k"), (torch.float16, "gray")):
        ax.axhline(
            math.log(torch.finfo(dtype).max), ls="--", color=color, lw=1, label=f"exp overflows {dtype}"
        )
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
    finish(fig)
