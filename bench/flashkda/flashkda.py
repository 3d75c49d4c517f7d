"""FlashKDA's forward (MIT, https://github.com/MoonshotAI/FlashKDA) called through ctypes.

`bench/flashkda/build.sh` compiles FlashKDA's CUDA sources with `bench/flashkda/shim.cu` into
`.flashkda/lib/libflashkda_shim.so`; this module loads that library and calls it on torch CUDA tensors, on the
current stream. No torch extension is built, so the library needs only nvcc to build and a CUDA driver to run.

FlashKDA computes, all in its kernels, the KDA forward of

    q, k  <- q / sqrt(|q|^2 + 1e-6), k / sqrt(|k|^2 + 1e-6)          (rounded to bf16)
    g     =  lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias))    (natural log, per channel)
    beta  =  sigmoid(beta_raw)

with chunks of 16 tokens, and keeps the state as `[B, H, V, K]`: the transpose of kda_edu's and fla's
`[B, H, K, V]`. Only K = V = 128, bf16 inputs and one head count for q, k and v.
"""

import ctypes
import json
import math
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / ".flashkda" / "lib" / "libflashkda_shim.so"
BUILD_INFO = ROOT / ".flashkda" / "lib" / "build_info.json"
DIM = 128  # the only head dimension FlashKDA is compiled for

_lib = None


def load_library(path: Path = LIBRARY) -> ctypes.CDLL:
    """The built shim, loaded once, with its functions' argument types declared."""
    global _lib
    if _lib is None:
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: build it with `bash bench/flashkda/build.sh`")
        lib = ctypes.CDLL(str(path))
        lib.fkda_workspace_bytes.restype = ctypes.c_int64
        lib.fkda_workspace_bytes.argtypes = [ctypes.c_int64] * 3
        ptr, i32, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        lib.fkda_forward.restype = i32
        lib.fkda_forward.argtypes = [ptr] * 7 + [i32, ptr, ptr, f32, i32, i32, i32, ptr, ptr, f32, ptr]
        _lib = lib
    return _lib


def build_info(path: Path = BUILD_INFO) -> dict:
    """What build.sh recorded: FlashKDA and CUTLASS commits, nvcc version, library size, build time."""
    return json.loads(path.read_text())


def _check(name, t, dtype, shape):
    if not isinstance(t, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor of shape {list(shape)} and dtype {dtype}, got {type(t)}"
        )
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name} of shape {list(shape)} must be {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} of shape {list(shape)} must be contiguous")


def check_inputs(q, k, v, g_raw, beta_raw, scale, A_log, dt_bias, lower_bound, initial_state):
    """Raise a clear error unless the arguments are what FlashKDA's kernels read; returns (B, T, H).

    Shapes, dtypes and contiguity are checked before devices, so the first three can be tried on CPU tensors.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a torch.Tensor [B, T, H, {DIM}], got {getattr(q, 'shape', type(q))}")
    B, T, H, K = q.shape
    if K != DIM:
        raise ValueError(f"FlashKDA is built for K = V = {DIM}; q is [B, T, H, K] with K = {K}")
    bf, f32 = torch.bfloat16, torch.float32
    tensors = dict(q=q, k=k, v=v, g_raw=g_raw, beta_raw=beta_raw, A_log=A_log, dt_bias=dt_bias)
    for name in ("q", "k", "v", "g_raw"):
        _check(name, tensors[name], bf, (B, T, H, DIM))
    _check("beta_raw", beta_raw, bf, (B, T, H))
    _check("A_log", A_log, f32, (H,))
    _check("dt_bias", dt_bias, f32, (H, DIM))
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or initial_state.dtype not in (bf, f32):
            raise TypeError(
                f"initial_state must be a bf16 or float32 tensor [B, H, V, K] = [{B}, {H}, 128, 128]"
            )
        _check("initial_state", initial_state, initial_state.dtype, (B, H, DIM, DIM))
        tensors["initial_state"] = initial_state
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite number, got {scale!r}")
    if (
        isinstance(lower_bound, bool)
        or not isinstance(lower_bound, (int, float))
        or not -5 <= lower_bound < 0
    ):
        raise ValueError(f"lower_bound must be a number in [-5, 0) (FlashKDA's range), got {lower_bound!r}")
    for name, t in tensors.items():
        if t.device.type != "cuda":
            raise ValueError(f"{name} must be a CUDA tensor (FlashKDA runs on sm_90a), got device {t.device}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    return B, T, H


def flashkda_fwd(
    q, k, v, g_raw, beta_raw, scale, A_log, dt_bias, lower_bound, initial_state=None, output_final_state=False
):
    """FlashKDA's KDA forward, gate, normalisation and sigmoid included (module docstring).

    Args:
        q, k, v: `[B, T, H, 128]` bf16, CUDA, contiguous (q and k not yet normalised).
        g_raw: the gate's pre-activation `[B, T, H, 128]` bf16.
        beta_raw: beta's logits `[B, T, H]` bf16.
        scale: query scale (`128 ** -0.5` for KDA's default).
        A_log: `[H]` float32; dt_bias: `[H, 128]` float32.
        lower_bound: the gate's floor, in [-5, 0).
        initial_state: optional `[B, H, V, K]` (FlashKDA's layout) bf16 or float32; zeros when None.
        output_final_state: also return the state after the last token, `[B, H, V, K]` in initial_state's
            dtype (float32 without one).

    Returns:
        `(o, final_state)`: o `[B, T, H, 128]` bf16; final_state or None.
    """
    B, T, H = check_inputs(q, k, v, g_raw, beta_raw, scale, A_log, dt_bias, lower_bound, initial_state)
    lib = load_library()
    out = torch.empty_like(q)
    beta_ht = beta_raw.reshape(B * T, H).t().contiguous()  # the kernels read beta head by head
    workspace = torch.empty(lib.fkda_workspace_bytes(B * T, H, B), dtype=torch.uint8, device=q.device)
    state_dtype = torch.float32 if initial_state is None else initial_state.dtype
    final = torch.empty(B, H, DIM, DIM, dtype=state_dtype, device=q.device) if output_final_state else None
    err = lib.fkda_forward(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        g_raw.data_ptr(),
        beta_ht.data_ptr(),
        None if initial_state is None else initial_state.data_ptr(),
        None if final is None else final.data_ptr(),
        int(state_dtype == torch.float32),
        out.data_ptr(),
        workspace.data_ptr(),
        float(scale),
        B,
        T,
        H,
        A_log.data_ptr(),
        dt_bias.data_ptr(),
        float(lower_bound),
        torch.cuda.current_stream(q.device).cuda_stream,
    )
    if err != 0:
        raise RuntimeError(f"FlashKDA's launch failed with CUDA error {err}")
    return out, final
