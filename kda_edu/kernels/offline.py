"""Compile kda_edu's Triton kernels for a GPU this machine does not have: no GPU, no driver, nothing launched.

A kernel that cannot be built for a reader's GPU (a bfloat16 product on a T4, an instruction only Hopper
has) fails only when it is first launched there. This module builds every kernel the library launches, for
any compute capability, on any machine, with Triton's own compiler and the `ptxas` that Triton ships:

- `recorded_launches(capability)`: a context in which the launchers run on "meta" tensors (shapes and dtypes,
  no data) as they would on a GPU of that capability and record each launch instead of running it;
- `library_launches(capability)`: the launches of `chunk_kda`'s forward and backward, of `fused_recurrent_kda`,
  of the absorbed MLA decode and of the layer's parts (short convolution, norms, gates), forward and backward,
  for every input dtype the library accepts on that GPU (`dtypes_for`) (the
  chapters list their own kernels' launches the same way:
  `kda_edu.chapters.ch08_chunk_kernel.chapter_launches`);
- `build(job)`: all of them compiled, one result (the error, if any) per distinct kernel;
- `compile_launch(launch, capability)`: the launch compiled to a cubin, through Triton's binder, so with the
  signature, constants and specialisations (16-byte aligned pointers and sizes) a real launch would get;
- `compile_source(kernel, signature, constexprs, options, capability, attrs)`: one kernel from an explicit
  signature (chapter 8 counts instructions in such builds);
- `in_fresh_python(module, function, jobs)`: any of these in a fresh Python. Where there is no GPU, a Python
  that has imported `kda_edu.kernels` has built the kernels for Triton's interpreter, which cannot be
  compiled; the fresh one builds them as on a GPU machine (`kda_edu.backend.INTERPRET = False` before
  `kda_edu.kernels` is imported).
"""

import contextlib
import importlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from unittest import mock

import torch

# Compute capabilities the library supports, with a GPU of each: T4 (Colab), A100, H100 / H200.
CAPABILITIES = ((7, 5), (8, 0), (9, 0))
MULTIPROCESSORS = {(7, 5): 40, (8, 0): 108, (9, 0): 132}
SHARED_MEMORY_PER_BLOCK = {(7, 5): 64 * 1024, (8, 0): 163 * 1024, (9, 0): 227 * 1024}  # the opt-in maximum


def dtypes_for(capability: tuple[int, int]) -> list[torch.dtype]:
    """The input dtypes the kernels accept on a GPU of `capability`: float32 and float16 everywhere, bfloat16
    from 8.0 on (the kernels' device check refuses it below; `kda_edu.device` picks float16 there)."""
    return [torch.float32, torch.float16, *([torch.bfloat16] if capability >= (8, 0) else [])]


def _target(capability: tuple[int, int]):
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 10 * capability[0] + capability[1], 32)


def compile_source(kernel, signature: dict, constexprs: dict, options: dict, capability, attrs=None):
    """`kernel` (a compiled-mode `triton.jit` function) built for `capability` from an explicit signature
    (name: Triton type, "constexpr" for the names in `constexprs`); returns Triton's compiled kernel
    (`.asm["ptx"]`, `.asm["cubin"]`, `.metadata`)."""
    import triton
    from triton.compiler import ASTSource

    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=_target(capability), options=options)


def _no_check(*args, **kwargs) -> None:
    """Stands in for the kernels' device check, which refuses "meta" tensors."""


@contextlib.contextmanager
def recorded_launches(capability: tuple[int, int]):
    """Inside, `kernel[grid](...)` records `(kernel, args, kwargs)` in the yielded list instead of launching,
    and `torch.cuda` answers as a GPU of `capability` would (its multiprocessor count, which the launchers
    size their grids by). Call the launchers on "meta" tensors; the kernels must be compiled-mode ones."""
    from triton.runtime.jit import JITFunction

    from kda_edu.kernels._backend import INTERPRET, check_device

    if INTERPRET:
        raise RuntimeError("kda_edu's kernels were built for the interpreter here: use in_fresh_python")
    launches = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))
        return types.SimpleNamespace(n_regs=0, n_spills=0, metadata=types.SimpleNamespace(shared=0))

    props = types.SimpleNamespace(
        multi_processor_count=MULTIPROCESSORS[tuple(capability)],
        shared_memory_per_block_optin=SHARED_MEMORY_PER_BLOCK[tuple(capability)],
        major=capability[0],
    )
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(JITFunction, "run", record))
        stack.enter_context(mock.patch.object(torch.cuda, "get_device_properties", lambda *a, **k: props))
        stack.enter_context(
            mock.patch.object(torch.cuda, "get_device_capability", lambda *a, **k: capability)
        )
        stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: 0))
        for name, module in list(sys.modules.items()):
            if name.startswith("kda_edu.") and getattr(module, "check_device", None) is check_device:
                stack.enter_context(mock.patch.object(module, "check_device", _no_check))
        yield launches


