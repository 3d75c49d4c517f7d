"""Serving a hybrid model, measured: caches after real prefills, appends, and decoding speed (chapter 13).

- `forward_in_pieces(module, x, sizes)`: feed a sequence through a layer or model in pieces (a prefill, then
  appends and single decoded tokens) through one cache; the result must equal one forward pass.
- `measure_cache_bytes(config, lengths)`: build a `HybridLM`, prefill real tokens up to each length and read
  the live cache's bytes (`HybridCache.nbytes_by_kind()`).
- `synthetic_cache(model, batch, context_len)`: a cache of the shapes `context_len` tokens would leave, filled
  with random numbers. Decoding time depends on the cache's shapes, not its contents, so timing runs use it
  instead of a long (and, for full attention, quadratic) prefill.
- `decode_step_seconds(model, cache)` and `decode_throughput(...)`: tokens per second of one decoding step
  over a batch, at several context lengths.
- `mla_append_seconds(layer, history, appended, mode)`: the time of one MLA append in MHA or MQA mode.
- `max_batch(config, context_len, budget_bytes)`: how many sequences' caches fit in a memory budget.
- `largest_batch_rows(result, pattern)` picks, per context length, the row with the largest batch.
"""

import math
import time

import torch

from kda_edu.costs import cache_bytes
from kda_edu.kda_layer import KDACache
from kda_edu.mla import MLACache
from kda_edu.model import HybridCache, HybridConfig, HybridLM

# Where bench/bench_decode_throughput.py writes its GPU results (absent until it has been run on a GPU).
GPU_RESULTS = "h200_decode_throughput.json"  # under bench/results, read with kda_edu.book.bench_result


def forward_in_pieces(module, x: torch.Tensor, sizes: list[int], **kwargs) -> torch.Tensor:
    """Run `module` over x in consecutive pieces of the given sizes through one fresh cache.

    Args:
        module: a `KDALayer`, an `MLA` or a `HybridLM` (anything with `new_cache()` and `forward(x, cache=)`).
        x: `[B, T, D]` hidden states, or `[B, T]` token ids for a model.
        sizes: piece lengths summing to T, e.g. `[100, 1, 1, 30, 1]`: a prefill, two decoded tokens, an append
            of 30 tokens, one more decoded token.
        kwargs: passed to every call (for example `mode="mqa"` for an MLA layer).

    Returns:
        The outputs of the pieces concatenated along time, the same shape as `module(x)`.
    """
    if sum(sizes) != x.shape[1] or min(sizes) < 1:
        raise ValueError(f"sizes must be >= 1 and sum to T = {x.shape[1]}, got {sizes}")
    cache = module.new_cache()
    outputs, start = [], 0
    with torch.no_grad():
        for n in sizes:
            outputs.append(module(x[:, start : start + n], cache=cache, **kwargs))
            start += n
    return torch.cat(outputs, dim=1)


def measure_cache_bytes(
    config: HybridConfig, lengths: list[int], batch: int = 1, piece: int = 256, seed: int = 0
) -> list[dict]:
    """Prefill random tokens into a fresh `HybridLM`'s cache and read its bytes at each length.

    The tokens arrive in pieces of at most `piece` (appends through the cache, which is how a long prompt is
    prefilled in chunks); after reaching each length the live cache is asked for its bytes.

    Returns:
        One dict per length: `{"context_len", "kda", "mla", "total"}` in bytes (whole batch).
    """
    torch.manual_seed(seed)
    model = HybridLM(config).eval()
    cache = model.new_cache()
    generator = torch.Generator().manual_seed(seed)
    rows, seen = [], 0
    with torch.no_grad():
        for length in sorted(lengths):
            while seen < length:
                n = min(piece, length - seen)
                model(torch.randint(0, config.vocab_size, (batch, n), generator=generator), cache=cache)
                seen += n
            by_kind = cache.nbytes_by_kind()
            rows.append({"context_len": length, **by_kind, "total": by_kind["kda"] + by_kind["mla"]})
    return rows


