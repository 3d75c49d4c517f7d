"""What softmax attention costs, measured on the machine that runs the book (chapter 1).

- `time_call(fn, *args)`: the fastest of several wall-clock runs of `fn(*args)`, in seconds (synchronising the
  GPU).
- `peak_memory(fn, *args)`: the peak bytes of the tensors `fn(*args)` allocates while it runs. On a GPU this is
  the CUDA allocator's own peak; on the CPU, `LiveTensorBytes` counts every tensor an operation creates and
  forgets it when it is freed.
- `fused_attention(q, k, v)`: the same attention through PyTorch's fused kernel, which never stores the scores.
- `fit_exponent(x, y)`: the slope p of `log y = p log x + c`, so that `y ~ x^p`.
- `decode(q, k, v)`: token-by-token decoding with `softmax_attention_step`, returning the outputs and the
  cache's bytes after every token.
- `CacheConfig` and `LLAMA3_8B`: the attention shapes of a real model and the bytes of its KV cache and the
  FLOPs of its attention prefill.
"""

import math
import time
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kda_edu.ops.attention import softmax_attention_step


def random_qkv(B: int, T: int, H: int, K: int, *, device="cpu", dtype=torch.float32, seed: int = 0):
    """Gaussian q, k, v of shape `[B, T, H, K]` (V = K, HV = H), reproducible from `seed`."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.randn(B, T, H, K, generator=generator, device=device, dtype=dtype) for _ in range(3))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention through PyTorch's fused kernel, `scaled_dot_product_attention`, in the book's layout.

    q, k, v `[B, T, H, K]` (one value head per head); returns `[B, T, H, K]`. On a GPU, and on a CPU since PyTorch 2.2,
    it picks a FlashAttention-style kernel that walks over blocks of keys and never stores the `[T, T]` scores.
    """
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    )
    return o.transpose(1, 2)


def time_call(fn, *args, repeats: int = 3, budget_s: float = 0.2, max_repeats: int = 50) -> float:
    """Seconds taken by `fn(*args)`: one warm-up run, then the fastest of the timed runs.

    Runs at least `repeats` times and, for fast calls, keeps going until `budget_s` seconds have been spent (at
    most `max_repeats` runs). The minimum, not the mean: on a shared machine other work only ever adds time, so
    the fastest run is the best estimate of the call's own cost.
    """
    device = args[0].device
    fn(*args)
    best, spent, runs = math.inf, 0.0, 0
    while runs < repeats or (spent < budget_s and runs < max_repeats):
        _sync(device)
        start = time.perf_counter()
        fn(*args)
        _sync(device)
        elapsed = time.perf_counter() - start
        best, spent, runs = min(best, elapsed), spent + elapsed, runs + 1
    return best


class LiveTensorBytes(TorchDispatchMode):
    """Inside `with LiveTensorBytes() as m:`, count the bytes of every tensor the operations create.

    Each operation's outputs are intercepted; a new storage (not a view of an existing one) adds its bytes to
    `m.live` and, through a finalizer, subtracts them when it is freed. `m.peak` is the largest `m.live` seen:
    the extra memory the block needed at its worst moment.
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self._tracked.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)
        }
        for t in tree_flatten(out)[0]:
            if not torch.is_tensor(t):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if key in inputs or key in self._tracked:  # a view of something already counted or not ours
                continue
            self._tracked.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, nbytes)
        return out


class OperationCount(TorchDispatchMode):
    """Inside `with OperationCount() as c:`, count the PyTorch (ATen) operations dispatched, in `c.count`.

    Each is one call into PyTorch with a fixed cost that does not depend on its size (a few microseconds on a
    CPU, a kernel launch on a GPU); views and allocations count too.
    """

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def peak_memory(fn, *args) -> int:
    """Peak bytes allocated by `fn(*args)` beyond what was allocated before the call.

    CUDA: `torch.cuda.max_memory_allocated` around the call. CPU: `LiveTensorBytes`.
    """
    device = args[0].device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn(*args)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with LiveTensorBytes() as counter:
        fn(*args)
    return counter.peak


def fit_exponent(x, y) -> float:
    """Least-squares slope p of `log y` against `log x`: the exponent of `y ~ c x^p`."""
    lx = torch.tensor(x, dtype=torch.float64).log()
    ly = torch.tensor(y, dtype=torch.float64).log()
    lx, ly = lx - lx.mean(), ly - ly.mean()
    return float((lx * ly).sum() / (lx * lx).sum())


def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Decode token by token with a KV cache: `softmax_attention_step` for t = 1, ..., T.

    q, k `[B, T, H, K]`, v `[B, T, HV, V]`. Returns the outputs `[B, T, HV, V]` and, for every t, the bytes
    held by the cache's two tensors after token t.
    """
    cache, outputs, cache_bytes = None, [], []
    for t in range(q.shape[1]):
        o, cache = softmax_attention_step(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], cache)
        outputs.append(o)
        cache_bytes.append(sum(x.nelement() * x.element_size() for x in cache))
    return torch.cat(outputs, dim=1), cache_bytes


@dataclass(frozen=True)
class CacheConfig:
    """The attention shapes of a model that decide its KV cache and its attention FLOPs."""

    name: str
    layers: int
    q_heads: int
    kv_heads: int  # grouped-query attention: fewer key/value heads than query heads
    head_dim: int
    bytes_per_value: int  # 2 for bf16

    def kv_cache_bytes(self, tokens: int, batch: int = 1) -> int:
        """One key and one value vector per layer, KV head and token: `2 L H_kv d b` bytes per token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_value * tokens * batch

    def attention_prefill_flops(self, tokens: int) -> int:
        """FLOPs of the causal `Q K^T` and `P V` products of a prefill: `2 T^2 d` per query head and layer.

        Each product has `T^2` entries of `d` multiply-adds (two FLOPs each): `2 T^2 d`, so `4 T^2 d` for both;
        the causal mask keeps half of the entries.
        """
        return 2 * tokens**2 * self.head_dim * self.q_heads * self.layers


LLAMA3_8B = CacheConfig("Llama-3-8B", layers=32, q_heads=32, kv_heads=8, head_dim=128, bytes_per_value=2)