def meta_kda_inputs(dtype, B=1, T=256, H=2, HV=2, K=128, V=128, N=None):
    meta = dict(device="meta")
    q, k = (torch.empty(B, T, H, K, dtype=dtype, **meta) for _ in range(2))
    v = torch.empty(B, T, HV, V, dtype=dtype, **meta)
    g = torch.empty(B, T, HV, K, dtype=torch.float32, **meta)
    beta = torch.empty(B, T, HV, dtype=dtype, **meta)
    state = torch.empty(N or B, HV, K, V, dtype=torch.float32, **meta)
    return q, k, v, g, beta, state


def library_launches(capability: tuple[int, int]) -> list[tuple]:
    """Every launch of the library's launchers for the dtypes of `capability` (see the module docstring),
    as `(kernel, args, kwargs)`; call it where the kernels are compiled-mode ones."""
    from kda_edu.kernels.chunk_bwd import chunk_kda_bwd
    from kda_edu.kernels.chunk_fwd import chunk_kda_fwd
    from kda_edu.kernels.fused_recurrent import default_config, fused_recurrent_fwd
    from kda_edu.kernels.mla_decode import mla_absorbed_attention

    with recorded_launches(capability) as launches:
        for dtype in dtypes_for(capability):
            # Every option on (initial and final states, cu_seqlens), which switches on the most code; the
            # constexpr switches only add or drop loads and stores around the same products.
            cu_seqlens = torch.tensor([0, 100, 256], dtype=torch.int32)  # read by the launchers: on the CPU
            q, k, v, g, beta, state = meta_kda_inputs(dtype, N=2)
            scale = q.shape[-1] ** -0.5
            flags = torch.empty(
                1, dtype=torch.int32, device="meta"
            )  # the value check chunk_kda runs on a GPU
            chunk_kda_fwd(q, k, v, g, beta, scale, state, True, cu_seqlens=cu_seqlens, flags=flags)
            chunk_kda_bwd(q, k, v, g, beta, scale, state, torch.empty_like(v), state, cu_seqlens=cu_seqlens)
            bv, warps = default_config(q.shape[-1], v.shape[-1], 2 * v.shape[2], torch.device("cuda"))
            fused_recurrent_fwd(q, k, v, g, beta, scale, state, state, cu_seqlens, bv, warps)
            slots = torch.empty(2, dtype=torch.int32, device="meta")  # decoding: a state pool, one token each
            fused_recurrent_fwd(q[:, :2], k[:, :2], v[:, :2], g[:, :2], beta[:, :2], scale, state, state, None, bv,
                                warps, state_indices=slots)  # fmt: skip
            mla_q = torch.empty(2, 1, 4, 576, dtype=dtype, device="meta")  # absorbed MLA: r = 512, d_r = 64
            cache = torch.empty(
                4, 4096, 576, dtype=dtype, device="meta"
            )  # long enough to split: the merge too
            mla_absorbed_attention(mla_q, cache, slots, slots, 0.1, 512)
            append_q = torch.empty(2, 3, 4, 576, dtype=dtype, device="meta")  # 3 new tokens: the append path
            mla_absorbed_attention(append_q, cache, slots, slots, 0.1, 512)
            layer_part_launches(dtype)
    return launches


def layer_part_launches(dtype) -> None:
    """The layer's parts around the recurrence, forward and backward, in `dtype` (inside `recorded_launches`):
    the short convolution with a window and with packed sequences, the q/k L2 norm on a slice of the
    convolution's output, the gated RMSNorm and both decay gates."""
    from kda_edu.kernels.layer_gates import kda_gates_bwd, kda_gates_fwd
    from kda_edu.kernels.norms import gated_rms_norm_bwd, gated_rms_norm_fwd, l2_norm_bwd, l2_norm_fwd
    from kda_edu.kernels.short_conv import short_conv_bwd, short_conv_fwd

    meta = dict(device="meta")
    B, T, H, K, W = 1, 256, 2, 128, 4
    x = torch.empty(B, T, 3 * H * K, dtype=dtype, **meta)
    weight = torch.empty(3 * H * K, W, dtype=dtype, **meta)
    window = torch.empty(B, W - 1, 3 * H * K, dtype=dtype, **meta)
    pos = torch.empty(T, dtype=torch.int32, **meta)
    for win, p in ((window, None), (None, pos)):
        short_conv_fwd(x, weight, win, p)
        short_conv_bwd(x, weight, win, p, torch.empty_like(x))
    q = x[..., : H * K].reshape(B, T, H, K)  # strided rows, as the layer's q
    y, rstd = l2_norm_fwd(q, 1e-6)
    l2_norm_bwd(y, rstd, torch.empty_like(y))
    rows = torch.empty(B * T * H, K, dtype=dtype, **meta)
    weight_d = torch.empty(K, dtype=dtype, **meta)
    gated_rms_norm_fwd(rows, rows, weight_d, 1e-5)
    gated_rms_norm_bwd(rows, rows, weight_d, rows, 1e-5)
    f = torch.empty(B, T, H, K, dtype=dtype, **meta)
    b = torch.empty(B, T, H, dtype=dtype, **meta)
    A_log, dt_bias = torch.empty(H, **meta), torch.empty(H, K, **meta)  # float32, as the layer keeps them
    g = torch.empty(B, T, H, K, **meta)
    for lower_bound in (None, -5.0):
        kda_gates_fwd(f, b, A_log, dt_bias, lower_bound)
        kda_gates_bwd(f, b, A_log, dt_bias, lower_bound, g, b)


