"""Importing kda_edu never imports Triton; kda_edu.kernels picks the interpreter itself on a CPU."""

import os
import subprocess
import sys

import pytest
import torch

CPU_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter is chosen only without a GPU"
)


def run(code: str, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment)


def test_import_kda_edu_does_not_import_triton():
    result = run("import sys, kda_edu, kda_edu.ops.kda, kda_edu.models.model; print('triton' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


@CPU_ONLY
def test_kda_edu_triton_switches_on_the_interpreter():
    result = run(
        "import os, kda_edu.kernels; print(os.environ['TRITON_INTERPRET'], kda_edu.kernels.interpreting())"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "True"]


@CPU_ONLY
def test_triton_imported_first_gets_a_clear_error():
    result = run("import triton\nimport kda_edu.kernels")
    assert result.returncode != 0
    assert "TRITON_INTERPRET=1" in result.stderr and "before" in result.stderr
