"""Importing kda_edu never imports Triton; kda_edu.kernels runs its kernels through the interpreter on a CPU
by itself, whether or not Triton was imported first, without changing how other code's kernels are built."""

import os
import subprocess
import sys

import pytest
import torch

CPU_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter is chosen only without a GPU"
)


def run(code: str, tmp_path, **env) -> subprocess.CompletedProcess:
    """`code` in a fresh Python, from a file (Triton reads a kernel's source from its file)."""
    script = tmp_path / "script.py"
    script.write_text(code)
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=environment)


def test_import_kda_edu_does_not_import_triton(tmp_path):
    result = run(
        "import sys, kda_edu, kda_edu.ops.kda, kda_edu.models.model, kda_edu.layers.kda_layer\n"
        "print('triton' in sys.modules)",
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


# Triton first (as fla or torch.compile would import it), then kda_edu's kernels on CPU tensors: both kernels
# agree with the float64 recurrence, the environment is left as it was, and a kernel someone else defines
# afterwards with a plain @triton.jit is still a compiled one (kda_edu chose the interpreter for its own only).
TRITON_FIRST = """
import os, triton, torch
import kda_edu.kernels as kk
from kda_edu.ops.kda import kda_recurrent
torch.manual_seed(0)
B, T, H, K, V = 1, 70, 2, 16, 16
q = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
v, beta = torch.randn(B, T, H, V), torch.rand(B, T, H)
g = -torch.rand(B, T, H, K)
want = kda_recurrent(*(x.double() for x in (q, k, v, g, beta)))[0]
for name, fn in (("chunk", kk.chunk_kda), ("recurrent", kk.fused_recurrent_kda)):
    o = fn(q, k, v, g, beta)[0]
    print(name, float((o.double() - want).norm() / want.norm()))
print("env", os.environ.get("TRITON_INTERPRET"))
@triton.jit
def plain(x):
    pass
print("plain", type(plain).__name__, kk.interpreting())
"""


@CPU_ONLY
def test_kernels_run_on_a_cpu_with_triton_imported_first(tmp_path):
    result = run(TRITON_FIRST, tmp_path)
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.strip().splitlines())
    # float32 kernels against the float64 loop at T = 70: the unit tests' float32 bound
    assert float(lines["chunk"]) < 1e-5 and float(lines["recurrent"]) < 1e-5, lines
    assert (
        lines["env"] == "None"
    )  # kda_edu switched the interpreter on only while its kernels were built and ran
    assert lines["plain"] == "JITFunction True"


PLAIN_KERNEL = """
import torch, triton, triton.language as tl
from kda_edu.kernels._backend import launchable
@triton.jit
def double(x, y, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + i, 2 * tl.load(x + i, mask=i < N), mask=i < N)
x = torch.arange(40, dtype=torch.float32)
y = torch.zeros(40)
launchable(double)[(3,)](x, y, 40, BLOCK=16)
print(torch.equal(y, 2 * x))
"""


@CPU_ONLY
def test_a_plain_triton_kernel_is_rebuilt_for_the_interpreter(tmp_path):
    """What the exercise checkers do with a reader's kernel: defined with a plain @triton.jit, launched on a CPU."""
    result = run(PLAIN_KERNEL, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"  # doubling is exact in float32
