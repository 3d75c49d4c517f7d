"""The device module: where the book runs, and which dtype its GPU runs use."""

import os
import subprocess
import sys

import pytest
import torch

from kda_edu import device


@pytest.mark.parametrize(
    "on_gpu, capability, bf16_ok, expected",
    [
        (False, (0, 0), False, torch.float32),  # a CPU
        (True, (9, 0), True, torch.bfloat16),  # H100 / H200
        (True, (8, 0), True, torch.bfloat16),  # A100
        (True, (7, 5), False, torch.float16),  # T4 (Colab)
        (True, (7, 5), True, torch.float16),  # torch may emulate bf16 there; no tensor cores for it
    ],
)
def test_choose_dtype_follows_the_hardware(on_gpu, capability, bf16_ok, expected):
    assert device.choose_dtype(None, on_gpu, capability, bf16_ok) == expected
    assert device.choose_dtype("", on_gpu, capability, bf16_ok) == expected


def test_choose_dtype_can_be_forced():
    assert device.choose_dtype("float16", True, (9, 0), True) == torch.float16
    assert device.choose_dtype("float32", True, (9, 0), True) == torch.float32
    assert device.choose_dtype("float32", False, (0, 0), False) == torch.float32


@pytest.mark.parametrize(
    "forced, on_gpu, capability, match",
    [
        ("half", True, (9, 0), "must be one of"),
        ("float16", False, (0, 0), "needs a CUDA GPU"),
        ("bfloat16", True, (7, 5), "no bfloat16 tensor cores"),
    ],
)
def test_choose_dtype_refuses_what_cannot_run(forced, on_gpu, capability, match):
    with pytest.raises(ValueError, match=match):
        device.choose_dtype(forced, on_gpu, capability, True)


def test_this_machine():
    assert device.DEVICE.type == ("cuda" if device.ON_GPU else "cpu")
    assert device.pick(cpu=1, gpu=2) == (2 if device.ON_GPU else 1)
    if not device.ON_GPU:
        assert device.DTYPE == torch.float32
    assert str(device.DTYPE).removeprefix("torch.") in device.describe()


def _threads_after_import(env: dict) -> str:
    """torch.get_num_threads() in a fresh Python that set two threads, then imported kda_edu.device."""
    code = "import torch; torch.set_num_threads(2); import kda_edu.device; print(torch.get_num_threads())"
    run = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "KDA_EDU_DEVICE": "cpu", **env},
        capture_output=True,
        text=True,
        check=False,
    )
    return run.stdout.strip() if run.returncode == 0 else run.stderr


@pytest.mark.slow
def test_cpu_runs_use_one_thread_unless_asked():
    # Two OpenMP threads on a machine whose cores another program shares spin and wait for each other at
    # every small operation (the module docstring): on a CPU the book runs on one thread.
    assert _threads_after_import({"KDA_EDU_THREADS": ""}) == "1"
    assert _threads_after_import({"KDA_EDU_THREADS": "2"}) == "2"
    assert "KDA_EDU_THREADS must be a positive integer, got '0'" in _threads_after_import(
        {"KDA_EDU_THREADS": "0"}
    )


@pytest.mark.parametrize("forced, expected", [(None, 1), ("", 1), ("1", 1), ("3", 3)])
def test_cpu_threads(forced, expected):
    assert device.cpu_threads(forced) == expected


@pytest.mark.parametrize("forced", ["0", "-1", "two", "1.5"])
def test_cpu_threads_refuses_what_is_not_a_count(forced):
    with pytest.raises(ValueError, match="KDA_EDU_THREADS must be a positive integer"):
        device.cpu_threads(forced)