def synthetic_cache(model: HybridLM, batch: int, context_len: int, seed: int = 0) -> HybridCache:
    """A cache with the shapes and dtypes a real prefill of `context_len` tokens leaves, random contents.

    KDA layers get a random convolution window and a small random state (float32, or float64 for a float64
    model); MLA layers get `context_len` random latents. Tested to have the same bytes as a real prefill.
    """
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    generator = torch.Generator(device=device).manual_seed(seed)
    layers = []
    for block in model.blocks:
        cache = block.mixer.new_cache()
        if isinstance(cache, KDACache):
            cfg = block.mixer.config
            C = 2 * cfg.num_heads * cfg.head_dim + cfg.hv * cfg.v_dim
            cache.conv_window = torch.randn(
                batch, cfg.conv_size - 1, C, generator=generator, device=device, dtype=dtype
            )
            cache.state = 0.01 * torch.randn(
                batch, cfg.hv, cfg.head_dim, cfg.v_dim, generator=generator, device=device, dtype=state_dtype
            )
            cache.seq_len = context_len
        else:
            r = block.mixer.config.kv_rank
            cache.latent = torch.randn(batch, context_len, r, generator=generator, device=device, dtype=dtype)
        layers.append(cache)
    return HybridCache(layers)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _truncate(cache: HybridCache, lengths: list[int | None]) -> None:
    """Cut the MLA latents back to the given lengths, so repeated timing runs see the same context."""
    for layer, n in zip(cache.layers, lengths, strict=True):
        if isinstance(layer, MLACache) and n is not None:
            layer.latent = layer.latent[:, :n]


def decode_step_seconds(model: HybridLM, cache: HybridCache, steps: int = 5, warmup: int = 2) -> float:
    """Seconds of one decoding step (one new token per sequence) from `cache`: the fastest of `steps` runs.

    After every run the MLA caches are cut back to their length before the run (the KDA caches have a fixed
    size), so every run decodes at the same context length. The minimum over runs, as in chapter 1: on a
    shared machine other work only adds time.
    """
    param = next(model.parameters())
    batch = next(c.state.shape[0] if isinstance(c, KDACache) else c.latent.shape[0] for c in cache.layers)
    token = torch.zeros(batch, 1, dtype=torch.long, device=param.device)
    lengths = [c.seq_len if isinstance(c, MLACache) else None for c in cache.layers]
    best = math.inf
    with torch.no_grad():
        for i in range(warmup + steps):
            _sync(param.device)
            start = time.perf_counter()
            model._logits(token, cache)
            _sync(param.device)
            if i >= warmup:
                best = min(best, time.perf_counter() - start)
            _truncate(cache, lengths)
    return best


def decode_throughput(
    config: HybridConfig,
    batch: int,
    context_lens: list[int],
    steps: int = 5,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> list[dict]:
    """Decoding speed of a randomly initialised `HybridLM` at several context lengths.

    Returns:
        One dict per context length: `{"context_len", "batch", "step_s", "tokens_per_s", "cache_bytes"}`;
        tokens_per_s = batch / step_s (one token per sequence per step), cache_bytes the whole batch's cache,
        which one step reads in full (MLA latents) or reads and rewrites (KDA state and window).
    """
    torch.manual_seed(seed)
    model = HybridLM(config).to(device=device, dtype=dtype).eval()
    rows = []
    for S in context_lens:
        cache = synthetic_cache(model, batch, S, seed=seed)
        step = decode_step_seconds(model, cache, steps=steps)
        rows.append(
            {
                "context_len": S,
                "batch": batch,
                "step_s": step,
                "tokens_per_s": batch / step,
                "cache_bytes": cache.nbytes(),
            }
        )
        del cache
    return rows


def mla_append_seconds(
    layer, history: int, appended: int, mode: str, batch: int = 1, repeats: int = 3
) -> float:
    """Seconds for one MLA layer to append `appended` tokens to a cache of `history` latents, in `mode`.

    The cache is reset to the same `history` random latents before every run; the fastest run counts.
    """
    param = next(layer.parameters())
    generator = torch.Generator(device=param.device).manual_seed(0)
    base = torch.randn(
        batch, history, layer.config.kv_rank, generator=generator, device=param.device, dtype=param.dtype
    )
    x = torch.randn(
        batch, appended, layer.d_model, generator=generator, device=param.device, dtype=param.dtype
    )
    cache = layer.new_cache()
    best = math.inf
    with torch.no_grad():
        for i in range(repeats + 1):
            cache.latent = base
            _sync(param.device)
            start = time.perf_counter()
            layer(x, cache=cache, mode=mode)
            _sync(param.device)
            if i > 0:
                best = min(best, time.perf_counter() - start)
    return best


def max_batch(config: HybridConfig, context_len: int, budget_bytes: float, dtype_bytes: int = 2) -> int:
    """How many sequences of `context_len` tokens fit their caches in `budget_bytes` (weights not counted)."""
    per_sequence = sum(cache_bytes(config, context_len, batch_size=1, dtype_bytes=dtype_bytes).values())
    return int(budget_bytes // per_sequence)


def largest_batch_rows(result: dict, pattern: str) -> list[dict]:
    """From a `bench_decode_throughput` result, the row with the largest batch at each context length of
    `pattern`, ordered by context length."""
    best: dict[int, dict] = {}
    for row in result["rows"]:
        if row["pattern"] == pattern and row["batch"] >= best.get(row["context_len"], {"batch": 0})["batch"]:
            best[row["context_len"]] = row
    return [best[S] for S in sorted(best)]