def _specialised(kernel, args, kwargs, capability):
    """What `kernel[grid](*args, **kwargs)` compiles on a GPU of `capability`: Triton's binder's signature,
    constants, attributes and options."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(_target(capability))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    return kernel._pack_args(backend, kwargs, bound, specialization, options)


def compile_launch(launch: tuple, capability: tuple[int, int]):
    """A recorded launch `(kernel, args, kwargs)` compiled for `capability` (to PTX, then by ptxas to a cubin)."""
    import triton
    from triton.compiler import ASTSource

    kernel, args, kwargs = launch
    options, signature, constexprs, attrs = _specialised(kernel, args, kwargs, capability)
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=_target(capability), options=options.__dict__)


def launch_key(launch: tuple, capability: tuple[int, int]) -> str:
    """A name for what a launch compiles: the kernel, its specialised signature, constants and options."""
    kernel, args, kwargs = launch
    options, signature, constexprs, attrs = _specialised(kernel, args, kwargs, capability)
    types_ = ",".join(t for t in signature.values() if t != "constexpr")
    consts = ",".join(f"{kernel.arg_names[p[0]]}={v}" for p, v in constexprs.items())
    return f"{kernel.fn.__name__}({types_}; {consts}; warps={options.num_warps}, stages={options.num_stages})"


def in_fresh_python(module: str, function: str, jobs: list) -> list:
    """`function` of `module` applied to each job (JSON values) in a fresh Python in which kda_edu builds its
    kernels for a GPU; returns the results (JSON values). Raises RuntimeError with the end of that Python's
    error output when it fails."""
    root = str(Path(__file__).resolve().parents[2])
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    code = (
        "import json, sys; import kda_edu.backend as b; b.INTERPRET = False\n"
        f"from {module} import {function}\n"
        f"print(json.dumps([{function}(job) for job in json.loads(sys.argv[1])]))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, json.dumps(jobs)], env=env, capture_output=True, text=True, check=False
    )
    if run.returncode != 0:
        raise RuntimeError(f"{module}.{function} failed in a fresh Python:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def build(job: dict) -> list[dict]:
    """Compile every distinct launch of `job["sets"]` (a list of "module:function" names of functions like
    `library_launches`, called with the capability) for `job["capability"]` (a list, e.g. [7, 5]) to a cubin;
    one `{"kernel":
    launch_key, "error": None or the compiler's message}` per distinct launch. A job of `in_fresh_python`.
    `job["extra"]`, "module:function" (optional): that function, called with the capability inside
    `recorded_launches`, launches more kernels to build (a test's planted kernel). `job["shard"]` = [i, n]
    (optional): only the i-th of every n distinct launches, so that n processes share the work."""
    capability = tuple(job["capability"])
    launches = []
    for name in job.get("sets", ()):
        module, function = name.split(":")
        launches += getattr(importlib.import_module(module), function)(capability)
    if job.get("extra"):
        module, function = job["extra"].split(":")
        with recorded_launches(capability) as extra:
            getattr(importlib.import_module(module), function)(capability)
        launches += extra
    distinct = {launch_key(launch, capability): launch for launch in launches}
    shard, shards = job.get("shard", (0, 1))
    results = []
    for key, launch in list(distinct.items())[shard::shards]:
        try:
            compiled = compile_launch(launch, capability)
            error = None if compiled.asm.get("cubin") else "no cubin"
        except Exception as failure:  # noqa: BLE001 - reported, with the kernel's name, by the caller
            error = f"{type(failure).__name__}: {str(failure)[-1500:]}"
        results.append({"kernel": key, "error": error})
    return results
