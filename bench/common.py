"""What the bench scripts share: the run's environment, the KDA inputs, interleaved timing, result files.

`kda_inputs` draws the inputs every KDA benchmark times, in this order from one generator seeded `seed`:

    q, k  = l2_normalize(N(0, 1))            [B, T, H, K]   in `dtype`
    v     = N(0, 1)                          [B, T, HV, V]  in `dtype`
    g     = -5 sigmoid(N(0, 1) - 2)          [B, T, HV, K]  float32, log-space decay in (-5, 0)
    beta  = sigmoid(N(0, 1))                 [B, T, HV]     in `dtype`

so that the same (B, T, H, seed) gives the same tensors in every script and the times compare.
"""

import datetime
import json
import os
import platform
import statistics
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """The commit of this checkout (`git rev-parse HEAD`), or "unknown" where git or the repository is absent."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def run_environment() -> dict:
    """What every benchmark JSON records about the run: the date, the GPU, the versions and the commit."""
    import triton

    return dict(
        date=datetime.date.today().isoformat(),
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        commit=git_commit(),
    )


def kda_inputs(
    B: int,
    T: int,
    H: int,
    K: int = 128,
    V: int | None = None,
    HV: int | None = None,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
    requires_grad: bool = False,
    generator: torch.Generator | None = None,
) -> dict:
    """The KDA inputs of the module docstring: a dict of q, k, v, g, beta (V defaults to K, HV to H).

    `generator`, when given, is drawn from instead of a new one seeded `seed` (a caller that draws more
    tensors after the inputs, such as an output gradient, keeps the generator going). With `requires_grad`
    every tensor is a leaf that requires grad.
    """
    V = K if V is None else V
    HV = H if HV is None else HV
    if HV % H:
        raise ValueError(f"HV must be a multiple of H, got HV={HV} and H={H}")
    gen = torch.Generator(device=device).manual_seed(seed) if generator is None else generator

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    x = dict(
        q=F.normalize(randn(B, T, H, K), dim=-1).to(dtype),
        k=F.normalize(randn(B, T, H, K), dim=-1).to(dtype),
        v=randn(B, T, HV, V).to(dtype),
        g=-5.0 * torch.sigmoid(randn(B, T, HV, K) - 2.0),
        beta=torch.sigmoid(randn(B, T, HV)).to(dtype),
    )
    if requires_grad:
        for t in x.values():
            t.requires_grad_()
    return x


def interleaved(fns: dict, repeats: int = 3, warmup: int = 25, rep: int = 200, graphs: bool = False) -> dict:
    """Median over `repeats` rounds of each function's `triton.testing.do_bench` median, the functions
    taking turns in every round, so that a drift of the GPU's clock or temperature hits all of them alike.

    With `graphs`, each function is captured in a CUDA graph and replayed (`do_bench_cudagraph`): the
    time is the GPU's alone, without the host's launch cost, as a server replays its decoding step."""
    from triton.testing import do_bench, do_bench_cudagraph

    def bench(fn):
        if graphs:
            return do_bench_cudagraph(fn, rep=rep, return_mode="median")
        return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")

    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(bench(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def write_result(path, data, indent: int = 1) -> None:
    """Write `data` as JSON to `path` atomically: a temporary file beside it, then `os.replace`, so that a
    run cut short never leaves a half-written file (the parent folders are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent) + "\n")
    os.replace(tmp, path)
